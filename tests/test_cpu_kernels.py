"""The portable CPU kernels (alignpipe/cpu_kernels.py): every x86-64 CPU with AVX2, Intel or AMD,
computes the same bits under them, and an artifact records which kernels computed it."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from alignpipe import cpu_kernels

REPO = Path(__file__).resolve().parents[1]

# A stage process's first steps (alignpipe.stage.run_stage: set_cpu_env before torch), then the
# kinds of arithmetic training does: a backward-shaped matrix product (MKL's GEMM), exp (MKL's
# vector math) and log_softmax (ATen's vectorised kernels).
PROBE = """
import hashlib, json
from alignpipe.context import set_cpu_env
set_cpu_env()
import torch
from alignpipe.cpu_kernels import chosen
torch.set_num_threads(1)
g = torch.Generator().manual_seed(0)
def h(t): return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()[:16]
go = torch.randn(1728, 384, generator=g); x = torch.randn(1728, 128, generator=g)
print(json.dumps({"kernels": chosen(), "matmul": h(go.t() @ x), "exp": h(torch.exp(x)),
                  "log_softmax": h(torch.log_softmax(go, dim=-1))}))
"""
# The probe's bits under the portable kernels: computed on an Intel Xeon (AVX-512) with MKL's AMD
# path, the path an AMD EPYC takes by itself (benchmarks/RESULTS.md, "CPU kernels").
PORTABLE_BITS = {"matmul": "e3a3f9bd4fa9cd1b", "exp": "57a549b8db17c8d2", "log_softmax": "15f524f50bf92a60"}

x86_avx2 = pytest.mark.skipif(
    platform.machine() != "x86_64" or "avx2" not in cpu_kernels._cpu()[1],
    reason="the portable kernels are x86-64 AVX2 kernels; elsewhere a run is not byte-comparable",
)


def probe(**env: str) -> dict:
    base = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", cpu_kernels.SETTING)}
    proc = subprocess.run([sys.executable, "-c", PROBE], env={**base, **env}, capture_output=True, text=True,
                          cwd=REPO, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@x86_avx2
def test_the_portable_kernels_compute_the_locks_bits():
    got = probe()
    locked = json.loads((REPO / "benchmarks" / "lock_kernels.json").read_text())["cpu_kernels"]
    assert got["kernels"] == locked
    assert {k: got[k] for k in PORTABLE_BITS} == PORTABLE_BITS


@x86_avx2
def test_native_kernels_are_the_cpus_own_and_say_so():
    native = probe(ALIGNPIPE_CPU_KERNELS="native")
    vendor, flags = cpu_kernels._cpu()
    if vendor == "AuthenticAMD" and "avx512f" not in flags:  # the portable kernels are this CPU's own
        assert native["kernels"] == {"aten": "avx2", "mkl": "amd", "torch": native["kernels"]["torch"]}
        assert {k: native[k] for k in PORTABLE_BITS} == PORTABLE_BITS
    else:
        assert native["kernels"] != probe()["kernels"]
        assert {k: native[k] for k in PORTABLE_BITS} != PORTABLE_BITS


@x86_avx2
def test_a_users_own_aten_choice_is_kept():
    assert probe(ATEN_CPU_CAPABILITY="default")["kernels"]["aten"] == "default"


def test_a_trained_artifact_records_its_kernels_and_a_copied_one_does_not(tmp_path):
    import torch  # noqa: F401  (the stage computed with torch)

    from alignpipe.artifacts import write_manifest

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    trained = write_manifest(tmp_path / "a", type="checkpoint_hf", format="hf", stage="sft", engine="local")
    copied = write_manifest(
        tmp_path / "b", type="checkpoint_hf", format="hf", stage="convert", engine="local"
    )
    assert trained["cpu_kernels"] == cpu_kernels.chosen() and "cpu_kernels" not in copied


def test_local_trainers_take_the_adamw_whose_root_is_exact(tmp_path):
    """torch's single-tensor AdamW divides by torch.sqrt, whose float32 rounding depends on the CPU
    maker (benchmarks/RESULTS.md, "torch's sqrt"); its fused CPU AdamW's root is exactly rounded.
    Every local trainer takes the fused one, whatever ``policy.optimizer.kwargs.fused`` says."""
    import torch
    from transformers import Trainer, TrainingArguments

    from alignpipe.config import load_params
    from alignpipe.context import build_context
    from alignpipe.engines.local.trl_args import trl_common_args

    for stage in ("sft", "rm", "dpo", "rlvr", "rlhf"):
        ctx = build_context(REPO, stage, params=load_params(REPO))
        optimizer, kwargs = Trainer.get_optimizer_cls_and_kwargs(
            TrainingArguments(**trl_common_args(ctx, tmp_path))
        )
        assert optimizer is torch.optim.AdamW and kwargs.get("fused") is True, (stage, kwargs)
    # betas 0 and eps 0: one step is lr * g / sqrt(g * g), exactly -lr * sign(g) where the root is
    # exactly rounded
    g = torch.randn(100_000, generator=torch.Generator().manual_seed(0))
    p = torch.nn.Parameter(torch.zeros_like(g))
    opt = optimizer([p], lr=1.0, betas=(0.0, 0.0), eps=0.0, weight_decay=0.0, fused=True)
    p.grad = g
    opt.step()
    assert torch.equal(p.detach(), -torch.sign(g))
