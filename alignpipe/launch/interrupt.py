"""Signals: an interrupted stage stops its trainer, publishes nothing, and leaves no orphan.

A remote job outlives the process that submitted it, so an interrupted stage must cancel
it before exiting. ``dvc queue kill``, ``timeout`` and batch systems stop a stage with
SIGTERM, which Python does not turn into an exception by default: the process would die
with the job still running. These helpers make SIGTERM behave like Ctrl-C while a job is
being watched, and keep a second Ctrl-C from cutting the cancellation short.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
from collections.abc import Iterator


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM raises KeyboardInterrupt (main thread only)."""
    if not _main_thread():
        yield
        return

    def _raise(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")

    previous = signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def shielded() -> Iterator[None]:
    """Ignore SIGINT/SIGTERM while cancelling a job, so the cancel itself is not interrupted."""
    if not _main_thread():
        yield
        return
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def stop_with_parent(sig: signal.Signals = signal.SIGTERM) -> None:
    """Have the kernel send ``sig`` to this process when the process that started it dies.

    DVC runs a stage as its child and does not pass SIGTERM on: ``timeout``, CI runners and
    schedulers that stop ``dvc`` alone would leave the trainer running, and it would later
    publish outputs that dvc.lock never records. Linux only (elsewhere a no-op).
    """
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return  # not fatal: the stage still runs, it just cannot follow its parent
    if os.getppid() != parent:  # the parent died before the request took effect
        os.kill(os.getpid(), sig)
