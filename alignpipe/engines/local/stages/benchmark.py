"""Stage ``benchmark@<policy>``: lm-evaluation-harness tasks on one policy.

``dvc.yaml`` runs it for the starting model and every policy (``benchmark: foreach``; the
policy directories are stage.toml's ``[sources]``). The policy is loaded once, float32 on CPU,
and handed to lm-eval's ``hf`` backend (``HFLM``); each configured task
(``alignpipe.measure.benchmarks``) runs through ``lm_eval.simple_evaluate`` with its own
few-shot, limit and chat settings, seeded from the pipeline seed, and with the system prompt
the policy was trained with.

``backend: vllm`` (the GPU profiles) uses lm-eval's ``vllm`` backend instead, where vLLM is: in
the pinned NeMo-RL image. On a host without vLLM the stage checks its tasks, then hands
``alignpipe run benchmark --source X --inner`` to the launcher the NeMo-RL engine uses
(container, Slurm or Ray), as convert does with NeMo-RL's converter.

Outputs (``results/benchmark/<policy>``, fixed names so DVC caches them; lm-eval's own
output files carry timestamps): ``metrics.json`` (``{"tasks": {task: {metric: value}}}``,
shown by ``dvc metrics show`` / ``dvc exp show``) and ``samples/<task>.jsonl``, lm-eval's
per-sample log (prompt, raw and filtered response, target, score).
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from alignpipe import console
from alignpipe.artifacts import staged_dir, write_json_atomic, write_text_atomic
from alignpipe.context import ImageNeed, StageContext, lift_offline_env
from alignpipe.engines.local.publish import write_record
from alignpipe.engines.local.torch_threads import apply_torch_threads
from alignpipe.errors import ConfigError
from alignpipe.measure.benchmarks import BenchmarkTask, benchmark_tasks, score_names, where
from alignpipe.measure.generation import model_system_prompt
from alignpipe.measure.logprobs import load_policy
from alignpipe.settings import Benchmark


def check_harness(settings: Benchmark) -> str:
    """The installed lm-eval must be the one the config names: its version is part of every score."""
    from importlib.metadata import version

    installed = version("lm-eval")
    wanted = settings.lm_eval_version or ""
    if installed != wanted:
        raise ConfigError(
            f"{where('lm_eval_version')} is {wanted or None}, but lm-eval {installed} is installed; "
            f"install lm-eval=={wanted} (pyproject.toml pins it) or update the config"
        )
    return installed


def check_chat_template(tasks: list[BenchmarkTask], tokenizer, policy_dir: Path) -> None:
    chat = [t.name for t in tasks if t.apply_chat_template]
    if chat and not tokenizer.chat_template:
        raise ConfigError(
            f"{policy_dir}: its tokenizer has no chat template, but tasks {chat} set apply_chat_template: "
            f"true; set it to false for them ({where('tasks')})"
        )


def vllm_model_args(settings: Benchmark, policy_dir: Path, seed: int) -> dict[str, Any]:
    """lm-eval's ``VLLM(**model_args)`` for the policy: the profile's ``vllm`` settings (those
    lm-eval's class takes; tests/test_benchmark.py checks), seeded."""
    return {
        "pretrained": str(policy_dir),
        "seed": seed,
        **{k: v for k, v in asdict(settings.vllm).items() if v is not None},
    }


def without_bars(lm_class: type) -> type:
    """``lm_class`` with its request loops' progress bars off: lm-eval asks tqdm for them with
    an explicit ``disable``, over ``TQDM_DISABLE``; the stage prints one line per task instead."""

    class Quiet(lm_class):
        def loglikelihood(self, requests, disable_tqdm: bool = False):
            return super().loglikelihood(requests, disable_tqdm=True)

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            return super().loglikelihood_rolling(requests, disable_tqdm=True)

        def generate_until(self, requests, disable_tqdm: bool = False):
            return super().generate_until(requests, disable_tqdm=True)

    Quiet.__name__ = Quiet.__qualname__ = lm_class.__name__
    return Quiet


def make_lm(settings: Benchmark, policy_dir: Path, seed: int):
    """The lm-eval model: HFLM on the loaded policy (CPU), or VLLM on its directory (GPU)."""
    if settings.backend == "vllm":
        from lm_eval.models.vllm_causallms import VLLM

        return without_bars(VLLM)(**vllm_model_args(settings, policy_dir, seed), batch_size="auto")
    from lm_eval.models.huggingface import HFLM

    model, tokenizer = load_policy(policy_dir)
    return without_bars(HFLM)(
        pretrained=model, tokenizer=tokenizer, batch_size=settings.batch_size, device="cpu"
    )


def plan(ctx: StageContext) -> dict[str, str]:
    """``alignpipe plan benchmark --source X``: the config and the lm-eval call."""

    settings = ctx.settings.benchmark
    backend = settings.backend
    policy_dir = ctx.input("policy")
    call = {
        "model": backend,
        "model_args": vllm_model_args(settings, policy_dir, ctx.seed) if backend == "vllm" else {"pretrained": str(policy_dir)},
        "tasks": [{**asdict(t), "yaml": str(t.yaml) if t.yaml else None} for t in benchmark_tasks(ctx.root, settings, data=False)],
    }  # fmt: skip
    label = f"{ctx.name}@{ctx.source}"
    files = {
        f"{label}.config.yaml": ctx.resolved_config_yaml(),
        f"{label}.lm_eval.json": json.dumps(call, indent=2) + "\n",
    }
    return files  # the launch: alignpipe.cli.plan_files, in the image when needs_image says so


def needs_image(ctx: StageContext) -> ImageNeed | None:
    """lm-eval's vllm backend runs where vLLM is: on a host without it, in the NeMo-RL image."""
    if ctx.settings.benchmark.backend == "vllm" and importlib.util.find_spec("vllm") is None:
        return ImageNeed(
            f"{where('backend')} is vllm",
            "vLLM",
            "use hf, or a GPU profile's launcher (container, slurm or ray)",
        )
    return None


def plain(value: Any) -> Any:
    """numpy scalars in lm-eval's sample records -> JSON."""
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def sample_lines(records: list[dict[str, Any]]) -> str:
    keep = ("doc_id", "doc", "arguments", "target", "resps", "filtered_resps", "filter", "metrics")
    lines = []
    for record in sorted(records, key=lambda r: (r["doc_id"], r.get("filter", ""))):
        row = {k: record[k] for k in keep if k in record}
        row["arguments"] = [list(a) for a in record.get("arguments", [])]
        row["scores"] = {m: record[m] for m in record.get("metrics", []) if m in record}
        lines.append(json.dumps(row, sort_keys=True, default=plain) + "\n")
    return "".join(lines)


def run(ctx: StageContext) -> None:
    import torch

    settings = ctx.settings.benchmark
    harness = check_harness(settings)
    tasks = benchmark_tasks(ctx.root, settings)
    if settings.download and any(t.builtin for t in tasks):
        lift_offline_env()  # builtin tasks read their data from the Hub
        print("benchmark: download=true: lm-eval's builtin tasks may fetch data from the Hugging Face Hub")
    policy_dir = ctx.input("policy")
    apply_torch_threads(ctx)
    from transformers import AutoTokenizer

    check_chat_template(tasks, AutoTokenizer.from_pretrained(policy_dir, local_files_only=True), policy_dir)

    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    lm = make_lm(settings, policy_dir, int(ctx.seed))
    local_dirs = sorted({str(t.yaml.parent) for t in tasks if not t.builtin})
    manager = TaskManager(include_path=local_dirs or None, include_defaults=any(t.builtin for t in tasks))
    system = model_system_prompt(policy_dir)
    seed = int(ctx.seed)
    scores: dict[str, dict[str, Any]] = {}
    samples: dict[str, str] = {}
    for task in tasks:
        torch.manual_seed(seed)
        out = simple_evaluate(
            model=lm, tasks=[task.name], task_manager=manager, num_fewshot=task.num_fewshot, limit=task.limit,
            apply_chat_template=task.apply_chat_template, fewshot_as_multiturn=task.fewshot_as_multiturn,
            gen_kwargs=task.gen_kwargs or None, system_instruction=system, log_samples=True, bootstrap_iters=0,
            random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed,
        )  # fmt: skip
        result = out["results"][task.name]
        scores[task.name] = {**score_names(result), "samples": int(result.get("sample_len", 0)),
                             "num_fewshot": int(out["n-shot"].get(task.name, 0))}  # fmt: skip
        samples[task.name] = sample_lines(out["samples"][task.name])
        shown = ", ".join(f"{m} {v:.3f}" for m, v in score_names(result).items())
        print(
            f"benchmark@{ctx.source}: {task.name}: {shown} ({scores[task.name]['samples']} documents)",
            flush=True,
        )

    metrics = {"policy": ctx.source, "path": str(policy_dir.relative_to(ctx.root)), "lm_eval": harness, "backend": settings.backend,
               "system_prompt": system is not None, "tasks": scores}  # fmt: skip
    with staged_dir(ctx.output("results")) as out_dir:
        write_json_atomic(out_dir / "metrics.json", metrics)
        (out_dir / "samples").mkdir()
        for name, text in samples.items():
            write_text_atomic(out_dir / "samples" / f"{name}.jsonl", text)
        write_record(out_dir, ctx, type="report", format="lm-eval-v1",
                     metrics={f"{t}/{m}": v for t, s in scores.items() for m, v in s.items()})  # fmt: skip
    headline = {"tasks": len(scores), "documents": sum(s["samples"] for s in scores.values())}
    console.outcome(
        f"benchmark@{ctx.source}", headline, ctx.output("results").relative_to(ctx.root), ctx.started
    )
