#!/usr/bin/env bash
# Re-run every benchmark; results land in benchmarks/results/*.json (summarised by hand in
# benchmarks/RESULTS.md, with the machine's load at the time). Measured, never asserted.
#
#   bash benchmarks/run_all.sh            # pipeline (~minutes on 2 cores) + 2 GiB cache test
#   BENCH_SKIP_PIPELINE=1 bash benchmarks/run_all.sh
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
py="${PYTHON:-$here/.venv/bin/python}"
# Scratch copies of the repo: BENCH_WORKDIR, else a new directory under the system temp dir.
work="${BENCH_WORKDIR:-$(mktemp -d -t alignpipe-bench.XXXXXX)}"
mkdir -p "$here/benchmarks/results"

if [ -z "${BENCH_SKIP_PIPELINE:-}" ]; then
  echo "==> whole tiny pipeline: dvc repro --force, per-stage times, start-up overhead, no-op repro"
  "$py" "$here/benchmarks/pipeline.py" --workdir "$work/pipeline" --out "$here/benchmarks/results/pipeline.json"
  echo "==> DVC's own no-op floor: as many trivial stages"
  PATH="$(dirname "$py"):$PATH" "$py" "$here/benchmarks/dvc_floor.py"
fi

echo "==> torch threads on the tiny model: 1 vs 2, spinning vs passive OpenMP workers, 0-2 busy neighbours"
"$py" "$here/benchmarks/torch_threads.py" > "$here/benchmarks/results/torch_threads.json"

echo "==> 2 GiB multi-file checkpoint into the DVC cache (hardlink) vs md5sum"
bash "$here/benchmarks/cache_checkpoint.sh" "$work/cache" "${BENCH_CKPT_FILES:-8}" "${BENCH_CKPT_MIB:-256}" \
  | tee "$here/benchmarks/results/cache_checkpoint.json"
