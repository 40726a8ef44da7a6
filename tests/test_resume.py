"""Exact resume for every trainer stage: SIGKILL after its first or after its last scratch
checkpoint, then a re-run, ends with weights bit-identical to an uninterrupted run's.

The last checkpoint matters on its own: transformers' loop, resumed at ``max_steps``, takes
one step too many, so a run killed between its final checkpoint and publishing would end
one step past a straight run.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from alignpipe.artifacts import md5_file
from tests.conftest import OFFLINE, run_cli, set_params, set_writable, writable_copy

pytestmark = pytest.mark.slow

GRPO = {
    "grpo": {"num_prompts_per_step": 8, "num_generations_per_prompt": 4, "max_num_steps": 4},
    "policy": {"train_global_batch_size": 32, "train_micro_batch_size": 32},
    "checkpointing": {"save_period": 2},
}
# Short runs with two checkpoints each; the weights file each stage publishes.
SETTINGS = {
    "sft": ({"sft": {"max_num_steps": 20}, "checkpointing": {"save_period": 10}}, "models/sft"),
    "rm": ({"rm": {"max_num_steps": 20}, "checkpointing": {"save_period": 10}}, "models/rm"),
    "dpo": ({"dpo": {"max_num_steps": 20}, "checkpointing": {"save_period": 10}}, "models/dpo"),
    "rlvr": (GRPO, "models/rlvr"),
    "rlhf": (GRPO, "models/rlhf"),
}


@pytest.fixture(scope="module")
def with_rm(trained_sft: Path, tmp_path_factory) -> Path:
    """The shared SFT repo plus a briefly trained reward model (rlhf's input)."""
    root = writable_copy(trained_sft, tmp_path_factory.mktemp("resume") / "repo")
    set_params(root, {"rm": SETTINGS["rm"][0]})
    run_cli(root, "run", "rm", env={"ALIGNPIPE_SCRATCH": str(root.parent / "scratch")})
    set_writable(root, False)
    return root


def _copy(src: Path, dst: Path, stage: str) -> tuple[Path, dict[str, str]]:
    root = writable_copy(src, dst / "repo")
    for out in (root / "models" / stage, root / "results" / stage):
        shutil.rmtree(out, ignore_errors=True)
    set_params(root, {stage: SETTINGS[stage][0]})
    return root, {"ALIGNPIPE_SCRATCH": str(dst / "scratch")}


def _kill_at_checkpoint(root: Path, stage: str, env: dict[str, str], which: str) -> None:
    """Run ``stage`` and SIGKILL it as soon as its first (or last) checkpoint is complete."""
    scratch = Path(env["ALIGNPIPE_SCRATCH"])
    proc = subprocess.Popen(
        ["alignpipe", "run", stage],
        cwd=root,
        env={**os.environ, **OFFLINE, "ALIGNPIPE_ROOT": str(root), **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 900  # a backstop for a hung run, not a timing assertion
        while True:
            assert proc.poll() is None, f"{stage} finished before its {which} checkpoint could be caught"
            assert time.monotonic() < deadline, f"no {which} checkpoint appeared"
            done = False
            for state_file in scratch.glob(f"repo/{stage}/*/checkpoint-*/trainer_state.json"):
                try:
                    state = json.loads(state_file.read_text())
                except json.JSONDecodeError:
                    continue  # being written
                done = done or which == "first" or state["global_step"] >= state["max_steps"]
            if done:
                break
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert not (root / "models" / stage).exists(), "a killed run must not publish"


@pytest.mark.parametrize("stage", list(SETTINGS))
def test_killed_stage_resumes_to_the_uninterrupted_weights(stage, trained_sft, with_rm, tmp_path):
    src = with_rm if stage == "rlhf" else trained_sft
    straight, env = _copy(src, tmp_path / "straight", stage)
    run_cli(straight, "run", stage, env=env)
    weights = SETTINGS[stage][1] + "/model.safetensors"
    expected = md5_file(straight / weights)

    for which in ("first", "last"):
        root, env = _copy(src, tmp_path / which, stage)
        _kill_at_checkpoint(root, stage, env, which)
        resumed = run_cli(root, "run", stage, env=env)
        assert "resuming from" in resumed.stdout, resumed.stdout
        assert md5_file(root / weights) == expected, f"{stage} resumed after its {which} checkpoint differs"
        assert _results(root, stage) == _results(straight, stage), f"{stage}: metrics or curves differ"
        assert not list(Path(env["ALIGNPIPE_SCRATCH"]).glob(f"repo/{stage}/*")), (
            "scratch is removed after publishing"
        )


def _results(root: Path, stage: str) -> dict[str, str]:
    """metrics.json and every curve (DVCLive TSV) the stage published, by relative path."""
    results = root / "results" / stage
    return {str(f.relative_to(results)): f.read_text() for f in sorted(results.rglob("*")) if f.is_file()}
