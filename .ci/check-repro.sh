#!/usr/bin/env bash
# CI's repro gate, after `make repro`: compare the dvc.lock the reproduction wrote with the
# committed one (.ci/check_repro.py says which entries must match and which are only reported).
# The report goes to stdout and, on GitHub Actions, to the job summary.
# Usage: .ci/check-repro.sh [COMMITTED [REPRODUCED]] [--strict]
#   COMMITTED   defaults to HEAD's dvc.lock (git show HEAD:dvc.lock)
#   REPRODUCED  defaults to the workspace's dvc.lock
#   --strict    fail on trained entries too (byte-equal lock)
# PYTHON picks the interpreter (default: .venv/bin/python, which `make repro` built; it has PyYAML).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
files=()
flags=()
for arg in "$@"; do
  case "$arg" in
    --*) flags+=("$arg") ;;
    *) files+=("$(cd "$(dirname "$arg")" && pwd)/$(basename "$arg")") ;;
  esac
done
python="${PYTHON:-$repo/.venv/bin/python}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
committed="${files[0]:-}"
if [ -z "$committed" ]; then
  committed="$tmp/committed.lock"
  git -C "$repo" show HEAD:dvc.lock >"$committed"
fi
reproduced="${files[1]:-$repo/dvc.lock}"
"$python" "$repo/.ci/check_repro.py" --repo "$repo" "${flags[@]}" "$committed" "$reproduced"
