"""The ray launcher against a real Ray head with token authentication (``RAY_AUTH_MODE=token``).

The head gets its token in ``RAY_AUTH_TOKEN`` and a HOME of its own; every client here runs
with a temporary HOME, so the user's ``~/.ray/auth_token`` is never read or written. Stages
run through ``dvc repro`` / ``alignpipe run`` in throwaway roots, as on a cluster with shared
storage; afterwards the token must be in none of the files they wrote, nor in their output.
A missing or wrong token stops the stage before anything reaches the cluster.
"""

from __future__ import annotations

import io
import json
import os
import re
import secrets
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.register_assert_rewrite("tests.clusters")

from alignpipe.launch import get_launcher  # noqa: E402
from tests.clusters import RayCluster, ray_head, stage_root  # noqa: E402
from tests.conftest import OFFLINE, set_params, writable_copy  # noqa: E402

pytestmark = pytest.mark.timeout(900)
# Made per run: a fixed string could be found in the repository by accident.
TOKEN = secrets.token_hex(24)
WRONG = secrets.token_hex(24)


@pytest.fixture(scope="module")
def token_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayCluster]:
    home = tmp_path_factory.mktemp("ray-head-home")
    with ray_head(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=TOKEN, HOME=str(home)) as cluster:
        yield cluster


def client_env(home: Path, **auth: str) -> dict[str, str]:
    """This host's environment with a HOME of its own and only the given RAY_AUTH_* settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH_") and k != "RAY_ADDRESS"}
    home.mkdir(parents=True, exist_ok=True)
    return {
        **env,
        **OFFLINE,
        "HOME": str(home),
        "ALIGNPIPE_SCRATCH": str(home / "scratch"),
        **auth,
    }


def on_ray(root: Path, cluster: RayCluster) -> None:
    set_params(root, {"runtime": {"launcher": "ray"}, "ray": {"address": cluster.address}})


def files_holding(root: Path, text: str) -> list[str]:
    return [
        str(p.relative_to(root))
        for p in root.rglob("*")
        if p.is_file() and not p.is_symlink() and text.encode() in p.read_bytes()
    ]


def alignpipe(root: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["alignpipe", *args],
        cwd=root,
        env={**env, "ALIGNPIPE_ROOT": str(root)},
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.ray
def test_dvc_repro_runs_a_stage_with_the_token_and_writes_it_nowhere(
    token_cluster: RayCluster, prepared_repo: Path, tmp_path: Path
) -> None:
    root = writable_copy(prepared_repo, tmp_path / "repo")
    # prep and base are done; sft (a trainer) is handed to the cluster, briefly.
    set_params(root, {"sft": {"sft": {"max_num_steps": 4}}})
    on_ray(root, token_cluster)
    token_file = tmp_path / "secret" / "ray_token"
    token_file.parent.mkdir()
    token_file.write_text(TOKEN + "\n")
    env = client_env(tmp_path / "home", RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token_file))
    repro = subprocess.run(
        ["dvc", "repro", "sft"], cwd=root, env=env, capture_output=True, text=True, timeout=600
    )
    output = repro.stdout + repro.stderr
    assert repro.returncode == 0, output
    job_id = json.loads((root / "models" / "sft" / "artifact.json").read_text())["job"].removeprefix("ray:")
    assert job_id.startswith("alignpipe-sft-") and f"Ray job {job_id}" in output
    assert "models/sft" in (root / "dvc.lock").read_text()
    plan = alignpipe(root, env, "plan", "sft", "--write", str(root / "plan"))
    assert plan.returncode == 0 and "ray job submit" in plan.stdout, plan.stdout + plan.stderr
    info = token_cluster.client().get_job_info(job_id)
    assert str(info.status) == "SUCCEEDED"
    driver_log = token_cluster.client().get_job_logs(job_id)
    assert "sft: heldout/accuracy" in driver_log
    # Nowhere: not in dvc.lock, params.yaml, the outputs and their manifests and resolved
    # configs, logs/, the plan, the console, Ray's job table or the driver's log.
    assert files_holding(root, TOKEN) == []
    for text in (output, plan.stdout, plan.stderr, driver_log, json.dumps(info.runtime_env), info.entrypoint):
        assert TOKEN not in text


@pytest.mark.ray
@pytest.mark.parametrize("source", ["RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "~/.ray/auth_token"])
def test_the_token_is_taken_where_ray_takes_it(
    token_cluster: RayCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str
) -> None:
    home = tmp_path / "home"
    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    if source == "RAY_AUTH_TOKEN":
        monkeypatch.setenv("RAY_AUTH_TOKEN", TOKEN)
    elif source == "RAY_AUTH_TOKEN_PATH":
        (tmp_path / "token").write_text(TOKEN)
        monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "token"))
    else:
        (home / ".ray").mkdir(parents=True)
        (home / ".ray" / "auth_token").write_text(TOKEN)
    launcher = get_launcher("ray", {}, {"ray": {"address": token_cluster.address}})
    out = io.StringIO()
    code = launcher.run(["bash", "-c", "echo job ran"], stage="auth", workdir=tmp_path, env={}, out=out)
    assert code == 0, out.getvalue()
    assert "job ran" in out.getvalue() and TOKEN not in out.getvalue()
    assert str(token_cluster.client().get_job_status(launcher.last_job["job_id"])) == "SUCCEEDED"


REFUSALS = {
    # case: (RAY_AUTH_* settings, a token in ~/.ray/auth_token or None, what the error says)
    "no-token": ({"RAY_AUTH_MODE": "token"}, None, r"Ray found no token in \S+/home/\.ray/auth_token"),
    "mode-unset": (
        {"RAY_AUTH_TOKEN": TOKEN},
        None,
        r"requires token authentication and no token was sent \(RAY_AUTH_MODE is unset here\): "
        r"export RAY_AUTH_MODE=token",
    ),
    "wrong-env-token": (
        {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": WRONG},
        None,
        r"refused the token from the RAY_AUTH_TOKEN environment variable",
    ),
    "wrong-token-file": (
        {"RAY_AUTH_MODE": "token"},
        WRONG,
        r"refused the token from \S+/home/\.ray/auth_token \(Ray's default token file\)",
    ),
    "unreadable-token-path": (
        {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": "/nonexistent/ray_token"},
        None,
        r"Ray found no token in the file /nonexistent/ray_token \(named by RAY_AUTH_TOKEN_PATH\)",
    ),
}


@pytest.mark.ray
@pytest.mark.parametrize("case", list(REFUSALS))
def test_a_missing_or_wrong_token_stops_the_stage_before_submitting(
    token_cluster: RayCluster, tmp_path: Path, case: str
) -> None:
    auth, default_file_token, message = REFUSALS[case]
    root = stage_root(tmp_path / "repo")
    on_ray(root, token_cluster)
    home = tmp_path / "home"
    if default_file_token is not None:
        (home / ".ray").mkdir(parents=True)
        (home / ".ray" / "auth_token").write_text(default_file_token)
    before = {job.submission_id for job in token_cluster.client().list_jobs()}
    proc = alignpipe(root, client_env(home, **auth), "run", "sft")
    assert proc.returncode == 2, proc.stdout + proc.stderr  # an AlignpipeError, said on stderr
    assert_matches(message, proc.stderr)
    assert "Nothing was submitted" in proc.stderr
    assert {job.submission_id for job in token_cluster.client().list_jobs()} == before
    assert not (root / "models").exists()  # nothing published
    for token in (TOKEN, WRONG):
        assert token not in proc.stdout + proc.stderr


def assert_matches(pattern: str, text: str) -> None:
    assert re.search(pattern, text), f"{pattern!r} not in:\n{text}"
