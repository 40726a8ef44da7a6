"""After a NeMo-RL run: checkpoint choice, export, metric import and manifest, on CPU.

A fake-but-faithful NeMo-RL output tree is built the way CheckpointManager and the
Logger lay it out (nemo-rl.md §3, §9): ``step_N/{config.yaml, training_info.json,
policy/weights, policy/tokenizer}``, an unfinished ``tmp_step_N``, and TensorBoard event
files written with ``torch.utils.tensorboard.SummaryWriter`` under ``logs/exp_NNN``
(two runs: the second resumed). The weights are a real tiny HF model, so held-out
accuracy runs for real.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from alignpipe.context import build_context
from alignpipe.engines.nemo_rl import convert as CV
from alignpipe.engines.nemo_rl.checkpoints import NoCheckpointError, select_checkpoint
from alignpipe.engines.nemo_rl.metrics import read_scalars
from alignpipe.engines.nemo_rl.publish import publish, validation_answers
from alignpipe.engines.nemo_rl.render import RunPaths, render_for
from alignpipe.measure.intervals import wilson
from tests.conftest import REPO, set_params

PROMPTS = [("sort 312", "123"), ("reverse 45", "54"), ("add 2 3", "5"), ("sort 21", "12")]


def compose_into(root: Path, profile: str) -> None:
    from dvc.utils.hydra import compose_and_dump

    compose_and_dump(
        root / "params.yaml", str(REPO / "conf"), None, "config", str(REPO), [f"profile={profile}"]
    )


def write_prepared(root: Path) -> None:
    for family in ("rlvr", "rlhf"):
        d = root / "data" / "prepared" / family
        d.mkdir(parents=True, exist_ok=True)
        rows = [
            {"id": f"{family}{i}", "task": p.split()[0], "prompt": p, "answer": a, "verifier": "exact"}
            for i, (p, a) in enumerate(PROMPTS)
        ]
        for split in ("train", "validation", "test"):
            (d / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def tiny_hf(directory: Path) -> tuple[Path, Path]:
    """A real tiny Llama saved as HF weights + tokenizer, in NeMo-RL's V2 consolidated layout."""
    from alignpipe import tiny

    texts = [p + a for p, a in PROMPTS]
    tok = tiny.train_tokenizer(texts, "char")
    model = tiny.build_causal_lm(
        tok,
        {
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "max_position_embeddings": 64,
        },
        seed=0,
    )
    weights = directory / "weights" / "model" / "consolidated"
    model.save_pretrained(weights, safe_serialization=True)
    tok.save_pretrained(directory / "tokenizer")
    return weights, directory / "tokenizer"


def write_step(ckpt: Path, step: int, cfg: dict, info: dict, hf_source: Path | None = None) -> Path:
    import shutil

    d = ckpt / f"step_{step}"
    (d / "policy").mkdir(parents=True)
    (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    (d / "training_info.json").write_text(json.dumps(info))
    (d / "train_dataloader.pt").write_bytes(b"state")
    if hf_source is not None:
        shutil.copytree(hf_source / "weights", d / "policy" / "weights")
        shutil.copytree(hf_source / "tokenizer", d / "policy" / "tokenizer")
        (d / "policy" / "optimizer" / "optim").mkdir(parents=True)
    return d


def write_events(log_dir: Path, scalars: dict[str, list[tuple[int, float]]]) -> None:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(log_dir / "tensorboard"))
    for tag, points in scalars.items():
        for step, value in points:
            writer.add_scalar(tag, value, step)
    writer.close()


@pytest.fixture
def rlvr_run(repo_copy: Path, tmp_path: Path):
    compose_into(repo_copy, "default")
    set_params(
        repo_copy, {"rlvr": {"alignpipe": {"heldout": {"limit": 4, "max_new_tokens": 4, "batch_size": 4}}}}
    )
    write_prepared(repo_copy)
    ctx = build_context(repo_copy, "rlvr", "default")
    paths = RunPaths(ctx.scratch_dir)
    cfg = render_for(ctx, paths.scratch)
    hf = tmp_path / "hf"
    tiny_hf(hf)
    for step, acc in ((10, 0.40), (20, 0.60), (30, 0.50)):
        write_step(
            paths.checkpoints, step, cfg, {"current_step": step, "val:accuracy": acc, "val_reward": acc}, hf
        )
    (paths.checkpoints / "tmp_step_40" / "policy").mkdir(parents=True)  # unfinished: never chosen
    write_events(
        paths.logs / "exp_001",
        {
            "train/loss": [(1, 0.9), (2, 0.7), (3, 0.6)],
            "train/reward": [(1, 0.1), (2, 0.2), (3, 0.3)],
            "train/kl_penalty": [(1, 0.0), (2, 0.01), (3, 0.02)],
            "validation/accuracy": [(2, 0.4)],
            "timing/train/total_step_time": [(1, 12.0), (2, 11.0), (3, 10.0)],
        },
    )
    # Resumed after an interruption at step 2: NeMo-RL made exp_002 and re-logged step 3.
    write_events(
        paths.logs / "exp_002", {"train/reward": [(3, 0.35), (4, 0.45)], "validation/accuracy": [(4, 0.6)]}
    )
    return ctx, cfg, paths


def test_select_best_by_metric_then_latest(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    for step, loss in ((5, 1.2), (10, 0.8), (15, 0.9)):
        write_step(ckpt, step, {}, {"val:validation-default_loss": loss})
    (ckpt / "tmp_step_20").mkdir()
    (ckpt / "old_step_10").mkdir()
    best = select_checkpoint(ckpt, "val:validation-default_loss", higher_is_better=False)
    assert (best.step, best.metric_value) == (10, 0.8)
    assert best.reason == "best val:validation-default_loss=0.8"
    assert select_checkpoint(ckpt, "val:validation-default_loss", higher_is_better=True).step == 5
    # The metric is absent (e.g. validation never ran): the latest finished step.
    latest = select_checkpoint(ckpt, "val:accuracy")
    assert (latest.step, latest.reason) == (15, "latest")
    with pytest.raises(NoCheckpointError, match="no finished step_N"):
        select_checkpoint(tmp_path / "empty", "val:accuracy")


def test_metric_import_merges_resumed_runs(rlvr_run) -> None:
    _, _, paths = rlvr_run
    scalars = read_scalars(paths.logs)
    assert scalars["train/reward"] == {
        1: pytest.approx(0.1),
        2: pytest.approx(0.2),
        3: pytest.approx(0.35),
        4: pytest.approx(0.45),
    }


def test_publish_hf_policy(rlvr_run) -> None:
    ctx, cfg, paths = rlvr_run
    manifest = publish(ctx, cfg, paths, runner=_no_commands)

    out = ctx.output("policy_out")
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    assert (out / "tokenizer.json").is_file()
    assert manifest["type"] == "checkpoint_hf" and manifest["format"] == "hf"
    assert manifest["engine"] == "nemo_rl" and manifest["stage"] == "rlvr"
    assert manifest["image"] == ctx.runtime["image"]
    nemo = manifest["nemo_rl"] if "nemo_rl" in manifest else manifest["extra"]["nemo_rl"]
    assert nemo["checkpoint"] == "step_20" and nemo["selected_by"] == "best val:accuracy=0.6"
    assert nemo["checkpoint_format"] == CV.HF_CONSOLIDATED
    assert (
        yaml.safe_load((out / "nemo_rl_config.yaml").read_text())["checkpointing"]["metric_name"]
        == "val:accuracy"
    )
    assert (out / "resolved_config.yaml").is_file()
    saved = json.loads((out / "artifact.json").read_text())
    assert saved["type"] == "checkpoint_hf"

    # The published model loads with transformers, as the next stage will load it.
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True)

    metrics = json.loads((ctx.output("metrics") / "metrics.json").read_text())
    assert metrics["train"]["reward_mean"] == pytest.approx(0.45)  # last step, from the resumed run
    assert metrics["train"]["loss"] == pytest.approx(0.6)
    assert metrics["train"]["kl"] == pytest.approx(0.02)
    assert metrics["val"]["verifier_accuracy"] == pytest.approx(0.6)  # NeMo-RL validation/accuracy
    # Its interval, as the local engine logs it: each validation scored the 4 validation prompts
    # once (the default profile's max_val_samples and val_batch_size are 256), 0.6 x 4 -> 2 right.
    assert validation_answers(ctx, cfg) == 4
    low, high = wilson(2, 4)
    assert (metrics["val"]["verifier_accuracy_low"], metrics["val"]["verifier_accuracy_high"]) == (
        pytest.approx(low),
        pytest.approx(high),
    )
    curve = ctx.output("metrics") / "plots" / "metrics" / "val" / "verifier_accuracy_low.tsv"
    assert [line.split("\t")[0] for line in curve.read_text().splitlines()[1:]] == ["2", "4"]
    assert "timing" not in metrics  # unmapped NeMo-RL tags stay out
    assert 0.0 <= metrics["heldout"]["accuracy"] <= 1.0
    tsv = (ctx.output("metrics") / "plots" / "metrics" / "train" / "reward_mean.tsv").read_text().splitlines()
    assert tsv[0].split("\t")[:2] == ["step", "reward_mean"]
    assert [line.split("\t")[0] for line in tsv[1:]] == ["1", "2", "3", "4"]
    assert manifest["metrics"]["heldout"]["accuracy"] == metrics["heldout"]["accuracy"]

    # The held-out samples are published with the policy (evaluate reuses them when its settings
    # match), keyed by what drew them: transformers here, where there is no vLLM.
    from alignpipe.measure.heldout import SAMPLES_FILE, drawn_with, heldout_rows, sampling_key
    from alignpipe.rewards import score_completions

    settings = ctx.settings.heldout
    assert settings.backend == "vllm"  # the GPU profile's; vLLM draws them in the image
    rows = heldout_rows(ctx, settings)
    lines = [json.loads(line) for line in (out / SAMPLES_FILE).read_text().splitlines()]
    assert {line["key"] for line in lines} == {
        sampling_key(rows, drawn_with(settings, "hf"), ctx.system_prompt)
    }
    scores = score_completions(rows, [line["completion"] for line in lines])
    assert metrics["heldout"]["accuracy"] == pytest.approx(sum(scores) / len(scores))


def test_publish_megatron_keeps_the_checkpoint(repo_copy: Path, tmp_path: Path) -> None:
    compose_into(repo_copy, "default_megatron")
    write_prepared(repo_copy)
    ctx = build_context(repo_copy, "sft", "default_megatron")
    paths = RunPaths(ctx.scratch_dir)
    cfg = render_for(ctx, paths.scratch)
    assert cfg["policy"]["megatron_cfg"]["enabled"] is True
    for step, loss in ((50, 1.1), (100, 0.9)):
        d = write_step(paths.checkpoints, step, cfg, {"step": step, "val:val_loss": loss})
        it = d / "policy" / "weights" / "iter_0000000"
        it.mkdir(parents=True)
        (it / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
        (it / "run_config.yaml").write_text("model: {}\n")
        (it / "common.pt").write_bytes(b"\x00" * 16)
        (it / "__0_0.distcp").write_bytes(step.to_bytes(4, "little"))
        (d / "policy" / "tokenizer").mkdir()
        (d / "policy" / "tokenizer" / "tokenizer.json").write_text("{}")
    write_events(
        paths.logs / "exp_001", {"train/loss": [(1, 2.0), (2, 1.5)], "validation/val_loss": [(2, 0.9)]}
    )

    manifest = publish(ctx, cfg, paths, runner=_no_commands)
    out = ctx.output("policy")
    assert manifest["type"] == "checkpoint_megatron" and manifest["format"] == "megatron_bridge"
    assert (out / "policy" / "weights" / "iter_0000000" / "__0_0.distcp").read_bytes() == (100).to_bytes(
        4, "little"
    )
    assert (out / "policy" / "tokenizer" / "tokenizer.json").is_file()
    assert (out / "config.yaml").is_file()
    assert not (out / "policy" / "optimizer").exists()
    # The next stage's pretrained_checkpoint and the convert stage read this layout.
    assert CV.checkpoint_format(out) == CV.MEGATRON
    assert CV.converter_argv(out, CV.MEGATRON, tmp_path / "hf") == [
        CV.MCORE_PYTHON,  # the image's Megatron venv, not the project venv (no mcore extra there)
        CV.MEGATRON_TO_HF,
        "--config",
        str(out / "config.yaml"),
        "--megatron-ckpt-path",
        str(out / "policy" / "weights" / "iter_0000000"),
        "--hf-ckpt-path",
        str(tmp_path / "hf"),
    ]
    metrics = json.loads((ctx.output("metrics") / "metrics.json").read_text())
    assert metrics == {"train": {"loss": 1.5}, "val": {"loss": pytest.approx(0.9)}, "step": 2}


def test_converter_dispatch(tmp_path: Path) -> None:
    step = tmp_path / "step_7"
    (step / "policy" / "weights").mkdir(parents=True)
    (step / "config.yaml").write_text(yaml.safe_dump({"policy": {"dtensor_cfg": {"enabled": True}}}))
    with pytest.raises(CV.CheckpointFormatError, match="no consolidated HF dir and no DCP .metadata"):
        CV.checkpoint_format(step)
    (step / "policy" / "weights" / ".metadata").write_bytes(b"")
    assert CV.checkpoint_format(step) == CV.DCP
    assert CV.converter_argv(step, CV.DCP, tmp_path / "out") == [
        "python",
        "examples/converters/convert_dcp_to_hf.py",
        "--config",
        str(step / "config.yaml"),
        "--dcp-ckpt-path",
        str(step / "policy" / "weights"),
        "--hf-ckpt-path",
        str(tmp_path / "out"),
    ]
    assert CV.converter_argv(step, CV.HF_CONSOLIDATED, tmp_path / "out") == []
    with pytest.raises(CV.CheckpointFormatError, match="unknown checkpoint format"):
        CV.converter_argv(step, "gguf", tmp_path / "out")


def _no_commands(argv, cwd):
    raise AssertionError(f"no converter should run for this checkpoint format, got {argv}")


def test_megatron_input_to_a_dtensor_stage_is_converted_first(tmp_path: Path) -> None:
    """rm on the Megatron profile: its DTensor policy needs HF weights from the sft checkpoint_megatron."""
    from alignpipe.engines.nemo_rl.inputs import convert_megatron_inputs

    sft = tmp_path / "models" / "sft"
    (sft / "policy" / "weights" / "iter_0000000").mkdir(parents=True)
    (sft / "policy" / "tokenizer").mkdir()
    (sft / "config.yaml").write_text("policy: {megatron_cfg: {enabled: true}}\n")
    (sft / "artifact.json").write_text(json.dumps({"type": "checkpoint_megatron"}))
    cfg = {
        "policy": {
            "model_name": str(sft),
            "tokenizer": {"name": str(sft)},
            "megatron_cfg": {"enabled": False},
        }
    }
    paths = RunPaths(tmp_path / "scratch")
    calls = []

    def converter(argv, cwd):  # stands in for NeMo-RL's convert_megatron_to_hf.py (mcore, in the image)
        calls.append((list(argv), cwd))
        out = Path(argv[argv.index("--hf-ckpt-path") + 1])
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        return 0

    convert_megatron_inputs(cfg, paths, converter, Path("/opt/nemo-rl"))
    out = paths.converted / "sft"
    assert calls == [(CV.converter_argv(sft, CV.MEGATRON, out), Path("/opt/nemo-rl"))]
    assert cfg["policy"]["model_name"] == str(out)
    assert cfg["policy"]["tokenizer"]["name"] == str(sft / "policy" / "tokenizer")
    convert_megatron_inputs(
        cfg | {"policy": {**cfg["policy"], "model_name": str(sft)}}, paths, converter, Path("/x")
    )
    assert len(calls) == 1, "an existing conversion in the run's scratch dir is reused"
