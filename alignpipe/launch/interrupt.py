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
import select
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path


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
# Shells DVC may run a stage's cmd with ($SHELL, else /bin/sh): `<shell> -c "alignpipe run ..."`.
_SHELLS = frozenset({"sh", "dash", "bash", "zsh", "ksh", "mksh", "fish", "busybox"})


def _ppid(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2 :].split()[1])  # after "pid (comm) state"


def _is_shell_wrapper(pid: int) -> bool:
    """Is ``pid`` a non-interactive shell running a command string (``sh -c ...``)?"""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    name = os.path.basename(argv[0].decode(errors="replace")).lstrip("-")
    return name in _SHELLS and b"-c" in argv[1:]


def _watch(pid: int, sig: signal.Signals) -> None:
    """Send ``sig`` to this process when ``pid`` exits (a pidfd turns readable on exit)."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        os.kill(os.getpid(), sig)
        return
    except (AttributeError, OSError):
        return  # no pidfd (Linux < 5.3): only the direct parent is followed

    def wait_then_signal() -> None:
        select.select([pidfd], [], [])
        os.kill(os.getpid(), sig)

    threading.Thread(target=wait_then_signal, name="stop-with-parent", daemon=True).start()


def stop_with_parent(sig: signal.Signals = signal.SIGTERM) -> None:
    """Get ``sig`` when the process that started this command dies.

    DVC runs a stage as its child and does not pass SIGTERM on: ``timeout``, CI runners and
    schedulers that stop ``dvc`` alone would leave the trainer running, and it would later
    publish outputs that dvc.lock never records. The kernel signals us when our parent
    dies (PR_SET_PDEATHSIG). DVC starts the cmd through ``$SHELL -c``: bash execs a lone
    command, but dash (Debian's /bin/sh, used when SHELL is unset, as on many CI runners)
    forks and waits, so our parent is then a shell that outlives dvc; past such wrappers we
    watch the first real ancestor. Linux only (elsewhere a no-op).
    """
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0 and os.getppid() != parent:
        os.kill(os.getpid(), sig)  # the parent died before the request took effect
        return
    starter = parent
    try:
        while starter > 1 and _is_shell_wrapper(starter):
            starter = _ppid(starter)
    except (OSError, ValueError, IndexError):
        return
    if starter != parent and starter > 1:
        _watch(starter, sig)
