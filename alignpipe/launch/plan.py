"""One launch, decided once: what ``alignpipe run`` launches is what ``alignpipe plan`` prints.

``alignpipe.stage.launch_plan`` builds a ``LaunchPlan`` for a stage: the launcher, the inner
command, the environment the job gets, its label and what it needs. ``run`` executes it
(``LaunchPlan.run``, or in the stage's own process on the process launcher); ``plan`` prints it
(``LaunchPlan.files``). Nothing else picks a launcher, an argv or an environment.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from alignpipe.launch.base import Launcher, Resources, is_secret, shell_join


@dataclass(frozen=True)
class LaunchPlan:
    """A stage's launch. ``env`` holds values because ``run`` needs them; what is printed holds
    the values alignpipe sets itself (``pinned``) and only the names of the rest, so a secret's
    value never leaves the environment it came from."""

    launcher: Launcher
    argv: tuple[str, ...]  # the inner command: alignpipe run <stage> --inner ...
    env: Mapping[str, str]  # every variable the job gets
    pinned: frozenset[str]  # names alignpipe sets (offline flags, ALIGNPIPE_ROOT); the rest are forwarded
    label: str  # stage or stage@source: the job's, container's and log's name
    workdir: Path
    outputs: tuple[Path, ...]  # what the job writes, checked after it succeeds
    notes: tuple[str, ...] = field(default=())  # why this launcher: printed atop the script

    def __post_init__(self) -> None:
        secret = sorted(name for name in self.pinned if is_secret(name))
        if secret:  # pinned values are printed
            raise ValueError(f"a launch plan prints pinned values; these look secret: {secret}")

    @property
    def here(self) -> bool:
        """The process launcher's job is the stage's own process: ``run`` does the work in place."""
        return self.launcher.name == "process"

    def command(self) -> list[str]:
        """The exact host command the launcher runs."""
        return self.launcher.command(self.argv, stage=self.label, workdir=self.workdir, env=self.env)

    def resources(self) -> Resources:
        return self.launcher.resources()

    def forwarded(self) -> list[str]:
        return sorted(set(self.env) - self.pinned)

    def secrets(self) -> list[str]:
        return [name for name in sorted(self.env) if is_secret(name)]

    def run(self) -> int:
        """Launch, wait, and check the outputs came back; the job's exit code."""
        code = self.launcher.run(self.argv, stage=self.label, workdir=self.workdir, env=dict(self.env))
        if code == 0:
            self.launcher.check_outputs(list(self.outputs))
        return code

    def script(self) -> str:
        """``<label>.launch.sh``: this plan as a script; its last line is the launch command."""
        needs = self.resources()
        secret = set(self.secrets())
        forwarded = [f"{n} (secret)" if n in secret else n for n in self.forwarded()]
        lines = [
            "#!/usr/bin/env bash",
            *(f"# {note}" for note in self.notes),
            f"# Image {needs.image or 'none'}; GPUs {needs.gpus or 'none'}; nodes {needs.nodes}; writes "
            f"{', '.join(str(p.relative_to(self.workdir)) for p in self.outputs) or 'nothing'}.",
            f"# Forwarded by name from this shell: {', '.join(forwarded) or 'none'}.",
            "set -euo pipefail",
            f"cd {shell_join([str(self.workdir)])}",
            *(f"export {k}={shell_join([self.env[k]])}" for k in sorted(self.pinned)),
            shell_join(self.command()),
        ]
        return "\n".join(lines) + "\n"

    def files(self) -> dict[str, str]:
        """What ``alignpipe plan`` shows of the launch: the script, and what the launcher
        writes at run time (the Slurm batch script)."""
        return {
            f"{self.label}.launch.sh": self.script(),
            **self.launcher.run_files(self.argv, stage=self.label, workdir=self.workdir),
        }
