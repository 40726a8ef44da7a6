"""Stage ``benchmark@<policy>``: lm-evaluation-harness tasks on one policy.

``dvc.yaml`` runs it for the starting model and every policy (``benchmark: foreach``; the
policy directories are stage.toml's ``[sources]``). The policy is loaded once, float32 on CPU,
and handed to lm-eval's ``hf`` backend (``HFLM``); each configured task
(``alignpipe.measure.benchmarks``) runs through ``lm_eval.simple_evaluate`` with its own
few-shot, limit and chat settings, seeded from the pipeline seed, and with the system prompt
the policy was trained with.

Outputs (``results/benchmark/<policy>``, fixed names so DVC caches them; lm-eval's own
output files carry timestamps): ``metrics.json`` (``{"tasks": {task: {metric: value}}}``,
shown by ``dvc metrics show`` / ``dvc exp show``) and ``samples/<task>.jsonl``, lm-eval's
per-sample log (prompt, raw and filtered response, target, score).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from alignpipe import console
from alignpipe.artifacts import staged_dir, write_json_atomic, write_text_atomic
from alignpipe.config import get_path
from alignpipe.context import StageContext
from alignpipe.engines.local import training
from alignpipe.engines.local.publish import write_record
from alignpipe.errors import ConfigError
from alignpipe.measure.benchmarks import BenchmarkTask, benchmark_tasks, score_names, where
from alignpipe.measure.generation import model_system_prompt
from alignpipe.measure.logprobs import load_policy


def check_harness(section: dict[str, Any]) -> str:
    """The installed lm-eval must be the one the config names: its version is part of every score."""
    from importlib.metadata import version

    installed = version("lm-eval")
    wanted = str(section.get("lm_eval_version") or "")
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

    section = dict(get_path(ctx.config, "alignpipe.benchmark", {}) or {})
    harness = check_harness(section)
    tasks = benchmark_tasks(ctx.root, section)
    if section.get("download") and any(t.builtin for t in tasks):
        for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
            os.environ.pop(name, None)  # builtin tasks read the Hub (datasets reads these at import)
        print("benchmark: download=true: lm-eval's builtin tasks may fetch data from the Hugging Face Hub")
    policy_dir = ctx.input("policy")
    training.apply_torch_threads(ctx)
    from transformers import AutoTokenizer

    check_chat_template(tasks, AutoTokenizer.from_pretrained(policy_dir, local_files_only=True), policy_dir)

    os.environ.setdefault("TQDM_DISABLE", "1")  # lm-eval's per-request bars: one line per task instead
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    model, tokenizer = load_policy(policy_dir)
    lm = HFLM(
        pretrained=model, tokenizer=tokenizer, batch_size=int(section.get("batch_size", 32)), device="cpu"
    )
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

    metrics = {"policy": ctx.source, "path": str(policy_dir.relative_to(ctx.root)), "lm_eval": harness,
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
