"""Intra-op threads on the tiny model: 1 vs 2 threads, spinning vs sleeping OpenMP workers, idle vs busy CPU.

The tiny Llama (stages/base/config/tiny.yaml, ~0.8M parameters) is built from its config, with a
character tokenizer over digits and task names, so no pipeline run is needed. For each OpenMP
wait policy (libgomp's default, which spins, and ``OMP_WAIT_POLICY=PASSIVE``, which the stage
process sets: ``alignpipe.context.CPU_ENV``) and each number of busy-looping neighbour processes
(0, 1, 2 on a 2-core machine), a child process times a training step and held-out sampling with
1 and 2 threads, in rounds, best round kept. Wall and CPU seconds are both reported: when the
cores are shared, spinning threads burn CPU waiting for a descheduled partner.

Each child also hashes the weights after its training steps: the bytes depend on the thread
count (float sums split differently), never on the wait policy or the load.

Usage: ``python benchmarks/torch_threads.py [--rounds 2] [--busy 0 1 2]`` -> JSON on stdout.
Measured, never asserted.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
POLICIES = {"spin (libgomp default)": None, "passive": "PASSIVE"}


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def measure(rounds: int) -> dict:
    """Runs in the child: best-of-``rounds`` seconds per training step and per sampling pass."""
    import torch
    import yaml

    sys.path.insert(0, str(REPO))
    from alignpipe.measure.generation import generate
    from alignpipe.tiny import build_causal_lm, train_tokenizer

    cfg = yaml.safe_load((REPO / "stages/base/config/tiny.yaml").read_text())["model"]
    tok = train_tokenizer(["0123456789 +:sortreverseadd"], "char")
    prompts = [f"sort:{i * 7919 % 10000:04d}" for i in range(300)]  # held-out-sized batch
    x = torch.randint(0, len(tok), (64, 16), generator=torch.Generator().manual_seed(0))  # rm's micro batch

    out: dict[str, dict] = {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        model = build_causal_lm(tok, cfg, seed=0)
        opt = torch.optim.AdamW(model.parameters(), 1e-3)

        def train_steps(n: int, model=model, opt=opt) -> None:
            model.train()
            for _ in range(n):
                model(input_ids=x, labels=x).loss.backward()
                opt.step()
                opt.zero_grad()
            model.eval()

        def sample(model=model) -> None:
            generate(model, tok, prompts, max_new_tokens=12, temperature=1.0, batch_size=128, seed=1234)

        best: dict[str, tuple[float, float]] = {}
        for _ in range(rounds):
            for name, fn, unit in (("train_step", lambda: train_steps(10), 10), ("sample_300x12", sample, 1)):
                w0, c0 = time.time(), cpu_s()
                fn()
                wall, cpu = (time.time() - w0) / unit, (cpu_s() - c0) / unit
                if name not in best or wall < best[name][0]:
                    best[name] = (round(wall, 4), round(cpu, 4))
        weights = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
        out[f"threads={threads}"] = {
            **{name: {"wall_s": w, "cpu_s": c} for name, (w, c) in best.items()},
            "weights_md5": hashlib.md5(weights).hexdigest(),
        }
    return out


def busy_loops(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--busy", type=int, nargs="*", default=[0, 1, 2], help="busy neighbour processes")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.rounds)))
        return 0

    results = {}
    started = {
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "loadavg_1_5_15": os.getloadavg(),
    }
    for busy in args.busy:
        for label, policy in POLICIES.items():
            env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
            if policy:
                env["OMP_WAIT_POLICY"] = policy
            hogs = busy_loops(busy)
            try:
                child = subprocess.run(
                    [sys.executable, __file__, "--child", "--rounds", str(args.rounds)],
                    env=env,
                    capture_output=True,
                    text=True,
                    check=True,
                )
            finally:
                for hog in hogs:
                    hog.kill()
            results[f"busy={busy}/{label}"] = json.loads(child.stdout.strip().splitlines()[-1])
    print(json.dumps({**started, "cores": os.cpu_count(), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
