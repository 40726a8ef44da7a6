"""GRPO plumbing on the local engine, without training: key mapping, refusals, rewards,
advantages as the trainer computes them, metric names, judge mechanics, hacking flag."""

from __future__ import annotations

import collections
import math
import statistics
from pathlib import Path

import pytest
import torch

from alignpipe.context import build_context
from alignpipe.engines.local import grpo, judge
from alignpipe.engines.local.stages import rlhf
from alignpipe.errors import ConfigError, UnsupportedSetting
from alignpipe.measure.metrics import local_keys
from alignpipe.rl.advantages import compute_grpo_advantages
from alignpipe.rl.shaping import scale_reward
from alignpipe.settings import Judge, parse

REPO = Path(__file__).resolve().parents[1]


def context(stage: str, knobs: dict | None = None):
    from alignpipe.config import load_params

    params = load_params(REPO)
    if knobs is not None:
        params = {**params, stage: knobs}
    return build_context(REPO, stage, params=params)


# ----------------------------------------------------------------------------- mapping


def test_grpo_keys_map_to_trl_arguments(tmp_path):
    ctx = context(
        "rlvr",
        {
            "grpo": {"num_prompts_per_step": 4, "num_generations_per_prompt": 4, "max_num_steps": 7},
            "policy": {
                "train_global_batch_size": 8,
                "train_micro_batch_size": 4,
                "generation": {"temperature": 0.7, "top_p": 0.9, "max_new_tokens": 9},
            },
            "loss_fn": {
                "reference_policy_kl_penalty": 0.05,
                "ratio_clip_min": 0.1,
                "ratio_clip_max": 0.3,
                "token_level_loss": False,
            },
        },
    )
    args = grpo.grpo_args(ctx, tmp_path)
    assert args["num_generations"] == 4
    assert args["generation_batch_size"] == 16  # 4 prompts x 4 generations per GRPO step
    assert args["per_device_train_batch_size"] == 4 and args["gradient_accumulation_steps"] == 2
    assert args["max_steps"] == 14  # 7 GRPO steps x (16 rollouts / global batch 8) optimizer steps
    assert args["beta"] == 0.05 and args["epsilon"] == 0.1 and args["epsilon_high"] == 0.3
    assert args["loss_type"] == "grpo"  # token_level_loss false -> per-sequence means
    assert (args["temperature"], args["top_p"], args["max_completion_length"]) == (0.7, 0.9, 9)


def test_rollouts_must_fill_whole_optimizer_steps(tmp_path):
    ctx = context(
        "rlvr",
        {
            "grpo": {"num_prompts_per_step": 3, "num_generations_per_prompt": 4},
            "policy": {"train_global_batch_size": 8, "train_micro_batch_size": 8},
        },
    )
    with pytest.raises(UnsupportedSetting, match="multiple of policy.train_global_batch_size"):
        grpo.grpo_args(ctx, tmp_path)


@pytest.mark.parametrize(
    "knobs, needle",
    [
        ({"policy": {"generation": {"backend": "vllm"}}}, "policy.generation.backend='vllm'"),
        ({"loss_fn": {"use_kl_in_reward": True}}, "loss_fn.use_kl_in_reward"),
        ({"grpo": {"use_dynamic_sampling": True}}, "grpo.use_dynamic_sampling"),
        ({"loss_fn": {"reference_policy_kl_type": "k1"}}, "k3"),
        ({"grpo": {"max_rollout_turns": 4}}, "grpo.max_rollout_turns=4: a second turn answers a tool call"),
        (
            {"grpo": {"max_rollout_turns": 3}, "alignpipe": {"tools": {"tools": ["calculator"]}}},
            "disagrees with alignpipe.tools.max_rollout_turns=4",
        ),
    ],
)
def test_settings_the_local_engine_cannot_honour_are_refused(knobs, needle):
    with pytest.raises(UnsupportedSetting) as err:
        grpo.refuse_unsupported_grpo(context("rlvr", knobs))
    assert needle in str(err.value) and "fix:" in str(err.value)


def test_rlhf_refuses_no_kl_anchor_and_unknown_reward_source():
    with pytest.raises(UnsupportedSetting, match="reference_policy_kl_penalty > 0"):
        rlhf.check_settings(context("rlhf", {"loss_fn": {"reference_policy_kl_penalty": 0.0}}))
    with pytest.raises(ConfigError, match="reward_source"):
        rlhf.check_settings(context("rlhf", {"alignpipe": {"reward_source": "oracle"}}))


def test_several_turns_are_accepted_with_tools():
    tools = {"alignpipe": {"tools": {"tools": ["calculator"], "max_rollout_turns": 3}}}
    grpo.refuse_unsupported_grpo(context("rlvr", {"grpo": {"max_rollout_turns": 3}, **tools}))


def test_tiny_profiles_run_on_the_local_engine():
    for stage in ("rlvr", "rlhf"):
        ctx = context(stage)
        grpo.refuse_unsupported_grpo(ctx)  # no GPU-only setting in the committed tiny config
        assert ctx.config["policy"]["generation"]["backend"] not in ("vllm", "megatron")
    assert rlhf.check_settings(context("rlhf")) == "rm"


# ----------------------------------------------------------------------------- rewards


def test_reward_fn_reads_conversational_rollouts_and_keeps_unknowns_as_nan():
    seen = {}

    def score(rows, texts, num_tokens, log_metric):
        seen.update(rows=rows, texts=texts, num_tokens=num_tokens)
        log_metric("verifier_accuracy", 0.5)
        return [1.0, None]

    logged = []
    fn = grpo.RewardFn(score, name="verifier")
    prompts = [[{"role": "user", "content": "sort:321"}]] * 2
    completions = [[{"role": "assistant", "content": "123"}], [{"role": "assistant", "content": "x"}]]
    out = fn(
        prompts,
        completions,
        [[5, 6, 7], [8]],
        answer=["123", "123"],
        verifier=["exact", "exact"],
        log_metric=lambda name, value: logged.append((name, value)),
    )
    assert out == [1.0, None]
    assert seen["texts"] == ["123", "x"] and seen["num_tokens"] == [3, 1]
    # Without a conversation column, a row's prompt is TRL's conversational prompt.
    assert seen["rows"][0] == {"prompt": prompts[0], "answer": "123", "verifier": "exact"}
    assert fn.last[0] == 1.0 and math.isnan(fn.last[1])
    assert logged == [("verifier_accuracy", 0.5)]


def test_reward_fn_rows_carry_the_rows_own_conversation_without_the_stage_system_turn():
    seen = {}

    def score(rows, texts, num_tokens, log_metric):
        seen["rows"] = rows
        return [1.0] * len(rows)

    own = [
        {"role": "user", "content": "sort:321"},
        {"role": "assistant", "content": "123"},
        {"role": "user", "content": "and reverse it?"},
    ]
    prepared = [
        {"prompt": own, "answer": "321", "verifier": "exact"},
        {
            "prompt": [{"role": "system", "content": "mine"}, {"role": "user", "content": "add:2+2"}],
            "answer": "4",
        },
    ]
    dataset = grpo.conversational(prepared, system="Answer with digits only.")
    assert dataset[0]["prompt"][0] == {"role": "system", "content": "Answer with digits only."}
    columns = {k: [r[k] for r in dataset] for k in dataset[0]}
    prompts = columns.pop("prompt")
    grpo.RewardFn(score)(prompts, ["321", "4"], [[1], [2]], **columns)
    # The reward rows are the prepared rows: each its own conversation (its own system turn
    # kept, the stage's left out), not the last user turn's text.
    assert seen["rows"] == prepared


def test_reward_scaling_clamps_then_maps_linearly():
    scaling = {"enabled": True, "source_min": 0.0, "source_max": 2.0, "target_min": -1.0, "target_max": 1.0}
    assert [scale_reward(r, scaling) for r in (-5.0, 0.0, 1.0, 2.0, 9.0)] == [-1.0, -1.0, 0.0, 1.0, 1.0]
    assert scale_reward(7.0, {"enabled": False}) == 7.0


def test_rlvr_reward_is_the_verifier_then_shaping():
    from alignpipe.engines.local.stages.rlvr import verifier_score

    rows = [
        {"prompt": [{"role": "user", "content": "add:2+2"}], "answer": "4", "verifier": "numeric"},
        {"prompt": [{"role": "user", "content": "sort:21"}], "answer": "12"},
    ]
    logged = {}
    score = verifier_score({"format_penalty": 0.5, "clip": [-0.25, None]})
    out = score(rows, ["4.0", " "], [2, 1], lambda k, v: logged.__setitem__(k, v))
    assert out == [1.0, -0.25]  # correct; empty answer: 0 - 0.5 format penalty, clipped at -0.25
    assert logged["verifier_accuracy"] == 0.5  # the unshaped verifier view
    with pytest.raises(ConfigError, match="Did you mean 'alignpipe.reward_shaping.length_penalty'"):
        verifier_score({"lenght_penalty": 1.0})


def test_rm_reward_is_clipped_and_logs_raw_score_and_verifier_accuracy():
    asked = []

    def scorer(prompts, completions):
        asked.extend(prompts)
        return [5.0, -3.0]

    logged = {}
    score = rlhf.rm_score_fn(scorer, [-1.0, 2.0])
    conversation = [{"role": "system", "content": "mine"}, {"role": "user", "content": "sort:21"}]
    rows = [{"prompt": conversation, "answer": "12", "verifier": "exact"}] * 2
    assert score(rows, ["12", "21"], [2, 2], lambda k, v: logged.__setitem__(k, v)) == [2.0, -1.0]
    assert asked == [conversation] * 2  # the reward model reads the whole conversation
    assert logged == {"rm_score": 1.0, "verifier_accuracy": 0.5}
    assert rlhf.clip(3.0, None) == 3.0 and rlhf.clip(3.0, [None, 1.0]) == 1.0


# ----------------------------------------------------------------------------- advantages


@pytest.mark.parametrize("loo", [True, False])
@pytest.mark.parametrize("normalize", [True, False])
def test_trainer_replaces_trl_advantages_with_nemo_rl_ones(monkeypatch, loo, normalize):
    """The advantages the loss sees are alignpipe.rl.advantages' on the same rewards, grouped
    by identical (left-padded) prompt tokens as NeMo-RL groups them."""
    from trl import GRPOTrainer

    cls = grpo.make_trainer_class()
    rewards = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, float("nan")]
    # Two prompts of different lengths, left-padded with 0 (also a real token id: the mask decides).
    prompt_ids = torch.tensor([[0, 5, 6]] * 4 + [[7, 0, 6]] * 4)
    prompt_mask = torch.tensor([[0, 1, 1]] * 4 + [[1, 1, 1]] * 4)

    def fake_parent(self, inputs):  # what TRL computed: must be replaced
        self._metrics["train"]["reward_std"].append(99.0)
        return {"advantages": torch.full((8,), 99.0), "prompt_ids": prompt_ids, "prompt_mask": prompt_mask}

    monkeypatch.setattr(GRPOTrainer, "_generate_and_score_completions", fake_parent)
    trainer = object.__new__(cls)
    trainer._metrics = {"train": collections.defaultdict(list)}
    trainer.model = torch.nn.Linear(1, 1)  # in training mode, as while TRL samples a step
    fn = grpo.RewardFn(lambda *a: [])
    fn.last = rewards
    trainer.reward_funcs = [fn]
    trainer.advantage_settings = {"normalize_rewards": normalize, "leave_one_out_baseline": loo}
    got = trainer._generate_and_score_completions(None)["advantages"]

    r = torch.tensor(rewards)
    want = compute_grpo_advantages(
        torch.nan_to_num(r),
        4,
        valid_mask=~torch.isnan(r),
        normalize_rewards=normalize,
        leave_one_out_baseline=loo,
    )
    want[7] = 0.0  # unknown reward: no signal
    assert torch.allclose(got, want)
    # TRL's reward_std replaced: in float64 with an IEEE sqrt (torch's float32 CPU sqrt is 1 ULP off
    # on about one value in seven, and differently on Intel and AMD CPUs).
    assert trainer._metrics["train"]["reward_std"] == [
        pytest.approx(statistics.stdev(r for r in rewards if r == r), rel=1e-12)
    ]
    # Hand check, LOO without normalisation: [1,0,0,0] -> 1 - 0 = 1 and 0 - 1/3.
    if loo and not normalize:
        assert torch.allclose(got[:4], torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3]))
    trainer.advantage_settings["clip"] = (-0.5, 0.5)
    assert trainer._generate_and_score_completions(None)["advantages"].abs().max() <= 0.5


# ----------------------------------------------------------------------------- metric names


@pytest.mark.parametrize("stage", ["rlvr", "rlhf"])
def test_rename_table_covers_the_operator_metrics(stage):
    table = local_keys(stage)
    for required in (
        "train/reward_mean",
        "train/reward_std",
        "train/frac_zero_std_groups",
        "train/kl",
        "train/response_length_mean",
        "train/truncated_fraction",
        "train/entropy",
        "train/loss",
    ):
        assert required in table.values()
    # The TRL 1.16 keys these come from.
    for trl_key in (
        "reward",
        "reward_std",
        "frac_reward_zero_std",
        "kl",
        "completions/mean_length",
        "completions/clipped_ratio",
        "entropy",
        "loss",
    ):
        assert trl_key in table


def test_hacking_flag_needs_rm_up_and_accuracy_down_beyond_noise():
    from alignpipe.measure.intervals import paired_difference

    n = 300
    sft = [1.0 if i < 90 else 0.0 for i in range(n)]  # 30% right

    def verdicts(lost: int, won: int) -> list[float]:  # sft's verdicts, `lost` right ones lost, `won` won
        return [0.0 if i < lost else 1.0 if 90 <= i < 90 + won else v for i, v in enumerate(sft)]

    up, down = paired_difference([1.0] * n, [0.5] * n), paired_difference([0.4] * n, [0.5] * n)
    assert rlhf.hacking_suspected(up, paired_difference(verdicts(30, 0), sft), 0.02)  # 10 points, all lost
    assert not rlhf.hacking_suspected(up, paired_difference(verdicts(3, 0), sft), 0.02)  # within the drop
    assert not rlhf.hacking_suspected(up, paired_difference(verdicts(45, 30), sft), 0.02)  # 5 points of churn
    assert not rlhf.hacking_suspected(down, paired_difference(verdicts(30, 0), sft), 0.02)  # RM score fell
    assert not rlhf.hacking_suspected(up, paired_difference(verdicts(0, 30), sft), 0.02)  # accuracy rose


# ----------------------------------------------------------------------------- judge


def judge_settings(section: dict) -> Judge:
    return parse(Judge, section, "stages/rlhf/config/tiny.yaml", "alignpipe.judge")


def test_judge_score_mode_builds_prompts_and_parses_grades():
    cfg = judge_settings({"mode": "score", "score_max": 10})
    prompt = judge.build_score_prompt(cfg, "sort:321", "123")
    assert "sort:321" in prompt and "123" in prompt and "10" in prompt
    asked = []

    def fake(prompts):
        asked.extend(prompts)
        return ["7", "grade: 10/10", "eleven", "42"]

    rewards, fail = judge.judge_rewards(cfg, fake, ["p"] * 4, ["a", "b", "c", "d"], group_size=4)
    assert rewards == [0.7, 1.0, None, None]  # no number; out of range
    assert fail == 0.5 and len(asked) == 4
    cfg0 = judge_settings({"mode": "score", "unparseable": 0.0})
    assert judge.judge_rewards(cfg0, fake, ["p"] * 4, ["a"] * 4, 4)[0][2:] == [0.0, 0.0]


def test_judge_pairwise_mode_compares_with_the_group_anchor_in_both_orders():
    cfg = judge_settings({"mode": "pairwise"})
    asked = []

    def fake(prompts):
        asked.extend(prompts)
        # pair (1 vs 0): A, then B -> candidate wins both; pair (2 vs 0): B, then "?" -> loses the
        # parseable one; (3 vs 2): "A." then "B" -> wins both; pair (5 vs 4): unparseable twice.
        return ["A", "B", "B", "?", "A.", "B", "none", "maybe"]

    rewards, fail = judge.judge_rewards(
        cfg, fake, ["p0", "p0", "p0", "p1", "p1", "p1"][:6], ["x", "y", "z", "u", "v", "w"], group_size=3
    )
    # groups: [0,1,2] anchor 0 and [3,4,5] anchor 3
    assert len(asked) == 8
    assert "A:y" in asked[0] and "B:x" in asked[0] and "A:x" in asked[1] and "B:y" in asked[1]
    assert rewards[0] == 0.5 and rewards[3] == 0.5  # anchors
    assert rewards[1] == 1.0 and rewards[2] == 0.0
    assert rewards[4] == 1.0 and rewards[5] is None
    assert fail == 3 / 8


def test_a_pairwise_judge_validates_each_answer_against_the_sft_answer():
    """Validation answers each prompt once: no group, so no anchor of its own. Each answer is
    compared, in both orders, with the SFT policy's answer to its prompt."""
    cfg = judge_settings({"mode": "pairwise"})
    asked = []

    def fake(prompts):
        asked.extend(prompts)
        return ["A", "B", "B", "A", "A", "?"][: len(prompts)]  # wins, loses, wins once

    sft = {"p0": "s0", "p1": "s1", "p2": "s2"}
    score = rlhf.judge_score_fn(cfg, fake, group_size=4, sft_answers=sft)
    logged = {}
    rows = [{"prompt": p} for p in ("p0", "p1", "p2")]
    rewards = score(rows, ["x", "y", "z"], [1, 1, 1], lambda k, v: logged.setdefault(k, v))
    assert rewards == [1.0, 0.0, 1.0] and logged["judge_parse_fail_fraction"] == 1 / 6
    assert len(asked) == 6
    assert "A:x" in asked[0] and "B:s0" in asked[0] and "A:s0" in asked[1] and "B:x" in asked[1]
    assert "A:z" in asked[4] and "B:s2" in asked[4]
    # Rollouts (groups of one prompt) still compare with their group's first answer.
    asked.clear()
    score(rows[:1] * 4, ["a", "b", "c", "d"], [1] * 4, lambda k, v: None)
    assert not any("s0" in p for p in asked) and "B:a" in asked[0]


def test_judge_verdict_and_score_parsers():
    assert judge.parse_verdict(" B is better") == "B"
    assert judge.parse_verdict("Answer: A") == "A"
    assert judge.parse_verdict("BA") is None and judge.parse_verdict("") is None
    assert judge.parse_score("3.5", 5) == 0.7 and judge.parse_score("-1", 5) is None


def test_judge_config_errors_name_the_problem():
    with pytest.raises(
        ConfigError, match="'alignpipe.judge.mode' is 'vote'; expected one of score, pairwise"
    ):
        judge_settings({"mode": "vote"})
    with pytest.raises(
        ConfigError, match=r"'alignpipe.judge.template' for mode 'pairwise' lacks \{response_a\}"
    ):
        judge_settings({"mode": "pairwise", "template": "{prompt} {response}"})
    with pytest.raises(
        ConfigError, match="'alignpipe.judge.modle' is not a setting. Did you mean 'alignpipe.judge.mode'"
    ):
        judge_settings({"modle": "x"})
