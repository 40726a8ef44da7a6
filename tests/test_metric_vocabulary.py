"""One metric vocabulary: a CPU run and a GPU run of a stage publish the same names.

Names one engine cannot measure are few and explicit here; every NeMo-RL tag the vocabulary
reads is one NeMo-RL v0.7.0's code really logs (checked in the vendored source).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from alignpipe.measure.metrics import VOCABULARY, local_keys, nemo_rl_names, nemo_rl_tags
from tests.conftest import REPO

# What only one engine measures, and why it cannot be the other's: TRL-only diagnostics, and
# the two terms of NeMo-RL's DPO loss that TRL does not log apart.
TOOLS = {"train/tool_calls_per_answer", "train/tool_malformed_share", "train/tool_turns", "train/tool_errors",
         "train/tool_seconds", "train/reward_with_tool", "train/reward_without_tool"}  # fmt: skip
LOCAL_ONLY = {
    "sft": {"train/token_accuracy", "val/token_accuracy"},
    "dpo": {"train/reward_margin", "val/reward_margin", "val/kl_to_reference"},
    "rm": {"train/reward_margin", "val/reward_margin"},
    "rlvr": {"train/reward_std", "train/frac_zero_std_groups", "train/clip_fraction", "val/reward_std",
             "train/verifier_accuracy", "val/reward_mean", *TOOLS},
    # NeMo-RL's rlhf validation/accuracy is the RM's mean score: no verifier accuracy, no interval.
    "rlhf": {"train/reward_std", "train/frac_zero_std_groups", "train/clip_fraction", "val/reward_std",
             "train/verifier_accuracy", "train/rm_score", "train/judge_parse_fail_fraction",
             "val/verifier_accuracy", "val/rm_score", "val/verifier_accuracy_low",
             "val/verifier_accuracy_high", "val/judge_parse_fail_fraction"},
}  # fmt: skip
NEMO_RL_ONLY = {
    "dpo": {"train/preference_loss"},
    "rm": {"train/chosen_reward", "train/rejected_reward"},
}


@pytest.mark.parametrize("stage", list(VOCABULARY))
def test_both_engines_publish_the_same_names(stage: str) -> None:
    local, nemo_rl = set(local_keys(stage).values()), nemo_rl_names(stage)
    assert local - nemo_rl == LOCAL_ONLY[stage]
    assert nemo_rl - local == NEMO_RL_ONLY.get(stage, set())


def test_the_plots_dvc_yaml_compares_read_names_both_engines_publish() -> None:
    """The cross-stage plots (loss, reward, kl, length, preference accuracy) are not empty on
    the GPU engine: each curve they read is a name NeMo-RL's importer writes too."""
    plots = yaml.safe_load((REPO / "dvc.yaml").read_text())["plots"]
    for plot in plots:
        if not isinstance(plot, dict):
            continue
        (spec,) = plot.values()
        for tsv in (spec or {}).get("y", {}) if isinstance(spec, dict) else {}:
            match = re.fullmatch(r"results/(\w+)/plots/metrics/(.+)\.tsv", tsv)
            stage, name = match.group(1), match.group(2)
            if name in LOCAL_ONLY[stage] or name == "val/kl_to_reference":
                continue  # dpo's exact KL is a local-only diagnostic, plotted beside GRPO's
            assert name in nemo_rl_names(stage), f"{tsv}: NeMo-RL never publishes {name}"


def test_every_nemo_rl_tag_is_one_upstream_logs(nemo_rl_src: Path) -> None:
    """Each tag's key appears as a logged metric key in NeMo-RL's algorithms, loss functions or rollouts."""
    source = "\n".join(
        p.read_text()
        for d in ("algorithms", "experience", "environments")
        for p in (nemo_rl_src / "nemo_rl" / d).rglob("*.py")
    )
    for stage in VOCABULARY:
        for tag in nemo_rl_tags(stage):
            key = tag.split("/", 1)[1]
            if key == "total_reward/mean":  # NeMo-Gym's aggregate, "<metric>/mean" of total_reward
                key = "total_reward"
            assert f'"{key}"' in source or f"'{key}'" in source, f"{stage}: NeMo-RL logs no {tag}"


def test_nemo_rl_dpo_rewards_are_put_on_trls_scale() -> None:
    """NeMo-RL's DPO loss logs log-ratios before beta (loss_functions.py _preference_loss); TRL's
    rewards/* are beta * log-ratio. The importer multiplies by the run's beta."""
    from alignpipe.engines.nemo_rl.metrics import map_scalars

    scalars = {
        "train/rewards_chosen_mean": {1: 2.0},
        "validation-default/rewards_rejected_mean": {1: -4.0},
        "train/accuracy": {1: 0.5},
    }
    mapped = map_scalars("dpo", scalars, {"dpo": {"reference_policy_kl_penalty": 0.1}})
    assert mapped["train/chosen_reward"] == {1: pytest.approx(0.2)}
    assert mapped["val/rejected_reward"] == {1: pytest.approx(-0.4)}
    assert mapped["train/preference_accuracy"] == {1: 0.5}  # unscaled
    assert map_scalars("rm", {"validation-default/rewards_chosen_mean": {1: 2.0}})["val/chosen_reward"] == {
        1: 2.0
    }
