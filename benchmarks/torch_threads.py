"""Intra-op threads on the tiny model: 1 vs all cores, for a training step and held-out sampling.

The tiny Llama (stages/base/config/tiny.yaml, ~0.8M parameters) is built from its config, with a
character tokenizer over digits and task names, so no pipeline run is needed. Each setting is
timed in rounds, alternating thread counts so load changes hit both alike. Wall and CPU
seconds are both reported: on a busy machine the two diverge as OpenMP threads wait on each
other.

Usage: ``python benchmarks/torch_threads.py [--rounds 3]`` -> JSON on stdout. Measured, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def build():
    from alignpipe.tiny import build_causal_lm, train_char_tokenizer

    cfg = yaml.safe_load((REPO / "stages/base/config/tiny.yaml").read_text())["model"]
    tok = train_char_tokenizer(["0123456789 +:sortreverseadd"])
    return build_causal_lm(tok, cfg, seed=0).eval(), tok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    from alignpipe.measure.generation import generate

    model, tok = build()
    prompts = [f"sort:{i * 7919 % 10000:04d}" for i in range(300)]  # held-out-sized batch
    x = torch.randint(0, len(tok), (32, 48))  # the sft stage's micro batch shape
    opt = torch.optim.AdamW(model.parameters(), 1e-4)

    def train_steps(n: int) -> None:
        model.train()
        for _ in range(n):
            model(input_ids=x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad()
        model.eval()

    def sample() -> None:
        generate(model, tok, prompts, max_new_tokens=12, temperature=1.0, batch_size=128, seed=1234)

    train_steps(2)
    sample()
    cores = os.cpu_count() or 1
    results: dict[str, dict[str, list[float]]] = {}
    for _ in range(args.rounds):
        for threads in (1, cores):
            torch.set_num_threads(threads)
            for name, fn, unit in (("train_step", lambda: train_steps(10), 10), ("sample_300x12", sample, 1)):
                w0, c0 = time.time(), cpu_s()
                fn()
                entry = results.setdefault(f"{name}/threads={threads}", {"wall_s": [], "cpu_s": []})
                entry["wall_s"].append(round((time.time() - w0) / unit, 4))
                entry["cpu_s"].append(round((cpu_s() - c0) / unit, 4))
    print(
        json.dumps(
            {
                "loadavg_1_5_15": [round(v, 2) for v in os.getloadavg()],
                "cores": cores,
                "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "results": results,
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
