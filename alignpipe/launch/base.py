"""The launcher contract and the pieces every launcher shares."""

from __future__ import annotations

import os
import re
import shlex
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from pathlib import Path

# Variables a stage needs wherever it runs. DVC_* tell DVCLive it is inside a pipeline
# (otherwise it would try to create its own experiment); HF_* keep the hub offline.
FORWARDED_PREFIXES = ("DVC_", "HF_", "ALIGNPIPE_", "TRANSFORMERS_", "WANDB_", "NRL_")
FORWARDED_NAMES = ("PYTHONHASHSEED", "TOKENIZERS_PARALLELISM", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES")

_SECRET = re.compile(r"(TOKEN|SECRET|PASSWORD|PASSWD|API_KEY|APIKEY|CREDENTIAL|PRIVATE_KEY|ACCESS_KEY)", re.I)


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


class Launcher(ABC):
    """Runs the stage's inner command somewhere and waits for it."""

    name: str = "?"

    @abstractmethod
    def command(self, argv: Sequence[str], *, stage: str, workdir: Path) -> list[str]:
        """The exact host command that launches ``argv`` (shown by ``alignpipe plan``)."""

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
