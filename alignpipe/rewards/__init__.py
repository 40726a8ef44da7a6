"""Rewards: the verifiers that compute one (exact, numeric, math-verify, sandboxed code).

``score_completion(row, completion) -> float`` is the one entry point every stage uses
(held-out accuracy, GRPO rewards). Heavy parts (math-verify pool, code sandbox) are imported
lazily. The math on rewards (shaping, scaling, advantages) is ``alignpipe.rl``.
"""

from alignpipe.rewards import verifiers
from alignpipe.rewards.verifiers import *  # noqa: F403 - exactly verifiers.__all__, listed once there

__all__ = [*verifiers.__all__]
