#!/usr/bin/env bash
# The small profile's evidence run (-S evidence=small: 256 held-out prompts, rlvr 30 steps at
# 2e-5) over training seeds: does RLVR's gain over SFT hold from one training run to another?
# Per seed, in a throwaway clone of this checkout's HEAD: params.yaml composed as
# `dvc exp run -S profile=small -S model.name=MODEL -S evidence=small -S seed=N` composes it,
# then prep, base, sft, rlvr and evaluate (sft and rlvr only: the claim is rlvr - sft, and dpo,
# rm and rlhf would add ~20 min a seed), stage by stage with `alignpipe run`. Then
# `alignpipe.measure.seeds` pools rlvr - sft over the seeds (paired per prompt within a seed, a
# t interval over the seeds), as `alignpipe seeds` does for experiments.
#
#   bash benchmarks/seeds_small.sh MODEL_DIR [SEED...]   # default seeds 1-4; ~25 min each on 2 cores
# MODEL_DIR: SmolLM2-135M-Instruct (`python -m tests.smollm2`). Writes
# benchmarks/results/seeds_small.json (pooled over the SEEDs given) and each seed's evaluate
# samples under benchmarks/results/seeds_small/, and prints the Markdown table. Measured, never asserted.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
model="$(cd "$1" && pwd)"
shift
seeds=("${@:-1 2 3 4}")
read -r -a seeds <<<"${seeds[*]}"
work="$(mktemp -d)"
keep="$here/benchmarks/results/seeds_small"  # per seed: evaluate's samples.jsonl and metrics.json
trap 'rm -rf "$work"' EXIT
git clone -q "$here" "$work/alignpipe"
cd "$work/alignpipe"
make -s venv
export PATH="$work/alignpipe/.venv/bin:$PATH"
for seed in "${seeds[@]}"; do
  python "$here/benchmarks/compose_params.py" --evaluate sft,rlvr profile=small "model.name=$model" evidence=small "seed=$seed"
  for stage in prep base sft rlvr evaluate; do
    /usr/bin/time -f "seed $seed $stage: %e s wall, %U+%S s CPU" alignpipe run "$stage" >"$work/seed-$seed-$stage.log" 2>&1 \
      || { tail -20 "$work/seed-$seed-$stage.log"; exit 1; }
    tail -1 "$work/seed-$seed-$stage.log"
  done
  # Kept beside the summary: a later seed pools with these, and another machine's run compares with them.
  mkdir -p "$keep/seed-$seed" && cp results/evaluate/samples.jsonl results/evaluate/metrics.json "$keep/seed-$seed/"
done
python - "$here/benchmarks/results/seeds_small.json" "$keep" "${seeds[@]}" <<'PY'
import json, platform, subprocess, sys

from alignpipe.measure.compare import Run
from alignpipe.measure.seeds import as_json, markdown, pool

out, keep, *seeds = sys.argv[1:]
runs = []
for seed in seeds:
    heldout = {}
    for line in open(f"{keep}/seed-{seed}/samples.jsonl"):
        row = json.loads(line)
        heldout.setdefault(row["policy"], []).append(row)
    runs.append(Run(f"seed {seed}", f"seed {seed}", heldout))
rows = pool(runs)
info = {}
for line in open("/proc/cpuinfo"):
    key, _, value = line.partition(":")
    info.setdefault(key.strip(), value.strip())
cpu = f"{info.get('model name', platform.processor())}, family {info.get('cpu family')} model {info.get('model')}"
result = as_json(runs, rows)
result.update(
    commit=subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
    cpu=cpu,
    seeds=[int(s) for s in seeds],
    heldout_accuracy={  # each seed's own figures, beside the paired differences above
        seed: {name: m["heldout_accuracy"] for name, m in json.load(open(f"{keep}/seed-{seed}/metrics.json"))["policies"].items()}
        for seed in seeds
    },
)
json.dump(result, open(out, "w"), indent=1, sort_keys=True)
print(markdown(runs, rows))
PY
