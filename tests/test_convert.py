"""Stage ``convert``: a policy checkpoint becomes a verified, self-describing Hugging Face export."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from alignpipe.artifacts import dvc_hash
from tests.conftest import run_cli, set_params, writable_copy


def logits(model_dir: Path, text: str = "sort:3142"):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()
    ids = tok.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        return model(**ids).logits.float(), model


@pytest.mark.slow
def test_convert_exports_the_same_model_with_card_and_lineage(trained_sft: Path, tmp_path: Path):
    root = writable_copy(trained_sft, tmp_path / "repo")
    run_cli(root, "run", "convert", "--source", "sft")
    export = root / "exports" / "sft"
    for name in (
        "model.safetensors",
        "tokenizer.json",
        "generation_config.json",
        "README.md",
        "artifact.json",
        "resolved_config.yaml",
        "training_config.yaml",
    ):
        assert (export / name).is_file(), name
    assert not list(export.glob("*.bin")), "weights must be safetensors"

    # Loads offline and is the same function as the source checkpoint.
    got, _ = logits(export)
    want, _ = logits(root / "models" / "sft")
    assert (got - want).abs().max().item() == 0.0

    manifest = json.loads((export / "artifact.json").read_text())
    source_hash = dvc_hash(root / "models" / "sft")
    assert manifest["inputs"]["checkpoint"] == {"path": "models/sft", "hash": source_hash}
    assert manifest["source"]["stage"] == "sft" and manifest["source"]["engine"] == "local"
    assert manifest["verification"]["max_abs_logit_diff"] == 0.0
    assert manifest["verification"]["greedy_matches_source"] == 1.0
    assert (
        manifest["metrics"]["heldout/accuracy"]
        == json.loads((root / "models" / "sft" / "artifact.json").read_text())["metrics"]["heldout/accuracy"]
    )

    card = (export / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: transformers")
    assert source_hash in card
    for entry in manifest["source"]["inputs"].values():  # the sft stage's own inputs: data, base model
        assert entry["hash"] in card
    # The producing stage's held-out accuracy, with its 95% interval.
    sft = json.loads((root / "results" / "sft" / "metrics.json").read_text())["heldout"]
    bounds = sft["intervals"]["accuracy"]
    assert (
        f"| `heldout/accuracy` | {sft['accuracy']:.4g} [{bounds['low']:.4g}, {bounds['high']:.4g}] |" in card
    )
    assert "intervals" not in card  # the bounds are shown beside their figure, not as rows
    # The producing stage's resolved config travels with the export.
    assert (export / "training_config.yaml").read_text() == (
        root / "models" / "sft" / "resolved_config.yaml"
    ).read_text()
    gen = json.loads((export / "generation_config.json").read_text())
    assert gen["eos_token_id"] is not None and gen["pad_token_id"] is not None


@pytest.mark.slow
def test_convert_casts_dtype_on_request(trained_sft: Path, tmp_path: Path):
    import torch

    root = writable_copy(trained_sft, tmp_path / "repo")
    set_params(root, {"convert": {"alignpipe": {"export": {"dtype": "bfloat16"}}}})
    run_cli(root, "run", "convert", "--source", "sft")
    export = root / "exports" / "sft"
    from safetensors import safe_open

    with safe_open(export / "model.safetensors", "pt") as f:
        dtypes = {f.get_tensor(k).dtype for k in f.keys()}
    assert dtypes == {torch.bfloat16}
    got, model = logits(export)
    assert model.dtype == torch.bfloat16 and torch.isfinite(got).all()
    manifest = json.loads((export / "artifact.json").read_text())
    assert manifest["dtype"] == "bfloat16"
    assert (
        yaml.safe_load((export / "resolved_config.yaml").read_text())["alignpipe"]["export"]["dtype"]
        == "bfloat16"
    )


def fake_nemo_rl_checkpoint(root: Path, name: str, fmt: str = "dcp") -> Path:
    """A NeMo-RL step_N layout as the nemo_rl engine publishes it (config.yaml, policy/weights/...)."""
    src = root / "models" / name
    weights = src / "policy" / "weights"
    megatron = fmt == "megatron_bridge"
    if megatron:
        (weights / "iter_0000000").mkdir(parents=True)
        (weights / "iter_0000000" / "metadata.json").write_text("{}")
    else:
        weights.mkdir(parents=True)
        (weights / ".metadata").write_bytes(b"")
    policy = {"model_name": "meta-llama/Llama-3.2-1B-Instruct", "megatron_cfg": {"enabled": megatron}}
    (src / "config.yaml").write_text(yaml.safe_dump({"policy": policy}))
    (src / "artifact.json").write_text(
        json.dumps(
            {
                "type": "checkpoint_hf",
                "format": fmt,
                "stage": name,
                "engine": "nemo_rl",
                "inputs": {},
                "metrics": {},
            }
        )
    )
    return src


@pytest.mark.parametrize(
    ("fmt", "command"),
    [
        (
            "dcp",
            "/opt/nemo-rl/examples/converters/convert_dcp_to_hf.py --config {src}/config.yaml "
            "--dcp-ckpt-path {src}/policy/weights --hf-ckpt-path",
        ),
        (
            "megatron_bridge",
            "/opt/nemo-rl/examples/converters/convert_megatron_to_hf.py --config {src}/config.yaml "
            "--megatron-ckpt-path {src}/policy/weights/iter_0000000 --hf-ckpt-path",
        ),
    ],
)
def test_nemo_rl_checkpoint_goes_through_its_converter_and_is_refused_outside_the_container(
    repo_copy: Path, fmt: str, command: str
):
    src = fake_nemo_rl_checkpoint(repo_copy, "dpo", fmt)
    (repo_copy / "data" / "prepared" / "rlvr").mkdir(parents=True)
    (repo_copy / "data" / "prepared" / "rlvr" / "test.jsonl").write_text(
        '{"prompt": "sort:21", "answer": "12"}\n'
    )

    plan = run_cli(repo_copy, "plan", "convert", "--source", "dpo").stdout
    assert command.format(src=src.resolve()) in plan

    result = run_cli(repo_copy, "run", "convert", "--source", "dpo", check=False)
    assert result.returncode == 2
    assert "holds a NeMo-RL checkpoint" in result.stderr and "runtime.engine=nemo_rl" in result.stderr
    assert not (repo_copy / "exports" / "dpo").exists()


def test_convert_errors_name_what_is_wrong(repo_copy: Path):
    result = run_cli(repo_copy, "run", "convert", check=False)
    assert result.returncode == 2 and "needs --source" in result.stderr
    result = run_cli(repo_copy, "run", "convert", "--source", "dpo", check=False)
    assert result.returncode == 2 and "models/dpo/artifact.json is missing" in result.stderr
    fake_nemo_rl_checkpoint(repo_copy, "dpo", fmt="hf")
    set_params(repo_copy, {"convert": {"alignpipe": {"export": {"dtype": "int8"}}}})
    result = run_cli(repo_copy, "run", "convert", "--source", "dpo", check=False)
    assert result.returncode == 2
    assert (
        "params.yaml 'convert.alignpipe.export.dtype' (over stages/convert/config/tiny.yaml): "
        "'alignpipe.export.dtype' is 'int8'; expected one of float32, bfloat16, float16, null"
    ) in result.stderr
