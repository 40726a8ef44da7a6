"""The ray launcher against a real Ray head on loopback (tests/clusters.py), through the Jobs API.

The "cluster" shares this machine's filesystem, so the real ``prep`` and ``base`` stages
run in a throwaway repository root exactly as they would on a cluster with shared storage.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

pytest.register_assert_rewrite("tests.clusters")

from alignpipe.errors import AlignpipeError, ConfigError  # noqa: E402
from alignpipe.launch import get_launcher  # noqa: E402
from alignpipe.launch.ray_jobs import RayJobLauncher, RaySettings, exit_code  # noqa: E402
from tests.clusters import RayCluster, stage_env, stage_root, wait_until  # noqa: E402
from tests.conftest import start_like_a_stage  # noqa: E402

# The cluster fixture (ray_cluster) lives in tests/clusters.py.
pytest_plugins = ["tests.clusters"]
# Every wait inside is bounded; this is the backstop if a cluster hangs.
pytestmark = pytest.mark.timeout(900)


def inner(stage: str) -> list[str]:
    return ["alignpipe", "run", stage, "--inner"]


def launcher(cluster: RayCluster, **overrides) -> RayJobLauncher:
    made = get_launcher("ray", {}, {"ray": {"address": cluster.address, **overrides}})
    assert isinstance(made, RayJobLauncher)
    return made


@pytest.mark.ray
def test_prep_and_base_stages_run_as_ray_jobs(ray_cluster: RayCluster, tmp_path: Path) -> None:
    root = stage_root(tmp_path / "repo")
    ray_launcher = launcher(ray_cluster)
    # A secret in the stage's environment is not sent to Ray's job table.
    env = {**stage_env(root), "HF_TOKEN": "hf_do_not_leak"}
    for stage, output in (("prep", root / "data" / "prepared"), ("base", root / "models" / "base")):
        out = io.StringIO()
        code = ray_launcher.run(inner(stage), stage=stage, workdir=root, env=env, out=out)
        log = out.getvalue()
        assert code == 0, log
        ray_launcher.check_outputs([output])
        job_id = ray_launcher.last_job["job_id"]
        assert json.loads((output / "artifact.json").read_text())["job"] == f"ray:{job_id}"
        assert f"{stage}: " in log  # the job's own output, streamed here
        assert "not sending HF_TOKEN" in log and "hf_do_not_leak" not in log
        info = ray_cluster.client().get_job_info(job_id)
        assert str(info.status) == "SUCCEEDED"
        assert "HF_TOKEN" not in info.runtime_env["env_vars"]
        assert info.runtime_env["env_vars"]["ALIGNPIPE_ROOT"] == str(root)
    assert (root / "models" / "base" / "model.safetensors").is_file()


@pytest.mark.ray
def test_failing_jobs_return_their_exit_code(ray_cluster: RayCluster, tmp_path: Path) -> None:
    ray_launcher = launcher(ray_cluster)
    out = io.StringIO()
    code = ray_launcher.run(
        ["bash", "-c", "echo about to fail; exit 3"], stage="fail", workdir=tmp_path, env={}, out=out
    )
    assert code == 3
    assert "about to fail" in out.getvalue()
    assert ray_launcher.last_job["status"] == "FAILED"


@pytest.mark.ray
def test_repository_not_shared_with_the_cluster_is_reported(ray_cluster: RayCluster, tmp_path: Path) -> None:
    ray_launcher = launcher(ray_cluster)
    out = io.StringIO()
    missing = tmp_path / "only-on-the-laptop"
    assert ray_launcher.run(["true"], stage="noop", workdir=missing, env={}, out=out) == 2
    assert f"{missing} does not exist on the Ray node" in out.getvalue()
    with pytest.raises(AlignpipeError, match=r"shared with the DVC workspace.*Ray job alignpipe-noop-"):
        ray_launcher.check_outputs([missing / "models"])


WATCHER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from alignpipe.launch.interrupt import stop_with_parent
    stop_with_parent()  # as `alignpipe run` does
    from alignpipe.launch.ray_jobs import RayJobLauncher, RaySettings
    launcher = RayJobLauncher(RaySettings(address=sys.argv[2]))
    sys.exit(launcher.run(["sleep", "300"], stage="sleepy", workdir=Path(sys.argv[1]), env={}))
    """
)


@pytest.mark.ray
@pytest.mark.parametrize("to_parent", [False, True], ids=["SIGTERM", "SIGTERM-to-dvc-alone"])
def test_interrupting_the_stage_stops_the_job(
    ray_cluster: RayCluster, tmp_path: Path, to_parent: bool
) -> None:
    """SIGTERM (what `dvc queue kill` and batch systems send), to the stage or to a dvc-like
    parent that does not pass it on."""
    log = tmp_path / "watcher.log"
    client = ray_cluster.client()
    argv = [sys.executable, "-c", WATCHER, str(tmp_path), ray_cluster.address]
    watcher = start_like_a_stage(argv, log, under_dvc=to_parent)
    try:
        found: dict[str, str] = {}

        def running() -> bool:
            match = re.search(r"Ray job (alignpipe-sleepy-\w+)", log.read_text())
            if match:
                found["id"] = match.group(1)
                return str(client.get_job_status(found["id"])) == "RUNNING"
            assert watcher.poll() is None, log.read_text()
            return False

        wait_until(running, 90, "the sleep job running")
        watcher.send_signal(signal.SIGTERM)
        watcher.wait(timeout=90)
        wait_until(
            lambda: f"stopping Ray job {found['id']}" in log.read_text(), 30, "the stage stopping the job"
        )
        wait_until(
            lambda: str(client.get_job_status(found["id"])) == "STOPPED", 30, "the job showing STOPPED"
        )
    finally:
        if watcher.poll() is None:
            watcher.kill()
            watcher.wait()
    assert watcher.returncode != 0


def test_settings_address_and_exit_codes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(ConfigError, match="ray.address"):
        RayJobLauncher(RaySettings()).address()
    monkeypatch.setenv("RAY_ADDRESS", "http://head:8265")
    ray_launcher = RayJobLauncher(
        RaySettings.from_params({"ray": {"env_vars": {"A": 1}, "entrypoint_num_cpus": 2}})
    )
    assert ray_launcher.address() == "http://head:8265"
    cmd = ray_launcher.command(inner("sft"), stage="sft", workdir=Path("/shared/repo"), env={})
    assert cmd[:4] == ["ray", "job", "submit", "--address=http://head:8265"]
    assert "--entrypoint-num-cpus=2" in cmd
    assert cmd[-1] == "cd /shared/repo || " + cmd[-1].split(" || ", 1)[1]
    assert cmd[-1].endswith("&& exec alignpipe run sft --inner")
    assert '&& export PYTHONPATH=/shared/repo"${PYTHONPATH:+:$PYTHONPATH}" &&' in cmd[-1]  # the repo's code
    with pytest.raises(ConfigError, match="ray.adress"):
        RaySettings.from_params({"ray": {"adress": "x"}})
    assert exit_code("SUCCEEDED", None, None) == 0
    assert exit_code("FAILED", 3, "") == 3
    assert exit_code("FAILED", None, "Job entrypoint command failed with exit code 7, last logs") == 7
    assert exit_code("FAILED", None, "runtime env setup failed") == 1
    assert exit_code("STOPPED", None, None) == 1


@pytest.mark.ray
def test_alignpipe_run_hands_a_trainer_stage_to_the_cluster(ray_cluster: RayCluster, tmp_path: Path) -> None:
    """`alignpipe run sft` (what dvc.yaml calls) with runtime.launcher=ray from params.yaml.

    The root has no prepared data or base model, so the job fails quickly on the cluster;
    what is checked is the hand-over: the job ran there and its failure is the stage's.
    """
    root = stage_root(tmp_path / "repo")
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["runtime"]["launcher"] = "ray"
    params["ray"]["address"] = ray_cluster.address
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    before = {job.submission_id for job in ray_cluster.client().list_jobs()}
    proc = subprocess.run(
        ["alignpipe", "run", "sft"],
        cwd=root,
        env={**os.environ, "ALIGNPIPE_ROOT": str(root)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode not in (0, 2), proc.stdout + proc.stderr  # 2 would be a config error on this host
    assert f"stage 'sft' failed on the ray launcher (exit {proc.returncode})" in proc.stderr
    new = [job for job in ray_cluster.client().list_jobs() if job.submission_id not in before]
    assert [job.submission_id.startswith("alignpipe-sft-") for job in new] == [True]
    assert str(new[0].status) == "FAILED" and new[0].runtime_env["env_vars"]["ALIGNPIPE_ROOT"] == str(root)
