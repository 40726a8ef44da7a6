#!/usr/bin/env bash
# The tiny profile's README claims (DPO, RLVR, RLHF over SFT) over training seeds: one
# `dvc exp run` per seed (data and held-out prompts fixed), queued and run one at a time, then
# `alignpipe seeds` pools each policy's paired gain over the runs. Run in the checkout whose
# committed run (seed 42) is the workspace's; measured, never asserted.
#
#   bash benchmarks/seeds.sh [SEED...]      # default 1 2 3; ~5 min each on 2 cores
# Writes benchmarks/results/seeds_tiny.json and prints the Markdown table.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
cd "$here"
export PATH="$here/.venv/bin:$PATH"
seeds=("${@:-1 2 3}")
read -r -a seeds <<<"${seeds[*]}"
names=()
for s in "${seeds[@]}"; do
  name="tiny-seed-$s"
  names+=("$name")
  # Done already on this commit (an experiment of another commit ran another recipe: run again).
  # grep reads all of dvc's output: `grep -q` would stop early and, under pipefail, fail the test.
  if ! dvc exp list --name-only 2>/dev/null | grep -x "$name" >/dev/null; then
    dvc exp run --queue -q -n "$name" -S "seed=$s"
  fi
done
dvc queue start -j 1 -q
while dvc queue status 2>/dev/null | grep -E "Queued|Running" >/dev/null; do sleep 20; done
# Written aside, then moved: a failed pooling leaves the committed figures as they were.
alignpipe seeds workspace "${names[@]}" --json >benchmarks/results/seeds_tiny.json.tmp
mv benchmarks/results/seeds_tiny.json.tmp benchmarks/results/seeds_tiny.json
alignpipe seeds workspace "${names[@]}"
