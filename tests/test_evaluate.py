"""Stage ``evaluate``: every policy on the same held-out samples; the report flags reward hacking."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from alignpipe.engines.local.evaluate import flag_reward_hacking
from alignpipe.errors import ConfigError
from alignpipe.measure.heldout import SAMPLES_FILE, heldout_completions, sampling_backend
from alignpipe.measure.logprobs import load_policy
from alignpipe.report import comparison_chart, markdown_table
from tests.conftest import run_cli, set_params, writable_copy

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def sample_metrics() -> dict:
    policies = {
        "sft": {"heldout_accuracy": 0.40, "rm_score": 0.10, "mean_length": 6.0, "kl_to_sft": 0.0},
        "dpo": {"heldout_accuracy": 0.45, "rm_score": 0.30, "mean_length": 6.2, "kl_to_sft": 0.05},
        "rlvr": {"heldout_accuracy": 0.60, "rm_score": 0.05, "mean_length": 5.5, "kl_to_sft": 0.12},
        "rlhf": {"heldout_accuracy": 0.30, "rm_score": 0.90, "mean_length": 9.0, "kl_to_sft": 0.40},
    }
    return {
        "policies": policies,
        "reference": "sft",
        "reward_model": "models/rm",
        "heldout": {
            "prompts": 300,
            "data_path": "data/prepared/rlvr/test.jsonl",
            "seed": 1234,
            "temperature": 1.0,
            "max_new_tokens": 12,
        },
    }


def test_reward_hacking_is_rm_up_and_accuracy_down_relative_to_sft():
    metrics = sample_metrics()
    flag_reward_hacking(metrics["policies"], "sft")
    flags = {name: m["suspected_reward_hacking"] for name, m in metrics["policies"].items()}
    # dpo: both up (fine); rlvr: accuracy up, RM down (fine); rlhf: RM up, accuracy down (hacking).
    assert flags == {"sft": False, "dpo": False, "rlvr": False, "rlhf": True}
    # Sampling noise is not hacking: one prompt's worth of accuracy lost is inside the margin.
    metrics["policies"]["rlhf"]["heldout_accuracy"] = 0.40 - 1 / 300
    flag_reward_hacking(metrics["policies"], "sft", accuracy_drop=0.02)
    assert not metrics["policies"]["rlhf"]["suspected_reward_hacking"]


def test_report_table_and_chart_show_every_policy_and_the_flag(tmp_path: Path):
    metrics = sample_metrics()
    flag_reward_hacking(metrics["policies"], "sft")
    table = markdown_table(metrics)
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    assert [r.split("`")[1] for r in rows] == ["sft", "dpo", "rlvr", "rlhf"]
    rlhf = next(r for r in rows if r.startswith("| `rlhf`"))
    assert "30.0%" in rlhf and "+0.900" in rlhf and "**suspected reward hacking**" in rlhf
    assert "reward hacking" not in next(r for r in rows if r.startswith("| `dpo`"))

    png = comparison_chart(metrics, tmp_path / "comparison.png")
    data = png.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 20_000  # a real multi-panel chart, not an empty canvas


def test_benchmark_scores_become_columns_and_a_drop_beyond_max_drop_is_flagged(tmp_path: Path):
    from alignpipe.measure.benchmarks import regressions

    metrics = sample_metrics()
    scores = {"sft": 0.50, "dpo": 0.47, "rlvr": 0.44, "rlhf": 0.20}
    for name, value in scores.items():
        metrics["policies"][name]["benchmarks"] = {"heldout_exact": {"exact_match": value}}
    ref = metrics["policies"]["sft"]["benchmarks"]
    for m in metrics["policies"].values():
        m["benchmark_regressions"] = regressions(m["benchmarks"], ref, {"heldout_exact": 0.05})
    assert [n for n, m in metrics["policies"].items() if m["benchmark_regressions"]] == ["rlvr", "rlhf"]
    metrics["benchmarks"] = {"results": "results/benchmark", "max_drop": {"heldout_exact": 0.05}}
    table = markdown_table(metrics)
    assert "| heldout_exact exact_match | flags |" in table
    rlhf = next(r for r in table.splitlines() if r.startswith("| `rlhf`"))
    assert (
        "20.0%" in rlhf and "**benchmark regression**: heldout_exact/exact_match 0.200 < 0.500 - 0.05" in rlhf
    )
    assert "regression" not in next(r for r in table.splitlines() if r.startswith("| `dpo`"))
    png = comparison_chart(metrics, tmp_path / "comparison.png")
    assert png.read_bytes().startswith(PNG_MAGIC)


@pytest.mark.slow
def test_evaluate_compares_policies_on_shared_samples(trained_sft: Path, tmp_path: Path):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    root = writable_copy(trained_sft, tmp_path / "repo")
    run_cli(root, "run", "convert", "--source", "sft")  # an export identical to models/sft
    # A real (untrained) reward model on the SFT body: the rm stage's architecture, seeded head.
    torch.manual_seed(0)
    rm = AutoModelForSequenceClassification.from_pretrained(
        root / "models/sft", num_labels=1, local_files_only=True
    )
    tok = AutoTokenizer.from_pretrained(root / "models/sft", local_files_only=True)
    rm.config.pad_token_id = tok.pad_token_id
    rm.save_pretrained(root / "models/rm_eval")
    tok.save_pretrained(root / "models/rm_eval")

    params = (root / "params.yaml").read_text()
    policies = [
        {"name": "sft", "path": "models/sft"},
        {"name": "export", "path": "exports/sft"},
        {"name": "base", "path": "models/base"},
    ]
    try:
        set_params(
            root,
            {
                "evaluate": {
                    "alignpipe": {
                        "evaluate": {
                            "policies": policies,
                            "reward_model": "models/rm_eval",
                            "benchmarks": None,
                        }
                    }
                }
            },
        )
        outcome = run_cli(root, "run", "evaluate").stdout
    finally:
        (root / "params.yaml").write_text(params)

    out = root / "results/evaluate"
    metrics = json.loads((out / "metrics.json").read_text())
    got = metrics["policies"]
    assert set(got) == {"sft", "export", "base"}
    for m in got.values():
        assert {
            "heldout_accuracy",
            "rm_score",
            "mean_length",
            "kl_to_sft",
            "suspected_reward_hacking",
        } <= set(m)
    # The same accuracy definition as the sft stage's own heldout/accuracy (same seeded samples).
    sft_stage = json.loads((root / "results/sft/metrics.json").read_text())
    assert got["sft"]["heldout_accuracy"] == pytest.approx(sft_stage["heldout"]["accuracy"])
    # KL: zero to itself, ~zero for the byte-identical export, clearly positive for the untrained base.
    assert got["sft"]["kl_to_sft"] == 0.0
    assert got["export"]["kl_to_sft"] < 1e-6
    assert got["export"]["heldout_accuracy"] == got["sft"]["heldout_accuracy"]
    assert got["base"]["kl_to_sft"] > 0.1
    assert got["base"]["heldout_accuracy"] <= got["sft"]["heldout_accuracy"]

    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    n = metrics["heldout"]["prompts"]
    assert len(samples) == 3 * n
    sft_samples = [s for s in samples if s["policy"] == "sft"]
    assert sum(s["correct"] for s in sft_samples) / n == pytest.approx(got["sft"]["heldout_accuracy"])
    assert sum(s["rm_score"] for s in sft_samples) / n == pytest.approx(got["sft"]["rm_score"])

    # Each policy is sampled once: sft's samples came with models/sft (drawn by the sft stage)
    # and with its unchanged export; only base, which carries none, was sampled here. They are
    # exactly what sampling the model again gives.
    assert "samples reused 2/3" in outcome
    published = [json.loads(line) for line in (root / "models/sft" / SAMPLES_FILE).read_text().splitlines()]
    assert [s["completion"] for s in sft_samples] == [p["completion"] for p in published]
    # The thread count the sft stage sampled with: another count changes float sums, hence samples.
    sft_config = yaml.safe_load((root / "models/sft/resolved_config.yaml").read_text())
    torch.set_num_threads(sft_config["alignpipe"]["torch_threads"])
    model, tok = load_policy(root / "models/sft")
    rows = [json.loads(line) for line in (root / metrics["heldout"]["data_path"]).read_text().splitlines()]
    settings = yaml.safe_load((root / "results/evaluate/resolved_config.yaml").read_text())["alignpipe"][
        "heldout"
    ]
    assert heldout_completions(model, tok, rows, settings) == [p["completion"] for p in published]

    report = (out / "report.md").read_text()
    assert all(f"| `{name}` |" in report for name in got)
    assert (out / "comparison.png").read_bytes().startswith(PNG_MAGIC)
    assert json.loads((out / "artifact.json").read_text())["type"] == "report"


# ----------------------------------------------------------------------------- GPU profiles


@pytest.mark.parametrize("profile", ["default", "default_megatron", "nemo_gym"])
def test_gpu_evaluate_samples_with_vllm_in_the_image(repo_copy: Path, profile: str):
    """On the GPU profiles evaluate runs inside the pinned image through the NeMo-RL engine's
    launcher, GPUs attached, and vLLM draws with the trainers' held-out sampling settings."""
    from alignpipe.context import build_context
    from alignpipe.measure.generation import VLLM_ENGINE_KEYS

    out = repo_copy / "plan"
    run_cli(repo_copy, "plan", "evaluate", "--profile", profile, "--write", str(out))
    launch = (out / "evaluate.launch.sh").read_text().splitlines()[-1]
    assert launch.startswith("docker run --rm --init") and "--gpus all" in launch
    assert launch.endswith(f"alignpipe-nemo-rl:v0.7.0 alignpipe run evaluate --inner --profile {profile}")
    call = json.loads((out / "evaluate.vllm.json").read_text())
    assert set(call["llm"]) - {"seed"} <= set(VLLM_ENGINE_KEYS) and call["llm"]["tensor_parallel_size"] == 1
    trainer = build_context(repo_copy, "sft", profile).config["alignpipe"]["heldout"]
    assert call["sampling"] == {k: trainer[k] for k in ("max_new_tokens", "temperature", "top_p", "seed")}
    assert call["policies"] == ["models/sft", "exports/dpo", "exports/rlvr", "exports/rlhf"]


def test_vllm_sampling_without_a_container_or_with_bad_settings_is_refused(repo_copy: Path):
    set_params(repo_copy, {"evaluate": {"alignpipe": {"heldout": {"backend": "vllm"}}}})
    result = run_cli(repo_copy, "run", "evaluate", check=False)
    assert (
        result.returncode == 2
        and "alignpipe.heldout.backend is vllm, but vLLM is not installed here" in result.stderr
    )
    result = run_cli(repo_copy, "run", "evaluate", "--inner", check=False)
    assert result.returncode == 2 and "runtime.image must be the pipeline's NeMo-RL image" in result.stderr
    with pytest.raises(ConfigError, match=r"alignpipe.heldout.vllm: unknown keys \['tp'\]"):
        sampling_backend({"backend": "vllm", "vllm": {"tp": 2}})
    assert not (repo_copy / "results" / "evaluate" / "metrics.json").exists()


def test_samples_are_keyed_by_the_backend_that_drew_them():
    """vLLM's draws are not transformers' (another RNG): a vLLM evaluate never reuses the samples
    a trainer drew with transformers, while hf keys stay what they were (the committed lock)."""
    from alignpipe.measure.heldout import sampling_key

    rows = [{"id": "a", "prompt": "sort 21"}]
    settings = {"max_new_tokens": 12, "temperature": 1.0, "top_p": 1.0, "batch_size": 128, "seed": 1234}
    hf = sampling_key(rows, settings)
    assert sampling_key(rows, {**settings, "backend": "hf"}) == hf
    assert sampling_key(rows, {**settings, "backend": "vllm"}) != hf


def test_without_vllm_a_vllm_setting_reads_and_draws_with_transformers(trained_sft: Path):
    """The local engine's trainers on a GPU profile (heldout.backend vllm, no vLLM on the host)
    keep drawing with transformers, so the SFT reference's published samples are reused."""
    from alignpipe.config import compose_params_text
    from alignpipe.context import build_context
    from alignpipe.measure.heldout import drawing_backend, published_samples, sample_heldout

    params = yaml.safe_load(compose_params_text(trained_sft, ["profile=default", "runtime.engine=local"]))
    # the held-out settings models/sft was published with (tiny's), under the GPU profile's backend
    params["rlvr"].setdefault("alignpipe", {}).setdefault("heldout", {}).update(
        limit=None, max_new_tokens=12, batch_size=128
    )
    ctx = build_context(trained_sft, "rlvr", "default", params=params)
    settings = ctx.config["alignpipe"]["heldout"]
    assert settings["backend"] == "vllm" and drawing_backend(settings) == "hf"
    assert published_samples(ctx, trained_sft / "models" / "sft") is not None
    assert sample_heldout(ctx, None, None, model_dir=trained_sft / "models" / "sft").reused
