"""Whether a policy's gain over the SFT policy holds from one training run to another.

The runs (git revisions, DVC experiments or the workspace; typically ``dvc exp run -S seed=N``,
the data and held-out prompts fixed) each evaluated every policy on the same held-out prompts.
Per run, a policy's difference from ``sft`` is paired per prompt (measure/intervals.py); over the
runs, those per-run differences are pooled as a mean with a t interval over the runs. That
interval carries the spread between training seeds (another seed, or another machine's float
order, is another draw of training) as well as each run's prompt sampling, which a single run's
per-prompt interval cannot: a claim that holds there holds for the recipe, not for one draw.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from alignpipe.measure.compare import CompareError, Run, heldout_figures, same_prompts
from alignpipe.measure.intervals import Z95, above, below, paired_difference

REFERENCE = "sft"
# Student's t 97.5th percentiles by degrees of freedom: a mean over a few runs is far from
# normal enough for Z95 (3 runs: 4.30, not 1.96). Beyond 30 the normal's is within 4%.
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262,
        10: 2.228, 12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042}  # fmt: skip


def across_runs(values: Sequence[float]) -> dict[str, float]:
    """``{value, low, high}``: the mean of one figure over ``n >= 2`` runs and its 95% t interval
    (n - 1 degrees of freedom; between tabulated ones, the next smaller)."""
    n = len(values)
    if n < 2:
        raise ValueError("an interval across runs needs at least two runs")
    mean = sum(values) / n
    error = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n)
    t = T975[max(k for k in T975 if k <= n - 1)] if n - 1 <= 30 else Z95
    return {"value": mean, "low": mean - t * error, "high": mean + t * error}


@dataclass
class SeedRow:
    policy: str
    figure: str  # heldout_accuracy, heldout_accuracy_<task>, rm_score
    per_run: list[dict[str, float]]  # policy - reference within each run, paired per prompt
    pooled: dict[str, float]  # the per-run values' mean, with its t interval over the runs

    @property
    def verdict(self) -> str:
        if above(self.pooled):
            return "above zero"
        if below(self.pooled):
            return "below zero"
        return "not resolved"


def pool(runs: list[Run], reference: str = REFERENCE) -> list[SeedRow]:
    """Every policy but ``reference``, each figure its runs all have, as ``policy - reference``
    per run and pooled over the runs. Refuses fewer than two runs, a run without the reference
    or the policy, and runs on different held-out prompts (naming the first that differs)."""
    if len(runs) < 2:
        raise CompareError(f"pooling across runs needs at least two runs, got {len(runs)}")
    for run in runs:
        if reference not in run.heldout:
            raise CompareError(f"{run.name} has no {reference} policy to measure the others against")
        same_prompts(runs[0], run, reference, runs[0].heldout[reference], run.heldout[reference])
    policies = sorted(set.intersection(*(set(r.heldout) for r in runs)) - {reference})
    rows = []
    for policy in policies:
        figures: dict[str, list[dict[str, float]]] = {}
        for run in runs:
            mine, ref = run.heldout[policy], run.heldout[reference]
            same_prompts(run, run, policy, ref, mine)  # within a run: every policy, the same prompts
            for figure, values, base in heldout_figures(mine, ref):
                figures.setdefault(figure, []).append(paired_difference(values, base))
        for figure, per_run in figures.items():
            if len(per_run) == len(runs):
                rows.append(SeedRow(policy, figure, per_run, across_runs([d["value"] for d in per_run])))
    return rows


def _cell(d: dict[str, float]) -> str:
    return f"{d['value']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}]"


def markdown(runs: list[Run], rows: list[SeedRow], reference: str = REFERENCE) -> str:
    names = ", ".join(r.label for r in runs)
    lines = [
        f"### policy - {reference} over {len(runs)} runs",
        "",
        f"Runs: {names}. Per run: the difference paired per held-out prompt, with its 95% interval. "
        f"Pooled: the runs' mean with a 95% t interval over the {len(runs)} runs (between-run spread included).",
        "",
        "| policy | figure | " + " | ".join(r.name for r in runs) + " | pooled [95%] | |",
        "|---|---|" + "---:|" * (len(runs) + 1) + "---|",
    ]
    for row in rows:
        cells = " | ".join(_cell(d) for d in row.per_run)
        lines.append(f"| {row.policy} | {row.figure} | {cells} | {_cell(row.pooled)} | {row.verdict} |")
    if any(r.figure == "rm_score" for r in rows):
        lines += ["", "- rm_score: each run's policies are scored by that run's own reward model"]
    return "\n".join(lines) + "\n"


def as_json(runs: list[Run], rows: list[SeedRow], reference: str = REFERENCE) -> dict[str, Any]:
    return {
        "reference": reference,
        "runs": [r.label for r in runs],
        "rows": [
            {
                "policy": r.policy,
                "figure": r.figure,
                "per_run": r.per_run,
                "pooled": r.pooled,
                "verdict": r.verdict,
            }
            for r in rows
        ],
    }
