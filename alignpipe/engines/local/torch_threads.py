"""The stage process's torch CPU threads (``alignpipe.torch_threads``), set once by every local
stage that runs a model."""

from __future__ import annotations

from alignpipe.context import StageContext


def apply_torch_threads(ctx: StageContext) -> None:
    """``alignpipe.torch_threads`` from the profile: torch's intra-op CPU threads.

    A fixed count keeps results byte-identical across machines (a different count changes
    the floating-point sums, hence every hash in dvc.lock). The stage process lets idle
    OpenMP workers sleep (``context.CPU_ENV``), so a second thread no longer costs a busy
    machine the 2-10x that spinning did.
    """
    threads = ctx.settings.torch_threads
    if threads:
        import torch

        torch.set_num_threads(threads)
