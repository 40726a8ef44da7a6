#!/usr/bin/env bash
# The tools preset (conf/tools/on.yaml) on the tiny profile, measured: `dvc exp run -S tools=on`
# in a throwaway clone of this checkout's HEAD (the workspace stays as it is), then evaluate's
# figures: each policy's held-out accuracy overall and per task, its paired difference from sft
# on the same prompts, and what it did with the calculator. One draw of answers per prompt moves
# a policy's calc accuracy by up to ~10 points, so evaluate then samples four more draws
# (heldout.seed 1-4) and the paired differences are also given per prompt averaged over all five.
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
draws="$(dirname "$clone")/draws"
cp -r results/evaluate "$draws" && cp results/evaluate/samples.jsonl "$draws/draw-1234.jsonl"
for seed in 1 2 3 4; do  # the same trained policies, their answers drawn again
  python -c "import yaml; p = yaml.safe_load(open('params.yaml')); p['evaluate']['alignpipe']['heldout']['seed'] = $seed; yaml.safe_dump(p, open('params.yaml', 'w'), sort_keys=False)"
  alignpipe run evaluate >/dev/null
  cp results/evaluate/samples.jsonl "$draws/draw-$seed.jsonl"
done
python - "$here/benchmarks/results/tools_tiny.json" "$draws" <<'PY'
import glob, json, platform, subprocess, sys
from alignpipe.measure.intervals import paired_difference
metrics = json.load(open(f"{sys.argv[2]}/metrics.json"))
keep = ("heldout_accuracy", "intervals", "vs_reference", "tool_calls_per_answer", "tool_malformed_share",
        "tool_accuracy_with_call", "tool_accuracy_without_call")
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.processor())
out = {
    "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
    "cpu": cpu,
    "policies": {name: {k: m[k] for k in keep if k in m} for name, m in metrics["policies"].items()},
}
# Five draws: each prompt's accuracy averaged over them, paired with sft's on the same prompt.
correct = {}
for path in sorted(glob.glob(f"{sys.argv[2]}/draw-*.jsonl")):
    for line in open(path):
        s = json.loads(line)
        correct.setdefault(s["policy"], {}).setdefault((s["task"], s["id"]), []).append(s["correct"])
mean = {p: {k: sum(v) / len(v) for k, v in by.items()} for p, by in correct.items()}
out["draws"] = {"seeds": [1234, 1, 2, 3, 4], "vs_sft": {}}
for name in mean:
    for task in ("all", "calc"):
        keys = sorted(k for k in mean["sft"] if task == "all" or k[0] == task)
        diff = paired_difference([mean[name][k] for k in keys], [mean["sft"][k] for k in keys])
        out["draws"]["vs_sft"].setdefault(name, {})[task] = diff
json.dump(out, open(sys.argv[1], "w"), indent=1, sort_keys=True)
PY
sed -n '/^## Held-out accuracy per task/,$p' "$draws/report.md"
python -c "import json, sys; print(json.dumps(json.load(open(sys.argv[1]))['draws'], indent=1))" "$here/benchmarks/results/tools_tiny.json"
