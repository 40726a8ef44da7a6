"""The SFT warm start trains for real, records lineage, and resumes after being killed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from alignpipe.artifacts import dvc_hash, read_manifest
from alignpipe.measure.intervals import wilson
from alignpipe.rewards.verifiers import score_completion
from tests.conftest import run_cli, set_params


def tsv_values(path: Path) -> list[float]:
    lines = path.read_text().splitlines()[1:]
    return [float(line.split("\t")[-1]) for line in lines]


def test_sft_trains_reloads_and_records_lineage(trained_sft):
    from transformers import AutoModelForCausalLM

    policy = trained_sft / "models" / "sft"
    AutoModelForCausalLM.from_pretrained(policy, local_files_only=True)
    base = load_file(trained_sft / "models" / "base" / "model.safetensors")
    tuned = load_file(policy / "model.safetensors")
    changed = [k for k in base if not (base[k] == tuned[k]).all()]
    assert len(changed) == len(base), "every parameter tensor should have moved"

    loss = tsv_values(trained_sft / "results" / "sft" / "plots" / "metrics" / "train" / "loss.tsv")
    assert loss[-1] < loss[0] * 0.8, f"training loss did not fall: {loss[0]} -> {loss[-1]}"

    metrics = json.loads((trained_sft / "results" / "sft" / "metrics.json").read_text())
    # Each held-out accuracy with its 95% Wilson interval over the prompts it was measured on,
    # recounted here from the published samples and each row's verifier.
    held = metrics["heldout"]
    rows = {r["id"]: r for r in map(json.loads, (trained_sft / "data/prepared/rlvr/test.jsonl").open())}
    samples = [json.loads(line) for line in (policy / "heldout_samples.jsonl").open()]
    verdicts: dict[str, list[float]] = {}
    for sample in samples:
        row = rows[sample["id"]]
        score = score_completion(row, sample["completion"])
        for name in ("accuracy", f"accuracy_{row['task']}"):
            verdicts.setdefault(name, []).append(score)
    assert set(held["intervals"]) == set(verdicts) and len(verdicts) > 2, held
    for name, scores in verdicts.items():
        assert held[name] == pytest.approx(sum(scores) / len(scores)), name
        low, high = wilson(sum(scores), len(scores))
        assert held["intervals"][name] == {"low": pytest.approx(low), "high": pytest.approx(high)}, name
    assert (
        0.0 < held["intervals"]["accuracy"]["low"] < held["accuracy"] < held["intervals"]["accuracy"]["high"]
    )
    manifest = read_manifest(policy)
    assert manifest["type"] == "checkpoint_hf" and manifest["engine"] == "local"
    assert manifest["inputs"]["base_model"]["hash"] == dvc_hash(trained_sft / "models" / "base")
    assert manifest["inputs"]["data"]["hash"] == dvc_hash(trained_sft / "data" / "prepared")
    assert "max_num_steps: 40" in (policy / "resolved_config.yaml").read_text()


def test_sft_can_import_an_existing_checkpoint_instead_of_training(repo_copy):
    env = {}
    run_cli(repo_copy, "run", "prep", env=env)
    run_cli(repo_copy, "run", "base", env=env)
    set_params(repo_copy, {"sft": {"alignpipe": {"import_checkpoint": "models/base"}}})
    run_cli(repo_copy, "run", "sft", env=env)
    base = load_file(repo_copy / "models" / "base" / "model.safetensors")
    imported = load_file(repo_copy / "models" / "sft" / "model.safetensors")
    assert all((base[k] == imported[k]).all() for k in base)
    metrics = json.loads((repo_copy / "results" / "sft" / "metrics.json").read_text())
    assert "heldout" in metrics and "train" not in metrics  # evaluated, not trained
