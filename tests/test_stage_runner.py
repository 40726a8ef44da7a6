"""The tests' stage runner (tests/stage_runner.py): a stage run forked from the preloaded
interpreter publishes what a new ``alignpipe`` process publishes, and a run the fork could
change goes to a new process; the same for the stage processes a ``dvc`` command starts
(tests/stage_shim.py), which also stop with it."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil

from tests import fork_server, stage_runner
from tests.conftest import (
    GIT_ENV,
    OFFLINE,
    ONE_THREAD,
    SINGLE_TURN,
    copy_repo,
    merged,
    run_cli,
    set_params,
    writable_copy,
)

SHORT_SFT = {"sft": {"sft": {"max_num_steps": 6, "val_period": 3}}}


def _digests(top: Path) -> dict[str, str]:
    return {
        p.relative_to(top).as_posix(): hashlib.md5(p.read_bytes()).hexdigest()
        for p in top.rglob("*")
        if p.is_file()
    }


def test_a_forked_stage_publishes_the_same_bytes_as_a_new_process(trained_sft: Path, tmp_path: Path) -> None:
    published = {}
    for how in ("forked", "new"):
        root = writable_copy(trained_sft.parent, tmp_path / how) / "repo"
        set_params(root, SHORT_SFT)
        env = {"ALIGNPIPE_SCRATCH": str(tmp_path / how / "scratch")}
        if how == "new":
            env[stage_runner.FRESH] = "1"
        served = stage_runner.served()
        run_cli(root, "run", "sft", env=env)
        run_cli(root, "run", "benchmark", "--source", "sft", env=env)  # the server with lm-eval
        assert stage_runner.served() - served == 2 * (how == "forked"), how
        published[how] = {
            out: _digests(root / out) for out in ("models/sft", "results/sft", "results/benchmark/sft")
        }
    assert published["forked"]["results/benchmark/sft"] and published["forked"] == published["new"]


def test_runs_the_fork_could_change_get_a_new_process() -> None:
    env = {**os.environ, **OFFLINE, "ALIGNPIPE_ROOT": "/somewhere"}
    assert stage_runner._forkable(["alignpipe", "run", "sft"], env)
    assert stage_runner._forkable(["alignpipe", "run", "convert", "--source", "dpo"], env)
    assert stage_runner._forkable(["alignpipe", "run", "benchmark", "--source", "sft"], env)
    assert not stage_runner._forkable(["alignpipe", "plan", "sft"], env)
    assert not stage_runner._forkable(["alignpipe", "run", "sft"], {**env, stage_runner.FRESH: "1"})
    # Read by libraries at import: a run that sets one other than the server's is not forked.
    assert fork_server.differs(env, {**env, "HF_HOME": "/elsewhere"}) == ["HF_HOME"]
    assert fork_server.differs(env, {k: v for k, v in env.items() if k != "HF_HUB_OFFLINE"}) == [
        "HF_HUB_OFFLINE"
    ]
    # Read by the stage at run time: may differ per run.
    assert (
        fork_server.differs(env, {**env, "ALIGNPIPE_SCRATCH": "/s", "PATH": "/bin", "SHELL": "/bin/zsh"})
        == []
    )


def test_what_a_library_adds_to_the_workers_environment_leaves_its_runs_forked(
    repo_copy: Path, monkeypatch
) -> None:
    """Importing scikit-learn in the worker (transformers' generation does) sets KMP_INIT_AT_FORK
    in os.environ; the worker's later stage runs were all new processes before."""
    assert "KMP_INIT_AT_FORK" not in stage_runner._WORKER_ENV
    run_cli(repo_copy, "run", "prep")  # the server is up, in the environment as it was
    monkeypatch.setenv("KMP_INIT_AT_FORK", "FALSE")  # then a test imports sklearn, which does this
    served = stage_runner.served()
    run_cli(repo_copy, "run", "prep")
    assert stage_runner.served() == served + 1
    # A value a test passes itself is its choice: that run is no fork of the servers.
    run_cli(repo_copy, "run", "prep", env={"KMP_INIT_AT_FORK": "TRUE"})
    assert stage_runner.served() == served + 1


def test_the_stages_dvc_starts_are_forked_and_publish_what_new_processes_do(tmp_path: Path) -> None:
    locks = {}
    for how in ("forked", "new"):
        root = copy_repo(tmp_path / how / "repo", git=True)
        set_params(root, merged(SINGLE_TURN, ONE_THREAD))
        env = {**os.environ, **OFFLINE, **GIT_ENV, "ALIGNPIPE_SCRATCH": str(tmp_path / how / "scratch")}
        if how == "new":
            env[stage_runner.FRESH] = "1"
        repro = subprocess.run(
            ["dvc", "repro", "base"], cwd=root, env=stage_runner.dvc_env(env), capture_output=True, text=True
        )
        assert repro.returncode == 0, repro.stdout[-3000:] + repro.stderr[-3000:]
        assert len(stage_runner.forked_for_dvc(root)) == 2 * (how == "forked"), how  # prep and base
        assert "base: parameters" in repro.stdout  # the stage's console reached dvc's stdout
        locks[how] = (root / "dvc.lock").read_text()
    assert locks["forked"] == locks["new"]
    # What a new stage process would print while importing (a library's warning) goes to the
    # servers' own log, not to dvc's console (test_dvc_pipeline's console test): none.
    for server in stage_runner._servers.values():
        said = [
            line
            for line in server.log.read_text().splitlines()
            if not line.startswith(fork_server.CLIENT_RUN)
        ]
        assert not said, f"the {server.name}'s imports printed:\n" + "\n".join(said)


def test_a_forked_stage_stops_with_the_dvc_that_started_it(prepared_repo: Path, tmp_path: Path) -> None:
    """As for a stage process (tests/test_interrupts.py): SIGTERM to dvc alone stops the run,
    and it publishes nothing."""
    root = writable_copy(prepared_repo, tmp_path / "repo")
    env = {**os.environ, **OFFLINE, "ALIGNPIPE_SCRATCH": str(tmp_path / "scratch"), "SHELL": "/bin/bash"}
    dvc = subprocess.Popen(
        ["dvc", "repro", "sft"],
        cwd=root,
        env=stage_runner.dvc_env(env),
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while not stage_runner.forked_for_dvc(root):
            assert dvc.poll() is None and time.monotonic() < deadline, (
                f"dvc's sft was never forked: {stage_runner.refused_for_dvc(root) or 'not refused'}"
            )
            time.sleep(0.2)
        ((command, pid),) = stage_runner.forked_for_dvc(root)
        assert command == "alignpipe run sft"
        time.sleep(2)  # into training
        os.kill(dvc.pid, signal.SIGTERM)  # the dvc PID alone, not its process group
        dvc.wait(timeout=30)
        deadline = time.monotonic() + 10
        while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "the forked sft outlived dvc by 10 s"
            time.sleep(0.2)
    finally:
        try:
            os.killpg(dvc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not (root / "models" / "sft").exists(), "an interrupted stage must publish nothing"
