"""The tests' stage runner (tests/stage_runner.py): a stage run forked from the preloaded
interpreter publishes what a new ``alignpipe`` process publishes, and a run the fork could
change goes to a new process."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from tests import fork_server, stage_runner
from tests.conftest import OFFLINE, run_cli, set_params, writable_copy

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
    assert fork_server.differs(env, {**env, "ALIGNPIPE_SCRATCH": "/s", "PATH": "/bin"}) == []
