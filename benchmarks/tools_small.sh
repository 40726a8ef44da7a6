#!/usr/bin/env bash
# The tools preset on the small profile: SmolLM2-135M-Instruct with the calculator, measured.
# SmolLM2's own chat template renders no tools (sft refuses tool rows on it, naming the
# template), so the model is copied with benchmarks/smollm2_tools.jinja: its ChatML, plus the
# offered tools' schemas in the system turn, <tool_call> blocks in assistant turns and a `tool`
# role, in the Hermes/Qwen2.5 convention alignpipe.tools parses; without tools it renders the
# same text as SmolLM2's. A calc conversation is then ~250 tokens, so sft and rlvr get
# max_total_sequence_length 320 (the preset's 128 is the tiny model's). In a throwaway clone of
# HEAD, stage by stage (`alignpipe run`): prep, base, sft, rlvr, then evaluate on sft and rlvr.
#
#   bash benchmarks/tools_small.sh MODEL_DIR     # MODEL_DIR: `python -m tests.smollm2`; ~30 min
# Writes benchmarks/results/tools_small.json. Measured, never asserted.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
source_model="$(cd "$1" && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
git clone -q "$here" "$work/alignpipe"
cp -r "$source_model" "$work/model"
cp "$here/benchmarks/smollm2_tools.jinja" "$work/model/chat_template.jinja"
cd "$work/alignpipe"
make -s venv
export PATH="$work/alignpipe/.venv/bin:$PATH"
python "$here/benchmarks/compose_params.py" --evaluate sft,rlvr profile=small "model.name=$work/model" tools=on \
  sft.policy.max_total_sequence_length=320 rlvr.policy.max_total_sequence_length=320
for stage in prep base sft rlvr evaluate; do
  /usr/bin/time -f "$stage: %e s wall, %U+%S s CPU" alignpipe run "$stage" >"$work/$stage.log" 2>&1 \
    || { tail -20 "$work/$stage.log"; exit 1; }
  tail -1 "$work/$stage.log"
done
python - "$here/benchmarks/results/tools_small.json" <<'PY'
import json, subprocess, sys

info = {}
for line in open("/proc/cpuinfo"):
    key, _, value = line.partition(":")
    info.setdefault(key.strip(), value.strip())
metrics = json.load(open("results/evaluate/metrics.json"))
keep = ("heldout_accuracy", "intervals", "vs_reference", "tool_calls_per_answer", "tool_malformed_share",
        "tool_accuracy_with_call", "tool_accuracy_without_call")
json.dump({
    "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
    "cpu": f"{info.get('model name')}, family {info.get('cpu family')} model {info.get('model')}",
    "policies": {name: {k: m[k] for k in keep if k in m} for name, m in metrics["policies"].items()},
    "rlvr_train": json.load(open("results/rlvr/metrics.json")).get("train"),
}, open(sys.argv[1], "w"), indent=1, sort_keys=True)
PY
sed -n '/^## Held-out accuracy per task/,$p' results/evaluate/report.md
