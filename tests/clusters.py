"""Real clusters on loopback for the ``slurm`` and ``ray`` tests, started and stopped here.

- ``slurm_cluster``: a Slurm cluster of two nodes, ``n1`` and ``n2``, both on this host
  (MACHINE.md's one-node recipe with one ``slurmd -N <node>`` per node, each on its own
  port and spool dir, so multi-node jobs really span two slurmd daemons); auth/none, state
  in a temp dir, free ports; ``slurmctld -D`` and the slurmds are child processes, with a
  bounded wait until ``sinfo`` shows both nodes idle; teardown cancels its jobs and stops
  the daemons.
- ``ray_cluster``: a Ray head (``ray start --head --block``, token auth off) for one test
  module, with the dashboard and Jobs API on free ports; teardown sends it SIGTERM and kills
  whatever is left in its session. ``ray_head(**env)`` starts one with other settings (token auth).

When the software is missing the fixtures install it the way CI does
(``.ci/install-clusters.sh``) instead of skipping. Test modules import the fixtures:
``from tests.clusters import slurm_cluster  # noqa: F401``.
"""

from __future__ import annotations

import getpass
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BIN = str(Path(sys.executable).parent)
SLURM_TOOLS = ("slurmctld", "slurmd", "sbatch", "sinfo", "squeue", "scancel", "scontrol")
# What a stage needs to run from a throwaway root (the code comes from the installed package).
STAGE_FILES = ("dvc.yaml", "params.yaml", "conf", "stages")


def wait_until(check: Callable[[], bool], timeout_s: float, what: str, interval_s: float = 0.5) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {timeout_s:.0f}s")
        time.sleep(interval_s)


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free on loopback right now, outside the kernel's ephemeral range and
    Ray's worker ports (10002-19999). A port the kernel handed out for ``bind(0)`` and that was
    closed again goes back into that range: a Ray component binding port 0 later could get it
    first (seen in CI: the client server's port "already in use")."""
    import random

    low, high = 20000, 32767  # Linux's ephemeral range starts at 32768 by default
    ports: list[int] = []
    for port in random.sample(range(low, high), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        ports.append(port)
        if len(ports) == n:
            return ports
    raise AssertionError(f"fewer than {n} free ports in {low}-{high}")


def ensure_installed() -> None:
    """Install Slurm and Ray as CI does when either is missing (never skip silently)."""
    missing_slurm = [t for t in SLURM_TOOLS if shutil.which(t) is None]
    has_ray = subprocess.run(
        [sys.executable, "-c", "import ray.job_submission, ray.dashboard"], capture_output=True
    )
    if missing_slurm or has_ray.returncode != 0:
        subprocess.run(
            ["bash", str(REPO / ".ci" / "install-clusters.sh"), str(Path(sys.executable).parents[1])],
            check=True,
            timeout=1200,
        )


def stage_root(dst: Path) -> Path:
    """A throwaway repository root (ALIGNPIPE_ROOT) on the shared filesystem: no data yet."""
    dst.mkdir(parents=True, exist_ok=True)
    for name in STAGE_FILES:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, dst / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, dst / name)
    return dst


def stage_env(root: Path) -> dict[str, str]:
    """What ``run_stage`` hands a launcher: forwarded variables, offline flags, the root."""
    from alignpipe.context import OFFLINE_ENV
    from alignpipe.launch.base import forwarded_env

    return {**forwarded_env(), **OFFLINE_ENV, "ALIGNPIPE_ROOT": str(root)}


def _stop(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=grace_s)


# --------------------------------------------------------------------------- Slurm


@dataclass
class SlurmCluster:
    conf: Path
    dir: Path

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(self, *argv: str) -> subprocess.CompletedProcess:
        return subprocess.run(list(argv), env=self.env, capture_output=True, text=True, timeout=30)

    def job_state(self, job_id: str) -> str:
        out = self.run("scontrol", "show", "job", "-o", job_id).stdout
        for part in out.split():
            if part.startswith("JobState="):
                return part.split("=", 1)[1]
        return ""

    def queue(self) -> list[str]:
        return self.run("squeue", "-h", "-o", "%i").stdout.split()

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
            for p in sorted((self.dir / "log").glob("*"))
        )


NODES = ("n1", "n2")


def slurm_conf(d: Path, ctld_port: int, n1_port: int, n2_port: int) -> str:
    # MACHINE.md's recipe: no munge (auth/none), process tracking without cgroups. Two
    # node names on one host: %n gives each slurmd its own spool, pid and log file.
    return f"""\
ClusterName=alignpipe-test
SlurmctldHost=localhost
SlurmctldPort={ctld_port}
AuthType=auth/none
CredType=cred/none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool-%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd-%n.log
SlurmUser={getpass.getuser()}
SlurmdUser={getpass.getuser()}
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MinJobAge=600
KillWait=5
NodeName=n1 NodeHostname=localhost NodeAddr=127.0.0.1 Port={n1_port} CPUs=1 RealMemory=10000 State=UNKNOWN
NodeName=n2 NodeHostname=localhost NodeAddr=127.0.0.1 Port={n2_port} CPUs=1 RealMemory=10000 State=UNKNOWN
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP
"""


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    ensure_installed()
    # Short path under /tmp: Slurm and Ray put sockets and pid files here.
    d = Path(tempfile.mkdtemp(prefix="apslurm."))
    for sub in ("state", "log"):
        (d / sub).mkdir()
    conf = d / "slurm.conf"
    conf.write_text(slurm_conf(d, *free_ports(3)))
    cluster = SlurmCluster(conf=conf, dir=d)
    daemons = []
    try:
        for name, argv in (("slurmctld", ["slurmctld"]), *((n, ["slurmd", "-N", n]) for n in NODES)):
            out = (d / "log" / f"{name}.out").open("w")
            daemons.append(
                subprocess.Popen(
                    [*argv, "-D", "-c"],
                    env=cluster.env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        try:
            wait_until(
                lambda: (
                    cluster.run("sinfo", "-h", "-N", "-o", "%N %T").stdout.split()
                    == ["n1", "idle", "n2", "idle"]
                ),
                60,
                "both nodes of the test Slurm cluster coming up idle",
            )
        except TimeoutError as e:
            pytest.fail(f"{e}\n{cluster.logs()}")
        yield cluster
    finally:
        if daemons and daemons[0].poll() is None:
            cluster.run("scancel", "--user", str(os.getuid()))
            try:
                wait_until(lambda: not cluster.queue(), 30, "all test jobs ending")
            except TimeoutError:
                pass
        for proc in reversed(daemons):
            _stop(proc)
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def slurm(slurm_cluster: SlurmCluster, monkeypatch: pytest.MonkeyPatch) -> SlurmCluster:
    """The session's cluster, with SLURM_CONF set for the code under test."""
    monkeypatch.setenv("SLURM_CONF", str(slurm_cluster.conf))
    return slurm_cluster


# --------------------------------------------------------------------------- Ray


@dataclass
class RayCluster:
    address: str  # Jobs API (dashboard) URL
    gcs_address: str
    pid: int
    token: str | None = None  # the cluster's auth token when it runs with RAY_AUTH_MODE=token

    def client(self):
        """A Jobs client for the test itself (the launcher under test makes its own)."""
        from ray.job_submission import JobSubmissionClient

        headers = {"Authorization": f"Bearer {self.token}"} if self.token else None
        return JobSubmissionClient(self.address, headers=headers)


def _session_pids(sid: int) -> list[int]:
    """Processes in session ``sid`` (the Ray head's): what it started, and nothing else."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getsid(int(entry.name)) == sid:
                    pids.append(int(entry.name))
            except (ProcessLookupError, PermissionError):
                continue
    return pids


@contextmanager
def ray_head(**env_overrides: str) -> Iterator[RayCluster]:
    """A Ray head on free loopback ports, in its own temp dir, stopped on exit.

    ``env_overrides`` go into the head's environment (``RAY_AUTH_MODE``, ``RAY_AUTH_TOKEN``,
    ``HOME`` ...); the Jobs API is polled with the same ones until it answers.
    """
    ensure_installed()
    (gcs, dash, client, nm, om, agent_http, agent_grpc, renv, metrics) = free_ports(9)
    tmp = Path(tempfile.mkdtemp(prefix="apray."))
    env = {
        **os.environ,
        # Jobs run `alignpipe` from the same venv (the repo and venv are shared with the "cluster").
        "PATH": BIN + os.pathsep + os.environ.get("PATH", ""),
        "RAY_USAGE_STATS_ENABLED": "0",
        **env_overrides,
    }
    argv = [
        str(Path(BIN) / "ray"),
        "start",
        "--head",
        "--block",
        "--disable-usage-stats",
        "--node-ip-address=127.0.0.1",
        f"--port={gcs}",
        "--include-dashboard=true",
        "--dashboard-host=127.0.0.1",
        f"--dashboard-port={dash}",
        f"--ray-client-server-port={client}",
        f"--node-manager-port={nm}",
        f"--object-manager-port={om}",
        f"--dashboard-agent-listen-port={agent_http}",
        f"--dashboard-agent-grpc-port={agent_grpc}",
        f"--runtime-env-agent-port={renv}",
        f"--metrics-export-port={metrics}",
        "--num-cpus=1",
        "--num-gpus=0",
        "--object-store-memory=100000000",
        f"--temp-dir={tmp}",
    ]
    log = (tmp / "head.out").open("w")
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    token = env_overrides.get("RAY_AUTH_TOKEN") if env_overrides.get("RAY_AUTH_MODE") == "token" else None
    cluster = RayCluster(
        address=f"http://127.0.0.1:{dash}", gcs_address=f"127.0.0.1:{gcs}", pid=proc.pid, token=token
    )

    def jobs_api_up() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(
                f"ray start exited with {proc.returncode}:\n{(tmp / 'head.out').read_text()[-3000:]}"
            )
        try:
            cluster.client().list_jobs()
            return True
        except Exception:
            return False

    try:
        try:
            wait_until(jobs_api_up, 120, "the Ray head's Jobs API answering", interval_s=1.0)
        except TimeoutError as e:
            pytest.fail(f"{e}\n{(tmp / 'head.out').read_text()[-3000:]}")
        yield cluster
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # `ray start --block` stops what it started
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        for pid in _session_pids(proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            proc.wait(timeout=10)
        shutil.rmtree(tmp, ignore_errors=True)


# Per module, not per session: an idle head (GCS, raylet, dashboard) keeps about a tenth of a
# core busy, which over the rest of a session was ~130 s of the suite's CPU (DEVELOPING.md,
# "Test suite speed"). Its one user is tests/test_ray.py.
@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[RayCluster]:
    # A loopback test cluster without token auth: Ray >= 2.60 turns it on for a new head
    # whenever ~/.ray/auth_token exists (any local `ray.init()` writes one).
    # tests/test_ray_auth.py starts one with token auth.
    with ray_head(RAY_AUTH_MODE="disabled") as cluster:
        yield cluster
