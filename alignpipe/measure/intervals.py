"""95% intervals for the figures a report shows, and for a policy's difference from the reference.

Every policy answers the same held-out prompts (and the same benchmark documents), so a
difference between two policies is paired: it is measured per prompt, and its interval is
that of a mean of per-prompt differences -- much narrower than two independent intervals
side by side, because most prompts are equally easy or hard for both.

* a share of 0/1 outcomes (accuracy, exact match): Wilson's score interval, which stays inside
  [0, 1] and is sound near 0 and 1 where the normal approximation is not;
* any other mean (a reward-model score), and a paired difference: the mean plus or minus
  z times its standard error (the central limit theorem; 300 held-out prompts here).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

Z95 = 1.959963984540054  # the standard normal's 97.5th percentile


def wilson(successes: float, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson's score interval for a share of ``successes`` in ``n`` trials."""
    if n <= 0:
        raise ValueError("an interval needs at least one trial")
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    # At 0 or n the bound is exactly 0 or 1; float rounding would put it a hair inside.
    low = 0.0 if successes <= 0 else max(0.0, centre - half)
    high = 1.0 if successes >= n else min(1.0, centre + half)
    return low, high


def _mean_and_error(values: Sequence[float]) -> tuple[float, float]:
    n = len(values)
    if n == 0:
        raise ValueError("an interval needs at least one value")
    mean = sum(values) / n
    if n == 1:
        return mean, 0.0
    variance = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(variance / n)


def mean_interval(values: Sequence[float], z: float = Z95) -> dict[str, float]:
    """``{value, low, high}``: the mean of ``values`` and its 95% interval (Wilson's when every
    value is 0 or 1)."""
    if all(v in (0, 1) for v in values):
        low, high = wilson(sum(values), len(values), z)
        return {"value": sum(values) / len(values), "low": low, "high": high}
    mean, error = _mean_and_error(values)
    return {"value": mean, "low": mean - z * error, "high": mean + z * error}


def interval_of(values: Sequence[float]) -> dict[str, float]:
    """``{low, high}`` of the mean of ``values`` (the mean itself is the figure's own key)."""
    found = mean_interval(values)
    return {"low": found["low"], "high": found["high"]}


def paired_difference(
    values: Sequence[float], reference: Sequence[float], z: float = Z95
) -> dict[str, float]:
    """``{value, low, high}``: mean of ``values[i] - reference[i]`` over the same items, with
    its 95% interval."""
    if len(values) != len(reference):
        raise ValueError(f"a paired difference needs the same items: {len(values)} against {len(reference)}")
    mean, error = _mean_and_error([a - b for a, b in zip(values, reference, strict=True)])
    return {"value": mean, "low": mean - z * error, "high": mean + z * error}


def below(difference: dict[str, float], margin: float = 0.0) -> bool:
    """The whole interval of a difference lies more than ``margin`` below zero."""
    return difference["high"] < -margin


def above(difference: dict[str, float], margin: float = 0.0) -> bool:
    """The whole interval of a difference lies more than ``margin`` above zero."""
    return difference["low"] > margin
