#!/usr/bin/env bash
# Install what the `slurm` and `ray` test markers need, idempotently:
#   - Debian's slurm-wlm (slurmctld + slurmd + client tools). The tests run a one-node
#     cluster with AuthType=auth/none: munge comes along as a package dependency but is
#     neither configured nor started.
#   - ray[default] (Jobs API + dashboard) into the project's virtual environment.
# Usage: .ci/install-clusters.sh [VENV]   (VENV defaults to .venv next to this repo)
#        .ci/install-clusters.sh --system  (Slurm only: .ci/run, while `make venv` builds the venv)
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${1:-${VENV:-$repo/.venv}}"

need_slurm=0
for tool in sbatch slurmctld slurmd sinfo squeue scancel sacct scontrol; do
  command -v "$tool" >/dev/null 2>&1 || need_slurm=1
done
if [ "$need_slurm" = 1 ]; then
  if [ "$(id -u)" != 0 ]; then
    sudo=sudo
  else
    sudo=
  fi
  $sudo apt-get update -qq
  # --no-install-recommends keeps munge's daemon and mail servers off the machine. DEBIAN_FRONTEND
  # through env: sudo's env_reset drops variables exported before it.
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends slurm-wlm slurm-client >/dev/null
fi

# On a fresh clone the venv does not exist yet: `make test` creates it and installs the
# dev extra, which carries ray[default]. An existing venv gets Ray here if it lacks it.
if [ "$venv" = --system ]; then
  ray_version="(not checked: --system)"
elif [ -x "$venv/bin/python" ]; then
  if ! "$venv/bin/python" -c 'import ray.job_submission, ray.dashboard' >/dev/null 2>&1; then
    "$venv/bin/python" -m pip install -q "ray[default]>=2.55.1,<2.61"  # pyproject.toml's dev pin
  fi
  ray_version="$("$venv/bin/python" -c 'import ray; print(ray.__version__)')"
else
  ray_version="(installed by make with the dev extra)"
fi

echo "install-clusters: slurm $(dpkg-query -W -f='${Version}' slurmctld 2>/dev/null || echo missing); ray $ray_version"
