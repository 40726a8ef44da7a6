"""Held-out verifier accuracy: the one definition every policy stage reports as ``heldout/*``."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from alignpipe.config import get_path
from alignpipe.context import StageContext
from alignpipe.jsonl import read_jsonl
from alignpipe.measure.generation import generate


def heldout_settings(ctx: StageContext) -> dict[str, Any]:
    settings = dict(get_path(ctx.config, "alignpipe.heldout", {}) or {})
    settings.setdefault("data_path", "data/prepared/rlvr/test.jsonl")
    return settings


def heldout_completions(model, tokenizer, rows: list[dict[str, Any]], settings: dict[str, Any]) -> list[str]:
    """The seeded samples ``heldout_accuracy`` scores (one per row), from ``alignpipe.heldout`` settings."""
    return generate(
        model,
        tokenizer,
        [r["prompt"] for r in rows],
        max_new_tokens=int(settings.get("max_new_tokens", 16)),
        temperature=float(settings.get("temperature", 1.0)),
        top_p=float(settings.get("top_p", 1.0)),
        batch_size=int(settings.get("batch_size", 128)),
        seed=int(settings.get("seed", 1234)),
    )


def heldout_accuracy(
    model,
    tokenizer,
    rows: Iterable[dict[str, Any]],
    settings: dict[str, Any],
    completions: list[str] | None = None,
) -> dict[str, float]:
    """Verifier accuracy of sampled answers on held-out prompts, overall and per task.

    The one definition every policy stage reports as ``heldout/accuracy``. ``completions``:
    samples already drawn with ``heldout_completions`` (the evaluate stage reuses them).
    """
    from alignpipe.rewards import score_completions

    rows = list(rows)
    if completions is None:
        completions = heldout_completions(model, tokenizer, rows, settings)
    scores = score_completions(rows, completions)
    result = {
        "accuracy": sum(scores) / max(1, len(scores)),
        "mean_length": sum(len(tokenizer(c, add_special_tokens=False)["input_ids"]) for c in completions)
        / max(1, len(completions)),
    }
    by_task: dict[str, list[float]] = {}
    for row, score in zip(rows, scores, strict=True):
        by_task.setdefault(row.get("task", "all"), []).append(score)
    for task, values in sorted(by_task.items()):
        result[f"accuracy_{task}"] = sum(values) / len(values)
    return result


def log_heldout(live, ctx: StageContext, model, tokenizer) -> dict[str, float]:
    """Held-out accuracy of ``model`` into ``live.summary["heldout"]`` (a DVCLive ``Live``)."""
    settings = heldout_settings(ctx)
    rows = read_jsonl(ctx.root / settings["data_path"])
    result = heldout_accuracy(model, tokenizer, rows, settings)
    for key, value in result.items():
        live.summary.setdefault("heldout", {})[key] = value
    return result
