#!/usr/bin/env bash
# CI's reproduction of the pipeline, after `make venv`. With a DVC remote (DVC_REMOTE: a URL, from
# the repository variable; its credentials from the environment, as DVC's remotes read them),
# unchanged stages are restored from the remote's run cache instead of retrained, and what ran is
# pushed back with its run cache. Without one (a pull request from a fork gets no secrets) it is
# the full run `make repro` does.
# Usage: .ci/repro.sh   (env: DVC_REMOTE, DVC=path to dvc, default .venv/bin/dvc)
set -euo pipefail
dvc="${DVC:-.venv/bin/dvc}"
if [ -z "${DVC_REMOTE:-}" ]; then
  echo "repro: no DVC remote: the full run"
  exec "$dvc" repro
fi
# --local: the remote stays out of the committed .dvc/config (it is this runner's setting).
"$dvc" remote add --local --force --default ci "$DVC_REMOTE"
# --pull: a stage whose inputs are unchanged gets its outputs from the remote (or its run cache).
"$dvc" repro --pull
"$dvc" push --run-cache
