"""``nemo_rl.run(ctx)`` end to end against a stand-in NeMo-RL checkout.

NeMo-RL cannot run without GPUs, so ``NEMO_RL_DIR`` points at a directory whose
``examples/run_sft.py`` is a stand-in: it reads the rendered ``--config`` exactly as the
real script's inputs would be read (checkpoint_dir, log_dir, data paths, model_name),
auto-resumes from the highest ``step_N`` like CheckpointManager, and writes the same
layout (``step_N/{config.yaml, training_info.json, policy/...}``, TensorBoard events under
``log_dir/exp_NNN``). What is under test is everything around the trainer: the config
written to the scratch dir, the entry argv and cwd, exit-code propagation, resume after a
failure, publishing, and scratch clean-up.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from alignpipe.context import build_context
from alignpipe.engines.nemo_rl.engine import run
from tests.test_nemo_rl_publish import compose_into, tiny_hf, write_prepared

STAND_IN = textwrap.dedent(
    """
    import argparse, json, os, shutil, sys
    from pathlib import Path
    import yaml
    from torch.utils.tensorboard import SummaryWriter

    p = argparse.ArgumentParser(); p.add_argument("--config"); args, overrides = p.parse_known_args()
    assert not overrides, overrides
    cfg = yaml.safe_load(open(args.config))
    assert Path.cwd() == Path(__file__).resolve().parents[1], "entry scripts run from the NeMo-RL checkout"
    for split in ("train", "validation"):
        assert Path(cfg["data"][split]["data_path"]).is_file(), cfg["data"][split]
    ckpt = Path(cfg["checkpointing"]["checkpoint_dir"])
    steps = sorted(int(d.name[5:]) for d in ckpt.glob("step_*")) if ckpt.is_dir() else []
    start = steps[-1] if steps else 0          # CheckpointManager auto-resume
    print(f"stand-in: start={start}", flush=True)
    log_root = Path(cfg["logger"]["log_dir"]); log_root.mkdir(parents=True, exist_ok=True)
    exp = log_root / f"exp_{len(list(log_root.glob('exp_*'))) + 1:03d}"  # get_next_experiment_dir
    writer = SummaryWriter(str(exp / "tensorboard"))
    fail_at = int(os.environ.get("STAND_IN_FAIL_AT", "0"))
    max_steps = cfg["sft"]["max_num_steps"]
    for step in range(start + 1, max_steps + 1):
        writer.add_scalar("train/loss", 1.0 / step, step)
        if step % cfg["checkpointing"]["save_period"] == 0 or step == max_steps:
            writer.add_scalar("validation/val_loss", 2.0 / step, step)
            d = ckpt / f"step_{step}"
            (d / "policy").mkdir(parents=True)
            (d / "config.yaml").write_text(yaml.safe_dump(cfg))
            (d / "training_info.json").write_text(json.dumps({"step": step, "val:val_loss": 2.0 / step,
                                                             "resumed_from": start}))
            src = Path(os.environ["STAND_IN_WEIGHTS"])
            shutil.copytree(src / "weights", d / "policy" / "weights")
            shutil.copytree(src / "tokenizer", d / "policy" / "tokenizer")
        if step == fail_at:
            writer.close(); print("simulated crash", file=sys.stderr); sys.exit(3)
    writer.close()
    """
)


@pytest.fixture
def nemo_rl_checkout(tmp_path: Path, monkeypatch) -> Path:
    checkout = tmp_path / "nemo-rl"
    (checkout / "examples").mkdir(parents=True)
    (checkout / "examples" / "run_sft.py").write_text(STAND_IN)
    tiny_hf(tmp_path / "weights")
    monkeypatch.setenv("NEMO_RL_DIR", str(checkout))
    monkeypatch.setenv("STAND_IN_WEIGHTS", str(tmp_path / "weights"))
    return checkout


@pytest.mark.slow
def test_run_fails_with_trainer_exit_code_then_resumes_and_publishes(
    repo_copy: Path, nemo_rl_checkout: Path, monkeypatch, capfd
) -> None:
    compose_into(repo_copy, "default")
    from tests.conftest import set_params

    set_params(
        repo_copy, {"sft": {"sft": {"max_num_steps": 4}, "alignpipe": {"heldout": {"enabled": False}}}}
    )
    set_params(repo_copy, {"sft": {"checkpointing": {"save_period": 2}}})
    write_prepared(repo_copy)
    for split in ("train", "validation"):
        sft = repo_copy / "data" / "prepared" / "sft"
        sft.mkdir(parents=True, exist_ok=True)
        (sft / f"{split}.jsonl").write_text(
            json.dumps({"messages": [{"role": "user", "content": "a"}]}) + "\n"
        )

    ctx = build_context(repo_copy, "sft", "default")
    monkeypatch.setenv("STAND_IN_FAIL_AT", "3")
    with pytest.raises(SystemExit) as failed:
        run(ctx)
    assert failed.value.code == 3
    scratch = ctx.scratch_dir
    assert (scratch / "checkpoints" / "step_2").is_dir(), "checkpoints survive a failed run"
    assert not ctx.output("policy").exists(), "nothing is published after a failure"

    monkeypatch.setenv("STAND_IN_FAIL_AT", "0")
    ctx = build_context(repo_copy, "sft", "default")
    assert ctx.scratch_dir == scratch, "same config and inputs -> same scratch dir -> resume"
    run(ctx)

    out = ctx.output("policy")
    manifest = json.loads((out / "artifact.json").read_text())
    info = manifest.get("nemo_rl") or manifest["extra"]["nemo_rl"]
    assert info["checkpoint"] == "step_4" and info["selected_by"] == "best val:val_loss=0.5"
    # The second run resumed from step_2 (it did not start over).
    printed = capfd.readouterr()
    assert "nemo_rl: resuming from step_2" in printed.out
    assert "stand-in: start=2" in printed.out
    metrics = json.loads((ctx.output("metrics") / "metrics.json").read_text())
    assert metrics["train"]["loss"] == pytest.approx(0.25) and metrics["val"]["loss"] == pytest.approx(0.5)
    assert not scratch.exists(), "scratch is removed once everything is published"
    assert (out / "config.json").is_file() and (out / "nemo_rl_config.yaml").is_file()
    assert manifest["type"] == "checkpoint_hf" and manifest["engine"] == "nemo_rl"


def test_run_refuses_without_a_nemo_rl_checkout(repo_copy: Path, tmp_path: Path, monkeypatch) -> None:
    compose_into(repo_copy, "default")
    monkeypatch.setenv("NEMO_RL_DIR", str(tmp_path / "missing"))
    from alignpipe.errors import ConfigError

    with pytest.raises(ConfigError, match="NeMo-RL checkout not found"):
        run(build_context(repo_copy, "sft", "default"))


def test_an_invalid_config_stops_before_the_entry_script(
    repo_copy: Path, nemo_rl_checkout: Path, nemo_rl_src: Path, schema_python: Path, monkeypatch
) -> None:
    """The engine's pre-flight runs NeMo-RL's own validation first: a wrong type fails in
    seconds, naming the key, and the trainer never starts."""
    from alignpipe.errors import ConfigError
    from tests.conftest import set_params

    compose_into(repo_copy, "default")
    set_params(repo_copy, {"sft": {"sft": {"max_num_steps": "four"}}})
    write_prepared(repo_copy)
    monkeypatch.setenv("NEMO_RL_SRC", str(nemo_rl_src))
    monkeypatch.setenv("NEMO_RL_PYTHON", str(schema_python))
    ran = []
    with pytest.raises(ConfigError, match=r"sft\.max_num_steps: Input should be a valid integer"):
        run(build_context(repo_copy, "sft", "default"), runner=lambda argv, cwd: ran.append(argv) or 0)
    assert ran == [], "the entry script must not run"
