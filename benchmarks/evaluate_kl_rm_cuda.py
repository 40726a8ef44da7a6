"""One-off GPU check (run on a lent H200: benchmarks/results/evaluate_kl_rm_cuda_h200.json): evaluate's KL
and RM scores with the models on CUDA equal those on CPU. Run from the repository root after
`dvc repro`: `python benchmarks/evaluate_kl_rm_cuda.py OUT.json`."""

import json
import sys
import time

import torch

from alignpipe.measure.generation import generate
from alignpipe.measure.logprobs import kl_to_reference, load_policy
from alignpipe.measure.reward_model import RewardModelScorer

rows = [json.loads(line) for line in open("data/prepared/rlvr/test.jsonl")][:128]
prompts = [r["prompt"] for r in rows]
sft, tok = load_policy("models/sft")
dpo, _ = load_policy("exports/dpo")
completions = generate(dpo, tok, prompts, max_new_tokens=12, temperature=1.0, seed=1234)
rm = RewardModelScorer.load("models/rm")
t = time.time()
kl_cpu = kl_to_reference(dpo, sft, tok, prompts, completions, 12)
rm_cpu = rm(prompts, completions)
cpu_s = time.time() - t
for m in (sft, dpo, rm.model):
    m.to("cuda")
t = time.time()
kl_gpu = kl_to_reference(dpo, sft, tok, prompts, completions, 12)
rm_gpu = rm(prompts, completions)
gpu_s = time.time() - t
result = {
    "device": torch.cuda.get_device_name(0),
    "torch": torch.__version__,
    "prompts": len(prompts),
    "kl_cpu": kl_cpu,
    "kl_cuda": kl_gpu,
    "kl_abs_diff": abs(kl_cpu - kl_gpu),
    "rm_max_abs_diff": max(abs(a - b) for a, b in zip(rm_cpu, rm_gpu, strict=True)),
    "rm_mean_cpu": sum(rm_cpu) / len(rm_cpu),
    "rm_mean_cuda": sum(rm_gpu) / len(rm_gpu),
    "model_device_after": str(next(dpo.parameters()).device),
    "cpu_s": round(cpu_s, 3),
    "cuda_s": round(gpu_s, 3),
}
print(json.dumps(result, indent=1))
json.dump(result, open(sys.argv[1], "w"), indent=1)
