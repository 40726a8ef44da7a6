#!/usr/bin/env bash
# The repro job's summary: the evaluate stage's policy table and DVC's metrics, as Markdown to
# $GITHUB_STEP_SUMMARY (stdout outside GitHub Actions). Runs after a failed step too: whatever
# the pipeline got to.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
dvc="${DVC:-.venv/bin/dvc}"
{
  echo "## Policies (results/evaluate/report.md)"
  cat results/evaluate/report.md 2>/dev/null || echo "evaluate did not run"
  echo "## Metrics"
  echo '```'
  "$dvc" metrics show 2>&1 || true
  echo '```'
} >>"${GITHUB_STEP_SUMMARY:-/dev/stdout}"
