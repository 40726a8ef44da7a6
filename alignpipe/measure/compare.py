"""What a change did: every policy's figures in two runs of the pipeline, paired per prompt.

A run is a git revision, a DVC experiment or the workspace; its evaluate results
(``results/evaluate/samples.jsonl``: one scored sample per policy and held-out prompt) and its
benchmark results (``results/benchmark/<policy>/samples/<task>.jsonl``: per document) are read
through DVC, from the cache or the remote. Both runs answered the same prompts, so each figure's
change is the mean of per-prompt differences, with its 95% interval (measure/intervals.py): the
interval says whether the data can tell the two apart, which two bare numbers cannot.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

from alignpipe.errors import AlignpipeError
from alignpipe.measure.intervals import above, below, paired_difference

EVALUATE = "results/evaluate"
BENCHMARK = "results/benchmark"
REWARD_MODEL = "models/rm"
WORKSPACE = "workspace"


class CompareError(AlignpipeError):
    """Two runs cannot be compared: a revision unknown, its outputs missing, other prompts."""


@dataclass
class Run:
    """One run's per-item scores: ``heldout[policy]`` the evaluate samples in prompt order,
    ``benchmarks[policy][task][doc_id]`` lm-eval's per-document scores."""

    name: str
    label: str  # the name with its commit, for the report's heading
    heldout: dict[str, list[dict[str, Any]]]
    benchmarks: dict[str, dict[str, dict[int, dict[str, float]]]] = field(default_factory=dict)
    reward_model: str | None = None  # the reward model's content hash, when the run has one


@dataclass(frozen=True)
class Named:
    name: str  # as the user wrote it
    rev: str | None  # the commit; None for the workspace
    label: str


def resolve(root, name: str) -> Named:
    """``workspace``, a git revision or a DVC experiment's name, as a commit."""
    from dvc.repo import Repo
    from dvc.scm import RevError, resolve_rev

    if name == WORKSPACE:
        return Named(name, None, name)
    with Repo(str(root)) as repo:
        try:
            rev = resolve_rev(repo.scm, name)
        except RevError:
            raise CompareError(
                f"no git revision or DVC experiment named '{name}' (see `git log`, `dvc exp show`)"
            ) from None
    return Named(name, rev, rev[:7] if rev.startswith(name) else f"{name} ({rev[:7]})")


def read_run(root, named: Named) -> Run:
    """The run's results as DVC has them, from the cache or the remote."""
    from dvc.api import DVCFileSystem

    name, rev, label = named.name, named.rev, named.label
    fs = DVCFileSystem(str(root), rev=rev)
    outs = _lock_outs(fs)
    samples = _read(fs, name, f"{EVALUATE}/samples.jsonl", outs)
    heldout: dict[str, list[dict[str, Any]]] = {}
    for line in samples.splitlines():
        if line.strip():
            row = json.loads(line)
            heldout.setdefault(row["policy"], []).append(row)
    benchmarks: dict[str, dict[str, dict[int, dict[str, float]]]] = {}
    if fs.isdir(BENCHMARK):
        for policy in sorted(heldout):
            where = f"{BENCHMARK}/{policy}/samples"
            if not fs.isdir(where):
                continue
            for path in sorted(fs.find(where)):
                if path.endswith(".jsonl"):
                    rows = [json.loads(x) for x in _read(fs, name, path, outs).splitlines() if x.strip()]
                    benchmarks.setdefault(policy, {})[PurePosixPath(path).stem] = {
                        int(r["doc_id"]): {k: float(v) for k, v in r["scores"].items()} for r in rows
                    }
    return Run(name, label, heldout, benchmarks, outs.get(REWARD_MODEL))


def _read(fs, name: str, path: str, outs: dict[str, str]) -> str:
    try:
        return fs.read_text(path)
    except Exception as e:  # DVC raises several kinds for a missing object; each means the same here
        if not any(path == o or path.startswith(o + "/") for o in outs):
            raise CompareError(f"{name} has no {path}: the pipeline had not run evaluate there") from None
        raise CompareError(
            f"{name}'s {path} is not in the DVC cache or the remote: `dvc pull` it (or `dvc exp pull` "
            f"an experiment), or reproduce it there (`git checkout` or `dvc exp apply` it, then `dvc repro`)"
        ) from e


def _lock_outs(fs) -> dict[str, str]:
    """Every output the revision's dvc.lock records, with its content hash."""
    import yaml

    try:
        stages = yaml.safe_load(fs.read_text("dvc.lock")).get("stages", {})
    except Exception:  # no dvc.lock: nothing ran there
        return {}
    return {o["path"]: o.get("md5") for stage in stages.values() for o in stage.get("outs", [])}


@dataclass
class Row:
    policy: str
    figure: str
    a: float
    b: float
    difference: dict[str, float]  # B - A, paired: {value, low, high}
    n: int

    @property
    def verdict(self) -> str:
        if above(self.difference):
            return "B higher"
        if below(self.difference):
            return "B lower"
        return "not resolved"


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _paired(policy: str, figure: str, a: list[float], b: list[float]) -> Row:
    return Row(policy, figure, _mean(a), _mean(b), paired_difference(b, a), len(a))


def compare(a: Run, b: Run) -> tuple[list[Row], list[str]]:
    """Every figure both runs have, per policy, as paired differences ``b - a``; and notes
    (policies or tasks only one run has, a changed reward model)."""
    notes = []
    rows: list[Row] = []
    for policy in sorted(set(a.heldout) | set(b.heldout)):
        if policy not in a.heldout or policy not in b.heldout:
            notes.append(f"{policy}: only in {a.name if policy in a.heldout else b.name}")
            continue
        mine, theirs = a.heldout[policy], b.heldout[policy]
        same_prompts(a, b, policy, mine, theirs)
        rows += [_paired(policy, figure, x, y) for figure, x, y in heldout_figures(mine, theirs)]
        rows += _benchmark_rows(a, b, policy, notes)
    if a.reward_model != b.reward_model and any(r.figure == "rm_score" for r in rows):
        notes.append("rm_score: each run is scored by its own reward model, and the two differ")
    return rows, notes


def heldout_figures(mine: list[dict[str, Any]], theirs: list[dict[str, Any]]):
    """(figure, mine, theirs) per held-out figure of two policies' samples on the same prompts:
    accuracy, accuracy per task, and the RM score where both have one."""
    yield "heldout_accuracy", column(mine, "correct"), column(theirs, "correct")
    for task in sorted({s["task"] for s in mine if s.get("task")}):
        pick = [i for i, s in enumerate(mine) if s["task"] == task]
        yield (
            f"heldout_accuracy_{task}",
            [float(mine[i]["correct"]) for i in pick],
            [float(theirs[i]["correct"]) for i in pick],
        )
    if all(s.get("rm_score") is not None for s in mine + theirs):
        yield "rm_score", column(mine, "rm_score"), column(theirs, "rm_score")


def column(rows: list[dict[str, Any]], key: str) -> list[float]:
    return [float(s[key]) for s in rows]


def same_prompts(a: Run, b: Run, policy: str, mine: list[dict], theirs: list[dict]) -> None:
    ids = [(s["id"], s["prompt"]) for s in mine]
    other = [(s["id"], s["prompt"]) for s in theirs]
    if ids == other:
        return
    first = next(
        (i for i, (x, y) in enumerate(zip(ids, other, strict=False)) if x != y), min(len(ids), len(other))
    )
    where = f"prompt {first + 1} is id {_id(ids, first)} in {a.name}, {_id(other, first)} in {b.name}"
    raise CompareError(
        f"{a.name} and {b.name} evaluated {policy} on different held-out sets ({len(ids)} prompts "
        f"against {len(other)}; {where}): a paired comparison needs the same prompts"
    )


def _id(ids: list[tuple], i: int) -> str:
    return repr(ids[i][0]) if i < len(ids) else "absent"


def _benchmark_rows(a: Run, b: Run, policy: str, notes: list[str]) -> list[Row]:
    rows = []
    mine, theirs = a.benchmarks.get(policy, {}), b.benchmarks.get(policy, {})
    for task in sorted(set(mine) | set(theirs)):
        if task not in mine or task not in theirs:
            notes.append(f"{policy}: benchmark {task} only in {a.name if task in mine else b.name}")
            continue
        if set(mine[task]) != set(theirs[task]):
            raise CompareError(
                f"{a.name} and {b.name} scored {policy} on different documents of benchmark {task} "
                f"({len(mine[task])} against {len(theirs[task])}): a paired comparison needs the same ones"
            )
        docs = sorted(mine[task])
        for metric in sorted(mine[task][docs[0]]):
            rows.append(
                _paired(
                    policy,
                    f"{task}/{metric}",
                    [mine[task][d][metric] for d in docs],
                    [theirs[task][d][metric] for d in docs],
                )
            )
    return rows


def markdown(a: Run, b: Run, rows: list[Row], notes: list[str]) -> str:
    """The comparison as a Markdown table (a terminal reads it; a CI job summary renders it)."""
    prompts = max((r.n for r in rows if r.figure == "heldout_accuracy"), default=0)
    lines = [
        f"### {a.label} -> {b.label}",
        "",
        f"Each figure in A = {a.name} and B = {b.name}, and B - A paired per prompt ({prompts} held-out "
        "prompts; per document for benchmarks) with its 95% interval.",
        "",
        "| policy | figure | A | B | B - A [95% interval] | |",
        "|---|---|---:|---:|---:|---|",
    ]
    for r in rows:
        d = r.difference
        lines.append(
            f"| {r.policy} | {r.figure} | {r.a:.3f} | {r.b:.3f} | "
            f"{d['value']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}] | {r.verdict} |"
        )
    lines += [""] + [f"- {note}" for note in notes]
    return "\n".join(lines).rstrip() + "\n"


def as_json(a: Run, b: Run, rows: list[Row], notes: list[str]) -> dict[str, Any]:
    return {
        "a": a.label,
        "b": b.label,
        "rows": [
            {
                "policy": r.policy,
                "figure": r.figure,
                "a": r.a,
                "b": r.b,
                "b_minus_a": r.difference,
                "n": r.n,
                "verdict": r.verdict,
            }
            for r in rows
        ],
        "notes": notes,
    }
