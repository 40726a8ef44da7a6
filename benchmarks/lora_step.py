"""Where a `small` training step's time goes on this CPU (issue 25's 10-minute aim): one forward
and backward of SmolLM2-135M-Instruct on 8 x 128 tokens, 2 threads, with full weights, with a
rank-8 LoRA on every projection (the base frozen), and with that LoRA under bfloat16 autocast
(this CPU has avx512_bf16; the local engine trains in float32). Raw output:
results/lora_step.json. Run from the repository root:
`python benchmarks/lora_step.py MODEL_DIR OUT.json`."""

import json
import os
import sys
import time

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
REPEATS = 5


def seconds_per_step(model, ids, autocast: bool) -> float:
    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        model.zero_grad(set_to_none=True)

    step()  # warm-up: allocator and oneDNN kernels
    start = time.perf_counter()
    for _ in range(REPEATS):
        step()
    return (time.perf_counter() - start) / REPEATS


def main(model_dir: str, out: str) -> None:
    torch.set_num_threads(2)
    torch.manual_seed(0)
    ids = torch.randint(0, 49152, (8, 128))
    full = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    results = {"full weights, float32": seconds_per_step(full, ids, False)}
    for p in full.parameters():
        p.requires_grad_(False)
    lora = get_peft_model(full, LoraConfig(r=8, lora_alpha=32, target_modules=PROJECTIONS))
    results["LoRA, float32"] = seconds_per_step(lora, ids, False)
    results["LoRA, bfloat16 autocast"] = seconds_per_step(lora, ids, True)
    record = {
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "cpus": os.cpu_count(),
        "batch": list(ids.shape),
        "repeats": REPEATS,
        "seconds_per_step": {k: round(v, 3) for k, v in results.items()},
    }
    with open(out, "w") as f:
        json.dump(record, f, indent=2)
        f.write("\n")
    for name, s in record["seconds_per_step"].items():
        print(f"{name:>26}: {s:.2f} s/step")


if __name__ == "__main__":
    main(*sys.argv[1:3])
