#!/usr/bin/env bash
# NeMo-Gym at the version NeMo-RL v0.7.0 runs (its submodule 3rdparty/Gym-workspace/Gym is Gym
# tag v0.4.0; PyPI's nemo-gym==0.4.0 has the same nemo_gym/*.py), in its own Python >= 3.12 venv:
# tests/test_nemo_gym_contract.py resolves the pipeline's Gym configs and runs Gym's servers with it.
# Idempotent: a finished venv (marked .complete) is left alone.
set -euo pipefail
venv="${ALIGNPIPE_GYM_VENV:-$HOME/.cache/alignpipe/gym-0.4.0-venv}"
[ -f "$venv/.complete" ] && exit 0
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
"$venv/bin/python" -m pip install -q --upgrade pip
# math_with_judge's own requirement, as Gym pins it (Gym would build it a venv of its own with uv)
"$venv/bin/python" -m pip install -q "nemo-gym==0.4.0" "math-verify==0.8.0"
"$venv/bin/python" -c 'import nemo_gym, importlib.metadata as m; print("install-gym: nemo-gym", m.version("nemo-gym"))'
touch "$venv/.complete"
