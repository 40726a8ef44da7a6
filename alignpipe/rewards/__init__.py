"""Rewards: verifiers (exact, numeric, math-verify, sandboxed code), shaping, advantages.

``score_completion(row, completion) -> float`` is the one entry point every stage uses
(held-out accuracy, GRPO rewards). Heavy parts (math-verify pool, code sandbox, torch for
advantages) are imported lazily.
"""

from alignpipe.rewards import verifiers
from alignpipe.rewards.shaping import format_ok, shape_reward, shape_rewards, shaping_config
from alignpipe.rewards.verifiers import *  # noqa: F403 - exactly verifiers.__all__, listed once there

__all__ = ["format_ok", "shape_reward", "shape_rewards", "shaping_config", *verifiers.__all__]
