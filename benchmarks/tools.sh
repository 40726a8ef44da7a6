#!/usr/bin/env bash
# The tools preset (conf/tools/on.yaml) on the tiny profile, measured: `dvc exp run -S tools=on`
# in a throwaway clone of this checkout's HEAD (the workspace stays as it is), then evaluate's
# figures: each policy's held-out accuracy overall and per task, its paired difference from sft
# on the same prompts, and what it did with the calculator.
#
#   bash benchmarks/tools.sh          # ~8 min on 2 cores
# Writes benchmarks/results/tools_tiny.json. Measured, never asserted.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
clone="$(mktemp -d)/alignpipe"
trap 'rm -rf "$(dirname "$clone")"' EXIT
git clone -q "$here" "$clone"
cd "$clone"
make -s venv
export PATH="$clone/.venv/bin:$PATH"
dvc exp run -q -S tools=on
python - "$here/benchmarks/results/tools_tiny.json" <<'PY'
import json, platform, subprocess, sys
metrics = json.load(open("results/evaluate/metrics.json"))
keep = ("heldout_accuracy", "intervals", "vs_reference", "tool_calls_per_answer", "tool_malformed_share",
        "tool_accuracy_with_call", "tool_accuracy_without_call")
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.processor())
out = {
    "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
    "cpu": cpu,
    "policies": {name: {k: m[k] for k in keep if k in m} for name, m in metrics["policies"].items()},
}
json.dump(out, open(sys.argv[1], "w"), indent=1, sort_keys=True)
PY
sed -n '/^## Held-out accuracy per task/,$p' results/evaluate/report.md
