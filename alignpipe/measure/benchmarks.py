"""Benchmark tasks (lm-evaluation-harness) as the ``benchmark`` stage's params name them.

A task entry is ``{name, file?, limit, num_fewshot, apply_chat_template, fewshot_as_multiturn,
gen_kwargs}``. Its YAML is ``file`` (a path in the repository), else
``stages/benchmark/tasks/<name>.yaml``, else one of lm-eval's builtin tasks, whose data come
from the Hugging Face Hub and so need ``download: true``.

Everything is checked here, before any model loads, because lm-eval itself skips a YAML it
cannot parse and later reports only "task not found". Shared by both engines: the local one
runs lm-eval's ``hf`` backend on the policy, GPU profiles its ``vllm`` backend.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from alignpipe.errors import ConfigError
from alignpipe.settings import Benchmark

TASKS_DIR = Path("stages") / "benchmark" / "tasks"
# Dataset builders that read local files through dataset_kwargs.data_files.
FILE_BUILDERS = {"json", "csv", "parquet", "text", "arrow"}
ENTRY_KEYS = {"name", "file", "limit", "num_fewshot", "apply_chat_template", "fewshot_as_multiturn",
              "gen_kwargs", "max_drop"}  # fmt: skip


@dataclass(frozen=True)
class BenchmarkTask:
    name: str
    yaml: Path | None  # None: one of lm-eval's builtin tasks
    limit: int | None = None
    num_fewshot: int | None = None
    apply_chat_template: bool = True
    fewshot_as_multiturn: bool = False
    gen_kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def builtin(self) -> bool:
        return self.yaml is None


def where(section: str) -> str:
    return f"params.yaml benchmark.alignpipe.benchmark.{section} (stages/benchmark/config/<profile>.yaml)"


def load_task_yaml(path: Path) -> dict[str, Any]:
    """The task YAML as lm-eval reads it (``!function`` tags, ``include``), or a ConfigError
    naming the file and the line."""
    from lm_eval.tasks._yaml_loader import load_yaml

    try:
        doc = load_yaml(path)
    except Exception as e:  # yaml.MarkedYAMLError names the line; say it with the file
        raise ConfigError(f"{path}: lm-eval cannot read this task YAML: {type(e).__name__}: {e}") from e
    return doc


def check_data_files(root: Path, path: Path, doc: dict[str, Any]) -> None:
    if doc.get("dataset_path") not in FILE_BUILDERS:
        return
    files = ((doc.get("dataset_kwargs") or {}).get("data_files")) or {}
    if not files:
        raise ConfigError(
            f"{path}: dataset_path {doc['dataset_path']} reads local files, but dataset_kwargs.data_files "
            f"is empty; name them, e.g. data_files: {{test: data/prepared/rlvr/test.jsonl}}"
        )
    values = files.values() if isinstance(files, dict) else [files]
    for value in values:
        for name in value if isinstance(value, list) else [value]:
            if not (root / name).is_file():
                raise ConfigError(
                    f"{path}: dataset_kwargs.data_files names {name}, which does not exist under {root} "
                    f"(relative paths are the repository's; run `dvc repro prep` if it is prepared data)"
                )


def benchmark_tasks(root: Path, settings: Benchmark, *, data: bool = True) -> list[BenchmarkTask]:
    """The configured tasks, each checked: a known name, a readable YAML, existing data files
    (unless ``data`` is false: planning needs no prepared data), and for builtin tasks,
    downloads allowed. Every bad entry is named in one error, not the first alone: lm-eval's
    task index, which a builtin or unknown name needs, takes ~15 s to build."""
    entries = settings.tasks
    if not entries:
        raise ConfigError(f"{where('tasks')} must be a non-empty list of tasks ({{name: ..., limit: ...}})")
    out, errors = [], []
    builtin: list[list[str]] = []  # lm-eval's task names, read once when first needed
    for i, entry in enumerate(entries):
        try:
            out.append(_task(root, settings, i, entry, data, builtin))
        except ConfigError as e:
            errors.append(str(e))
    if errors:
        raise ConfigError("\n".join(errors))
    return out


def _task(
    root: Path, settings: Benchmark, i: int, entry: Any, data: bool, builtin: list[list[str]]
) -> BenchmarkTask:
    if isinstance(entry, str):
        entry = {"name": entry}
    if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
        raise ConfigError(f"{where(f'tasks[{i}]')}: expected a mapping with a task name, got {entry!r}")
    unknown = sorted(set(entry) - ENTRY_KEYS)
    if unknown:
        raise ConfigError(f"{where(f'tasks[{i}]')}: unknown keys {unknown}; known: {sorted(ENTRY_KEYS)}")
    name = entry["name"]
    path = Path(entry["file"]) if entry.get("file") else TASKS_DIR / f"{name}.yaml"
    if entry.get("file") and not (root / path).is_file():
        raise ConfigError(f"{where(f'tasks[{i}].file')}: task YAML {path} does not exist in the repository")
    if (root / path).is_file():
        doc = load_task_yaml(root / path)
        if doc.get("task") != name:
            raise ConfigError(
                f"{root / path}: its task is {doc.get('task')!r}, but {where(f'tasks[{i}]')} names {name!r}"
            )
        if data:
            check_data_files(root, root / path, doc)
        yaml_path: Path | None = root / path
    else:
        if not builtin:
            from lm_eval.tasks import TaskManager

            builtin.append(TaskManager().all_tasks)
        if name not in builtin[0]:
            import difflib

            close = difflib.get_close_matches(name, [*builtin[0], *local_task_names(root)], n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ConfigError(
                f"{where(f'tasks[{i}]')}: unknown task {name!r}: no {TASKS_DIR / (name + '.yaml')} and no "
                f"lm-eval builtin task of that name{hint}"
            )
        if not settings.download:
            raise ConfigError(
                f"{where(f'tasks[{i}]')}: {name!r} is an lm-eval builtin task, whose data come from the "
                f"Hugging Face Hub, and downloads are off: set benchmark.alignpipe.benchmark.download=true "
                f"(dvc exp run -S benchmark.alignpipe.benchmark.download=true), or use a task YAML "
                f"over local files in {TASKS_DIR}"
            )
        yaml_path = None
    return BenchmarkTask(
        name=name,
        yaml=yaml_path,
        limit=entry.get("limit"),
        num_fewshot=entry.get("num_fewshot"),
        apply_chat_template=bool(entry.get("apply_chat_template", True)),
        fewshot_as_multiturn=bool(entry.get("fewshot_as_multiturn", False)),
        gen_kwargs=dict(entry.get("gen_kwargs") or {}),
    )


def local_task_names(root: Path) -> list[str]:
    return sorted(p.stem for p in (root / TASKS_DIR).glob("*.yaml"))


def score_names(task_results: dict[str, Any]) -> dict[str, float]:
    """lm-eval's ``"metric,filter"`` keys as ``metric`` (``metric/filter`` when a task has several
    filters); stderr and bookkeeping dropped."""
    keys = [k for k in task_results if "," in k and "_stderr" not in k]
    filters = {k.split(",", 1)[1] for k in keys}
    out = {}
    for key in keys:
        metric, filt = key.split(",", 1)
        value = task_results[key]
        if isinstance(value, (int, float)):
            out[metric if len(filters) == 1 else f"{metric}/{filt}"] = float(value)
    return out


def read_scores(results_dir: Path) -> dict[str, dict[str, float]]:
    """``{task: {metric: value}}`` from a benchmark stage's metrics.json (counts dropped)."""
    import json

    path = Path(results_dir) / "metrics.json"
    if not path.is_file():
        raise ConfigError(f"{path} does not exist; run `dvc repro benchmark` for that policy first")
    tasks = json.loads(path.read_text())["tasks"]
    return {t: {m: v for m, v in s.items() if m not in ("samples", "num_fewshot")} for t, s in tasks.items()}


def doc_scores(results_dir: Path) -> dict[str, dict[int, dict[str, float]]]:
    """Per task, each document's lm-eval scores (``samples/<task>.jsonl``: ``doc_id`` ->
    ``{metric: score}``), the per-item values the benchmark's intervals are made of."""
    import json

    out = {}
    for path in sorted((results_dir / "samples").glob("*.jsonl")):
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        out[path.stem] = {int(r["doc_id"]): {k: float(v) for k, v in r["scores"].items()} for r in rows}
    return out


def max_drops(tasks: list[str | dict[str, Any]]) -> dict[str, float]:
    """Per task, the largest drop against the reference policy tolerated (tasks without none)."""
    out = {}
    for entry in tasks:
        if isinstance(entry, dict) and entry.get("max_drop") is not None:
            out[str(entry["name"])] = float(entry["max_drop"])
    return out
