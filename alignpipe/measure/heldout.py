"""Held-out verifier accuracy: the one definition every policy stage reports as ``heldout/*``.

Sampling is the expensive part, so each policy's held-out samples are drawn once, by the
stage that trains it, and published beside its weights (``heldout_samples.jsonl``, keyed by
the prompts and sampling settings). Later readers of that model directory (the RL stages for
their SFT reference, ``convert`` for an unchanged export, ``evaluate``) reuse them when the
key matches, and sample afresh otherwise. What an RL stage measured on them (KL to its
reference, reward-model scores) goes beside them too (``heldout_measures.json``), with the
hash of the model each was measured against.

Every accuracy comes with its 95% interval (``intervals``: Wilson's for 0/1 verdicts), so a
stage's ``metrics.json`` and outcome line say how far its few hundred prompts can be trusted.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from alignpipe.context import StageContext, scratch_root
from alignpipe.errors import ConfigError, UnsupportedSetting
from alignpipe.jsonl import read_jsonl
from alignpipe.measure.generation import Prompt, generate, generate_vllm, model_system_prompt
from alignpipe.measure.intervals import interval_of
from alignpipe.settings import Heldout


def heldout_rows(ctx: StageContext, settings: Heldout | None = None) -> list[dict[str, Any]]:
    """The held-out prompts: ``data_path``, the first ``limit`` rows when set (a per-profile knob:
    sampling them is most of an RL stage's held-out cost on a real model)."""
    settings = settings or ctx.settings.heldout
    rows = read_jsonl(ctx.root / settings.data_path)
    return rows[: settings.limit] if settings.limit else rows


def drawing_backend(settings: Heldout) -> str:
    """What draws a published model's samples here: vLLM when the settings ask for it and it is
    installed (the NeMo-RL image, where evaluate and the nemo_rl engine's check run on GPU
    profiles), else transformers, e.g. the local engine's trainers on a host without vLLM."""
    import importlib.util

    if settings.backend == "vllm" and importlib.util.find_spec("vllm") is not None:
        return "vllm"
    return "hf"


def drawn_with(settings: Heldout, backend: str) -> Heldout:
    """``settings`` as the backend that actually drew the samples: what their key names."""
    return dataclasses.replace(settings, backend=backend)


SAMPLES_FILE = "heldout_samples.jsonl"
# What a sample depends on besides the model and the prompts (batching moves the RNG stream).
SAMPLING_KEYS = ("max_new_tokens", "temperature", "top_p", "batch_size", "seed")


@dataclass(frozen=True)
class HeldoutSamples:
    """One policy's seeded held-out samples: what ``heldout/*``, KL and RM scores are measured on."""

    rows: list[dict[str, Any]]
    completions: list[str]
    key: str
    reused: bool = False
    # The system turn the prompts were asked with: what KL is measured under, too.
    system: str | None = None
    # Rows that offer tools: each answer's (tool calls, malformed calls); None without tools.
    tool_use: list[tuple[int, int]] | None = None

    @property
    def prompts(self) -> list[Prompt]:
        return [r["prompt"] for r in self.rows]


def sampling_key(rows: list[dict[str, Any]], settings: Heldout, system: str | None = None) -> str:
    sampling = {k: getattr(settings, k) for k in SAMPLING_KEYS}
    if offered_tools(rows):  # rows without tools keep the key they had before tools
        sampling["max_tool_turns"] = settings.max_tool_turns
    if settings.backend != "hf":  # hf samples keep the key they had before backends
        sampling["backend"] = settings.backend
    ids = [r.get("id") or r["prompt"] for r in rows]
    # Without a system prompt the key is what it was before there could be one.
    parts = [sampling, ids] if system is None else [sampling, ids, system]
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def load_samples(model_dir: Path, key: str, n: int) -> tuple[list[str], list[tuple[int, int]] | None] | None:
    """The completions a model directory carries for ``key`` and their tool use, or None."""
    path = Path(model_dir) / SAMPLES_FILE
    if not path.is_file():
        return None
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if len(lines) != n or any(line.get("key") != key for line in lines):
        return None
    tool_use = (
        [(line["tool_calls"], line["tool_malformed"]) for line in lines] if "tool_calls" in lines[0] else None
    )
    return [line["completion"] for line in lines], tool_use


def samples_file(samples: HeldoutSamples) -> dict[str, str]:
    """``{SAMPLES_FILE: text}`` to publish beside the model (``publish_model(files=...)``)."""
    uses = samples.tool_use or [None] * len(samples.rows)
    lines = []
    for r, c, use in zip(samples.rows, samples.completions, uses, strict=True):
        line = {"key": samples.key, "id": r.get("id"), "completion": c}
        if use is not None:  # a line without tools is what it was before tools
            line.update(tool_calls=use[0], tool_malformed=use[1])
        lines.append(json.dumps(line, ensure_ascii=False) + "\n")
    return {SAMPLES_FILE: "".join(lines)}


MEASURES_FILE = "heldout_measures.json"


def measures_file(samples: HeldoutSamples, measures: dict[str, dict[str, Any]]) -> dict[str, str]:
    """``{MEASURES_FILE: text}``: what was measured on ``samples`` and against which model.

    ``measures`` maps a measure to ``{"model": <DVC hash of the model it was measured with>, ...}``:
    ``kl_to_reference: {model, value}`` (the reference policy) and ``rm_score: {model, scores}``
    (the reward model, one score per sample). ``evaluate`` reuses an entry when the model it
    would measure with has the same hash, instead of running both models over the samples again.
    """
    if not measures:
        return {}
    return {MEASURES_FILE: json.dumps({"key": samples.key, **measures}, indent=1, sort_keys=True) + "\n"}


def load_measures(model_dir: Path | str, samples: HeldoutSamples) -> dict[str, dict[str, Any]]:
    """The measures a model directory carries for exactly these samples (``{}`` if none)."""
    path = Path(model_dir) / MEASURES_FILE
    if not path.is_file():
        return {}
    found = json.loads(path.read_text())
    if found.pop("key", None) != samples.key:
        return {}
    return found


SCORES_FILE = "reference_rm_scores.json"


def scores_file(policy_hash: str, samples: HeldoutSamples, scores: list[float]) -> dict[str, str]:
    """``{SCORES_FILE: text}`` for a reward model's directory: its scores of the held-out samples
    its starting policy (the SFT reference, DVC hash ``policy_hash``) published. The rm stage
    writes them once; rlhf and evaluate, which need the reference's RM scores, reuse them."""
    return {SCORES_FILE: json.dumps({"policy": policy_hash, "key": samples.key, "scores": scores}) + "\n"}


def load_scores(rm_dir: Path | str, policy_hash: str, samples: HeldoutSamples) -> list[float] | None:
    """The scores ``rm_dir`` published for exactly these samples of that policy, else None."""
    path = Path(rm_dir) / SCORES_FILE
    if not path.is_file():
        return None
    found = json.loads(path.read_text())
    if found.get("policy") != policy_hash or found.get("key") != samples.key:
        return None
    return found["scores"]


def published_samples(ctx: StageContext, model_dir: Path | str) -> HeldoutSamples | None:
    """The held-out samples ``model_dir`` carries for this stage's prompts and settings, asked
    with the system prompt that model was trained with; None when it carries none that match."""
    settings = ctx.settings.heldout
    rows = heldout_rows(ctx, settings)
    system = model_system_prompt(model_dir)
    key = sampling_key(rows, drawn_with(settings, drawing_backend(settings)), system)
    if (cached := load_samples(Path(model_dir), key, len(rows))) is None:
        return None
    completions, tool_use = cached
    return HeldoutSamples(rows, completions, key, reused=True, system=system, tool_use=tool_use)


def sample_heldout(
    ctx: StageContext, model, tokenizer, model_dir: Path | str | None = None
) -> HeldoutSamples:
    """This model's held-out samples: reused from ``model_dir`` when it carries them for these
    prompts and settings, drawn (seeded) otherwise. A published model (``model_dir``) is asked
    with the system prompt it was trained with; the stage's own policy with the stage's."""
    if model_dir is not None and (held := published_samples(ctx, model_dir)) is not None:
        return held
    settings = ctx.settings.heldout
    rows = heldout_rows(ctx, settings)
    system = model_system_prompt(model_dir) if model_dir is not None else ctx.system_prompt
    if model_dir is not None and drawing_backend(settings) == "vllm":
        if offered_tools(rows):
            raise UnsupportedSetting(
                f"{settings.data_path}: its rows offer tools, which held-out sampling runs on the hf backend "
                "only: set alignpipe.heldout.backend: hf"
            )
        completions, tool_use = vllm_completions(ctx, Path(model_dir), rows, settings, system), None
    else:  # the stage's own policy (in memory, not published yet) is sampled with transformers
        completions, tool_use = heldout_completions(model, tokenizer, rows, settings, system)
        settings = drawn_with(settings, "hf")
    key = sampling_key(rows, settings, system)
    return HeldoutSamples(rows, completions, key, system=system, tool_use=tool_use)


def vllm_completions(
    ctx: StageContext,
    model_dir: Path,
    rows: list[dict[str, Any]],
    settings: Heldout,
    system: str | None,
) -> list[str]:
    """``heldout_completions``' sampling on vLLM, over the model's directory (an adapter's chain
    merged first: vLLM loads full weights here), with the ``alignpipe.heldout.vllm`` engine settings."""
    from alignpipe.adapters import merged_dir
    from alignpipe.measure.logprobs import LOCAL_DTYPE

    full = merged_dir(model_dir, ctx.root, scratch_root(ctx.params) / "merged", LOCAL_DTYPE)
    prompts = [r["prompt"] for r in rows]
    return generate_vllm(
        full, prompts, **sampling_args(settings), system=system, engine=vllm_engine(settings)
    )


def vllm_engine(settings: Heldout) -> dict[str, Any]:
    """``alignpipe.heldout.vllm``: the ``vllm.LLM`` arguments the profile sets."""
    return {k: v for k, v in dataclasses.asdict(settings.vllm).items() if v is not None}


def heldout_completions(
    model, tokenizer, rows: list[dict[str, Any]], settings: Heldout, system: str | None = None
) -> tuple[list[str], list[tuple[int, int]] | None]:
    """The seeded samples ``heldout_accuracy`` scores (one per row), from ``alignpipe.heldout``
    settings, and their tool use. Rows that offer tools are rolled out with them
    (``max_tool_turns`` turns, ``max_new_tokens`` for all of them): the sample is the final
    answer, its tool use (calls, malformed calls); without tools the tool use is None."""
    prompts = [r["prompt"] for r in rows]
    names = offered_tools(rows)
    if not names:
        drawn = generate(
            model,
            tokenizer,
            prompts,
            **sampling_args(settings),
            batch_size=settings.batch_size,
            system=system,
        )
        return drawn, None
    from alignpipe.measure.tool_generation import generate_with_tools
    from alignpipe.tools import BUILTIN_TOOLS, build_toolset

    unknown = [n for n in names if n not in BUILTIN_TOOLS]
    if unknown:
        raise ConfigError(
            f"{settings.data_path}: held-out rows offer {unknown[0]!r}; held-out sampling runs the builtin "
            f"tools ({', '.join(BUILTIN_TOOLS)}) only"
        )
    rollouts = generate_with_tools(
        model, tokenizer, prompts, build_toolset({"tools": names}), max_turns=settings.max_tool_turns,
        **sampling_args(settings), batch_size=settings.batch_size, system=system,
    )  # fmt: skip
    return ["" if r.answer is None else r.answer for r in rollouts], [
        (r.calls, r.malformed) for r in rollouts
    ]


def offered_tools(rows: Iterable[dict[str, Any]]) -> list[str]:
    """The names of the tools the rows offer (prep's ``tools`` column), sorted."""
    return sorted({t.get("function", t)["name"] for r in rows for t in r.get("tools") or []})


def sampling_args(settings: Heldout) -> dict[str, Any]:
    """The sampling settings both backends draw with (``alignpipe.heldout``)."""
    return {k: getattr(settings, k) for k in ("max_new_tokens", "temperature", "top_p", "seed")}


def heldout_accuracy(
    tokenizer,
    rows: Iterable[dict[str, Any]],
    completions: list[str],
    tool_use: list[tuple[int, int]] | None = None,
) -> dict[str, Any]:
    """Verifier accuracy of sampled answers on held-out prompts, overall and per task, each
    with its 95% interval under ``intervals`` (``{"accuracy": {"low": .., "high": ..}, ...}``).
    With ``tool_use`` (answers rolled out with tools): tool calls per answer, the share of
    calls that could not be read, and the accuracy of answers with and without a call.

    The one definition every policy stage reports as ``heldout/accuracy``, of ``completions``
    drawn with ``heldout_completions`` or on vLLM (one per row).
    """
    from alignpipe.rewards import score_completions

    rows = list(rows)
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
    groups = {"accuracy": scores, **{f"accuracy_{t}": v for t, v in sorted(by_task.items())}}
    if tool_use is not None:
        calls = sum(c for c, _ in tool_use)
        result["tool_calls_per_answer"] = calls / max(1, len(tool_use))
        result["tool_malformed_share"] = sum(m for _, m in tool_use) / max(1, calls)
        for name, called in (("tool_accuracy_with_call", True), ("tool_accuracy_without_call", False)):
            chosen = [s for s, (c, _) in zip(scores, tool_use, strict=True) if (c > 0) == called]
            if chosen:
                result[name] = sum(chosen) / len(chosen)
                groups[name] = chosen
    if scores:
        result["intervals"] = {name: interval_of(values) for name, values in groups.items()}
    return result


def headline(result: dict[str, Any], suffix: str = "") -> float | tuple[float, float, float]:
    """A stage's outcome-line figure for ``result["accuracy" + suffix]``: with its interval
    when there is one (``console.outcome`` prints ``0.530 [0.474, 0.586]``)."""
    value = result[f"accuracy{suffix}"]
    bounds = (result.get(f"intervals{suffix}") or {}).get("accuracy")
    return (value, bounds["low"], bounds["high"]) if bounds else value


def log_heldout(live, tokenizer, samples: HeldoutSamples, suffix: str = "") -> dict[str, Any]:
    """Held-out accuracy of ``samples`` into ``live.summary["heldout"]`` (a DVCLive ``Live``),
    each name with ``suffix`` (``_reference`` for the SFT reference's: ``intervals_reference``)."""
    result = heldout_accuracy(tokenizer, samples.rows, samples.completions, samples.tool_use)
    result = {f"{k}{suffix}": v for k, v in result.items()}
    live.summary.setdefault("heldout", {}).update(result)
    return result
