"""The one metric vocabulary both engines publish into ``results/<stage>/`` (DVCLive).

Each pipeline metric names where each engine reads it: ``local`` is the key the TRL trainer
logs (or the stage's own validation returns), ``nemo_rl`` the TensorBoard tag(s) NeMo-RL
v0.7.0 writes (``<prefix>/<key>``, nemo-rl.md §9). A CPU run and a GPU run of a stage then
diff with ``dvc metrics diff`` and ``dvc plots diff``. ``None``: that engine does not measure
it; ``tests/test_metric_vocabulary.py`` keeps those few explicit. ``heldout/*`` is computed
after training by ``measure.heldout`` on both engines and is not listed here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Metric:
    name: str
    local: str | None
    nemo_rl: tuple[str, ...] = ()
    meaning: str = ""
    # A config key whose value multiplies NeMo-RL's value to put it on the local engine's scale.
    nemo_rl_scale: str | None = None


_OPTIMIZER = (
    Metric("train/loss", "loss", ("train/loss",), "training loss"),
    Metric("train/grad_norm", "grad_norm", ("train/grad_norm",), "gradient norm before clipping"),
    Metric("train/lr", "learning_rate", ("train/lr",), "learning rate"),
)


def _pairs(scale: str | None) -> tuple[Metric, ...]:
    """Preference-pair metrics: dpo's implicit reward, rm's score. NeMo-RL logs DPO's rewards as
    log-ratios before beta, TRL as beta * log-ratio: ``scale`` names beta for dpo."""
    return (
        Metric("val/loss", "val_loss", ("validation-default/loss",), "validation loss"),
        Metric(
            "val/chosen_reward",
            "val_chosen_reward",
            ("validation-default/rewards_chosen_mean",),
            "mean reward of chosen validation answers",
            scale,
        ),
        Metric(
            "val/rejected_reward",
            "val_rejected_reward",
            ("validation-default/rewards_rejected_mean",),
            "mean reward of rejected validation answers",
            scale,
        ),
        Metric("val/reward_margin", "val_reward_margin", (), "chosen minus rejected reward (local only)"),
    )


def _train_pair_rewards(chosen: str | None, rejected: str | None, scale: str | None) -> tuple[Metric, ...]:
    return (
        Metric(
            "train/chosen_reward",
            chosen,
            ("train/rewards_chosen_mean",),
            "mean reward of chosen answers",
            scale,
        ),
        Metric(
            "train/rejected_reward",
            rejected,
            ("train/rewards_rejected_mean",),
            "mean reward of rejected answers",
            scale,
        ),
    )


_DPO_BETA = "dpo.reference_policy_kl_penalty"


_GRPO = (
    Metric("train/reward_mean", "reward", ("train/reward",), "mean reward of the step's rollouts"),
    Metric("train/kl", "kl", ("train/kl_penalty",), "KL estimate to the reference, before its coefficient"),
    Metric("train/entropy", "entropy", ("train/approx_entropy",), "policy entropy of sampled tokens"),
    Metric(
        "train/response_length_mean",
        "completions/mean_length",
        ("train/mean_gen_tokens_per_sample",),
        "mean generated tokens per answer",
    ),
    Metric(
        "train/truncated_fraction",
        "completions/clipped_ratio",
        ("train/truncation_rate",),
        "answers cut by the generation cap",
    ),
    Metric(
        "val/response_length_mean",
        "eval_completions/mean_length",
        ("validation/avg_length",),
        "mean generated tokens per validation answer",
    ),
    # TRL-only diagnostics (NeMo-RL logs no per-group variance or clip fraction under these meanings)
    Metric("train/reward_std", "reward_std", (), "reward std within the step (local only)"),
    Metric("train/frac_zero_std_groups", "frac_reward_zero_std", (), "groups with one reward (local only)"),
    Metric(
        "train/clip_fraction", "clip_ratio/region_mean", (), "tokens whose ratio was clipped (local only)"
    ),
    Metric("val/reward_std", "eval_reward_std", (), "validation reward std (local only)"),
)
# Tool rollouts (alignpipe.tools, local engine): what the policy did with its tools per step.
_TOOLS = (
    Metric(
        "train/tool_calls_per_answer", "tools/calls_per_answer", (), "tool calls per rollout (local only)"
    ),
    Metric(
        "train/tool_malformed_share", "tools/malformed_share", (), "calls that could not be read (local only)"
    ),
    Metric("train/tool_turns", "tools/turns_per_rollout", (), "assistant turns per rollout (local only)"),
    Metric("train/tool_errors", "tools/errors", (), "calls that ended in an error (local only)"),
    Metric(
        "train/tool_seconds", "tools/seconds", (), "seconds spent in tools, summed over calls (local only)"
    ),
    Metric(
        "train/reward_with_tool", "tools/reward_with_call", (), "mean reward of rollouts that called a tool"
    ),
    Metric(
        "train/reward_without_tool", "tools/reward_without_call", (), "mean reward of rollouts that did not"
    ),
)
# NeMo-RL's validation/accuracy is the mean validation reward: the verifier's for rlvr, the RM's
# for rlhf. NeMo-Gym reports the same as validation/total_reward/mean.
_VALIDATION_REWARD = ("validation/accuracy", "validation/total_reward/mean")
# The learning curve's uncertainty: validation accuracy's 95% Wilson interval over the answers
# scored. NeMo-RL logs no such tag; its importer derives it for rlvr (NEMO_RL_DERIVED).
_VALIDATION_INTERVAL = (
    Metric(
        "val/verifier_accuracy_low",
        "eval_verifier_accuracy_low",
        (),
        "lower end of validation accuracy's 95% Wilson interval",
    ),
    Metric(
        "val/verifier_accuracy_high",
        "eval_verifier_accuracy_high",
        (),
        "upper end of validation accuracy's 95% Wilson interval",
    ),
)

VOCABULARY: dict[str, tuple[Metric, ...]] = {
    "sft": (
        *_OPTIMIZER,
        Metric("val/loss", "eval_loss", ("validation/val_loss",), "validation loss"),
        Metric("train/token_accuracy", "mean_token_accuracy", (), "next-token accuracy (TRL only)"),
        Metric(
            "val/token_accuracy", "eval_mean_token_accuracy", (), "validation next-token accuracy (TRL only)"
        ),
    ),
    "dpo": (
        *_OPTIMIZER,
        *_pairs(_DPO_BETA),
        *_train_pair_rewards("rewards/chosen", "rewards/rejected", _DPO_BETA),
        Metric(
            "train/preference_accuracy", "rewards/accuracies", ("train/accuracy",), "chosen reward > rejected"
        ),
        Metric(
            "val/preference_accuracy",
            "val_preference_accuracy",
            ("validation-default/accuracy",),
            "chosen reward > rejected on validation pairs",
        ),
        Metric(
            "train/reward_margin", "rewards/margins", (), "chosen minus rejected implicit reward (TRL only)"
        ),
        Metric(
            "train/preference_loss",
            None,
            ("train/preference_loss",),
            "the DPO term of the loss (NeMo-RL only)",
        ),
        Metric(
            "train/sft_loss",
            "sft_loss",
            ("train/sft_loss",),
            "the SFT term of the loss (dpo.sft_loss_weight)",
        ),
        Metric(
            "val/kl_to_reference", "val_kl_to_reference", (), "exact KL on validation answers (local only)"
        ),
    ),
    "rm": (
        *_OPTIMIZER,
        *_pairs(None),
        *_train_pair_rewards(None, None, None),  # TRL's RewardTrainer logs mean_reward, not per side
        Metric("train/pairwise_accuracy", "accuracy", ("train/accuracy",), "chosen score > rejected"),
        Metric(
            "val/pairwise_accuracy",
            "val_pairwise_accuracy",
            ("validation-default/accuracy",),
            "chosen score > rejected on validation pairs",
        ),
        Metric("train/reward_margin", "margin", (), "chosen minus rejected score (TRL only)"),
    ),
    "rlvr": (
        *_OPTIMIZER,
        *_GRPO,
        Metric(
            "val/verifier_accuracy",
            "eval_verifier_accuracy",
            _VALIDATION_REWARD,
            "verifier accuracy of validation answers",
        ),
        *_VALIDATION_INTERVAL,
        Metric(
            "train/verifier_accuracy", "verifier_accuracy", (), "verifier accuracy of rollouts (local only)"
        ),
        Metric("val/reward_mean", "eval_reward", (), "mean shaped validation reward (local only)"),
        *_TOOLS,
    ),
    "rlhf": (
        *_OPTIMIZER,
        *_GRPO,
        Metric("val/reward_mean", "eval_reward", _VALIDATION_REWARD, "mean reward-model (or judge) score"),
        Metric(
            "train/verifier_accuracy", "verifier_accuracy", (), "verifier accuracy of rollouts (local only)"
        ),
        Metric("train/rm_score", "rm_score", (), "raw reward-model score of rollouts (local only)"),
        Metric(
            "train/judge_parse_fail_fraction",
            "judge_parse_fail_fraction",
            (),
            "judge verdicts that did not parse (local only)",
        ),
        Metric(
            "val/verifier_accuracy",
            "eval_verifier_accuracy",
            (),
            "verifier accuracy on validation (local only)",
        ),
        *_VALIDATION_INTERVAL,
        Metric("val/rm_score", "eval_rm_score", (), "raw reward-model score on validation (local only)"),
        Metric(
            "val/judge_parse_fail_fraction",
            "eval_judge_parse_fail_fraction",
            (),
            "judge verdicts on validation answers that did not parse (local only)",
        ),
    ),
}


def local_keys(stage: str) -> dict[str, str]:
    """TRL log key (or the stage's own validation key) -> pipeline metric name."""
    return {m.local: m.name for m in VOCABULARY[stage] if m.local}


def nemo_rl_tags(stage: str) -> dict[str, str]:
    """NeMo-RL TensorBoard tag -> pipeline metric name (tags without an entry are not imported)."""
    return {tag: m.name for m in VOCABULARY.get(stage, _OPTIMIZER) for tag in m.nemo_rl}


def nemo_rl_scales(stage: str) -> dict[str, str]:
    """Pipeline metric name -> the config key whose value multiplies NeMo-RL's value."""
    return {m.name: m.nemo_rl_scale for m in VOCABULARY.get(stage, _OPTIMIZER) if m.nemo_rl_scale}


# Names a NeMo-RL run publishes that no TensorBoard tag holds: rlvr's validation accuracy is a
# mean of 0/1 verifier rewards, so its interval follows from the accuracy and the number of
# answers validate() scored (alignpipe.engines.nemo_rl.metrics.with_validation_interval). rlhf's
# validation/accuracy is the RM's mean score, not an accuracy: no interval there.
NEMO_RL_DERIVED: dict[str, tuple[str, ...]] = {
    "rlvr": ("val/verifier_accuracy_low", "val/verifier_accuracy_high"),
}


def nemo_rl_names(stage: str) -> set[str]:
    """Every pipeline name a NeMo-RL run of ``stage`` publishes: from its tags, and derived."""
    return set(nemo_rl_tags(stage).values()) | set(NEMO_RL_DERIVED.get(stage, ()))
