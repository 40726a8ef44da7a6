"""Stage ``rlvr`` on the local engine: GRPO from the SFT policy with programmatic verifiers.

Each prompt row names its verifier (``alignpipe.rewards.score_completions``: 1.0 correct,
0.0 wrong); optional shaping from ``alignpipe.reward_shaping`` (format and length
penalties, clipping) is applied on top. Training and metrics: ``grpo.run_grpo``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from alignpipe.context import StageContext
from alignpipe.engines.local import grpo
from alignpipe.engines.local.nemo_rl_keys import grpo_keys
from alignpipe.settings import RewardShaping


def verifier_score(shaping: RewardShaping | Mapping[str, Any] | None) -> Callable[..., list[float]]:
    """Verifier scores, shaped; logs the unshaped accuracy so shaping never hides it."""
    from alignpipe.rewards import score_completions
    from alignpipe.rl.shaping import shape_rewards, shaping_config

    cfg = shaping_config(shaping)  # a bad mapping fails here, before any training

    def score(rows: list[dict], texts: list[str], num_tokens: list[int], log_metric) -> list[float]:
        scores = score_completions(rows, texts)
        log_metric("verifier_accuracy", sum(scores) / max(1, len(scores)))
        return shape_rewards(scores, texts, cfg, num_tokens)

    return score


def run(ctx: StageContext) -> None:
    reward = grpo.RewardFn(
        verifier_score(ctx.settings.reward_shaping),
        name="verifier",
        scaling=dict(grpo_keys(ctx).reward_scaling),
    )
    grpo.run_grpo(ctx, reward)
