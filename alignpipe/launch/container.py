"""Run a stage inside a container (docker or podman): the NeMo-RL image on GPU hosts.

The stage's inner command (``alignpipe run <stage> --inner``) runs in ``runtime.image``
with:

* the repository mounted at the **same path** and used as the working directory, so
  ``DVC_ROOT``, relative paths in configs and ``dvc.yaml`` outs stay valid;
* the scratch root mounted at the same path too (resumable NeMo-RL checkpoints survive
  the container), passed as ``ALIGNPIPE_SCRATCH``; ``HOME`` points into it because the
  invoking user has no home inside the image;
* ``--user $(id -u):$(id -g)`` so outputs are owned by the invoking user (DVC must hash,
  move and link them); rootless podman also gets ``--userns=keep-id`` so that uid is the
  same on both sides;
* GPUs (``--gpus all`` on docker, a device list as ``--gpus '"device=0,1"'``; CDI
  ``--device nvidia.com/gpu=all`` on podman; none when ``runtime.gpus`` is 0/none), ``--ipc=host`` and the ulimits NeMo-RL needs
  (``memlock=-1``, ``stack=67108864``);
* ``DVC_*``, ``HF_*``, ``ALIGNPIPE_*`` ... forwarded **by name** (``-e NAME``; the value
  travels in the client's environment, never on its command line);
* the mounted repository first on ``PYTHONPATH``, so the stage runs the repository's
  ``alignpipe`` (what dvc.yaml hashes), not the copy installed in the image at build time
  (that copy only brings the dependencies; ``alignpipe.stage`` refuses any other code);
* ``--rm --init``, no ``-t``/``-i`` (Ctrl-C and ``dvc queue kill`` stay effective) and a
  deterministic ``--name`` so an interrupt can ``stop``/``kill`` exactly this container.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from alignpipe.errors import ConfigError
from alignpipe.launch.base import JobLauncher, Resources, redact_argv, shell_join

RUNTIMES = ("docker", "podman")
# Forwarded variables that name host directories the job reads or writes: mounted at the
# same path when set to an existing absolute directory (the HF cache holds the weights
# of an offline run; Megatron's converted-HF cache must persist across runs).
MOUNTED_ENV_DIRS = ("HF_HOME", "HF_HUB_CACHE", "HF_DATASETS_CACHE", "NRL_MEGATRON_CHECKPOINT_DIR")
DEFAULT_ULIMITS = {"memlock": "-1", "stack": "67108864"}
NO_GPUS = {"", "0", "none", "false", "off"}


def _gpu_args(runtime: str, gpus: Any) -> list[str]:
    value = "" if gpus is None or gpus is False else str(gpus).strip()
    if value.lower() in NO_GPUS:
        return []
    if runtime == "docker":
        if value == "all" or value.isdigit():
            return ["--gpus", value]
        # docker reads --gpus as one CSV record: unquoted, "device=0,1" is the fields "device=0"
        # and "1" (a count), so the list must be a quoted field, quotes inside the argument.
        return ["--gpus", f'"device={value}"']
    # podman: NVIDIA Container Toolkit CDI devices (nvidia-ctk cdi generate).
    if value == "all":
        return ["--device", "nvidia.com/gpu=all"]
    if value.isdigit():
        value = ",".join(str(i) for i in range(int(value)))
    return [arg for i in value.split(",") for arg in ("--device", f"nvidia.com/gpu={i.strip()}")]


def env_dirs(env: Mapping[str, str]) -> list[Path]:
    """Host directories named by forwarded variables that must be visible in the container."""
    out = []
    for name in MOUNTED_ENV_DIRS:
        value = env.get(name)
        if value and Path(value).is_absolute() and Path(value).is_dir():
            out.append(Path(value))
    return out


def container_name(stage: str, workdir: Path) -> str:
    """Deterministic per workspace and stage: a second run of the same stage in the same
    workspace collides loudly instead of two containers writing the same outputs."""
    digest = hashlib.sha256(str(Path(workdir).resolve()).encode()).hexdigest()[:10]
    slug = re.sub(r"[^a-zA-Z0-9_.-]+", "-", Path(workdir).name).strip("-.") or "repo"
    stage = re.sub(r"[^a-zA-Z0-9_.-]+", "-", stage)  # convert@dpo: container names allow [a-zA-Z0-9_.-]
    return f"alignpipe-{slug}-{stage}-{digest}"


@dataclass
class ContainerLauncher(JobLauncher):
    image: str
    runtime: str = "docker"
    gpus: Any = "all"
    ulimits: dict[str, str] = field(default_factory=lambda: dict(DEFAULT_ULIMITS))
    extra_args: list[str] = field(default_factory=list)
    scratch_root: Path | None = None
    user: str | None = "auto"  # "auto": $(id -u):$(id -g); None/"": the image's user
    stop_timeout_s: int = 30
    ipc: str | None = "host"  # NCCL/vLLM shared memory; None keeps the runtime's default
    name = "container"

    @classmethod
    def from_params(cls, runtime: dict[str, Any], params: dict[str, Any]) -> ContainerLauncher:
        from alignpipe.context import scratch_root

        image = runtime.get("image")
        if not image:
            raise ConfigError(
                "params.yaml: runtime.image is empty; set it in conf/config.yaml to the image built "
                "from the repository's Dockerfile (docs/GPU.md) and run `alignpipe params`"
            )
        rt = str(runtime.get("container_runtime") or "docker")
        if rt not in RUNTIMES:
            raise ConfigError(
                f"params.yaml: runtime.container_runtime '{rt}' is not one of {', '.join(RUNTIMES)}"
            )
        args = runtime.get("container_args") or []
        if not isinstance(args, list) or not all(isinstance(a, (str, int, float)) for a in args):
            raise ConfigError(
                f"params.yaml: runtime.container_args must be a list of strings, found {args!r}"
            )
        ulimits = runtime.get("container_ulimits", DEFAULT_ULIMITS)
        if ulimits is not None and not isinstance(ulimits, dict):
            raise ConfigError(f"params.yaml: runtime.container_ulimits must be a mapping, found {ulimits!r}")
        return cls(
            image=str(image),
            runtime=rt,
            gpus=runtime.get("gpus", "all"),
            # A null value drops that limit (e.g. hosts that refuse memlock=-1).
            ulimits={str(k): str(v) for k, v in (ulimits or {}).items() if v is not None},
            extra_args=[str(a) for a in args],
            scratch_root=scratch_root(params),
            user=runtime.get("container_user", "auto"),
            ipc=runtime.get("container_ipc", "host"),
        )

    # ------------------------------------------------------------------ command

    def _user_args(self) -> list[str]:
        if not self.user:
            return []
        user = f"{os.getuid()}:{os.getgid()}" if self.user == "auto" else str(self.user)
        args = ["--user", user]
        if self.runtime == "podman" and os.getuid() != 0 and self.user == "auto":
            # Rootless podman maps the invoking user to root inside unless told otherwise.
            args.append("--userns=keep-id")
        return args

    def home_dir(self) -> Path | None:
        return (self.scratch_root / ".home") if self.scratch_root else None

    def argv(
        self,
        argv: Sequence[str],
        *,
        stage: str,
        workdir: Path,
        env_names: Sequence[str],
        env_dirs: Sequence[Path] = (),
    ) -> list[str]:
        workdir = Path(workdir).resolve()
        cmd = [self.runtime, "run", "--rm", "--init", "--name", container_name(stage, workdir)]
        if self.ipc:
            cmd.append(f"--ipc={self.ipc}")
        cmd += _gpu_args(self.runtime, self.gpus)
        for key, value in self.ulimits.items():
            cmd += ["--ulimit", f"{key}={value}"]
        cmd += self._user_args()
        cmd += ["-v", f"{workdir}:{workdir}", "-w", str(workdir)]
        if self.scratch_root is not None:
            root = Path(self.scratch_root).resolve()
            if root != workdir and workdir not in root.parents:
                cmd += ["-v", f"{root}:{root}"]
            # Values, not names: both are plain paths, and the inner process must agree with us.
            cmd += ["-e", f"ALIGNPIPE_SCRATCH={root}", "-e", f"HOME={root / '.home'}"]
        cmd += ["-e", f"PYTHONPATH={workdir}"]  # the repository's alignpipe, ahead of the image's
        mounted = [workdir, *([Path(self.scratch_root).resolve()] if self.scratch_root else [])]
        for directory in sorted({Path(d).resolve() for d in env_dirs}):
            if not any(directory == m or m in directory.parents for m in mounted):
                cmd += ["-v", f"{directory}:{directory}"]
                mounted.append(directory)
        # CUDA_VISIBLE_DEVICES holds host indices; inside, the runtime.gpus devices count from 0.
        for name in sorted(
            set(env_names) - {"ALIGNPIPE_SCRATCH", "HOME", "PYTHONPATH", "CUDA_VISIBLE_DEVICES"}
        ):
            cmd += ["-e", name]
        cmd += self.extra_args
        cmd.append(self.image)
        cmd += list(argv)
        return cmd

    def command(self, argv, *, stage, workdir, env):
        """``env`` travels by name; the directories it names are mounted."""
        return self.argv(argv, stage=stage, workdir=workdir, env_names=sorted(env), env_dirs=env_dirs(env))

    def resources(self) -> Resources:
        gpus = "" if self.gpus is None or self.gpus is False else str(self.gpus).strip()
        return Resources(image=self.image, gpus=None if gpus.lower() in NO_GPUS else gpus)

    # ------------------------------------------------------------------ run

    def _stop(self, name: str) -> None:
        """Stop the container (SIGTERM, then SIGKILL after the grace period); idempotent."""
        subprocess.run(
            [self.runtime, "stop", "-t", str(self.stop_timeout_s), name],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            check=False,
        )
        subprocess.run(
            [self.runtime, "kill", name], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False
        )

    def check_image(self) -> None:
        """A locally built image that the runtime does not have is named with its build command
        before anything starts; images in a registry are left for the runtime to pull."""
        probe = subprocess.run([self.runtime, "image", "inspect", "--format", "{{.Id}}", self.image],
                               capture_output=True, text=True, check=False)  # fmt: skip
        if probe.returncode == 0 or not re.search(r"no such image|image not known", probe.stderr, re.I):
            return
        registry = self.image.split("/")[0] if "/" in self.image else ""
        if registry and registry != "localhost" and ("." in registry or ":" in registry):
            return
        local = self.image.removeprefix("localhost/")
        if local.startswith("sha256:") or "@" in local:  # pinned by ID or digest: build, then re-pin
            local = "alignpipe-nemo-rl:v0.7.0"
        hint = (f" docker names local builds without podman's localhost/ prefix: set runtime.image: {local}."
                if self.runtime == "docker" and local != self.image else "")  # fmt: skip
        raise ConfigError(
            f"params.yaml: runtime.image {self.image} is not among {self.runtime}'s images.{hint} Build it "
            f"from the repository (docs/GPU.md §2): {self.runtime} build -t {local} ."
        )

    def submit(self, argv, *, stage, workdir, env, out):
        self.check_image()
        env = dict(env)
        cmd = self.command(argv, stage=stage, workdir=workdir, env=env)
        home = self.home_dir()
        if home is not None:
            home.mkdir(parents=True, exist_ok=True)
        print(f"alignpipe: {shell_join(redact_argv(cmd))}", file=sys.stderr, flush=True)
        # The client reads each `-e NAME`'s value from its own environment.
        proc = subprocess.Popen(cmd, cwd=workdir, env={**os.environ, **env}, start_new_session=True)
        return _Container(proc, container_name(stage, workdir.resolve()))

    def follow(self, job, out):
        # The client runs in the foreground: the container's output is already on ours.
        job.proc.wait()

    def cancel(self, job, out):
        print(f"alignpipe: interrupted; stopping container {job.name}", file=sys.stderr, flush=True)
        self._stop(job.name)
        try:
            job.proc.wait(timeout=self.stop_timeout_s + 30)
        except subprocess.TimeoutExpired:
            job.proc.kill()
            job.proc.wait()

    def finish(self, job, out):
        return job.proc.returncode


@dataclass
class _Container:
    proc: subprocess.Popen
    name: str
