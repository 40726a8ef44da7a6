"""Exact resume for every trainer (sft, rm, dpo, and rlvr's GRPO, which rlhf runs too): SIGKILL
after its first scratch checkpoint, a re-run killed again after its last, then a re-run to the
end, publishes ``models/<stage>`` and ``results/<stage>`` byte-identical to an uninterrupted
run's: weights (a LoRA adapter for sft and dpo), manifest, samples, metrics.json and every
curve, so ``dvc.lock`` does not change.

The settings put a checkpoint between two logging steps and a validation on the last step,
which is where resumes went wrong: transformers' loss (and TRL's metrics) average over the
steps since the last log, and a resume starts that window afresh; a run killed after its
final checkpoint validated its last step a second time. And the last checkpoint matters on
its own: transformers' loop, resumed at ``max_steps``, takes one step too many.
"""

from __future__ import annotations

import difflib
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from alignpipe.artifacts import dvc_hash, md5_file
from tests.conftest import OFFLINE, merged, run_cli, set_params, writable_copy

pytestmark = pytest.mark.slow

GRPO = {
    # Validated (on 32 prompts) at the start and at each checkpoint (the learning curve): a
    # resume replays it.
    # 16 rollouts a step (the profile has 128), one optimizer step each: the resume logic is
    # the same at any size.
    "grpo": {
        "num_prompts_per_step": 4,
        "num_generations_per_prompt": 4,
        "max_num_steps": 4,
        "val_period": 2,
        "max_val_samples": 32,
        "val_batch_size": 32,
    },
    "policy": {"train_global_batch_size": 16, "train_micro_batch_size": 16},
    "checkpointing": {"save_period": 2},
}
# 8 steps, logged and validated every 4 (val_period sets the logging period), checkpoints
# at 6 (mid-window) and 8 (the last step, which is also validated).
SHORT = {"max_num_steps": 8, "val_period": 4, "val_at_start": True}
SETTINGS = {
    "sft": {"sft": SHORT, "checkpointing": {"save_period": 6}},
    # 32 pairs in two micro-batches, not the profile's 128: accumulation still spans a step, at a
    # quarter of the compute (the resume logic is the same at any batch size).
    "rm": {
        "rm": SHORT,
        "checkpointing": {"save_period": 6},
        "policy": {"train_global_batch_size": 32, "train_micro_batch_size": 16},
    },
    "dpo": {"dpo": SHORT, "checkpointing": {"save_period": 6}},
    # rlhf is this GRPO trainer with a reward model's score for the verifier's: rlvr's chain is its.
    "rlvr": GRPO,
}


LORA = {"policy": {"dtensor_cfg": {"lora_cfg": {"enabled": True}}}}
# Each stage once: sft and dpo train LoRA adapters (the checkpoint holds the adapter and its
# optimizer state, not the base; dpo's reference is the disabled adapter), the others every
# weight. Both kinds of checkpoint and every trainer's resume, at four kill chains.
ADAPTER_STAGES = ("sft", "dpo")


@pytest.fixture(scope="module")
def straight_run(trained_sft, tmp_path_factory):
    """``straight_run(stage)``: the repo of an uninterrupted run of ``stage``, run once per module."""
    runs: dict[str, Path] = {}

    def get(stage: str) -> Path:
        if stage not in runs:
            root, env = _copy(trained_sft, tmp_path_factory.mktemp(f"straight_{stage}"), stage)
            run_cli(root, "run", stage, env=env)
            runs[stage] = root
        return runs[stage]

    return get


def _copy(src: Path, dst: Path, stage: str) -> tuple[Path, dict[str, str]]:
    root = writable_copy(src, dst / "repo")
    for out in (root / "models" / stage, root / "results" / stage):
        shutil.rmtree(out, ignore_errors=True)
    set_params(root, {stage: merged(SETTINGS[stage], LORA if stage in ADAPTER_STAGES else {})})
    return root, {"ALIGNPIPE_SCRATCH": str(dst / "scratch")}  # this run's own: no stale checkpoints


def _kill_at_checkpoint(root: Path, stage: str, env: dict[str, str], which: str) -> str:
    """Run ``stage`` and SIGKILL it as soon as its first (or last) checkpoint is complete;
    returns what it printed (unbuffered, so a kill loses none of it)."""
    scratch = Path(env["ALIGNPIPE_SCRATCH"])
    log = scratch.parent / f"{stage}-killed-{which}.log"
    with log.open("w") as out:
        proc = subprocess.Popen(  # a process group of its own: the kill takes what it started
            ["alignpipe", "run", stage],
            cwd=root,
            env={**os.environ, **OFFLINE, "ALIGNPIPE_ROOT": str(root), "PYTHONUNBUFFERED": "1", **env},
            stdout=out,
            stderr=subprocess.STDOUT,
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
    return log.read_text()


def _kill_chain(root: Path, stage: str, env: dict[str, str]) -> None:
    """Both kill points in one chain: killed after its first checkpoint; resumed from it and
    killed again after its last; resumed from that to the end. A resume that lost anything at
    either point shows in the published outputs."""
    assert "resuming from" not in _kill_at_checkpoint(root, stage, env, "first")
    resumed = _kill_at_checkpoint(root, stage, env, "last")
    assert "resuming from" in resumed, resumed
    resumed = run_cli(root, "run", stage, env=env)
    assert "resuming from" in resumed.stdout, resumed.stdout


@pytest.mark.parametrize("stage", list(SETTINGS))
def test_killed_stage_resumes_to_the_uninterrupted_outputs(stage, straight_run, trained_sft, tmp_path):
    straight = straight_run(stage)
    root, env = _copy(trained_sft, tmp_path, stage)
    _kill_chain(root, stage, env)
    weights = "adapter_model.safetensors" if stage in ADAPTER_STAGES else "model.safetensors"
    assert (root / "models" / stage / weights).is_file()

    for out in (f"models/{stage}", f"results/{stage}"):
        differences = _differences(straight / out, root / out)
        assert not differences, (
            f"{stage} killed after its first and after its last checkpoint, resumed each time: {out} "
            "differs from an uninterrupted run's\n" + "\n".join(differences)
        )
        assert dvc_hash(root / out) == dvc_hash(straight / out)  # what dvc.lock records
    assert not list(Path(env["ALIGNPIPE_SCRATCH"]).glob(f"repo/{stage}/*")), (
        "scratch is removed after publishing"
    )


def _differences(expected: Path, actual: Path, context_lines: int = 2, max_lines: int = 40) -> list[str]:
    """Every file that is missing, extra or not byte-identical under two output dirs, with a
    unified diff for text files (md5 and size for binary ones)."""
    files = {p.relative_to(d).as_posix() for d in (expected, actual) for p in d.rglob("*") if p.is_file()}
    out = []
    for rel in sorted(files):
        a, b = expected / rel, actual / rel
        if not b.is_file() or not a.is_file():
            out.append(f"{rel}: only in the {'uninterrupted' if a.is_file() else 'resumed'} run")
            continue
        if a.read_bytes() == b.read_bytes():
            continue
        try:
            diff = list(
                difflib.unified_diff(
                    a.read_text().splitlines(),
                    b.read_text().splitlines(),
                    "uninterrupted/" + rel,
                    "resumed/" + rel,
                    n=context_lines,
                    lineterm="",
                )
            )
        except UnicodeDecodeError:
            out.append(
                f"{rel}: binary, uninterrupted md5 {md5_file(a)} ({a.stat().st_size} B), "
                f"resumed md5 {md5_file(b)} ({b.stat().st_size} B)"
            )
            continue
        out.extend(
            diff[:max_lines]
            + ([f"... {len(diff) - max_lines} more diff lines"] if len(diff) > max_lines else [])
        )
    return out


def test_a_checkpoint_is_resumed_only_by_the_code_that_wrote_it(tmp_path: Path) -> None:
    """The scratch directory (what a re-run resumes from) is keyed by the code's sources too:
    after an edit to the package, a killed run's checkpoints are not resumed by other code."""
    import subprocess
    import sys

    from tests.conftest import copy_repo

    def key(root: Path) -> str:
        probe = "from pathlib import Path; from alignpipe.context import build_context; "
        probe += f"print(build_context(Path({str(root)!r}), 'sft').run_key)"
        env = {**os.environ, "PYTHONPATH": str(root)}  # run this copy's alignpipe
        return subprocess.run([sys.executable, "-c", probe], env=env, cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()  # fmt: skip

    same, edited = copy_repo(tmp_path / "same"), copy_repo(tmp_path / "edited")
    assert key(same) == key(copy_repo(tmp_path / "again"))
    (edited / "alignpipe" / "jsonl.py").write_text(
        (edited / "alignpipe" / "jsonl.py").read_text() + "\n# edited\n"
    )
    assert key(edited) != key(same)
