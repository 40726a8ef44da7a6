#!/usr/bin/env bash
# NeMo-Gym's own Python >= 3.12 venv, exactly lock/gym.txt (what lock/gym.in pins, resolved by
# `make lock`): tests/test_nemo_gym_contract.py resolves the pipeline's Gym configs and runs Gym's
# servers with it. Installed by uv from the lock's hashes: 31 s on a fresh 2-core machine, where
# pip resolving the same 168 packages took 76 s (benchmarks/RESULTS.md). Idempotent: a venv that
# holds this lock (its digest in .complete) is left alone.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
lock="$repo/lock/gym.txt"
venv="${ALIGNPIPE_GYM_VENV:-$HOME/.cache/alignpipe/gym-0.4.0-venv}"
digest="$(sha256sum "$lock" | cut -d' ' -f1)"
[ "$(cat "$venv/.complete" 2>/dev/null)" = "$digest" ] && exit 0
# Where a 3.12+ may be: GYM_PYTHON, on PATH (actions/setup-python puts every version it was given
# there, the last as `python`), in the runner's tool cache (setup-python's, by path), or pyenv's.
python=""
shopt -s nullglob
for candidate in "${GYM_PYTHON:-}" python3.13 python3.12 \
    "${RUNNER_TOOL_CACHE:-/opt/hostedtoolcache}"/Python/3.1[2-9].*/*/bin/python3 \
    "$HOME"/.pyenv/versions/3.1[2-9]*/bin/python3; do
  [ -n "$candidate" ] || continue
  if command -v "$candidate" >/dev/null 2>&1 \
      && "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
    python="$candidate"; break
  fi
done
shopt -u nullglob
if [ -z "$python" ]; then
  echo "install-gym: nemo-gym 0.4.0 needs Python >= 3.12 (none found; set GYM_PYTHON=/path/to/python3.12)" >&2
  exit 1
fi
rm -rf "$venv"
"$python" -m venv "$venv"
# uv at the project lock's version and hash, by the venv's own pip (a system Python may have none)
# and beside the venv, not in it: `uv pip sync` leaves the venv exactly the lock.
uv="$(mktemp -d)"
trap 'rm -rf "$uv"' EXIT
awk '/^[^ #]/ { keep = /^uv==/ } keep' "$repo/lock/requirements.txt" >"$uv/uv.txt"
"$venv/bin/python" -m pip install -q --require-hashes --no-deps --target "$uv" -r "$uv/uv.txt"
"$uv/bin/uv" -q pip sync --python "$venv/bin/python" --require-hashes --compile-bytecode "$lock"
"$venv/bin/python" -c 'import nemo_gym, importlib.metadata as m; print("install-gym: nemo-gym", m.version("nemo-gym"))'
echo "$digest" >"$venv/.complete"
