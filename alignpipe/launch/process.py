"""Run the stage in a child process of this one (a dev venv, or already inside the container)."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

from alignpipe.launch.base import Launcher


def run_foreground(argv: Sequence[str], *, cwd: Path, env: Mapping[str, str], grace_s: float = 30.0) -> int:
    """Run ``argv`` in its own process group, stream its output, and stop it on Ctrl-C.

    DVC ignores SIGINT while a stage runs, so the interrupt reaches us and must be
    passed on: SIGINT to the child's group, then SIGKILL after ``grace_s``.
    """
    proc = subprocess.Popen(list(argv), cwd=cwd, env=dict(env), start_new_session=True)
    try:
        return proc.wait()
    except BaseException:
        _stop_group(proc, grace_s)
        raise


def _stop_group(proc: subprocess.Popen, grace_s: float) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


class ProcessLauncher(Launcher):
    name = "process"

    def command(self, argv, *, stage, workdir, env):
        return list(argv)

    def run(self, argv, *, stage, workdir, env):
        return run_foreground(argv, cwd=workdir, env={**os.environ, **env})
