"""NeMo-RL checkpoints as NeMo-RL v0.7.0 writes them, through the convert stage's path:
the project's selection and format detection, then upstream's own converter, run for real."""

from __future__ import annotations

import sys
from pathlib import Path

from alignpipe.engines.nemo_rl.checkpoints import select_checkpoint
from alignpipe.engines.nemo_rl.convert import DCP, checkpoint_format, converter_argv
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
