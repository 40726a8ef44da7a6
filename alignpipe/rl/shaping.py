"""Reward shaping and scaling: pure functions on top of a reward, one float per completion.

Shaping (every option defaults to off): a profile's ``alignpipe.reward_shaping`` section
(``alignpipe.settings.RewardShaping``: each option with its default and meaning), or a mapping
of the same keys. Order:
``r - format_penalty * bad_format - length_penalty * max(0, length - target_length)``, then clip.

Scaling (:func:`scale_reward`): NeMo-RL's ``grpo.reward_scaling``, applied after shaping.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

from alignpipe.settings import RewardShaping, parse

__all__ = [
    "DEFAULT_ALLOWED_CHARS",
    "format_ok",
    "is_noop",
    "length_excess",
    "scale_reward",
    "shape_reward",
    "shape_rewards",
    "shaping_config",
]

# Printable text: tab/newline/CR, printable ASCII, and everything from U+00A0 up except the
# replacement character (a sign of broken decoding).
DEFAULT_ALLOWED_CHARS = r"\t\n\r\x20-\x7e\u00a0-\ufffc\ufffe-\U0010ffff"


def shaping_config(config: Mapping[str, Any] | RewardShaping | None) -> RewardShaping:
    """The settings as given, or a mapping of them checked (an unknown key or a bad value raises
    ``ConfigError``)."""
    if isinstance(config, RewardShaping):
        return config
    return parse(RewardShaping, config, "reward shaping", "alignpipe.reward_shaping")


def is_noop(cfg: RewardShaping) -> bool:
    return not cfg.format_penalty and not cfg.length_penalty and cfg.clip is None


@lru_cache(maxsize=32)
def _char_re(allowed_chars: str | None) -> re.Pattern:
    return re.compile(f"[^{allowed_chars or DEFAULT_ALLOWED_CHARS}]")


def format_ok(completion: str | None, allowed_chars: str | None = None) -> bool:
    """False for ``None``, empty or whitespace-only text, or any character outside ``allowed_chars``."""
    if completion is None or not completion.strip():
        return False
    return _char_re(allowed_chars).search(completion) is None


def length_excess(length: int, target_length: int | None) -> int:
    """``max(0, length - target_length)``; 0 when there is no target."""
    if target_length is None:
        return 0
    return max(0, int(length) - int(target_length))


def shape_reward(
    reward: float,
    completion: str | None,
    config: Mapping[str, Any] | RewardShaping | None = None,
    num_tokens: int | None = None,
) -> float:
    """Apply the configured penalties and clipping to one verifier score."""
    cfg = shaping_config(config)
    r = float(reward)
    if cfg.format_penalty and not format_ok(completion, cfg.allowed_chars):
        r -= cfg.format_penalty
    if cfg.length_penalty:
        if cfg.length_unit == "tokens":
            if num_tokens is None:
                raise ValueError("length_unit 'tokens' needs num_tokens")
            length = num_tokens
        else:
            length = len(completion or "")
        r -= cfg.length_penalty * length_excess(length, cfg.target_length)
    if cfg.clip is not None:
        lo, hi = cfg.clip
        if lo is not None:
            r = max(lo, r)
        if hi is not None:
            r = min(hi, r)
    return r


def shape_rewards(
    rewards: Sequence[float],
    completions: Sequence[str | None],
    config: Mapping[str, Any] | RewardShaping | None = None,
    num_tokens: Sequence[int] | None = None,
) -> list[float]:
    """:func:`shape_reward` over a batch (config validated once)."""
    if len(rewards) != len(completions):
        raise ValueError(f"{len(rewards)} rewards but {len(completions)} completions")
    cfg = shaping_config(config)
    if is_noop(cfg):
        return [float(r) for r in rewards]
    toks = list(num_tokens) if num_tokens is not None else [None] * len(rewards)
    return [shape_reward(r, c, cfg, t) for r, c, t in zip(rewards, completions, toks, strict=True)]


def scale_reward(r: float, scaling: dict[str, Any]) -> float:
    """NeMo-RL ``grpo.reward_scaling``: clamp to [source_min, source_max], map linearly to [target_min, target_max]."""
    if not scaling.get("enabled"):
        return r
    lo, hi = float(scaling.get("source_min", 0.0)), float(scaling.get("source_max", 1.0))
    tlo, thi = float(scaling.get("target_min", 0.0)), float(scaling.get("target_max", 1.0))
    r = min(max(r, lo), hi)
    return tlo + (r - lo) * (thi - tlo) / (hi - lo) if hi > lo else tlo
