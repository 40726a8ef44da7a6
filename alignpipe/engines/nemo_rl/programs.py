"""Running NeMo-RL's own programs (entry scripts, converters) from the engine: where its
checkout is, how a command runs in the foreground, and what a failure is."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

from alignpipe.errors import AlignpipeError

DEFAULT_NEMO_RL_DIR = "/opt/nemo-rl"

CommandRunner = Callable[[Sequence[str], Path], int]


class NemoRLFailed(AlignpipeError):
    def __init__(self, what: str, code: int):
        super().__init__(what)
        self.code = code


def nemo_rl_dir(ctx) -> Path:
    return Path(os.environ.get("NEMO_RL_DIR") or ctx.runtime.get("nemo_rl_dir") or DEFAULT_NEMO_RL_DIR)


def run_command(argv: Sequence[str], cwd: Path) -> int:
    """Run a NeMo-RL program in the foreground; Ctrl-C/SIGTERM stop it (its process group)."""
    from alignpipe.launch.interrupt import sigterm_as_interrupt
    from alignpipe.launch.process import run_foreground

    print(f"nemo_rl: (cd {cwd} && {' '.join(argv)})", flush=True)
    # `podman/docker stop` sends SIGTERM to this process: pass it on to NeMo-RL's process
    # group (run_foreground stops it on an exception) instead of dying and orphaning Ray.
    with sigterm_as_interrupt():
        return run_foreground(argv, cwd=cwd, env=os.environ)
