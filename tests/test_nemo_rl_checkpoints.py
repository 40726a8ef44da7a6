"""NeMo-RL checkpoints as NeMo-RL v0.7.0 writes them, through the convert stage's path:
the project's selection and format detection, then upstream's own converter, run for real."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from alignpipe.engines.nemo_rl.checkpoints import select_checkpoint
from alignpipe.engines.nemo_rl.convert import DCP, MEGATRON, checkpoint_format, converter_argv

# The checkpoints, written by NeMo-RL's own code. ``dcp_run`` is a ``checkpoint_dir`` written the
# way the DTensor (V1) policy does it during SFT: ``CheckpointManager`` (``init_tmp_checkpoint`` ->
# ``training_info.json`` + ``config.yaml``), then ``native_checkpoint.save_checkpoint``
# (``policy/weights`` and ``policy/optimizer`` as torch DCP, ``policy/tokenizer``),
# ``train_dataloader.pt``, then ``finalize_checkpoint`` (``tmp_step_N`` -> ``step_N``). The
# upstream code runs in a subprocess with the vendored source on ``PYTHONPATH``, so this
# session's imports stay clean. Read only.

# Two saved steps; step 2 has the better (lower) val loss, step 3 is the latest.
VAL_LOSS = {2: 0.5, 3: 0.9}
METRIC = "val:val_loss"

_WRITE_DCP_RUN = r"""
import json, os, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from nemo_rl.utils.checkpoint import CheckpointManager
from nemo_rl.utils.native_checkpoint import save_checkpoint

model_dir, ckpt_dir, val_loss = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
cfg = {"checkpoint_dir": ckpt_dir, "metric_name": "val:val_loss", "higher_is_better": False,
       "keep_top_k": 3, "save_optimizer": True, "enabled": True, "save_period": 1}
master = {"policy": {"model_name": model_dir, "tokenizer": {"name": model_dir},
                     "dtensor_cfg": {"enabled": True, "_v2": False}, "megatron_cfg": {"enabled": False}},
          "checkpointing": cfg}
# init_tmp_checkpoint dumps run_config.model_dump(); sft's MasterConfig is a pydantic model with extra="allow".
from pydantic import BaseModel
class RunConfig(BaseModel, extra="allow"):
    pass
master = RunConfig(**master)
manager = CheckpointManager(cfg)
for step, loss in sorted((int(k), v) for k, v in val_loss.items()):
    info = {"epoch": 0, "step": step, "total_steps": step, "consumed_samples": 4 * step,
            "total_valid_tokens": 100 * step, "val:val_loss": loss}
    path = manager.init_tmp_checkpoint(step, info, master)
    save_checkpoint(model, os.path.join(path, "policy", "weights"), optimizer=optimizer,
                    optimizer_path=os.path.join(path, "policy", "optimizer"), tokenizer=tokenizer,
                    tokenizer_path=os.path.join(path, "policy", "tokenizer"))
    torch.save({"sampler": step}, os.path.join(path, "train_dataloader.pt"))
    manager.finalize_checkpoint(path)
print(json.dumps({"best": manager.get_best_checkpoint_path(), "latest": manager.get_latest_checkpoint_path()}))
"""


def upstream_env(src: Path) -> dict:
    return {**os.environ, "PYTHONPATH": str(src), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def run_upstream(src: Path, argv: list[str], timeout: float = 600) -> str:
    """Run NeMo-RL code from ``src`` (cwd = the checkout, as the stage does); return stdout."""
    proc = subprocess.run(
        argv, cwd=src, env=upstream_env(src), capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, (
        f"{argv[:2]} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return proc.stdout


@pytest.fixture(scope="session")
def tiny_hf_model(tmp_path_factory) -> Path:
    """A tiny HF Llama + char tokenizer saved with save_pretrained (the run's ``policy.model_name``)."""
    from alignpipe.tiny import build_causal_lm, train_tokenizer

    tokenizer = train_tokenizer(["sort:3142 -> 1234", "add:2+3 = 5"], "char")
    model = build_causal_lm(
        tokenizer,
        {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4},
        seed=7,
    )
    out = tmp_path_factory.mktemp("tiny_hf") / "model"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def dcp_run(nemo_rl_src: Path, tiny_hf_model: Path, tmp_path_factory) -> dict:
    """``{"checkpoint_dir", "model", "best", "latest"}``: a DTensor run's checkpoints, by NeMo-RL."""
    ckpt_dir = tmp_path_factory.mktemp("dcp_run") / "checkpoints"
    out = run_upstream(
        nemo_rl_src,
        [sys.executable, "-c", _WRITE_DCP_RUN, str(tiny_hf_model), str(ckpt_dir), json.dumps(VAL_LOSS)],
    )
    picked = json.loads(out.strip().splitlines()[-1])
    return {"checkpoint_dir": ckpt_dir, "model": tiny_hf_model, **{k: Path(v) for k, v in picked.items()}}


# megatron-core's dist_checkpointing on CPU: it asks torch.cuda for a device and a sync point
# only; "cpu" and a no-op stand in. The layout is Megatron-Bridge's: weights/iter_0000000/
# (torch_dist shards + run_config.yaml) and weights/latest_checkpointed_iteration.txt.
_WRITE_MEGATRON_RUN = r"""
import json, os, sys, torch, yaml
import torch.distributed as dist

def main():
    ckpt_dir = sys.argv[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    from pydantic import BaseModel
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor
    from nemo_rl.utils.checkpoint import CheckpointManager

    class RunConfig(BaseModel, extra="allow"):
        pass

    cfg = {"checkpoint_dir": ckpt_dir, "metric_name": "val:val_loss", "higher_is_better": False,
           "keep_top_k": 3, "save_optimizer": False, "enabled": True, "save_period": 1}
    master = RunConfig(policy={"model_name": "tiny", "tokenizer": {"name": "tiny"},
                               "megatron_cfg": {"enabled": True}, "dtensor_cfg": {"enabled": False}},
                       checkpointing=cfg)
    manager = CheckpointManager(cfg)
    path = manager.init_tmp_checkpoint(1, {"step": 1, "val:val_loss": 0.7}, master)
    weights = os.path.join(path, "policy", "weights")
    iter_dir = os.path.join(weights, "iter_0000000")
    os.makedirs(iter_dir)
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    sd = {"embedding.word_embeddings.weight": ShardedTensor.from_rank_offsets(
        "embedding.word_embeddings.weight", w, replica_id=0)}
    dist_checkpointing.save(sd, iter_dir)
    with open(os.path.join(iter_dir, "run_config.yaml"), "w") as f:
        yaml.safe_dump({"model": {"num_layers": 1, "hidden_size": 4}, "checkpoint": {"save": weights}}, f)
    with open(os.path.join(weights, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("0")
    manager.finalize_checkpoint(path)
    print(json.dumps({"latest": manager.get_latest_checkpoint_path()}))

if __name__ == "__main__":
    main()
"""


@pytest.fixture(scope="session")
def megatron_run(nemo_rl_src: Path, tmp_path_factory) -> dict:
    """``{"checkpoint_dir", "latest"}``: a Megatron-backend run's checkpoint (megatron-core + NeMo-RL)."""
    import socket

    tmp = tmp_path_factory.mktemp("megatron_run")
    script = tmp / "write_megatron_run.py"  # a file: dist_checkpointing's workers re-import __main__
    script.write_text(_WRITE_MEGATRON_RUN)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = run_upstream(nemo_rl_src, [sys.executable, str(script), str(tmp / "checkpoints"), str(port)])
    picked = json.loads(out.strip().splitlines()[-1])
    return {"checkpoint_dir": tmp / "checkpoints", "latest": Path(picked["latest"])}


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
