"""The launcher contract and the pieces every launcher shares."""

from __future__ import annotations

import os
import re
import shlex
import sys
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from alignpipe.launch.interrupt import shielded, sigterm_as_interrupt

# Variables a stage needs wherever it runs. DVC_* tell DVCLive it is inside a pipeline
# (otherwise it would try to create its own experiment); HF_* keep the hub offline.
FORWARDED_PREFIXES = ("DVC_", "HF_", "ALIGNPIPE_", "TRANSFORMERS_", "WANDB_", "NRL_")
FORWARDED_NAMES = ("PYTHONHASHSEED", "TOKENIZERS_PARALLELISM", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES")

# TOKEN, but not TOKENIZERS_PARALLELISM (a setting every launched stage gets).
_SECRET = re.compile(
    r"(TOKEN(?!IZERS)|SECRET|PASSWORD|PASSWD|API_KEY|APIKEY|CREDENTIAL|PRIVATE_KEY|ACCESS_KEY)", re.I
)


def string_list(key: str, value) -> list[str]:
    """A params.yaml list-of-strings setting: absent -> [], one string -> [it]."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        from alignpipe.errors import ConfigError

        raise ConfigError(f"params.yaml: {key} must be a list of strings, found {value!r}")
    return list(value)


def settings_section(params: Mapping[str, Any], section: str, known: Iterable[str]) -> dict[str, Any]:
    """params.yaml's ``<section>:`` mapping (absent -> {}), refusing keys the launcher does not know."""
    from alignpipe.errors import ConfigError

    values = params.get(section) or {}
    if not isinstance(values, Mapping):
        raise ConfigError(f"params.yaml: '{section}' must be a mapping, found {type(values).__name__}")
    known = sorted(known)
    unknown = sorted(set(values) - set(known))
    if unknown:
        prefix = f", {section}."
        raise ConfigError(
            f"params.yaml: unknown key(s) {section}.{prefix.join(unknown)}; known keys: {', '.join(known)}"
        )
    return dict(values)


def is_secret(name: str) -> bool:
    return bool(_SECRET.search(name))


def forwarded_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The subset of the environment a stage carries into its job."""
    environ = os.environ if environ is None else environ
    return {k: v for k, v in environ.items() if k.startswith(FORWARDED_PREFIXES) or k in FORWARDED_NAMES}


def redact_env(env: Mapping[str, str]) -> dict[str, str]:
    """Copy of ``env`` safe to print or write to a manifest: secret values masked."""
    return {k: ("***" if is_secret(k) else v) for k, v in env.items()}


def redact_argv(argv: Sequence[str]) -> list[str]:
    """Mask ``NAME=value`` arguments whose name looks secret (``-e HF_TOKEN=...``)."""
    out = []
    for arg in argv:
        name, sep, _ = arg.partition("=")
        out.append(f"{name}=***" if sep and is_secret(name.lstrip("-")) else arg)
    return out


def shell_join(argv: Sequence[str]) -> str:
    return " ".join(shlex.quote(a) for a in argv)


@dataclass(frozen=True)
class Resources:
    """What a launch asks for: the image the job runs in, its GPUs, its nodes."""

    image: str | None = None
    gpus: str | None = None  # as the launcher asks: "all", "0,1", "8 per node"; None: none
    nodes: int = 1


class Launcher(ABC):
    """Runs the stage's inner command somewhere and waits for it."""

    name: str = "?"

    @abstractmethod
    def command(self, argv: Sequence[str], *, stage: str, workdir: Path, env: Mapping[str, str]) -> list[str]:
        """The exact host command that launches ``argv`` with ``env`` (``run`` runs it, ``plan``
        prints it); a secret's value never appears in it."""

    def resources(self) -> Resources:
        return Resources()

    def run_files(self, argv: Sequence[str], *, stage: str, workdir: Path) -> dict[str, str]:
        """Files the launcher writes at run time to launch ``argv``, by name (shown by ``plan``)."""
        return {}

    @abstractmethod
    def run(self, argv: Sequence[str], *, stage: str, workdir: Path, env: Mapping[str, str]) -> int:
        """Launch, stream logs, block until done, return the job's exit code.

        On KeyboardInterrupt/SIGTERM the job is cancelled before the exception propagates.
        """

    def last_job_where(self) -> str:
        """Where the last job ran (``slurm job 12 ran on node1``), for error messages; "" if unknown."""
        return ""

    def check_outputs(self, outputs: Sequence[Path]) -> None:
        """After a successful remote job: outputs must be visible here (shared filesystem)."""
        missing = [str(p) for p in outputs if not Path(p).exists()]
        if missing:
            from alignpipe.errors import AlignpipeError

            where = self.last_job_where()
            raise AlignpipeError(
                f"the {self.name} job finished successfully but these outputs are not visible from "
                f"this host: {', '.join(missing)}. The {self.name} launcher expects the job to write "
                f"to a filesystem shared with the DVC workspace; mount the repository at the same "
                f"path on the compute nodes." + (f" ({where})" if where else "")
            )


class JobLauncher(Launcher):
    """A launcher that hands the stage to something that outlives this process.

    A container, a Slurm job and a Ray job all go the same way: submit, follow the job's
    logs until it ends, and, if the stage is interrupted (Ctrl-C, or SIGTERM from ``dvc
    queue kill``/``timeout``) while following, cancel the job before the interrupt
    propagates, shielded from a second signal. That order lives here, once; each launcher
    says how it submits, follows, cancels and reads the outcome of its kind of job.
    """

    def run(
        self,
        argv: Sequence[str],
        *,
        stage: str,
        workdir: Path,
        env: Mapping[str, str],
        out: TextIO | None = None,
    ) -> int:
        out = out or sys.stdout
        with sigterm_as_interrupt():
            job = self.submit(argv, stage=stage, workdir=Path(workdir), env=env, out=out)
            try:
                self.follow(job, out)
            except BaseException:
                with shielded():
                    self.cancel(job, out)
                raise
        return self.finish(job, out)

    @abstractmethod
    def submit(
        self, argv: Sequence[str], *, stage: str, workdir: Path, env: Mapping[str, str], out: TextIO
    ) -> Any:
        """Start the job and return its handle (what the other three steps act on)."""

    @abstractmethod
    def follow(self, job: Any, out: TextIO) -> None:
        """Stream the job's output to ``out`` until it ends."""

    @abstractmethod
    def cancel(self, job: Any, out: TextIO) -> None:
        """Stop the job and wait a bounded time for it to be gone; must not raise."""

    @abstractmethod
    def finish(self, job: Any, out: TextIO) -> int:
        """Record where and how the job ended; return its exit code."""
