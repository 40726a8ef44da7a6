#!/usr/bin/env bash
# Acceptance run of the preference stages on the tiny profile, with the committed params:
# prep -> base -> sft -> rm -> dpo in a throwaway copy of the repo (never in the shared tree),
# then prints the acceptance figures and each stage's wall/CPU time and trainer runtime.
#
# Usage: benchmarks/preference_stages.sh [WORKDIR]   (default: a new directory from mktemp -d)
# Results of a measured run: benchmarks/preference_stages.md
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
work="${1:-$(mktemp -d -t alignpipe-pref-bench.XXXXXX)}"
py="${PYTHON:-$here/.venv/bin/python}"
rm -rf "$work"
"$py" -c "import sys; sys.path.insert(0, '$here'); from pathlib import Path; from tests.conftest import copy_repo; copy_repo(Path('$work/repo'))"
export ALIGNPIPE_ROOT="$work/repo" ALIGNPIPE_SCRATCH="$work/scratch" PATH="$(dirname "$py"):$PATH"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
export TRANSFORMERS_VERBOSITY=error TOKENIZERS_PARALLELISM=false
cd "$work/repo"
for stage in prep base sft rm dpo; do
  /usr/bin/time -f "$stage wall_s=%e cpu_user_s=%U cpu_sys_s=%S" -a -o "$work/times.txt" \
    alignpipe run "$stage" > "$work/$stage.log" 2>&1
  # TRL prints its own train_runtime (the training loop alone, without loading or held-out eval)
  grep -o "'train_runtime': '[0-9.]*'" "$work/$stage.log" | sed "s/^/$stage /" >> "$work/times.txt" || true
done
cat "$work/times.txt"
"$py" - "$work/repo" <<'EOF'
import json, sys
from pathlib import Path
root = Path(sys.argv[1])
m = {s: json.loads((root / f"results/{s}/metrics.json").read_text()) for s in ("sft", "rm", "dpo")}
print(f"rm  val/pairwise_accuracy   {m['rm']['val']['pairwise_accuracy']:.3f}   (>= 0.85)")
print(f"dpo val/preference_accuracy {m['dpo']['val']['preference_accuracy']:.3f}   (>= 0.85)")
print(f"sft heldout/accuracy        {m['sft']['heldout']['accuracy']:.3f}")
print(f"dpo heldout/accuracy        {m['dpo']['heldout']['accuracy']:.3f}   (>= sft + 0.10)")
for s in ("sft", "dpo"):
    h = m[s]["heldout"]
    print(s, {k: round(v, 3) for k, v in h.items()})
print("dpo val", {k: round(v, 4) for k, v in m["dpo"]["val"].items()})
print("rm val", {k: round(v, 4) for k, v in m["rm"]["val"].items()})
EOF
