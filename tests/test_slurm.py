"""The slurm launcher against a real one-node Slurm cluster started on loopback (tests/clusters.py).

Stages run from a throwaway repository root (ALIGNPIPE_ROOT) with the code of this
checkout, so the real ``prep`` and ``base`` stages go through ``sbatch --wait`` exactly as
``alignpipe run`` would hand them over.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import yaml

pytest.register_assert_rewrite("tests.clusters")

from alignpipe.errors import AlignpipeError, ConfigError  # noqa: E402
from alignpipe.launch import get_launcher  # noqa: E402
from alignpipe.launch.slurm import SlurmLauncher, SlurmSettings, job_exit_code  # noqa: E402
from tests.clusters import SlurmCluster, free_ports, stage_env, stage_root, wait_until  # noqa: E402
from tests.conftest import start_like_a_stage  # noqa: E402

# The cluster fixtures (slurm_cluster, slurm) live in tests/clusters.py.
pytest_plugins = ["tests.clusters"]
# Every wait inside is bounded; this is the backstop if a cluster hangs.
pytestmark = pytest.mark.timeout(900)
RAY_TEMP = os.path.join(tempfile.gettempdir(), "apray-slurm")

# No GPUs, no time limit worth hitting; everything else as params.yaml would give it.
CPU_JOB = {"gpus_per_node": 0, "time": "00:10:00"}


def inner(stage: str) -> list[str]:
    return ["alignpipe", "run", stage, "--inner"]


def launcher(**overrides) -> SlurmLauncher:
    made = get_launcher("slurm", {}, {"slurm": {**CPU_JOB, **overrides}})
    assert isinstance(made, SlurmLauncher)
    return made


@pytest.mark.slurm
def test_prep_and_base_stages_run_as_slurm_jobs(slurm: SlurmCluster, tmp_path: Path) -> None:
    root = stage_root(tmp_path / "repo")
    slurm_launcher = launcher()
    for stage, output in (("prep", root / "data" / "prepared"), ("base", root / "models" / "base")):
        out = io.StringIO()
        code = slurm_launcher.run(inner(stage), stage=stage, workdir=root, env=stage_env(root), out=out)
        log = out.getvalue()
        assert code == 0, log
        slurm_launcher.check_outputs([output])
        job = slurm_launcher.last_job
        assert job is not None and job["state"] == "COMPLETED" and job["nodes"] in ("n1", "n2")
        # The stage recorded which job made it, and the record next to the log says the same.
        assert json.loads((output / "artifact.json").read_text())["job"] == f"slurm:{job['job_id']}"
        record = json.loads((root / "logs" / "slurm" / f"{stage}-{job['job_id']}.json").read_text())
        assert record["job_id"] == job["job_id"] and Path(record["script"]).is_file()
        # The job's log was streamed here while it ran.
        assert f"slurm job {job['job_id']} on {job['nodes']}" in log
        assert f"{stage}: " in log
    assert (root / "models" / "base" / "model.safetensors").is_file()
    assert {"manifest.json", "sft", "rlvr"} <= {p.name for p in (root / "data" / "prepared").iterdir()}


@pytest.mark.slurm
def test_failing_jobs_return_their_exit_code(
    slurm: SlurmCluster, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    root = stage_root(tmp_path / "repo")
    params = yaml.safe_load((root / "params.yaml").read_text())
    params.setdefault("prep", {})["no_such_knob"] = 1  # a broken stage config: ConfigError, exit 2
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    slurm_launcher = launcher()
    out = io.StringIO()
    assert slurm_launcher.run(inner("prep"), stage="prep", workdir=root, env=stage_env(root), out=out) == 2
    assert "no_such_knob" in out.getvalue()
    assert slurm_launcher.last_job["state"] == "FAILED"
    assert not (root / "data" / "prepared").exists()

    out = io.StringIO()
    code = slurm_launcher.run(
        ["bash", "-c", "echo about to fail; exit 3"], stage="fail", workdir=root, env={}, out=out
    )
    assert code == 3
    assert "about to fail" in out.getvalue()

    # Rejected at submission: sbatch's own error reaches the user, and the stage fails.
    capfd.readouterr()
    code = launcher(partition="no-such-partition").run(
        ["true"], stage="rejected", workdir=root, env={}, out=out
    )
    assert code != 0
    err = capfd.readouterr().err
    assert "invalid partition" in err.lower() and "sbatch could not submit stage 'rejected'" in err


@pytest.mark.slurm
def test_outputs_missing_on_this_host_are_reported(slurm: SlurmCluster, tmp_path: Path) -> None:
    slurm_launcher = launcher()
    assert slurm_launcher.run(["true"], stage="noop", workdir=tmp_path, env={}, out=io.StringIO()) == 0
    with pytest.raises(AlignpipeError, match=r"shared with the DVC workspace.*slurm job \d+ ran on n[12]\)"):
        slurm_launcher.check_outputs([tmp_path / "models" / "never-written"])


WATCHER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from alignpipe.launch.interrupt import stop_with_parent
    stop_with_parent()  # as `alignpipe run` does
    from alignpipe.launch.slurm import SlurmLauncher, SlurmSettings
    launcher = SlurmLauncher(SlurmSettings(gpus_per_node=0, time="00:10:00"))
    sys.exit(launcher.run(["sleep", "300"], stage="sleepy", workdir=Path(sys.argv[1]), env={}))
    """
)


@pytest.mark.slurm
@pytest.mark.parametrize(
    "sig, to_parent",
    [(signal.SIGINT, False), (signal.SIGTERM, False), (signal.SIGTERM, True)],
    ids=["SIGINT", "SIGTERM", "SIGTERM-to-dvc-alone"],
)
def test_interrupting_the_stage_cancels_the_job(
    slurm: SlurmCluster, tmp_path: Path, sig: signal.Signals, to_parent: bool
) -> None:
    """Ctrl-C, SIGTERM, or SIGTERM to a dvc-like parent that does not pass it on."""
    log = tmp_path / "watcher.log"
    argv = [sys.executable, "-c", WATCHER, str(tmp_path)]
    watcher = start_like_a_stage(argv, log, under_dvc=to_parent)
    try:
        found: dict[str, str] = {}

        def running() -> bool:
            match = re.search(r"slurm job (\d+)", log.read_text())
            if match:
                found["id"] = match.group(1)
                return slurm.job_state(found["id"]) == "RUNNING"
            assert watcher.poll() is None, log.read_text()
            return False

        wait_until(running, 60, "the sleep job running")
        watcher.send_signal(sig)
        watcher.wait(timeout=90)
        wait_until(
            lambda: f"cancelling slurm job {found['id']}" in log.read_text(), 30, "the stage cancelling"
        )
        wait_until(lambda: slurm.job_state(found["id"]) == "CANCELLED", 30, "the job showing CANCELLED")
    finally:
        if watcher.poll() is None:
            watcher.kill()
            watcher.wait()
    assert watcher.returncode != 0
    assert found["id"] not in slurm.queue()


@pytest.mark.slurm
@pytest.mark.slow
def test_two_node_job_starts_a_ray_cluster_first(
    slurm: SlurmCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """nodes=2: Ray head on the first node, a worker on the second (ray.sub), then the trainer
    on the head attaches with ``ray.init(address="auto")`` and sees both nodes.

    With token auth, as Ray >= 2.59 has it: ~/.ray/auth_token exists (any local ``ray.init()``
    writes one) and RAY_AUTH_MODE is unset. The job's cluster then runs with a token made for
    it alone, shared by every node and the trainer, and written to no file or log."""
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "auth_token").write_text("a-token-from-some-local-ray-init")
    monkeypatch.setenv("HOME", str(home))  # never the user's own ~/.ray/auth_token
    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    gcs, dash, client, metrics, agent_head, agent_worker = free_ports(6)
    small = ["--num-cpus=1", "--object-store-memory=80000000"]
    slurm_launcher = launcher(
        nodes=2,
        ray_port=gcs,
        ray_start_timeout_s=180,
        # Both Ray nodes share this host, so every fixed default port is moved to a free one.
        ray_head_args=[
            *small,
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dash}",
            f"--ray-client-server-port={client}",
            f"--metrics-export-port={metrics}",
            f"--dashboard-agent-listen-port={agent_head}",
            # Short: Ray puts AF_UNIX sockets under it (107-byte limit); tmp_path is too long.
            f"--temp-dir={RAY_TEMP}-{gcs}",
        ],
        ray_worker_args=[*small, f"--dashboard-agent-listen-port={agent_worker}"],
    )
    seen = tmp_path / "token-the-trainer-saw"
    probe = (
        "import os, pathlib, ray; ray.init(address='auto'); "
        "print('alive nodes', sum(n['Alive'] for n in ray.nodes()), 'at', os.environ['RAY_ADDRESS'], "
        "'on', os.environ['SLURMD_NODENAME'], 'auth', os.environ['RAY_AUTH_MODE']); "
        f"pathlib.Path({str(seen)!r}).write_text(os.environ['RAY_AUTH_TOKEN'])"
    )
    out = io.StringIO()
    try:
        code = slurm_launcher.run(
            [sys.executable, "-c", probe], stage="raycheck", workdir=tmp_path, env={}, out=out
        )
    finally:
        shutil.rmtree(f"{RAY_TEMP}-{gcs}", ignore_errors=True)
    log = out.getvalue()
    assert code == 0, log
    assert slurm_launcher.last_job["nodes"] == "n[1-2]"
    assert "starting the Ray head on n1" in log and "Ray cluster ready with 2 node(s)" in log
    assert re.search(rf"alive nodes 2 at \S+:{gcs} on n1 auth token", log), log
    token = seen.read_text()
    assert re.fullmatch(r"[0-9a-f]{64}", token), "a token made for this job"
    written = [p for p in tmp_path.rglob("*") if p.is_file() and p != seen]
    assert written and not [p for p in written if token.encode() in p.read_bytes()]
    assert token not in log


def test_script_and_sbatch_options_from_params() -> None:
    """What cannot run here (pyxis, GPUs, several nodes) is at least rendered as ray.sub does."""
    settings = SlurmSettings.from_params(
        {
            "slurm": {
                "account": "llm",
                "partition": "batch",
                "nodes": 2,
                "gpus_per_node": 8,
                "container_image": "registry.example.com#team/alignpipe-nemo-rl:v0.7.0",
                "container_mounts": ["/lustre/hf:/root/.cache/huggingface"],
                "extra_args": ["--exclusive"],
            }
        }
    )
    slurm_launcher = SlurmLauncher(settings)
    root = Path("/shared/alignpipe")
    cmd = slurm_launcher.command(inner("sft"), stage="sft", workdir=root, env={})
    assert cmd[:3] == ["sbatch", "--wait", "--parsable"]
    for flag in (
        "--account=llm",
        "--partition=batch",
        "--nodes=2",
        "--gpus-per-node=8",
        "--exclusive",
        "--export=ALL",
    ):
        assert flag in cmd
    script = slurm_launcher.render_script(inner("sft"), stage="sft", workdir=root)
    assert "--container-image='registry.example.com#team/alignpipe-nemo-rl:v0.7.0'" in script
    assert (
        "--container-mounts=/shared/alignpipe:/shared/alignpipe,/lustre/hf:/root/.cache/huggingface" in script
    )
    head = script.index("ray start --head")
    assert (
        head < script.index('ray start --address="$RAY_ADDRESS"') < script.rindex("alignpipe run sft --inner")
    )
    assert 'export RAY_ADDRESS="$head_ip:$ray_port"' in script
    # The repository's code runs, not the image's copy (alignpipe.stage refuses any other).
    assert f'export PYTHONPATH={root}"${{PYTHONPATH:+:$PYTHONPATH}}"' in script
    # One auth mode for the head, the workers and the trainer, decided before the head starts.
    assert script.index('export RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"') < head
    assert script.index("export RAY_AUTH_TOKEN") < head
    with pytest.raises(ConfigError, match="slurm.partitoin"):
        SlurmSettings.from_params({"slurm": {"partitoin": "batch"}})


def test_exit_code_from_slurm_accounting() -> None:
    assert job_exit_code("COMPLETED", "0:0", 0) == 0
    assert job_exit_code("FAILED", "3:0", 3) == 3
    assert job_exit_code("CANCELLED", "0:15", 1) == 143
    assert job_exit_code("TIMEOUT", "0:0", 0) == 1
    assert job_exit_code(None, None, 7) == 7
