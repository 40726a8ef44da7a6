"""NeMo-RL checkpoints as NeMo-RL v0.7.0 writes them, through the convert stage's path:
the project's selection and format detection, then upstream's own converter, run for real."""

from __future__ import annotations

import sys
from pathlib import Path

from alignpipe.engines.nemo_rl.checkpoints import select_checkpoint
from alignpipe.engines.nemo_rl.convert import DCP, MEGATRON, checkpoint_format, converter_argv
from tests.checkpoints import METRIC, run_upstream

pytest_plugins = ["tests.checkpoints"]


def test_selection_agrees_with_upstream_checkpoint_manager(dcp_run: dict):
    ckpt = dcp_run["checkpoint_dir"]
    best = select_checkpoint(ckpt, METRIC, higher_is_better=False)
    assert best.path == dcp_run["best"] and best.step == 2 and best.metric_value == 0.5
    assert select_checkpoint(ckpt, None).path == dcp_run["latest"] == ckpt / "step_3"
    # What NeMo-RL's DTensor policy leaves on disk, as the stage sees it.
    weights = best.path / "policy" / "weights"
    assert (weights / ".metadata").is_file() and list(weights.glob("*.distcp"))
    assert (best.path / "policy" / "optimizer" / ".metadata").is_file()
    assert checkpoint_format(best.path) == DCP


def test_dcp_export_by_upstream_converter_is_the_saved_model(
    dcp_run: dict, nemo_rl_src: Path, tmp_path: Path
):
    import torch
    from transformers import AutoModelForCausalLM

    step = select_checkpoint(dcp_run["checkpoint_dir"], METRIC, higher_is_better=False).path
    out = tmp_path / "hf"
    argv = converter_argv(step, DCP, out, python=sys.executable)
    assert argv[1] == "examples/converters/convert_dcp_to_hf.py" and (nemo_rl_src / argv[1]).is_file()
    run_upstream(nemo_rl_src, argv)

    got = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).state_dict()
    want = AutoModelForCausalLM.from_pretrained(dcp_run["model"], local_files_only=True).state_dict()
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
    assert (out / "tokenizer.json").is_file() or (out / "tokenizer_config.json").is_file()


def test_megatron_checkpoint_selected_and_converter_argv(
    megatron_run: dict, nemo_rl_src: Path, tmp_path: Path
):
    """Not run: convert_megatron_to_hf.py itself (needs Megatron-Bridge and a GPU)."""
    choice = select_checkpoint(megatron_run["checkpoint_dir"], METRIC, higher_is_better=False)
    assert choice.path == megatron_run["latest"] and choice.metric_value == 0.7
    iter_dir = choice.path / "policy" / "weights" / "iter_0000000"
    assert (iter_dir / ".metadata").is_file() and list(iter_dir.glob("*.distcp"))
    assert (iter_dir / "run_config.yaml").is_file()
    assert checkpoint_format(choice.path) == MEGATRON
    argv = converter_argv(choice.path, MEGATRON, tmp_path / "hf", hf_model_name="Qwen/Qwen3-0.6B")
    script = argv.index("examples/converters/convert_megatron_to_hf.py")
    assert (nemo_rl_src / argv[script]).is_file()
    args = argv[script + 1 :]
    assert args[args.index("--config") + 1] == str(choice.path / "config.yaml")
    assert args[args.index("--megatron-ckpt-path") + 1] == str(iter_dir)
    assert args[args.index("--hf-ckpt-path") + 1] == str(tmp_path / "hf")
