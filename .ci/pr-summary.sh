#!/usr/bin/env bash
# A pull request's summary, after the repro job's reproduction: what the pull request changes in
# the pipeline's definition and in every policy's figures (`alignpipe compare`), against its base
# commit. One function per section, written as
# Markdown to $GITHUB_STEP_SUMMARY (stdout outside GitHub Actions).
# Usage: .ci/pr-summary.sh BASE_SHA   (the workflow passes github.event.pull_request.base.sha)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
base="${1:?usage: .ci/pr-summary.sh BASE_SHA}"
dvc="${DVC:-.venv/bin/dvc}"
alignpipe="${ALIGNPIPE:-.venv/bin/alignpipe}"
out="${GITHUB_STEP_SUMMARY:-/dev/stdout}"

# actions/checkout fetches only the merge commit: the base commit too, for the diffs below.
git cat-file -e "$base^{commit}" 2>/dev/null || git fetch -q --no-tags --depth=1 origin "$base"

params_section() {  # params.yaml's values that differ from the base's (DVC reads both from git)
  echo "### Parameters changed"
  local diff
  diff="$("$dvc" params diff "$base" --md 2>&1)" || { echo "dvc params diff failed:"; echo '```'; echo "$diff"; echo '```'; return; }
  # The table's header alone (a header row, no value rows) when nothing changed.
  if [ "$(grep -c '^| ' <<<"$diff")" -le 1 ]; then echo "None."; else echo "$diff"; fi
}

definition_section() {  # the files that define stages, profiles and prompts
  echo "### Pipeline definition files changed"
  local stat
  stat="$(git diff --stat "$base" HEAD -- dvc.yaml params.yaml conf stages prompts)"
  if [ -n "$stat" ]; then
    echo '```'
    echo "$stat"
    echo '```'
  else
    echo "None."
  fi
}

compare_section() {  # every policy's figures against the base's, paired per prompt (alignpipe compare)
  echo "### Figures against the base"
  local report
  if report="$("$alignpipe" compare "$base" workspace 2>&1)"; then
    echo "$report"
  else  # the base's outputs are in no cache here without a DVC remote: say why, in one line
    echo "Not compared: ${report##*error: }"
  fi
}

{
  echo "## Pull request against ${base:0:12}"
  params_section
  definition_section
  compare_section
} >>"$out"
