"""Run a stage on an existing Ray cluster through the Ray Jobs API.

The cluster (KubeRay, Anyscale, a head started by a Slurm job) must see the repository
at the same path as this host: the entrypoint ``cd``s there instead of uploading the
repo, so outputs land in the DVC workspace. The stage's forwarded environment (DVC_*,
HF_* ...) travels in ``runtime_env.env_vars``; variables whose names look secret are
left out unless ``ray.forward_secrets`` is true, because Ray keeps the runtime env in
its job table and dashboard. Logs are streamed while the job runs, the exit status is
returned (SUCCEEDED -> 0, FAILED -> the entrypoint's exit code), and Ctrl-C or SIGTERM
stops the job (``stop_job``) before the stage exits.

Token authentication (Ray >= 2.52): with ``RAY_AUTH_MODE=token`` in this process's
environment, every Jobs API call (submit, status, logs, stop) carries the token Ray's own
loader finds: ``RAY_AUTH_TOKEN``, else the file ``RAY_AUTH_TOKEN_PATH`` names, else
``~/.ray/auth_token``. As with Ray's own clients, an explicit address never turns token auth
on by itself, so a local cluster's token is not sent elsewhere unasked. A missing or refused
token stops the stage before anything is submitted. The token never enters the job's
runtime env, a log line or the plan; the cluster's nodes hold their own copy.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shlex
import threading
import time
import uuid
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, TextIO

from alignpipe.errors import AlignpipeError, ConfigError
from alignpipe.launch.base import (
    JobLauncher,
    Resources,
    is_secret,
    redact_env,
    settings_section,
    shell_join,
    string_list,
)

POLL_S = 1.0
# How long a stopped job may take to reach a terminal state before we stop waiting.
STOP_WAIT_S = 60.0


@dataclass
class RaySettings:
    """params.yaml ``ray:`` (documented in conf/config.yaml and docs/SCALE_OUT.md)."""

    address: str | None = None
    working_dir: str | None = None
    env_vars: dict[str, str] = field(default_factory=dict)
    pip: list[str] = field(default_factory=list)
    setup: list[str] = field(default_factory=list)
    forward_secrets: bool = False
    entrypoint_num_cpus: float | None = None
    entrypoint_num_gpus: float | None = None
    entrypoint_memory: int | None = None
    entrypoint_resources: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> RaySettings:
        values = settings_section(params, "ray", (f.name for f in fields(cls)))
        for key in ("env_vars", "entrypoint_resources"):
            value = values.get(key)
            if value is None:
                values[key] = {}
            elif not isinstance(value, Mapping):
                raise ConfigError(f"params.yaml: ray.{key} must be a mapping, found {value!r}")
            else:
                values[key] = {str(k): (str(v) if key == "env_vars" else v) for k, v in value.items()}
        for key in ("pip", "setup"):
            values[key] = string_list(f"ray.{key}", values.get(key))
        return cls(**values)


class RayJobLauncher(JobLauncher):
    name = "ray"

    def __init__(self, settings: RaySettings):
        self.settings = settings
        self.last_job: dict[str, Any] | None = None

    @classmethod
    def from_params(cls, runtime: Mapping[str, Any], params: Mapping[str, Any]) -> RayJobLauncher:
        return cls(RaySettings.from_params(params))

    def address(self) -> str:
        address = self.settings.address or os.environ.get("RAY_ADDRESS")
        if not address:
            raise ConfigError(
                "the ray launcher needs the cluster's Jobs API address: set ray.address in params.yaml "
                "(`dvc exp run -S ray.address=http://HEAD:8265`) or export RAY_ADDRESS=http://HEAD:8265"
            )
        return address

    def entrypoint(self, argv: Sequence[str], workdir: Path) -> str:
        """Shell line run by the job: setup, ``cd`` to the shared repo, then the stage."""
        cd = (
            f'cd {shlex.quote(str(workdir))} || {{ echo "alignpipe: {workdir} does not exist on the Ray node '
            "$(hostname); the ray launcher needs the repository on a filesystem shared with the cluster, "
            'at the same path" >&2; exit 2; }'
            # The repository's alignpipe, ahead of an image's or venv's copy (alignpipe.stage checks it).
            f' && export PYTHONPATH={shlex.quote(str(workdir))}"${{PYTHONPATH:+:$PYTHONPATH}}"'
        )
        parts = [*self.settings.setup, cd] if self.settings.working_dir is None else list(self.settings.setup)
        return " && ".join([*parts, f"exec {shell_join(argv)}"]) if parts else f"exec {shell_join(argv)}"

    def job_env(self, env: Mapping[str, str], job_id: str) -> tuple[dict[str, str], list[str]]:
        """Env vars for the job and the names of secret-looking ones left out."""
        merged = {**self.settings.env_vars, **env, "ALIGNPIPE_JOB_ID": f"ray:{job_id}"}
        if self.settings.forward_secrets:
            return merged, []
        dropped = sorted(k for k in merged if is_secret(k) and k not in self.settings.env_vars)
        return {k: v for k, v in merged.items() if k not in dropped}, dropped

    def runtime_env(self, env_vars: Mapping[str, str]) -> dict[str, Any]:
        runtime_env: dict[str, Any] = {"env_vars": dict(env_vars)}
        if self.settings.pip:
            runtime_env["pip"] = list(self.settings.pip)
        if self.settings.working_dir is not None:
            runtime_env["working_dir"] = self.settings.working_dir
        return runtime_env

    def submit_kwargs(self) -> dict[str, Any]:
        s = self.settings
        kwargs: dict[str, Any] = {
            "entrypoint_num_cpus": s.entrypoint_num_cpus,
            "entrypoint_num_gpus": s.entrypoint_num_gpus,
            "entrypoint_memory": s.entrypoint_memory,
            "entrypoint_resources": dict(s.entrypoint_resources) or None,
        }
        return {k: v for k, v in kwargs.items() if v is not None}

    def command(self, argv: Sequence[str], *, stage: str, workdir: Path, env: Mapping[str, str]) -> list[str]:
        """The equivalent ``ray job submit`` line (what ``run`` does through the Python API),
        with the runtime env ``submit`` sends, secret values masked.

        Like ``run``, ``ray job submit`` takes the token from the environment (RAY_AUTH_MODE,
        RAY_AUTH_TOKEN ...), so the line never holds it."""
        address = self.settings.address or os.environ.get("RAY_ADDRESS")
        env_vars, _ = self.job_env(env, "<submission-id>")
        cmd = ["ray", "job", "submit"]
        # Without an address here, `ray job submit` reads $RAY_ADDRESS where the plan is run.
        cmd += [f"--address={address}"] if address else []
        cmd.append(f"--submission-id=alignpipe-{stage}-<id>")
        cmd.append(f"--runtime-env-json={json.dumps(self.runtime_env(redact_env(env_vars)), sort_keys=True)}")
        flags = {
            "entrypoint_num_cpus": "--entrypoint-num-cpus",
            "entrypoint_num_gpus": "--entrypoint-num-gpus",
            "entrypoint_memory": "--entrypoint-memory",
        }
        for key, value in self.submit_kwargs().items():
            if key in flags:
                cmd.append(f"{flags[key]}={value}")
            else:
                cmd.append(f"--entrypoint-resources={json.dumps(value)}")
        return [*cmd, "--", "bash", "-c", self.entrypoint(argv, workdir)]

    def resources(self) -> Resources:
        gpus = self.settings.entrypoint_num_gpus
        return Resources(gpus=f"{gpus:g} for the entrypoint" if gpus else None)

    def client(self):
        try:
            from ray.exceptions import AuthenticationError
            from ray.job_submission import JobSubmissionClient
        except ImportError as e:
            raise AlignpipeError(
                "the ray launcher needs Ray's job client on this host: pip install 'ray[default]>=2.55.1,<2.61' "
                "(the cluster's version; docs/SCALE_OUT.md)"
            ) from e

        address = self.address()
        headers = auth_headers()
        try:
            # Connecting asks the cluster for its version, an authenticated call: a missing or
            # wrong token fails here, before anything is submitted.
            return JobSubmissionClient(address, headers=headers or None)
        except AuthenticationError:
            raise refused(address, sent_token=bool(headers)) from None
        except Exception as e:  # Ray raises ConnectionError, RuntimeError or ValueError here
            raise AlignpipeError(
                f"cannot reach the Ray Jobs API at {address}: {e}. ray.address / RAY_ADDRESS must be the "
                "dashboard URL of a running cluster, e.g. http://HEAD:8265"
            ) from None

    def submit(self, argv, *, stage, workdir, env, out):
        client = self.client()
        submission_id = f"alignpipe-{stage}-{uuid.uuid4().hex[:12]}"
        env_vars, dropped = self.job_env(env, submission_id)
        if dropped:
            print(
                f"alignpipe: not sending {', '.join(dropped)} to the Ray job (secrets stay out of Ray's job "
                "table); provide them on the cluster or set ray.forward_secrets: true",
                file=out,
                flush=True,
            )
        client.submit_job(
            entrypoint=self.entrypoint(argv, workdir),
            submission_id=submission_id,
            runtime_env=self.runtime_env(env_vars),
            metadata={"alignpipe_stage": stage, "workdir": str(workdir)},
            **self.submit_kwargs(),
        )
        print(
            f"alignpipe: submitted stage '{stage}' as Ray job {submission_id} at {self.address()}",
            file=out,
            flush=True,
        )
        logs = _LogStream(client, submission_id, out)
        logs.start()
        return _RayJob(client, submission_id, logs)

    def follow(self, job, out):
        job.status = job.client.get_job_status(job.submission_id)
        while not job.status.is_terminal():
            time.sleep(POLL_S)
            job.status = job.client.get_job_status(job.submission_id)

    def cancel(self, job, out):
        print(f"alignpipe: interrupted; stopping Ray job {job.submission_id}", file=out, flush=True)
        try:
            job.client.stop_job(job.submission_id)
            deadline = time.monotonic() + STOP_WAIT_S
            while time.monotonic() < deadline:
                status = job.client.get_job_status(job.submission_id)
                if status.is_terminal():
                    print(f"alignpipe: Ray job {job.submission_id} {status}", file=out, flush=True)
                    break
                time.sleep(0.5)
            else:
                print(
                    f"alignpipe: Ray job {job.submission_id} did not stop within {STOP_WAIT_S:.0f}s",
                    file=out,
                    flush=True,
                )
        except Exception as e:  # the interrupt must still propagate; say what went wrong
            print(f"alignpipe: could not stop Ray job {job.submission_id}: {e}", file=out, flush=True)
        job.logs.join(10.0)

    def finish(self, job, out):
        from ray.job_submission import JobStatus

        job.logs.join(30.0)
        info = job.client.get_job_info(job.submission_id)
        self.last_job = {
            "launcher": "ray",
            "job_id": job.submission_id,
            "status": str(info.status),
            "driver_node_id": info.driver_node_id,
            "message": info.message,
        }
        code = exit_code(job.status, info.driver_exit_code, info.message)
        if job.status == JobStatus.STOPPED:
            print(
                f"alignpipe: Ray job {job.submission_id} was stopped outside alignpipe", file=out, flush=True
            )
        print(f"alignpipe: Ray job {job.submission_id} {job.status} (exit {code})", file=out, flush=True)
        return code

    def last_job_where(self) -> str:
        job = self.last_job or {}
        return f"Ray job {job.get('job_id', '?')} ran its driver on node {job.get('driver_node_id') or '?'}"


# Where Ray's token loader looks, in its order of precedence.
TOKEN_SOURCES = "RAY_AUTH_TOKEN, the file RAY_AUTH_TOKEN_PATH names, or ~/.ray/auth_token"


def default_token_file() -> Path:
    return Path.home() / ".ray" / "auth_token"


def token_source(environ: Mapping[str, str] | None = None) -> str:
    """Where Ray's loader takes the token from right now, named for an error message."""
    environ = os.environ if environ is None else environ
    if environ.get("RAY_AUTH_TOKEN", "").strip():
        return "the RAY_AUTH_TOKEN environment variable"
    if environ.get("RAY_AUTH_TOKEN_PATH"):
        return f"the file {environ['RAY_AUTH_TOKEN_PATH']} (named by RAY_AUTH_TOKEN_PATH)"
    return f"{default_token_file()} (Ray's default token file)"


def auth_headers() -> dict[str, str]:
    """The Jobs API's Authorization header, from Ray's own token loader; {} unless RAY_AUTH_MODE=token."""
    mode = os.environ.get("RAY_AUTH_MODE", "").strip().lower()
    if mode != "token":
        return {}
    try:
        from ray._raylet import AuthenticationTokenLoader
    except ImportError:
        raise AlignpipeError(
            "RAY_AUTH_MODE=token is set but this host's Ray has no token authentication: install "
            "'ray[default]>=2.52' (the cluster's version) or unset RAY_AUTH_MODE"
        ) from None
    loader = AuthenticationTokenLoader.instance()
    # The loader caches the token, and Ray's process-wide config caches RAY_AUTH_MODE from the
    # first time it was read: read the token as the environment and files are now (tests and
    # notebooks run several stages in one process), the mode having been checked above.
    loader.reset_cache()
    try:
        headers = dict(loader.get_token_for_http_header(ignore_auth_mode=True))
    except Exception:  # ray.exceptions.AuthenticationError: RAY_AUTH_TOKEN_PATH unreadable or empty
        headers = {}
    if not headers:
        raise AlignpipeError(
            f"RAY_AUTH_MODE=token is set but Ray found no token in {token_source()}. Ray reads it from "
            f"{TOKEN_SOURCES}, in that order: put the cluster's token in one of them (KubeRay: the "
            "auth_token key of the cluster's Secret; docs/SCALE_OUT.md), or unset RAY_AUTH_MODE for a "
            "cluster without token auth. Nothing was submitted"
        )
    return headers


def refused(address: str, sent_token: bool) -> AlignpipeError:
    """The cluster answered 401/403: say which token went (or none) and where to fix it."""
    if sent_token:
        return AlignpipeError(
            f"the Ray cluster at {address} refused the token from {token_source()}: it is not this "
            f"cluster's token. Put the cluster's token there (Ray reads {TOKEN_SOURCES}, in that "
            "order). Nothing was submitted"
        )
    mode = os.environ.get("RAY_AUTH_MODE") or "unset"
    return AlignpipeError(
        f"the Ray cluster at {address} requires token authentication and no token was sent "
        f"(RAY_AUTH_MODE is {mode} here): export RAY_AUTH_MODE=token and give the cluster's token in "
        f"{TOKEN_SOURCES}. Nothing was submitted"
    )


def exit_code(status: Any, driver_exit_code: int | None, message: str | None) -> int:
    """SUCCEEDED -> 0; FAILED -> the entrypoint's exit code when Ray reports it; otherwise 1."""
    name = str(getattr(status, "value", status))
    if name == "SUCCEEDED":
        return 0
    if driver_exit_code is not None and driver_exit_code != 0:
        return driver_exit_code if driver_exit_code > 0 else 128 - driver_exit_code
    match = re.search(r"exit code (-?\d+)", message or "")
    if match and int(match.group(1)) != 0:
        code = int(match.group(1))
        return code if code > 0 else 128 - code
    return 1


@dataclass
class _RayJob:
    client: Any  # ray.job_submission.JobSubmissionClient
    submission_id: str
    logs: _LogStream
    status: Any = None  # ray.job_submission.JobStatus, once followed


class _LogStream(threading.Thread):
    """Streams the job's logs (``tail_job_logs``), falling back to polling ``get_job_logs``."""

    def __init__(self, client, submission_id: str, out: TextIO):
        super().__init__(name=f"ray-logs-{submission_id}", daemon=True)
        self.client, self.submission_id, self.out = client, submission_id, out
        self.written = 0

    def _write(self, text: str) -> None:
        if text:
            self.written += len(text)
            self.out.write(text)
            self.out.flush()

    def run(self) -> None:
        # Ray's client logs every websocket close at INFO and warns about its own aiohttp
        # call; neither says anything about the stage.
        logging.getLogger("ray.dashboard.modules.job.sdk").setLevel(logging.WARNING)
        warnings.filterwarnings("ignore", message="ssl=None is deprecated", category=DeprecationWarning)

        async def tail() -> None:
            async for chunk in self.client.tail_job_logs(self.submission_id):
                self._write(chunk)

        try:
            asyncio.run(tail())
            return
        except Exception:
            pass
        # Websockets may be blocked by a proxy: poll instead, printing only what is new.
        while True:
            try:
                text = self.client.get_job_logs(self.submission_id)
                self._write(text[self.written :])
                if self.client.get_job_status(self.submission_id).is_terminal():
                    self._write(self.client.get_job_logs(self.submission_id)[self.written :])
                    return
            except Exception:
                return
            time.sleep(2.0)
