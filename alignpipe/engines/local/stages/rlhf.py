"""Stage ``rlhf`` on the local engine: GRPO from the SFT policy against a learned reward.

Reward source (``alignpipe.reward_source``):

* ``rm`` (default): the ``rm`` stage's Bradley-Terry model (``models/rm``,
  ``AutoModelForSequenceClassification``, one logit) scores the chat-formatted
  conversation, exactly as TRL's RewardTrainer formatted its training pairs; the score
  is clipped to ``alignpipe.reward_clip`` ([lo, hi], either may be null) if set.
* ``judge``: a generative judge (``alignpipe.judge``, see ``judge.py``) grades or compares
  the completions.

The KL penalty to the SFT reference (``loss_fn.reference_policy_kl_penalty``) must be > 0:
a learned reward without it is an invitation to reward hacking. Besides the shared GRPO
metrics, the stage reports on held-out prompts the reward model's mean score of this
policy's samples (``heldout/rm_score``) and of the SFT reference's samples drawn with the
same seed (``heldout/rm_score_reference``), and flags reward hacking
(``heldout/reward_hacking_suspected``, plus a warning on stderr) when, paired on the same
prompts, the RM score rose while verifier accuracy fell by more than
``alignpipe.reward_hacking.accuracy_drop``, each over its whole 95% interval (evaluate's rule).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from alignpipe.context import StageContext
from alignpipe.data.schema import transcript
from alignpipe.engines.local import grpo
from alignpipe.engines.local.judge import judge_against, judge_rewards, load_judge
from alignpipe.engines.local.nemo_rl_keys import grpo_keys
from alignpipe.errors import ConfigError, UnsupportedSetting
from alignpipe.measure.heldout import HeldoutSamples, load_scores
from alignpipe.measure.intervals import paired_difference
from alignpipe.measure.reward_model import RewardModelScorer, hacking_suspected
from alignpipe.settings import Judge


def clip(value: float, bounds: list[float | None] | None) -> float:
    """Clamp to ``[lo, hi]``; ``bounds`` null or either bound null means unbounded on that side."""
    if not bounds:
        return value
    lo, hi = bounds
    if lo is not None:
        value = max(float(lo), value)
    if hi is not None:
        value = min(float(hi), value)
    return value


def check_settings(ctx: StageContext) -> str:
    """The reward source; refuses a learned reward without a KL anchor (``reward_source`` and
    ``reward_clip`` were checked with the profile, ``alignpipe.settings``)."""
    beta = grpo_keys(ctx).loss_fn.reference_policy_kl_penalty
    if beta <= 0:
        raise UnsupportedSetting(
            "rlhf needs loss_fn.reference_policy_kl_penalty > 0: a learned reward without a KL anchor "
            "to the SFT policy gets exploited (set e.g. 0.05 in params.yaml rlhf.loss_fn)"
        )
    return ctx.settings.reward_source


def rm_score_fn(scorer: RewardModelScorer, bounds: list[float | None] | None) -> Callable[..., list[float]]:
    from alignpipe.rewards import score_completions

    def score(rows: list[dict], texts: list[str], num_tokens: list[int], log_metric) -> list[float]:
        raw = scorer([r["prompt"] for r in rows], texts)
        log_metric("rm_score", sum(raw) / max(1, len(raw)))
        if all("answer" in r for r in rows):
            # Not a reward here: the verifier's view of the same rollouts, to spot hacking early.
            acc = score_completions(rows, texts)
            log_metric("verifier_accuracy", sum(acc) / max(1, len(acc)))
        return [clip(r, bounds) for r in raw]

    return score


def judge_score_fn(
    judge_cfg: Judge, generate, group_size: int, sft_answers: dict[str, str] | None = None
) -> Callable[..., list[float | None]]:
    """The judge's rewards. ``sft_answers`` (prompt transcript -> the SFT policy's answer): a
    pairwise judge's anchors in validation, which answers each prompt once."""

    def score(rows: list[dict], texts: list[str], num_tokens: list[int], log_metric) -> list[float | None]:
        prompts = [transcript(r["prompt"]) for r in rows]
        # Rollouts come as groups of identical prompts, each group compared with its first answer.
        grouped = len(prompts) % group_size == 0 and all(
            p == prompts[i - i % group_size] for i, p in enumerate(prompts)
        )
        if (
            not grouped
            and judge_cfg.mode == "pairwise"
            and sft_answers
            and all(p in sft_answers for p in prompts)
        ):
            anchors = [sft_answers[p] for p in prompts]
            rewards, fail = judge_against(judge_cfg, generate, prompts, texts, anchors)
        else:
            rewards, fail = judge_rewards(judge_cfg, generate, prompts, texts, group_size if grouped else 1)
        log_metric("judge_parse_fail_fraction", fail)
        return rewards

    return score


def sft_validation_answers(ctx: StageContext, judge_cfg: Judge) -> dict[str, str] | None:
    """A pairwise judge's validation anchors: the SFT policy's answer to each validation prompt,
    drawn as the policy's own validation answers are (``grpo.policy_answers``)."""
    rows = grpo.validation_rows(ctx)
    if judge_cfg.mode != "pairwise" or not rows:
        return None
    answers = grpo.policy_answers(ctx, rows)
    return {transcript(r["prompt"]): a for r, a in zip(rows, answers, strict=True)}


def heldout_rm_metrics(
    ctx: StageContext,
    scorer: RewardModelScorer,
    samples: HeldoutSamples,
    reference: HeldoutSamples,
    live,
    measures: dict[str, dict],
) -> dict[str, float]:
    """RM scores of the policy's and the SFT reference's held-out samples; the reward-hacking flag.
    The policy's per-sample scores go into ``measures``, published with its samples."""
    pol_scores = scorer(samples.prompts, samples.completions)
    measures["rm_score"] = {"model": ctx.input_hashes["reward_model"]["hash"], "scores": pol_scores}
    # The rm stage scored the SFT reference's samples when it published: reuse them if these are those.
    ref_scores = load_scores(ctx.input("reward_model"), ctx.input_hashes["policy"]["hash"], reference)
    if ref_scores is None:
        ref_scores = scorer(reference.prompts, reference.completions)
    out = {
        "rm_score": sum(pol_scores) / max(1, len(pol_scores)),
        "rm_score_reference": sum(ref_scores) / max(1, len(ref_scores)),
    }
    from alignpipe.rewards import score_completions

    summary = live.summary.setdefault("heldout", {})
    drop = ctx.settings.reward_hacking.accuracy_drop
    acc, acc_ref = summary["accuracy"], summary["accuracy_reference"]
    accuracy_vs = paired_difference(
        score_completions(samples.rows, samples.completions),
        score_completions(reference.rows, reference.completions),
    )
    hacking = hacking_suspected(paired_difference(pol_scores, ref_scores), accuracy_vs, drop)
    out["reward_hacking_suspected"] = 1.0 if hacking else 0.0
    if hacking:
        print(
            f"WARNING: rlhf: reward hacking suspected: held-out reward-model score rose "
            f"({out['rm_score_reference']:.3f} -> {out['rm_score']:.3f}) while verifier accuracy fell "
            f"({acc_ref:.3f} -> {acc:.3f}; paired 95% interval [{accuracy_vs['low']:+.3f}, "
            f"{accuracy_vs['high']:+.3f}], below -{drop:.3f}). Raise loss_fn.reference_policy_kl_penalty, "
            f"lower the learning rate, tighten alignpipe.reward_clip, or improve the reward model's negatives.",
            file=sys.stderr,
        )
    summary.update(out)
    return out


def run(ctx: StageContext) -> None:
    source = check_settings(ctx)
    grpo.refuse_unsupported_grpo(ctx)  # before the reward model loads (and torch with it)
    rm_path = ctx.input("reward_model")
    if not (rm_path / "config.json").is_file():
        raise ConfigError(f"rlhf: no reward model at {rm_path}; run the rm stage first (`dvc repro rm`)")
    scorer = RewardModelScorer.load(rm_path)
    scaling = dict(grpo_keys(ctx).reward_scaling)
    if source == "rm":
        reward = grpo.RewardFn(
            rm_score_fn(scorer, ctx.settings.reward_clip), name="reward_model", scaling=scaling
        )
    else:
        judge_cfg = ctx.settings.judge

        def resolve(name: str) -> str:
            path = ctx.root / name
            return str(path) if path.exists() else name

        generate = load_judge(judge_cfg, resolve)
        group = grpo_keys(ctx).num_generations_per_prompt
        anchors = sft_validation_answers(ctx, judge_cfg)
        reward = grpo.RewardFn(
            judge_score_fn(judge_cfg, generate, group, anchors), name="judge", scaling=scaling
        )

    def after(live, samples, reference, measures) -> dict[str, float]:
        return heldout_rm_metrics(ctx, scorer, samples, reference, live, measures)

    grpo.run_grpo(ctx, reward, after_training=after)
