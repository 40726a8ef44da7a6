"""Run a stage as a Slurm batch job: ``sbatch --wait``, optionally in a pyxis container.

The batch script ``cd``s into the repository (which must be on a filesystem shared with
the compute nodes, at the same path) and runs the stage's inner command. For multi-node
jobs it first starts a Ray cluster across the allocation the way NeMo-RL's ``ray.sub``
does: ``ray start --head`` on the first node, ``ray start --address`` on the others, a
bounded wait until every node has joined, then the trainer on the head node with
``RAY_ADDRESS`` set (NeMo-RL's ``init_ray()`` attaches to it with ``address="auto"``).
That cluster uses Ray's token auth unless ``RAY_AUTH_MODE=disabled`` is exported: every
step gets the same ``RAY_AUTH_MODE`` and token (made per job unless given).

While the job runs, its log file (``--output``) is streamed to this process's stdout, and
the stage returns as soon as Slurm reports the job ended.
Ctrl-C or SIGTERM cancels the job (``scancel``) before the stage exits. The job id, script,
log and node list are written to ``<log_dir>/<stage>-<jobid>.json``, and the job exports
``ALIGNPIPE_JOB_ID=slurm:<jobid>`` so the stage records it in its ``artifact.json``.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, TextIO

from alignpipe.errors import AlignpipeError, ConfigError
from alignpipe.launch.base import JobLauncher, Resources, settings_section, shell_join, string_list

# How long to wait for sbatch to notice a cancelled job before giving up on it.
CANCEL_WAIT_S = 60.0
# How often the job's log file is checked for new output.
POLL_S = 0.5
# `sbatch --wait` checks on its job at 2, 10 and then every 32 s (fewer when MinJobAge is
# short), so a 10 s job returns after 42 s. Slurm is asked for the job's state instead, at an
# interval that grows with the job's age (a tenth of it, 1 to 30 s): a prep or convert job
# returns within a second or two, and an hours-long training job costs one query a half-minute.
STATE_POLL_MIN_S, STATE_POLL_MAX_S = 1.0, 30.0
# Slurm's states for a job that has ended (JOB_STATE_BASE names, as scontrol prints them).
ENDED_STATES = frozenset(
    ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL",
     "DEADLINE", "OUT_OF_MEMORY")
)  # fmt: skip


@dataclass
class SlurmSettings:
    """params.yaml ``slurm:`` (documented in conf/config.yaml and docs/SCALE_OUT.md)."""

    account: str | None = None
    partition: str | None = None
    qos: str | None = None
    time: str | None = "04:00:00"
    nodes: int = 1
    gpus_per_node: int = 8
    cpus_per_task: int | None = None
    mem: str | None = None
    job_name: str | None = None
    container_image: str | None = None
    container_mounts: list[str] = field(default_factory=list)
    extra_args: list[str] = field(default_factory=list)
    setup: list[str] = field(default_factory=list)
    log_dir: str = "logs/slurm"
    ray_cluster: bool | None = None
    ray_port: int = 6379
    ray_start_timeout_s: int = 600
    ray_head_args: list[str] = field(default_factory=list)
    ray_worker_args: list[str] = field(default_factory=list)

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> SlurmSettings:
        values = settings_section(params, "slurm", (f.name for f in fields(cls)))
        for key in ("container_mounts", "extra_args", "setup", "ray_head_args", "ray_worker_args"):
            values[key] = string_list(f"slurm.{key}", values.get(key))
        for key in ("nodes", "gpus_per_node", "ray_port", "ray_start_timeout_s"):
            if key in values and (not isinstance(values[key], int) or isinstance(values[key], bool)):
                raise ConfigError(f"params.yaml: slurm.{key} must be an integer, found {values[key]!r}")
        if values.get("nodes", 1) < 1:
            raise ConfigError(f"params.yaml: slurm.nodes must be at least 1, found {values['nodes']}")
        if values.get("gpus_per_node", 0) < 0:
            raise ConfigError(
                f"params.yaml: slurm.gpus_per_node must be >= 0, found {values['gpus_per_node']}"
            )
        settings = cls(**values)
        if settings.log_dir in (None, ""):
            settings.log_dir = cls.log_dir
        return settings

    @property
    def wants_ray(self) -> bool:
        """A Ray cluster across the allocation: always for multi-node jobs, or when asked."""
        return self.nodes > 1 if self.ray_cluster is None else bool(self.ray_cluster)


class SlurmLauncher(JobLauncher):
    name = "slurm"

    def __init__(self, settings: SlurmSettings, *, python_bin: str | None = None):
        self.settings = settings
        # Without a container the job uses this interpreter's environment (a venv on the
        # shared filesystem): its bin/ goes first on PATH in the batch script.
        self.python_bin = python_bin if python_bin is not None else str(Path(sys.executable).parent)
        self.last_job: dict[str, Any] | None = None

    @classmethod
    def from_params(cls, runtime: Mapping[str, Any], params: Mapping[str, Any]) -> SlurmLauncher:
        return cls(SlurmSettings.from_params(params))

    # ------------------------------------------------------------------ rendering

    def log_dir(self, workdir: Path) -> Path:
        path = Path(self.settings.log_dir).expanduser()
        return path if path.is_absolute() else Path(workdir) / path

    def script_path(self, stage: str, workdir: Path) -> Path:
        return self.log_dir(workdir) / f"{stage}.sbatch"

    def sbatch_args(self, *, stage: str, workdir: Path) -> list[str]:
        s = self.settings
        args = [
            f"--job-name={s.job_name or f'alignpipe-{stage}'}",
            f"--nodes={s.nodes}",
            "--ntasks-per-node=1",
            f"--output={self.log_dir(workdir) / f'{stage}-%j.log'}",
            f"--chdir={workdir}",
            # The stage's environment (venv on PATH, DVC_*, HF_* offline flags) comes from
            # the submitting process; secrets stay in the environment, never in the script.
            "--export=ALL",
        ]
        for flag, value in (
            ("account", s.account),
            ("partition", s.partition),
            ("qos", s.qos),
            ("time", s.time),
            ("cpus-per-task", s.cpus_per_task),
            ("mem", s.mem),
        ):
            if value not in (None, ""):
                args.append(f"--{flag}={value}")
        if s.gpus_per_node:
            args.append(f"--gpus-per-node={s.gpus_per_node}")
        return args + list(s.extra_args)

    def command(self, argv: Sequence[str], *, stage: str, workdir: Path, env: Mapping[str, str]) -> list[str]:
        # `--export=ALL`: the job inherits ``env`` from sbatch's environment (``submit``).
        return [
            "sbatch",
            "--wait",
            "--parsable",
            *self.sbatch_args(stage=stage, workdir=workdir),
            str(self.script_path(stage, workdir)),
        ]

    def resources(self) -> Resources:
        s = self.settings
        return Resources(
            s.container_image, f"{s.gpus_per_node} per node" if s.gpus_per_node else None, s.nodes
        )

    def run_files(self, argv: Sequence[str], *, stage: str, workdir: Path) -> dict[str, str]:
        return {self.script_path(stage, workdir).name: self.render_script(argv, stage=stage, workdir=workdir)}

    def _step_prefix(self, workdir: Path, node: str | None) -> list[str]:
        """``srun`` for one task on one node, inside the container when one is configured."""
        s = self.settings
        prefix = ["srun", "--nodes=1", "--ntasks=1", "--overlap"]
        if node:
            prefix.append(f"-w {node}")
        if s.container_image:
            mounts = [f"{workdir}:{workdir}", *s.container_mounts]
            prefix += [
                f"--container-image={shlex.quote(s.container_image)}",
                f"--container-mounts={shlex.quote(','.join(mounts))}",
                f"--container-workdir={shlex.quote(str(workdir))}",
                # Named: later steps on a node reuse the container instead of unpacking it again.
                "--container-name=alignpipe",
            ]
        return prefix

    def render_script(self, argv: Sequence[str], *, stage: str, workdir: Path) -> str:
        # Over 60 lines: one sbatch script template, in the order the script runs.
        s = self.settings
        workdir_q = shlex.quote(str(workdir))
        lines = [
            "#!/usr/bin/env bash",
            f"# Stage '{stage}' as a Slurm job, rendered by alignpipe's slurm launcher on every run.",
            "# Options are on the sbatch command line (see the job record next to this file).",
            "set -uo pipefail",
            'export ALIGNPIPE_JOB_ID="slurm:${SLURM_JOB_ID}"',
        ]
        if not s.container_image and not s.setup and self.python_bin:
            lines.append(f'export PATH={shlex.quote(self.python_bin)}:"$PATH"')
        lines += list(s.setup)
        lines += [
            f'cd {workdir_q} || {{ echo "alignpipe: {workdir} is not visible on $(hostname); the slurm launcher '
            'needs the repository on a filesystem shared with the compute nodes, at the same path" >&2; exit 2; }',
            # The repository's alignpipe, ahead of an image's or venv's copy (alignpipe.stage checks it).
            f'export PYTHONPATH={workdir_q}"${{PYTHONPATH:+:$PYTHONPATH}}"',
            f'echo "alignpipe: slurm job ${{SLURM_JOB_ID}} on ${{SLURM_JOB_NODELIST}}: {shell_join(argv)}"',
        ]
        command = shell_join(argv)
        if not s.wants_ray:
            step = " ".join(self._step_prefix(workdir, None)) + " " if s.container_image else ""
            lines.append(f"exec {step}{command}")
            return "\n".join(lines) + "\n"

        # The ray.sub pattern: a Ray head on the first node, workers on the rest, the
        # trainer on the head once every node has joined.
        gpus = s.gpus_per_node
        head_args = " ".join(shlex.quote(a) for a in s.ray_head_args)
        worker_args = " ".join(shlex.quote(a) for a in s.ray_worker_args)
        head_step = " ".join(self._step_prefix(workdir, '"$head_node"'))
        worker_step = " ".join(self._step_prefix(workdir, '"$node"'))
        lines += [
            'mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")',
            'head_node="${nodes[0]}"',
            'head_ip="$(srun --nodes=1 --ntasks=1 --overlap -w "$head_node" hostname --ip-address | awk \'{print $1}\')"',
            f"ray_port={s.ray_port}",
            'export RAY_ADDRESS="$head_ip:$ray_port"',
            # Token auth (Ray >= 2.52): the head, the workers, `ray status` and the trainer must
            # agree on RAY_AUTH_MODE and share one token. Ray >= 2.59 turns it on for a head
            # whenever ~/.ray/auth_token exists, but never for a worker or client joining it, so
            # the mode is decided here, once, for every step. Unset means token, with a token
            # made for this job's cluster alone (unless RAY_AUTH_TOKEN/RAY_AUTH_TOKEN_PATH give
            # one): it lives in the environment the steps inherit, never in a file or the log.
            "# Ray token auth: one RAY_AUTH_MODE and one token for every node and the trainer.",
            'export RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"',
            'if [ "$RAY_AUTH_MODE" = token ] && [ -z "${RAY_AUTH_TOKEN:-}" ] && [ -z "${RAY_AUTH_TOKEN_PATH:-}" ]; then',
            "  RAY_AUTH_TOKEN=\"$(od -An -tx1 -N32 /dev/urandom | tr -d ' \\n')\"",
            "  export RAY_AUTH_TOKEN",
            "fi",
            "ray_pids=()",
            'stop_ray() { for p in "${ray_pids[@]}"; do kill "$p" 2>/dev/null; done; wait 2>/dev/null; }',
            "trap stop_ray EXIT",
            # Counts the nodes the head knows about; run on the head where `ray` is installed.
            f'ray_nodes() {{ {head_step} ray status --address "$RAY_ADDRESS" 2>/dev/null '
            "| grep -cE '^ *[0-9]+ node_' || true; }",
            "wait_for_nodes() {",
            f"  local want=$1 deadline=$((SECONDS + {s.ray_start_timeout_s}))",
            '  until [ "$(ray_nodes)" -ge "$want" ]; do',
            '    for p in "${ray_pids[@]}"; do',
            '      kill -0 "$p" 2>/dev/null || { echo "alignpipe: a ray start step exited; see above" >&2; exit 1; }',
            "    done",
            '    if [ "$SECONDS" -ge "$deadline" ]; then',
            f'      echo "alignpipe: only $(ray_nodes) of $want Ray nodes joined within {s.ray_start_timeout_s}s" >&2; exit 1',
            "    fi",
            "    sleep 3",
            "  done",
            "}",
            'echo "alignpipe: starting the Ray head on $head_node ($RAY_ADDRESS, auth $RAY_AUTH_MODE) and '
            '${#nodes[@]} node(s) in all"',
            f'{head_step} ray start --head --node-ip-address="$head_ip" --port="$ray_port" '
            f"--num-gpus={gpus} --disable-usage-stats {head_args} --block &",
            "ray_pids+=($!)",
            "wait_for_nodes 1",
            'for node in "${nodes[@]:1}"; do',
            f'  {worker_step} ray start --address="$RAY_ADDRESS" --num-gpus={gpus} --disable-usage-stats {worker_args} --block &',
            "  ray_pids+=($!)",
            "done",
            'wait_for_nodes "${#nodes[@]}"',
            'echo "alignpipe: Ray cluster ready with ${#nodes[@]} node(s)"',
            f"{head_step} {command}",
            "rc=$?",
            "exit $rc",
        ]
        return "\n".join(lines) + "\n"

    # ------------------------------------------------------------------ running

    def submit(self, argv, *, stage, workdir, env, out):
        script = self.script_path(stage, workdir)
        script.parent.mkdir(parents=True, exist_ok=True)
        script.write_text(self.render_script(argv, stage=stage, workdir=workdir))
        script.chmod(0o755)
        job_env = {**os.environ, **env}
        if not self.settings.container_image and self.python_bin:
            job_env["PATH"] = f"{self.python_bin}:{job_env.get('PATH', '')}"
        try:
            # Own session: a Ctrl-C on the terminal must not kill `sbatch --wait` (which would
            # leave the job running); `cancel` scancels the job instead.
            proc = subprocess.Popen(
                self.command(argv, stage=stage, workdir=workdir, env=env),
                cwd=workdir,
                env=job_env,
                stdout=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
        except FileNotFoundError:
            raise AlignpipeError(
                "runtime.launcher is slurm but `sbatch` is not on PATH: run the pipeline on a Slurm "
                "login node (or set runtime.launcher to process, container or ray)"
            ) from None
        return _SlurmJob(proc=proc, stage=stage, workdir=workdir, script=script)

    def follow(self, job, out):
        first = job.proc.stdout.readline() if job.proc.stdout else ""
        # --parsable prints "<jobid>" or "<jobid>;<cluster>" as soon as the job is queued.
        match = re.match(r"\s*(\d+)", first)
        if match is None:
            if first.strip():
                print(first.rstrip(), file=sys.stderr)
            job.proc.wait()
            return
        job.job_id = match.group(1)
        log = self.log_dir(job.workdir) / f"{job.stage}-{job.job_id}.log"
        print(
            f"alignpipe: submitted stage '{job.stage}' as slurm job {job.job_id} (log {log})",
            file=out,
            flush=True,
        )
        tail = _LogTail(log, out)
        started = next_state_check = time.monotonic()
        while job.proc.poll() is None:
            tail.pump()
            now = time.monotonic()
            if now >= next_state_check:
                if job_info(job.job_id).get("state") in ENDED_STATES:
                    job.proc.terminate()  # only `sbatch --wait`'s own polling: the job has ended
                    job.proc.wait()
                    job.ended_before_sbatch = True
                    break
                wait = min(max((now - started) / 10, STATE_POLL_MIN_S), STATE_POLL_MAX_S)
                next_state_check = now + wait
            time.sleep(POLL_S)
        tail.finish()

    def cancel(self, job, out):
        if job.job_id is not None:
            print(f"alignpipe: interrupted; cancelling slurm job {job.job_id}", file=out, flush=True)
            subprocess.run(["scancel", job.job_id], check=False, timeout=60)
        try:
            job.proc.wait(timeout=CANCEL_WAIT_S if job.job_id is not None else 5)
        except subprocess.TimeoutExpired:
            job.proc.kill()
            job.proc.wait()
        if job.job_id is not None:
            self._record(job, sbatch_rc=None)

    def finish(self, job, out):
        # sbatch stopped by `follow` has no exit code of the job's; Slurm's record has it.
        rc = None if job.ended_before_sbatch else job.proc.returncode
        if job.job_id is None:
            print(
                f"alignpipe: sbatch could not submit stage '{job.stage}' (exit {rc}); its error is above",
                file=sys.stderr,
            )
            return rc or 1
        info = self._record(job, sbatch_rc=rc)
        code = job_exit_code(info.get("state"), info.get("exit_code"), 1 if rc is None else rc)
        print(
            f"alignpipe: slurm job {job.job_id} {info.get('state') or 'finished'} (exit {code}) "
            f"on {info.get('nodes') or '?'}",
            file=out,
            flush=True,
        )
        return code

    def _record(self, job: _SlurmJob, sbatch_rc: int | None) -> dict[str, Any]:
        """Write ``<log_dir>/<stage>-<jobid>.json``: how to find this job again.

        ``sbatch_rc`` is null when the stage was interrupted and the job cancelled, or when
        Slurm reported the job ended before ``sbatch --wait`` noticed.
        """
        info = job_info(job.job_id)
        log_dir = self.log_dir(job.workdir)
        record = {
            "launcher": "slurm",
            "stage": job.stage,
            "job_id": job.job_id,
            "script": str(job.script),
            "log": str(log_dir / f"{job.stage}-{job.job_id}.log"),
            "sbatch_rc": sbatch_rc,
            **info,
        }
        path = log_dir / f"{job.stage}-{job.job_id}.json"
        path.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
        self.last_job = record
        return record

    def last_job_where(self) -> str:
        job = self.last_job or {}
        return f"slurm job {job.get('job_id', '?')} ran on {job.get('nodes') or '?'}"


@dataclass
class _SlurmJob:
    proc: subprocess.Popen  # `sbatch --wait`: exits when the job ends
    stage: str
    workdir: Path
    script: Path
    job_id: str | None = None  # known once sbatch prints it
    ended_before_sbatch: bool = False  # Slurm said the job ended; `sbatch --wait` was stopped


class _LogTail:
    """Copy what the job appends to its log file to ``out`` (the file appears once it starts)."""

    def __init__(self, path: Path, out: TextIO):
        self.path, self.out = path, out
        self.offset = 0

    def pump(self) -> None:
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return
        if data:
            self.offset += len(data)
            self.out.write(data.decode(errors="replace"))
            self.out.flush()

    def finish(self) -> None:
        # Shared filesystems may show the last lines a moment after the job ends.
        deadline = time.monotonic() + 2.0
        while True:
            before = self.offset
            self.pump()
            if self.offset == before and (self.path.exists() or time.monotonic() > deadline):
                return
            if time.monotonic() > deadline:
                return
            time.sleep(0.2)


_FIELDS = {"JobState": "state", "ExitCode": "exit_code", "NodeList": "nodes", "Reason": "reason"}


def job_info(job_id: str) -> dict[str, str]:
    """State, exit code and nodes of a job: ``scontrol`` while Slurm remembers it, then ``sacct``."""
    try:
        res = subprocess.run(
            ["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30
        )
        if res.returncode == 0:
            found = dict(re.findall(r"(\w+)=(\S*)", res.stdout))
            return {ours: found[theirs] for theirs, ours in _FIELDS.items() if theirs in found}
        res = subprocess.run(
            ["sacct", "-j", job_id, "-X", "-n", "-P", "-o", "State,ExitCode,NodeList"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if res.returncode == 0 and res.stdout.strip():
            state, exit_code, nodes = res.stdout.strip().splitlines()[0].split("|")[:3]
            return {"state": state.split()[0], "exit_code": exit_code, "nodes": nodes}
    except (OSError, subprocess.TimeoutExpired):
        pass
    return {}


def job_exit_code(state: str | None, exit_code: str | None, sbatch_rc: int) -> int:
    """The job's exit code: Slurm's ``ExitCode=<code>:<signal>`` when known, else sbatch's."""
    if exit_code and ":" in exit_code:
        code, _, sig = exit_code.partition(":")
        if code.isdigit() and sig.isdigit():
            if int(code):
                return int(code)
            if int(sig):
                return 128 + int(sig)
            if state and state not in ("COMPLETED",):
                # Cancelled, timed out, node failure, out of memory: no exit code, still a failure.
                return sbatch_rc or 1
            return 0
    return sbatch_rc
