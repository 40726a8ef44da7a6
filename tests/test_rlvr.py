"""The rlvr stage end to end on the tiny profile: GRPO moves the policy and its metrics."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from tests.conftest import run_cli, set_params, writable_copy

pytestmark = pytest.mark.slow

# Short, fast GRPO. The 40-step SFT policy of `trained_sft` rarely answers correctly, so the
# verifier alone gives almost no signal; a length penalty (alignpipe.reward_shaping) adds a
# dense one, which GRPO must learn within a few steps: shorter answers, higher reward.
FAST_RLVR = {
    "grpo": {"num_prompts_per_step": 8, "num_generations_per_prompt": 4, "max_num_steps": 14},
    "policy": {
        "train_global_batch_size": 32,
        "train_micro_batch_size": 32,
        "optimizer": {"kwargs": {"lr": 2.0e-3}},
    },
    "loss_fn": {"reference_policy_kl_penalty": 0.01},
    "alignpipe": {"reward_shaping": {"length_penalty": 0.25, "target_length": 1, "length_unit": "tokens"}},
}


def curve(root: Path, stage: str, name: str) -> list[float]:
    path = root / "results" / stage / "plots" / "metrics" / f"{name}.tsv"
    with path.open() as f:
        return [float(row[name.split("/")[-1]]) for row in csv.DictReader(f, delimiter="\t")]


@pytest.fixture(scope="module")
def rlvr_repo(tiny_pipeline) -> Path:
    """The committed profile's RLVR policy (25 GRPO steps from the 250-step SFT policy), trained
    once per session by the shared ``tiny_pipeline``."""
    return tiny_pipeline.root


def test_a_shaped_reward_is_what_grpo_learns(trained_sft, tmp_path):
    """The smallest run that shows reward shaping reaching the trainer: from the 40-step SFT
    policy, which rarely answers correctly, a length penalty is the only dense signal, and GRPO
    must follow it within a few steps: shorter answers, higher reward."""
    root = writable_copy(trained_sft, tmp_path / "repo")
    set_params(root, {"rlvr": FAST_RLVR})
    run_cli(root, "run", "rlvr", env={"ALIGNPIPE_SCRATCH": str(tmp_path / "scratch")})
    reward = curve(root, "rlvr", "train/reward_mean")
    length = curve(root, "rlvr", "train/response_length_mean")
    assert len(reward) == FAST_RLVR["grpo"]["max_num_steps"]  # one point per GRPO step
    first, last = sum(reward[:3]) / 3, sum(reward[-3:]) / 3
    assert last > first, reward
    assert sum(length[-3:]) / 3 < sum(length[:3]) / 3, length
    kl = curve(root, "rlvr", "train/kl")
    assert kl[-1] > 0  # beta > 0: the policy drifted from the reference and it is measured


def test_verifiable_rewards_raise_heldout_accuracy_over_sft(rlvr_repo):
    """On the same 300 held-out prompts as the SFT reference (measured +15 and +22 points on two
    CPU kinds; a 95% interval on the difference is about +-7 points)."""
    held = json.loads((rlvr_repo / "results/rlvr/metrics.json").read_text())["heldout"]
    assert held["accuracy"] >= held["accuracy_reference"] + 0.08, held
    sft = json.loads((rlvr_repo / "results/sft/metrics.json").read_text())["heldout"]["accuracy"]
    assert held["accuracy_reference"] == sft  # the reference is the SFT policy's own measure, reused
    assert curve(rlvr_repo, "rlvr", "train/kl")[-1] > 0  # beta > 0: the drift is measured


def steps(root: Path, stage: str, name: str) -> list[int]:
    path = root / "results" / stage / "plots" / "metrics" / f"{name}.tsv"
    with path.open() as f:
        return [int(row["step"]) for row in csv.DictReader(f, delimiter="\t")]


def test_the_learning_curve_is_validation_accuracy_with_its_interval(rlvr_repo):
    """The committed profile validates at the start, every 10 GRPO steps and at the end, each
    of the 200 validation prompts sampled once: accuracy rises from the SFT policy's, and each
    point carries its 95% Wilson interval over those 200 answers."""
    from alignpipe.measure.intervals import wilson

    accuracy = curve(rlvr_repo, "rlvr", "val/verifier_accuracy")
    low, high = (
        curve(rlvr_repo, "rlvr", "val/verifier_accuracy_low"),
        curve(rlvr_repo, "rlvr", "val/verifier_accuracy_high"),
    )
    at = steps(rlvr_repo, "rlvr", "val/verifier_accuracy")
    per_grpo_step = at[1] // 10
    assert at == [s * per_grpo_step for s in (0, 10, 20, 25)], at  # start, every 10 GRPO steps, end
    for a, lo, hi in zip(accuracy, low, high, strict=True):
        assert abs(a * 200 - round(a * 200)) < 1e-4  # a share of the 200 answers (DVCLive keeps float32)
        assert (lo, hi) == pytest.approx(wilson(round(a * 200), 200))
    assert accuracy[-1] > high[0], (accuracy, high)  # the gain is beyond step 0's interval


def test_validation_leaves_the_trained_policy_unchanged(trained_sft, tmp_path):
    """Validation samples from its own copy of the random state: the same GRPO run with
    validation every 2 steps and without it publishes the same weights; the zero-reward guard
    watches rollouts only."""
    short = {
        "grpo": {"num_prompts_per_step": 8, "num_generations_per_prompt": 4, "max_num_steps": 4},
        "policy": {"train_global_batch_size": 32, "train_micro_batch_size": 32},
    }
    runs = {}
    for name, val in (("on", {"val_period": 2, "val_at_start": True}), ("off", {"val_period": 0})):
        root = writable_copy(trained_sft, tmp_path / name / "repo")
        set_params(root, {"rlvr": {**short, "grpo": {**short["grpo"], **val}}})
        run_cli(root, "run", "rlvr", env={"ALIGNPIPE_SCRATCH": str(tmp_path / name / "scratch")})
        runs[name] = root
    weights = [(r / "models/rlvr/model.safetensors").read_bytes() for r in runs.values()]
    assert weights[0] == weights[1]
    assert steps(runs["on"], "rlvr", "val/verifier_accuracy") == [0, 2, 4]
    assert not (runs["off"] / "results/rlvr/plots/metrics/val").exists()


def test_logged_reward_std_is_exactly_rounded(rlvr_repo):
    """Each step's reward_std is the sample std of its 0/1 verifier rewards to double precision.
    TRL's own went through torch.sqrt in float32, which the CPU's approximate reciprocal square
    root leaves 1 ULP off on about one value in seven, differently on Intel and AMD CPUs: the
    logged curve then differed between them while every model matched."""
    import statistics

    import yaml

    grpo = yaml.safe_load((rlvr_repo / "params.yaml").read_text())["rlvr"]["grpo"]
    n = grpo["num_prompts_per_step"] * grpo["num_generations_per_prompt"]
    means, stds = curve(rlvr_repo, "rlvr", "train/reward_mean"), curve(rlvr_repo, "rlvr", "train/reward_std")
    assert len(means) == len(stds) == grpo["max_num_steps"]
    for mean, std in zip(means, stds, strict=True):
        right = round(mean * n)
        assert mean == pytest.approx(right / n, abs=1e-7)  # 0/1 rewards: a count of right answers
        assert std == pytest.approx(statistics.stdev([1.0] * right + [0.0] * (n - right)), rel=1e-12)


# What an operator reads off every GRPO stage's results/<stage>/metrics.json "train" section.
GRPO_TRAIN_METRICS = (
    "reward_mean",
    "reward_std",
    "frac_zero_std_groups",
    "kl",
    "response_length_mean",
    "truncated_fraction",
    "entropy",
    "loss",
    "verifier_accuracy",
)


def test_metrics_json_has_every_operator_metric(rlvr_repo):
    metrics = json.loads((rlvr_repo / "results/rlvr/metrics.json").read_text())
    for key in GRPO_TRAIN_METRICS:
        assert isinstance(metrics["train"][key], float), key
    assert 0.0 <= metrics["train"]["frac_zero_std_groups"] <= 1.0
    held = metrics["heldout"]
    # one accuracy per task in the held-out set (the tiny mix is sort and reverse)
    tasks = {json.loads(line)["task"] for line in (rlvr_repo / "data/prepared/rlvr/test.jsonl").open()}
    n = sum(1 for _ in (rlvr_repo / "data/prepared/rlvr/test.jsonl").open())
    for key in ("accuracy", "accuracy_reference", *(f"accuracy_{t}" for t in sorted(tasks))):
        # a share of the held-out prompts: strictly inside (0, 1) for a policy that learned
        # something and not everything, and a multiple of 1/n for the whole set
        assert 0.0 < held[key] < 1.0, (key, held[key])
    assert round(held["accuracy"] * n, 6) == round(held["accuracy"] * n)
    assert held["kl_to_reference"] > 0


def test_policy_reloads_changed_and_is_published_with_lineage(rlvr_repo):
    import torch
    from transformers import AutoModelForCausalLM

    out = rlvr_repo / "models/rlvr"
    policy = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    sft = AutoModelForCausalLM.from_pretrained(rlvr_repo / "models/sft", local_files_only=True)
    new, old = policy.state_dict(), sft.state_dict()
    changed = [k for k in old if not torch.equal(old[k], new[k])]
    assert changed, "GRPO left every parameter untouched"
    manifest = json.loads((out / "artifact.json").read_text())
    assert manifest["stage"] == "rlvr" and manifest["type"] == "checkpoint_hf"
    assert "heldout/accuracy" in manifest["metrics"]
    assert (out / "resolved_config.yaml").is_file()


def test_a_reward_that_is_always_zero_stops_the_stage_and_says_why(trained_sft, tmp_path):
    """One-token answers to multi-digit tasks: no completion can score, GRPO would learn nothing."""
    root = writable_copy(trained_sft, tmp_path / "repo")
    set_params(root, {"rlvr": {
        "grpo": {"num_prompts_per_step": 4, "num_generations_per_prompt": 4, "max_num_steps": 10},
        "policy": {"generation": {"max_new_tokens": 1}, "train_global_batch_size": 16, "train_micro_batch_size": 16},
        "alignpipe": {"zero_reward_batches": 2},
    }})  # fmt: skip
    result = run_cli(root, "run", "rlvr", env={"ALIGNPIPE_SCRATCH": str(tmp_path / "scratch")}, check=False)
    assert result.returncode == 2, result.stderr
    assert "rlvr: the reward was 0 for all 32 completions of the first 2 rollout batches" in result.stderr
    assert "100% of completions stopped at policy.generation.max_new_tokens=1" in result.stderr
    assert "rlvr.alignpipe.zero_reward_batches=0" in result.stderr
    assert not (root / "models" / "rlvr").exists() and not (root / "results" / "rlvr").exists()
