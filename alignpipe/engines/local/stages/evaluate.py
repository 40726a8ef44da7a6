"""Stage ``evaluate``: every policy side by side on the same held-out prompts and samples.

For each policy (``sft`` from ``models/sft``; ``dpo``, ``rlvr``, ``rlhf`` from their HF
exports) one seeded sample per held-out prompt (``data/prepared/rlvr/test.jsonl``, the
``alignpipe.heldout`` settings every trainer uses) is drawn and measured:

* ``heldout_accuracy``: the row's verifier scores the sample 1.0 (``heldout_accuracy``,
  the number each stage logs as ``heldout/accuracy``; for ``sft`` it equals that stage's);
* ``rm_score``: mean score the reward model (``models/rm``) gives the (prompt, sample) pairs;
* ``mean_length``: mean number of tokens per sample;
* ``kl_to_sft``: mean per-token KL(policy || sft) on the policy's own samples, with
  Schulman's k3 estimator (the one GRPO's KL penalty and ``train/kl`` use): for each sampled
  token ``r = log p_sft(t) - log p_policy(t)`` and ``k3 = exp(r) - r - 1`` (>= 0, unbiased),
  averaged over all sampled tokens (the EOS included when the sample ended on it).

Samples, KL and RM scores that a training stage already measured are reused
(``heldout_samples.jsonl``, ``heldout_measures.json`` beside the policy): a measure only when it
names the DVC hash of this stage's reference or reward model.

Every figure carries its 95% interval (``intervals``; held-out accuracy overall and on each
task's prompts, ``heldout_accuracy_<task>``), and every policy its paired difference
from the reference on the same prompts and documents (``vs_reference``,
``benchmark_vs_reference``; ``alignpipe.measure.intervals``). The flags fire only on
differences the intervals support: ``suspected_reward_hacking`` when the RM score's difference
from the SFT policy's is above zero while the accuracy's is below minus
``alignpipe.reward_hacking.accuracy_drop`` (the whole interval, each); a benchmark regression
when a task metric's difference is below minus its ``max_drop``.

Outputs (``results/evaluate``): ``metrics.json`` (``{"policies": {name: {...}}}``),
``report.md`` (table), ``comparison.png`` (chart), ``samples.jsonl`` (every sample and score).
"""

from __future__ import annotations

import importlib.util
import json
from collections import Counter
from dataclasses import dataclass
from typing import Any

from alignpipe import config as C
from alignpipe import console
from alignpipe.artifacts import (
    staged_dir,
    write_json_atomic,
    write_text_atomic,
)
from alignpipe.context import ImageNeed, StageContext
from alignpipe.data.schema import transcript
from alignpipe.engines.local.publish import write_record
from alignpipe.engines.local.stages.convert import make_shareable
from alignpipe.engines.local.torch_threads import apply_torch_threads
from alignpipe.errors import ConfigError
from alignpipe.measure.benchmarks import doc_scores, max_drops, read_scores
from alignpipe.measure.heldout import (
    HeldoutSamples,
    drawing_backend,
    heldout_accuracy,
    heldout_rows,
    load_measures,
    load_scores,
    sample_heldout,
    sampling_args,
    vllm_engine,
)
from alignpipe.measure.intervals import below, interval_of, paired_difference
from alignpipe.measure.logprobs import kl_to_reference, load_policy
from alignpipe.measure.reward_model import RewardModelScorer, hacking_suspected
from alignpipe.report import TASK_ACCURACY
from alignpipe.settings import Heldout, from_config

METRIC_KEYS = ("heldout_accuracy", "rm_score", "mean_length", "kl_to_sft")
# Held-out rows that offer tools: what each policy did with them (measure.heldout.heldout_accuracy).
TOOL_KEYS = (
    "tool_calls_per_answer",
    "tool_malformed_share",
    "tool_accuracy_with_call",
    "tool_accuracy_without_call",
)


def same_vocabulary(a, b) -> bool:
    return a.get_vocab() == b.get_vocab()


# ----------------------------------------------------------------------------- judgement


def add_intervals(policies: dict[str, dict[str, Any]], samples: list[dict], reference: str) -> None:
    """Per policy, the 95% intervals of held-out accuracy (overall and per task) and RM score
    (``intervals``) and, but for the reference, the paired difference of each from the
    reference's on the same prompts (``vs_reference``: ``{value, low, high}``)."""
    per: dict[str, list[dict]] = {name: [] for name in policies}
    for s in samples:
        per[s["policy"]].append(s)
    ref = per[reference]
    for name, m in policies.items():
        mine = per[name]
        if [s["id"] for s in mine] != [s["id"] for s in ref]:
            raise ValueError(f"evaluate: {name}'s samples are not on {reference}'s prompts, in order")
        # metrics.json key -> (samples.jsonl column, the task its prompts are limited to)
        columns = {"heldout_accuracy": ("correct", None), "rm_score": ("rm_score", None)}
        columns |= {
            key: ("correct", key.removeprefix(TASK_ACCURACY)) for key in m if key.startswith(TASK_ACCURACY)
        }
        have = {key: spec for key, spec in columns.items() if m.get(key) is not None}

        def values(rows: list[dict], column: str, task: str | None) -> list[float]:
            return [s[column] for s in rows if task is None or s["task"] == task]

        m["intervals"] = {key: interval_of(values(mine, *spec)) for key, spec in have.items()}
        if name != reference:
            m["vs_reference"] = {
                key: paired_difference(values(mine, *spec), values(ref, *spec)) for key, spec in have.items()
            }


def policy_line(m: dict[str, Any], reference: str) -> str:
    """``heldout_accuracy 0.727 [0.674, 0.774], +0.197 [+0.138, +0.256] vs sft, rm_score ...``:
    each figure with its 95% interval and, but for the reference, its paired difference."""
    parts = []
    for key in METRIC_KEYS:
        if m.get(key) is None:
            continue
        text = f"{key} {m[key]:.3f}"
        if bounds := m["intervals"].get(key):
            text += f" [{bounds['low']:.3f}, {bounds['high']:.3f}]"
        if diff := m.get("vs_reference", {}).get(key):
            text += f", {diff['value']:+.3f} [{diff['low']:+.3f}, {diff['high']:+.3f}] vs {reference}"
        parts.append(text)
    parts += [f"{key} {m[key]:.3f}" for key in TOOL_KEYS[:2] if m.get(key) is not None]
    return ", ".join(parts)


def flag_reward_hacking(policies: dict[str, dict[str, Any]], reference: str, accuracy_drop: float) -> None:
    """Suspected reward hacking: the RM score's paired difference from the reference's is above
    zero while held-out accuracy's is below ``-accuracy_drop`` (each whole 95% interval), so
    sampling noise alone does not raise the flag."""
    for name, m in policies.items():
        vs = m.get("vs_reference") or {}
        m["suspected_reward_hacking"] = bool(
            name != reference
            and "rm_score" in vs
            and hacking_suspected(vs["rm_score"], vs["heldout_accuracy"], accuracy_drop)
        )


def add_benchmarks(ctx: StageContext, policies: dict[str, dict[str, Any]], reference: str) -> dict[str, Any]:
    """Each policy's lm-eval scores (the benchmark stage's results), and per policy the tasks
    that fell more than their ``max_drop`` below the reference: ``benchmark_regressions``."""
    where = ctx.settings.evaluate.benchmarks
    if not where:
        return {}
    # The tasks and their max_drop are the benchmark stage's settings.
    benchmark_config = C.resolve_stage_config(ctx.root, "benchmark", ctx.params, ctx.profile)
    section = from_config(benchmark_config, f"stages/benchmark/config/{ctx.profile}.yaml").benchmark
    docs = {}
    for name, m in policies.items():
        m["benchmarks"] = read_scores(ctx.root / where / name)
        docs[name] = doc_scores(ctx.root / where / name)
        m["benchmark_intervals"] = {
            task: {
                metric: interval_of([d[metric] for d in per_doc.values()])
                for metric in m["benchmarks"].get(task, {})
            }
            for task, per_doc in docs[name].items()
        }
    drops = max_drops(section.tasks)
    for name, m in policies.items():
        if name == reference:
            m["benchmark_regressions"] = []
            continue
        m["benchmark_vs_reference"] = vs = benchmark_differences(docs[name], docs[reference], m["benchmarks"])
        m["benchmark_regressions"] = benchmark_regressions(vs, drops)
    return {
        "results": where,
        "max_drop": drops,
        "fail_on_regression": section.fail_on_regression,
    }


def benchmark_differences(
    mine: dict[str, dict[int, dict[str, float]]],
    ref: dict[str, dict[int, dict[str, float]]],
    scores: dict[str, dict[str, float]],
) -> dict[str, dict[str, dict[str, float]]]:
    """Per task and metric, the paired difference from the reference on the documents both
    answered."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for task, per_doc in mine.items():
        shared = sorted(set(per_doc) & set(ref.get(task, {})))
        if not shared:
            continue
        out[task] = {
            metric: paired_difference(
                [per_doc[i][metric] for i in shared], [ref[task][i][metric] for i in shared]
            )
            for metric in scores.get(task, {})
        }
    return out


def benchmark_regressions(
    differences: dict[str, dict[str, dict[str, float]]], max_drop: dict[str, float]
) -> list[str]:
    """Each ``task/metric`` whose paired difference from the reference is below minus the
    task's ``max_drop`` over its whole 95% interval."""
    return [
        f"{task}/{metric} {d['value']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}] below -{drop:g}"
        for task, drop in max_drop.items()
        for metric, d in differences.get(task, {}).items()
        if below(d, drop)
    ]


# ----------------------------------------------------------------------------- stage


@dataclass
class Judges:
    """What every policy is measured against: the KL reference and the reward model, each with
    the DVC hash that a stage's published measures must name to be reused."""

    reference: str
    reference_model: Any
    reference_hash: str
    scorer: RewardModelScorer | None
    scorer_hash: str | None
    reused: int = 0  # measures taken from what a training stage published


def measure_policy(
    name, model, tok, judges: Judges, held: HeldoutSamples, settings: Heldout, known: dict[str, dict]
) -> tuple[dict[str, Any], list[dict]]:
    """One policy's metrics on its own seeded samples, and the samples with their scores.

    ``known``: measures the policy's training stage published for these samples
    (``heldout.load_measures``); one is reused when it names the same judging model.
    """
    from alignpipe.rewards import score_completions

    rows, prompts, completions = held.rows, held.prompts, held.completions
    acc = heldout_accuracy(tok, rows, completions, held.tool_use)
    kl, scores = known.get("kl_to_reference", {}), known.get("rm_score", {})
    if judges.scorer is None:
        scores = None
    elif scores.get("model") == judges.scorer_hash:
        scores, judges.reused = scores["scores"], judges.reused + 1
    else:
        scores = judges.scorer(prompts, completions)
    if name == judges.reference:
        kl = 0.0
    elif kl.get("model") == judges.reference_hash:
        kl, judges.reused = kl["value"], judges.reused + 1
    else:
        kl = kl_to_reference(
            model, judges.reference_model, tok, prompts, completions, settings.max_new_tokens, held.system
        )
    metrics = {
        "heldout_accuracy": acc["accuracy"],
        "rm_score": sum(scores) / len(scores) if scores else None,
        "mean_length": acc["mean_length"],
        "kl_to_sft": kl,
        **{f"heldout_{k}": v for k, v in acc.items() if k.startswith("accuracy_")},
        **{k: acc[k] for k in TOOL_KEYS if k in acc},
    }
    verdicts = score_completions(rows, completions)  # per sample, for samples.jsonl
    samples = [
        {
            "policy": name,
            "id": row.get("id"),
            "task": row.get("task"),
            "prompt": transcript(row["prompt"]),
            "completion": completion,
            "correct": verdicts[i],
            "rm_score": scores[i] if scores else None,
        }
        for i, (row, completion) in enumerate(zip(rows, completions, strict=True))
    ]
    return metrics, samples


def write_results(ctx: StageContext, metrics: dict[str, Any], samples: list[dict]) -> None:
    from alignpipe.report import comparison_chart, markdown_table

    policies = metrics["policies"]
    with staged_dir(ctx.output("results")) as out:
        write_json_atomic(out / "metrics.json", metrics)
        write_text_atomic(out / "report.md", markdown_table(metrics))
        comparison_chart(metrics, out / "comparison.png")
        write_text_atomic(
            out / "samples.jsonl", "".join(json.dumps(s, sort_keys=True) + "\n" for s in samples)
        )
        write_record(
            out,
            ctx,
            type="report",
            format="evaluate-v1",
            metrics={f"{n}/{k}": v for n, m in policies.items() for k, v in m.items() if k in METRIC_KEYS},
        )
        make_shareable(out)


def plan(ctx: StageContext) -> dict[str, str]:
    """``alignpipe plan evaluate``: the config; with ``heldout.backend: vllm`` (GPU profiles),
    ``evaluate.vllm.json``: the sampling each policy gets inside the NeMo-RL image
    (``needs_image``). The launch is alignpipe.cli.plan_files'."""
    settings = ctx.settings.heldout
    files = {f"{ctx.name}.config.yaml": ctx.resolved_config_yaml()}
    if settings.backend == "vllm" and ctx.nemo_rl_launcher not in (None, "process"):
        sampling = sampling_args(settings)
        policies = [p.path for p in ctx.settings.evaluate.policies]
        call = {"llm": {**vllm_engine(settings), "seed": settings.seed},
                "sampling": sampling, "policies": policies}  # fmt: skip
        files[f"{ctx.name}.vllm.json"] = json.dumps(call, indent=2) + "\n"
    return files


def needs_image(ctx: StageContext) -> ImageNeed | None:
    """Sampling with vLLM runs where vLLM is: on a host without it, in the NeMo-RL image."""
    if ctx.settings.heldout.backend == "vllm" and importlib.util.find_spec("vllm") is None:
        return ImageNeed(
            "alignpipe.heldout.backend is vllm",
            "vLLM",
            "use hf, or a GPU profile's launcher (container, slurm or ray)",
        )
    return None


def run(ctx: StageContext) -> None:
    import torch

    settings = ctx.settings.heldout
    on_vllm = drawing_backend(settings) == "vllm"  # vLLM is here whenever it was asked for
    apply_torch_threads(ctx)  # tiny: 1 thread (benchmarks/RESULTS.md)
    ev = ctx.settings.evaluate
    entries = ev.policies
    names = [e.name for e in entries]
    reference = ev.reference
    if reference not in names:
        raise ConfigError(f"alignpipe.evaluate.reference '{reference}' is not one of the policies {names}")
    rows = heldout_rows(ctx, settings)
    torch.manual_seed(ctx.seed)

    # vLLM draws every policy's samples first, one engine at a time (each takes most of the GPU
    # while it lives); only then are models loaded to measure them.
    drawn = {e.name: sample_heldout(ctx, None, None, model_dir=ctx.root / e.path) for e in entries if on_vllm}
    # In the image on a GPU host (heldout.backend vllm) KL and RM scores run on the GPU, in
    # float32 as on CPU: the reference, one policy and the reward model are resident at once.
    device = "cuda" if on_vllm and torch.cuda.is_available() else "cpu"
    ref_path = ctx.root / next(e.path for e in entries if e.name == reference)
    ref_model, ref_tok = load_policy(ref_path)
    ref_model.to(device)
    rm_path = ev.reward_model
    scorer = RewardModelScorer.load(ctx.root / rm_path) if rm_path else None
    if scorer is not None:
        scorer.model.to(device)
    judges = Judges(
        reference,
        ref_model,
        ctx.content_hash(ref_path),
        scorer,
        ctx.content_hash(ctx.root / rm_path) if rm_path else None,
    )

    policies: dict[str, dict[str, Any]] = {}
    samples: list[dict[str, Any]] = []
    reused = 0
    for entry in entries:
        name = entry.name
        model, tok = (ref_model, ref_tok) if name == reference else load_policy(ctx.root / entry.path)
        model.to(device)
        if not same_vocabulary(tok, ref_tok):
            raise ConfigError(
                f"{entry.path}: its tokenizer differs from the reference '{reference}' policy's; "
                "kl_to_sft needs the same vocabulary"
            )
        # The samples the training stage drew and published with the model, when they match.
        held = drawn.get(name) or sample_heldout(ctx, model, tok, model_dir=ctx.root / entry.path)
        known = load_measures(ctx.root / entry.path, held) if held.reused else {}
        if name == reference and rm_path:
            # The rm stage scored the reference's samples when it published the reward model.
            scores = load_scores(ctx.root / rm_path, judges.reference_hash, held)
            if scores is not None:
                known = {**known, "rm_score": {"model": judges.scorer_hash, "scores": scores}}
        measured, policy_samples = measure_policy(name, model, tok, judges, held, settings, known)
        reused += held.reused
        policies[name] = {"path": entry.path, **measured}
        samples += policy_samples

    drop = ctx.settings.reward_hacking.accuracy_drop
    add_intervals(policies, samples, reference)
    for name, measured in policies.items():
        print(f"evaluate: {name}: {policy_line(measured, reference)}")
    flag_reward_hacking(policies, reference, drop)
    benchmarks = add_benchmarks(ctx, policies, reference)
    regressed = {n: m["benchmark_regressions"] for n, m in policies.items() if m.get("benchmark_regressions")}
    if regressed and benchmarks["fail_on_regression"]:  # before publishing: CI gates on the exit code
        raise ConfigError(
            f"benchmark regression against '{reference}' (benchmark.alignpipe.benchmark.fail_on_regression "
            "is true): " + "; ".join(f"{n}: {', '.join(r)}" for n, r in regressed.items())
        )
    metrics = {
        "policies": policies,
        "reference": reference,
        "heldout": {
            "data_path": settings.data_path,
            "prompts": len(rows),
            "tasks": dict(sorted(Counter(r["task"] for r in rows if r.get("task")).items())),
            "seed": settings.seed,
            "temperature": settings.temperature,
            "max_new_tokens": settings.max_new_tokens,
        },
        "reward_model": rm_path,
        "reward_hacking_accuracy_drop": drop,
        **({"benchmarks": benchmarks} if benchmarks else {}),
    }
    write_results(ctx, metrics, samples)
    flagged = [n for n, m in policies.items() if m["suspected_reward_hacking"]]
    console.outcome(
        "evaluate",
        {
            "policies": len(policies),
            "samples reused": f"{reused}/{len(policies)}",
            "measures reused": judges.reused,
            "suspected reward hacking": ", ".join(flagged) or "none",
            **({"benchmark regressions": ", ".join(regressed) or "none"} if benchmarks else {}),
        },
        ctx.output("results").relative_to(ctx.root),
        ctx.started,
    )
