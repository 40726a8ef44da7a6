"""Stopping `dvc` alone (what `timeout`, CI runners and schedulers do) stops the stage too.

DVC does not pass SIGTERM on to the stage it runs; `alignpipe run` asks the kernel for a
signal when its parent dies, and unwinds like Ctrl-C: no orphan, nothing published, and
the next `dvc repro` resumes from the scratch checkpoint.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import OFFLINE, set_params, writable_copy


def stage_processes(root: Path) -> list[psutil.Process]:
    """Live `alignpipe` processes working in ``root``."""
    found = []
    for proc in psutil.process_iter(["cmdline", "cwd", "status"]):
        info = proc.info
        if info["status"] == psutil.STATUS_ZOMBIE or info["cwd"] != str(root):
            continue
        if any(part.endswith("alignpipe") for part in info["cmdline"] or []):
            found.append(proc)
    return found


# DVC runs a stage's cmd with `$SHELL -c` (else /bin/sh): bash execs the lone command, so the
# stage is dvc's child; Debian's sh (dash) forks and waits, so a shell sits between them.
@pytest.mark.slow
@pytest.mark.parametrize("shell", ["/bin/bash", "/bin/sh"])
def test_sigterm_to_dvc_alone_stops_the_stage_and_repro_resumes(
    prepared_repo: Path, tmp_path: Path, shell: str
) -> None:
    root = writable_copy(prepared_repo, tmp_path / "repo")
    # An orphaned trainer either outlives dvc by 10 s (caught below) or finishes and publishes
    # models/sft (caught after), so the run only has to outlast its first checkpoint: the 50
    # steps after it are about 7 s of training here, and the resume pays them.
    set_params(root, {"sft": {"sft": {"max_num_steps": 60}}})
    cfg = root / "stages" / "sft" / "config" / "tiny.yaml"
    cfg.write_text(cfg.read_text().replace("save_period: 50", "save_period: 10"))
    scratch = tmp_path / "scratch"
    env = {**os.environ, **OFFLINE, "ALIGNPIPE_SCRATCH": str(scratch), "SHELL": shell}

    dvc = subprocess.Popen(
        ["dvc", "repro", "sft"],
        cwd=root,
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 600
        while not list(scratch.glob("repo/sft/*/checkpoint-10/trainer_state.json")):
            assert dvc.poll() is None, "dvc repro ended before sft wrote its first checkpoint"
            assert time.monotonic() < deadline, "no sft checkpoint appeared"
            time.sleep(0.2)
        assert stage_processes(root), "the sft stage process should be running"

        os.kill(dvc.pid, signal.SIGTERM)  # the dvc PID alone, not its process group
        dvc.wait(timeout=30)
        deadline = time.monotonic() + 10
        while (left := stage_processes(root)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not left, f"stage processes outlived dvc by 10 s: {[p.info['cmdline'] for p in left]}"
    finally:
        try:
            os.killpg(dvc.pid, signal.SIGKILL)  # whatever is left in the session, if the test failed
        except ProcessLookupError:
            pass
    assert not (root / "models" / "sft").exists(), "an interrupted stage must publish nothing"
    if shell != "/bin/bash":
        return  # what the next run resumes from does not depend on the shell that ran the stage

    resumed = subprocess.run(["dvc", "repro", "sft"], cwd=root, env=env, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resuming from" in resumed.stdout + resumed.stderr
    assert (root / "models" / "sft" / "model.safetensors").is_file()


def _dvc(root: Path, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(["dvc", *args], cwd=root, env=env, capture_output=True, text=True)


def test_a_killed_stage_leaves_no_partial_metrics_and_checkout_restores_the_last_result(
    tiny_pipeline, tmp_path: Path
) -> None:
    root = writable_copy(tiny_pipeline.root, tmp_path / "repo")
    scratch = tmp_path / "scratch"
    env = {**os.environ, **OFFLINE, "ALIGNPIPE_SCRATCH": str(scratch)}
    # The last result: the committed run as reproduced here (its dvc.lock is the committed one
    # where the CPU kernels are the lock's; committed again either way).
    subprocess.run(["git", "commit", "-qam", "reproduced"], cwd=root, env=env)
    committed = (root / "results" / "sft" / "metrics.json").read_text()

    # A new experiment, killed mid-training while DVCLive is logging every step.
    set_params(root, {"sft": {"sft": {"max_num_steps": 400}, "checkpointing": {"save_period": 10}}})
    proc = subprocess.Popen(
        ["dvc", "repro", "sft"],
        cwd=root,
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 600
        while not list(scratch.glob("repo/sft/*/checkpoint-10/trainer_state.json")):
            assert proc.poll() is None, "sft ended before it could be interrupted"
            assert time.monotonic() < deadline, "no sft checkpoint appeared"
            time.sleep(0.1)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    # DVC removed the stage's outputs before running it; the killed run published none, so
    # `dvc metrics show` presents the last committed result (from the cache), not step 10.
    assert not (root / "results" / "sft").exists()
    shown = _dvc(root, "metrics", "show", "--json", env=env)
    assert shown.returncode == 0, shown.stderr
    sft_metrics = json.loads(shown.stdout)[""]["data"]["results/sft/metrics.json"]["data"]
    assert sft_metrics == json.loads(committed)

    subprocess.run(["git", "checkout", "params.yaml"], cwd=root, env=env, check=True)
    restored = _dvc(root, "checkout", "sft", env=env)
    assert restored.returncode == 0, restored.stdout + restored.stderr
    assert (root / "results" / "sft" / "metrics.json").read_text() == committed
