"""Weighted mixtures: a family's train split drawn from its sources in the proportions their
``weight`` asks for (stages/prep/README.md, "Mixtures").

The rule: when any source feeding a family has a ``weight``, every source feeding it must have
one, and the family's train split holds ``N`` rows, source ``i`` contributing ``N * w_i / sum(w)``
of them (largest remainder, so they sum to ``N``), each drawn without repetition from that
source's train rows by a generator seeded with the split seed, the family and the source.
``N`` is ``mix.<family>.train_rows`` when set, else the largest mixture drawable without
repeating a row: ``min_i floor(n_i * sum(w) / w_i)`` over the sources' ``n_i`` train rows.
Validation and test splits keep every row: they measure, they are not reweighted.
"""

from __future__ import annotations

import math
import random
from typing import Any

from alignpipe.errors import ConfigError


def source_weight(src: dict[str, Any], index: int) -> float | None:
    """A source's ``weight``: None when unset, else a positive number."""
    if "weight" not in src or src["weight"] is None:
        return None
    w = src["weight"]
    if isinstance(w, bool) or not isinstance(w, int | float) or not math.isfinite(w) or w <= 0:
        raise ConfigError(
            f"prep config: sources[{index}].weight is {w!r}; it must be a positive number "
            "(the source's share of its family's train split, relative to the other sources' weights)"
        )
    return float(w)


def mixture_size(cfg: dict[str, Any], family: str) -> int | None:
    """``mix.<family>.train_rows`` (None: the largest mixture without repeated rows)."""
    mix = cfg.get("mix") or {}
    if not isinstance(mix, dict):
        raise ConfigError("prep config: 'mix' must map a family to {train_rows: N}")
    size = (mix.get(family) or {}).get("train_rows")
    if size is None:
        return None
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise ConfigError(f"prep config: mix.{family}.train_rows is {size!r}; it must be a positive integer")
    return size


def shares(size: int, weights: dict[int, float]) -> dict[int, int]:
    """``size`` split over the sources in proportion to ``weights`` (largest remainder)."""
    total = sum(weights.values())
    exact = {i: size * w / total for i, w in weights.items()}
    counts = {i: math.floor(x) for i, x in exact.items()}
    for i in sorted(exact, key=lambda i: (counts[i] - exact[i], i))[: size - sum(counts.values())]:
        counts[i] += 1
    return counts


def draw(
    family: str,
    by_source: dict[int, list[Any]],
    weights: dict[int, float],
    size: int | None,
    seed: int,
    labels: dict[int, str],
) -> tuple[dict[int, list[Any]], int]:
    """Each source's drawn train rows and the mixture's size (module docstring)."""
    total = sum(weights.values())
    largest = min(math.floor(len(by_source.get(i, [])) * total / w) for i, w in weights.items())
    if size is None:
        size = largest
    if size > largest or size == 0:
        limit = min(weights, key=lambda i: len(by_source.get(i, [])) * total / weights[i])
        raise ConfigError(
            f"prep config: the {family} mixture needs {size or 'some'} train rows, but {labels[limit]} has "
            f"{len(by_source.get(limit, []))} at weight share {weights[limit] / total:.3f}, so at most "
            f"{largest} can be drawn without repeating a row; lower mix.{family}.train_rows or that weight"
        )
    counts = shares(size, weights)
    drawn = {
        i: random.Random(f"alignpipe-mix:{seed}:{family}:{i}").sample(by_source.get(i, []), counts[i])
        for i in weights
    }
    return drawn, size


def source_label(src: dict[str, Any], index: int) -> str:
    where = src.get("path") or src.get("name")
    return f"sources[{index}] ({src['kind']}{': ' + str(where) if where else ''})"


def mix_families(
    cfg: dict[str, Any], sources: list[dict[str, Any]], splits: dict[str, dict], seed: int
) -> dict:
    """Replace each weighted family's train split by its mixture (in place); returns, per mixed
    family, its size and each source's weight, available and drawn train rows."""
    weights = {i: source_weight(src, i) for i, src in enumerate(sources)}
    labels = {i: source_label(src, i) for i, src in enumerate(sources)}
    out: dict[str, Any] = {}
    for family, by_split in splits.items():
        feeding = sorted({src for placed in by_split.values() for _, _, src in placed})
        weighted = [i for i in feeding if weights[i] is not None]
        size = mixture_size(cfg, family)
        if not weighted:
            if size is not None:
                raise ConfigError(
                    f"prep config: mix.{family}.train_rows is set but no source feeding {family} has a "
                    "weight; give its sources weights or drop the setting"
                )
            continue
        unweighted = [i for i in feeding if weights[i] is None]
        if unweighted:
            raise ConfigError(
                f"prep config: {labels[unweighted[0]]} feeds {family} without a weight, beside weighted "
                f"{labels[weighted[0]]}; give every source of a mixture a weight"
            )
        by_source = {i: [p for p in by_split["train"] if p[2] == i] for i in feeding}
        drawn, size = draw(family, by_source, {i: weights[i] for i in feeding}, size, seed, labels)
        by_split["train"] = [p for i in feeding for p in drawn[i]]
        out[family] = {
            "train_rows": size,
            "sources": {
                labels[i]: {"weight": weights[i], "available": len(by_source[i]), "drawn": len(drawn[i])}
                for i in feeding
            },
        }
    return out
