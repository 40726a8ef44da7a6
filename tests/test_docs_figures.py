"""The figures the docs quote from the committed run are the committed run's.

README.md and benchmarks/RESULTS.md quote the tiny pipeline's results only inside blocks
between two markers, ``<!-- figures:NAME -->`` and ``<!-- /figures -->``. Each block is rendered
from a run's outputs by ``RUN_BLOCKS[NAME]`` (the stages' ``metrics.json``, the evaluate report,
``models/base/artifact.json``) or from ``dvc.lock`` by ``LOCK_BLOCKS[NAME]``, and a block must be
exactly its rendering. So is the chart the README shows (``docs/comparison.png``), and so is the
tiny model's size wherever a current doc states it.

A run's outputs are the committed run's when their DVC hashes are ``dvc.lock``'s. The session's
``tiny_pipeline`` (``dvc repro`` of the committed pipeline) is that run on the kind of CPU that
wrote the lock (tests/test_dvc_pipeline.py checks it); the working tree is, after a ``dvc repro``
or ``dvc checkout`` of the committed lock. Either is checked where it is the committed run.

After a change that moves the lock, ``dvc repro``, then rewrite the blocks and the chart from
the working tree: ``python -m tests.test_docs_figures``.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from alignpipe.artifacts import dvc_hash
from alignpipe.measure.intervals import wilson
from tests.conftest import REPO

FIGURE_DOCS = ("README.md", "benchmarks/RESULTS.md")
BLOCK = re.compile(r"(<!-- figures:([\w-]+) -->\n)(.*?)(<!-- /figures -->)", re.S)
CHART = "docs/comparison.png"
# What the run-rendered blocks and the chart read: checked against dvc.lock before use.
OUTPUTS = (
    "models/base",
    "results/sft",
    "results/rm",
    "results/dpo",
    "results/rlvr",
    "results/rlhf",
    "results/evaluate",
    "results/benchmark/base",
)
# Docs that describe the project as it is (history in benchmarks/ keeps its own figures).
CURRENT_DOCS = ("README.md", "DEVELOPING.md", "docs/*.md", "stages/*/README.md", "prompts/README.md")


@dataclass(frozen=True)
class Run:
    """A pipeline's outputs: the working tree, or a copy that ran ``dvc repro``."""

    root: Path

    def json(self, rel: str) -> dict:
        return json.loads((self.root / rel).read_text())

    def metrics(self, stage: str) -> dict:
        return self.json(f"results/{stage}/metrics.json")


def differences_from_lock(root: Path, lock_text: str) -> list[str]:
    """``OUTPUTS`` under ``root`` that are missing or are not what ``dvc.lock`` records."""
    recorded = {
        out["path"]: out["md5"]
        for stage in yaml.safe_load(lock_text)["stages"].values()
        for out in stage.get("outs", [])
    }
    found = []
    for rel in OUTPUTS:
        if not (root / rel).exists():
            found.append(f"{rel} is missing")
        elif dvc_hash(root / rel) != recorded.get(rel):
            found.append(f"{rel} is {dvc_hash(root / rel)}, dvc.lock records {recorded.get(rel)}")
    return found


# --------------------------------------------------------------------------- renderings


def markdown_rows(text: str, first_header: str) -> tuple[list[str], list[list[str]]]:
    """The first Markdown table in ``text`` whose first header cell is ``first_header``."""
    lines = [line.strip() for line in text.splitlines()]
    for i, line in enumerate(lines):
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("|") and cells[0] == first_header:
            rows = []
            for row in lines[i + 2 :]:
                if not row.startswith("|"):
                    break
                rows.append([c.strip() for c in row.strip("|").split("|")])
            return cells, rows
    raise ValueError(f"no table whose first column is {first_header!r}")


# The columns of results/evaluate/report.md the README's table shows, in its order.
REPORT_COLUMNS = (
    "held-out accuracy",
    "accuracy vs `sft` (points)",
    "reward-model score",
    "KL to SFT (per token)",
    "heldout_exact exact_match",
    "preference_choice acc",
)


def share(value: float, n: int) -> str:
    """A share with its Wilson interval, as the evaluate report prints one."""
    low, high = wilson(value * n, n)
    return f"{value:.1%} [{low:.1%}, {high:.1%}]"


def tiny_results(run: Run) -> str:
    """README's table: the evaluate report's columns, the starting model's benchmark scores and
    each stage's own validation figures."""
    header, rows = markdown_rows((run.root / "results/evaluate/report.md").read_text(), "policy")
    missing = [c for c in REPORT_COLUMNS if c not in header]
    if missing:
        raise ValueError(f"results/evaluate/report.md has no column {missing} (it has {header})")
    report = {row[0].strip("`"): row for row in rows}
    m = {s: run.metrics(s) for s in ("sft", "rm", "dpo", "rlvr", "rlhf")}
    parameters = run.json("models/base/artifact.json")["metrics"]["parameters"]
    base = run.metrics("benchmark/base")["tasks"]
    rlhf_flag = "suspected" if m["rlhf"]["heldout"]["reward_hacking_suspected"] else "not suspected"
    policies = {
        "sft": (
            f"`sft` ({m['sft']['step']} steps)",
            f"val token accuracy {m['sft']['val']['token_accuracy']:.3f}",
        ),
        "dpo": (
            f"`dpo` ({m['dpo']['step']} steps)",
            f"val preference accuracy {m['dpo']['val']['preference_accuracy']:.3f}, "
            f"margin {m['dpo']['val']['reward_margin']:.2f}",
        ),
        "rlvr": (
            f"`rlvr` (GRPO + verifiers, {m['rlvr']['step']} optimizer steps)",
            f"last step's reward mean {m['rlvr']['train']['reward_mean']:.3f}",
        ),
        "rlhf": (
            f"`rlhf` (GRPO + reward model, {m['rlhf']['step']} optimizer steps)",
            f"last step's RM score {m['rlhf']['train']['rm_score']:.2f}; reward hacking {rlhf_flag}",
        ),
    }
    width = len(REPORT_COLUMNS)
    lines = [
        "| policy | " + " | ".join(REPORT_COLUMNS) + " | the stage's own metrics |",
        "|---|" + "---:|" * width + "---|",
        f"| `base` (random init, {parameters / 1e6:.2f}M parameters) | "
        + " | ".join(["—"] * (width - 2))
        + f" | {share(base['heldout_exact']['exact_match'], base['heldout_exact']['samples'])}"
        + f" | {share(base['preference_choice']['acc'], base['preference_choice']['samples'])} | — |",
    ]
    for name, (label, own) in policies.items():
        cells = [report[name][header.index(c)] for c in REPORT_COLUMNS]
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {own} |")
    lines.append(
        f"| `rm` (Bradley-Terry, {m['rm']['step']} steps) | "
        + " | ".join(["—"] * width)
        + f" | val pairwise accuracy {m['rm']['val']['pairwise_accuracy']:.3f}, "
        f"margin {m['rm']['val']['reward_margin']:.2f} |"
    )
    return "\n".join(lines) + "\n"


def stage_list(lock_text: str) -> str:
    """The stages ``dvc repro`` runs, as ``dvc.lock`` records them, foreach items folded."""
    names: list[str] = []
    items: dict[str, list[str]] = {}
    for name in yaml.safe_load(lock_text)["stages"]:
        stage, _, item = name.partition("@")
        if item and stage in items:
            items[stage].append(item)
            continue
        names.append(stage)
        if item:
            items[stage] = [item]
    shown = [f"`{n}@{{{','.join(items[n])}}}`" if n in items else f"`{n}`" for n in names]
    count = len(yaml.safe_load(lock_text)["stages"])
    return f"`dvc repro` runs {count} stages: {', '.join(shown)}.\n"


RUN_BLOCKS: dict[str, Callable[[Run], str]] = {"tiny-results": tiny_results}
LOCK_BLOCKS: dict[str, Callable[[str], str]] = {"stages": stage_list}


# --------------------------------------------------------------------------- the checks


def block_errors(doc: str, text: str, rendered: dict[str, str]) -> list[str]:
    """Blocks of ``text`` named in ``rendered`` that are not their rendering; unknown names."""
    errors = []
    for m in BLOCK.finditer(text):
        name, body = m.group(2), m.group(3)
        line = text[: m.start()].count("\n") + 1
        if name not in RUN_BLOCKS and name not in LOCK_BLOCKS:
            errors.append(f"{doc}:{line}: no rendering for a figures block named {name!r}")
        elif name in rendered and body != rendered[name]:
            errors.append(
                f"{doc}:{line}: the {name!r} block is not the committed run's "
                f"(`python -m tests.test_docs_figures` rewrites it); it should read:\n{rendered[name]}"
            )
    return errors


def rewrite_blocks(text: str, rendered: dict[str, str]) -> str:
    return BLOCK.sub(lambda m: m.group(1) + rendered.get(m.group(2), m.group(3)) + m.group(4), text)


def docs_text() -> dict[str, str]:
    return {doc: (REPO / doc).read_text() for doc in FIGURE_DOCS}


def current_docs() -> list[Path]:
    return sorted({p for g in CURRENT_DOCS for p in REPO.glob(g)})


MODEL_SIZE = re.compile(r"(\d+(?:\.\d+)?)M[- ]param")


def model_size_errors(run: Run) -> list[str]:
    """Every "~N.NM-parameter" in the current docs is the tiny model's size, to the decimals shown
    (at least one: "~1M" hides that it is 0.8M)."""
    parameters = run.json("models/base/artifact.json")["metrics"]["parameters"]
    errors = []
    for path in current_docs():
        text = path.read_text()
        for m in MODEL_SIZE.finditer(text):
            decimals = len(m.group(1).partition(".")[2])
            if not decimals or f"{parameters / 1e6:.{decimals}f}" != m.group(1):
                line = text[: m.start()].count("\n") + 1
                errors.append(
                    f"{path.relative_to(REPO)}:{line}: {m.group(0)}, the tiny model has {parameters / 1e6:.2f}M"
                )
    return errors


def run_figure_errors(run: Run) -> list[str]:
    """Everything the docs quote from ``run``: its blocks, the chart, the tiny model's size."""
    rendered = {name: render(run) for name, render in RUN_BLOCKS.items()}
    errors = [e for doc, text in docs_text().items() for e in block_errors(doc, text, rendered)]
    if (REPO / CHART).read_bytes() != (run.root / "results/evaluate/comparison.png").read_bytes():
        errors.append(f"{CHART} is not the run's results/evaluate/comparison.png (copy it)")
    return errors + model_size_errors(run)


def test_the_docs_quote_the_working_trees_run_where_it_is_the_committed_one() -> None:
    differences = differences_from_lock(REPO, (REPO / "dvc.lock").read_text())
    if differences:
        pytest.skip(f"the working tree holds no committed run ({differences[0]}); tiny_pipeline checks it")
    errors = run_figure_errors(Run(REPO))
    assert not errors, "\n".join(errors)


@pytest.mark.slow
def test_the_docs_quote_the_reproduced_committed_run(tiny_pipeline) -> None:
    differences = differences_from_lock(tiny_pipeline.root, tiny_pipeline.committed_lock)
    if differences:
        pytest.skip(
            f"the reproduced run is not the committed one ({differences[0]}): expected with other CPU "
            "kernels than benchmarks/lock_kernels.json's, where the figures are not checked; with those "
            "tests/test_dvc_pipeline.py fails too"
        )
    errors = run_figure_errors(Run(tiny_pipeline.root))
    assert not errors, "\n".join(errors)


def test_the_figure_blocks_are_there_and_the_lock_blocks_are_the_locks() -> None:
    texts = docs_text()
    names = {doc: {m.group(2) for m in BLOCK.finditer(text)} for doc, text in texts.items()}
    assert {"tiny-results", "stages"} <= names["README.md"], names
    assert "stages" in names["benchmarks/RESULTS.md"], names
    rendered = {name: render((REPO / "dvc.lock").read_text()) for name, render in LOCK_BLOCKS.items()}
    errors = [e for doc, text in texts.items() for e in block_errors(doc, text, rendered)]
    assert not errors, "\n".join(errors)


NUMBER_WORDS = "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen \
fifteen sixteen seventeen eighteen nineteen twenty".split()
STAGE_COUNT = re.compile(r"\b(\d+|" + "|".join(NUMBER_WORDS) + r") stages( in `dvc\.yaml`)?", re.I)


def stage_count_errors(doc: str, text: str, lock_count: int, yaml_count: int) -> list[str]:
    """Counts: "N stages" must be dvc.lock's, "N stages in `dvc.yaml`" dvc.yaml's."""
    errors = []
    for m in STAGE_COUNT.finditer(text):
        word = m.group(1).lower()
        said = int(word) if word.isdigit() else NUMBER_WORDS.index(word)
        expected = yaml_count if m.group(2) else lock_count
        if said != expected:
            line = text[: m.start()].count("\n") + 1
            errors.append(f"{doc}:{line}: {m.group(0)!r}, but there are {expected}")
    return errors


def test_stage_counts_in_the_current_docs_are_the_pipelines() -> None:
    lock_count = len(yaml.safe_load((REPO / "dvc.lock").read_text())["stages"])
    yaml_count = len(yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"])
    errors = []
    for path in [REPO / "README.md", REPO / "DEVELOPING.md", *REPO.glob("docs/*.md")]:
        errors += stage_count_errors(str(path.relative_to(REPO)), path.read_text(), lock_count, yaml_count)
    assert not errors, "\n".join(errors)


SAME_AS = re.compile(r"<!-- same-as: (\S+) -->\s*\n```ya?ml\n(.*?)```", re.S)


def test_config_files_the_docs_show_are_the_committed_ones() -> None:
    """A YAML block after ``<!-- same-as: PATH -->`` holds what PATH holds (comments aside)."""
    errors, found = [], 0
    for path in current_docs():
        for m in SAME_AS.finditer(path.read_text()):
            found += 1
            if yaml.safe_load(m.group(2)) != yaml.safe_load((REPO / m.group(1)).read_text()):
                errors.append(f"{path.relative_to(REPO)}: the block is not {m.group(1)}; copy it again")
    assert found and not errors, "\n".join(errors) or "no same-as block found"


RUN_FIGURE = re.compile(r"(?<![\w.])(?:0\.\d{3}|[+-]\d{1,2}\.\d)(?![\w.%])")


def figures_outside_blocks(text: str) -> list[str]:
    """Run-like figures (0.530, +15.0) in prose or tables outside the checked blocks and code."""
    text = BLOCK.sub("", text)
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return RUN_FIGURE.findall(text)


def test_the_readme_quotes_run_figures_only_in_checked_blocks() -> None:
    found = figures_outside_blocks((REPO / "README.md").read_text())
    assert not found, f"README.md quotes {found} outside a figures block: render them in one"


# --------------------------------------------------------------------------- the machinery


def fake_run(root: Path) -> Run:
    """The outputs ``tiny_results`` reads, with round figures."""
    files = {
        "models/base/artifact.json": {"metrics": {"parameters": 798080}},
        "results/benchmark/base/metrics.json": {
            "tasks": {
                "heldout_exact": {"exact_match": 0.0, "samples": 64},
                "preference_choice": {"acc": 0.5, "samples": 64},
            }
        },
        "results/sft/metrics.json": {"step": 250, "val": {"token_accuracy": 0.9343}},
        "results/rm/metrics.json": {"step": 250, "val": {"pairwise_accuracy": 0.88, "reward_margin": 8.72}},
        "results/dpo/metrics.json": {
            "step": 100,
            "val": {"preference_accuracy": 0.985, "reward_margin": 1.74},
        },
        "results/rlvr/metrics.json": {"step": 100, "train": {"reward_mean": 0.71875}},
        "results/rlhf/metrics.json": {
            "step": 80,
            "train": {"rm_score": 5.36},
            "heldout": {"reward_hacking_suspected": 0.0},
        },
    }
    for rel, content in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(json.dumps(content))
    header = "| policy | " + " | ".join(REPORT_COLUMNS) + " | flags |"
    rows = [f"| `{p}` | " + " | ".join(f"{p}-{i}" for i in range(len(REPORT_COLUMNS))) + " |  |"
            for p in ("sft", "dpo", "rlvr", "rlhf")]  # fmt: skip
    report = "\n".join(["# Policy comparison", "", header, "|---|" + "---:|" * 7, *rows, ""])
    (root / "results/evaluate").mkdir(parents=True)
    (root / "results/evaluate/report.md").write_text(report)
    return Run(root)


def test_the_table_takes_the_reports_cells_and_each_stages_own_figures(tmp_path: Path) -> None:
    table = tiny_results(fake_run(tmp_path))
    lines = table.splitlines()
    assert lines[0].startswith("| policy | held-out accuracy | accuracy vs `sft` (points) |")
    assert lines[2] == (
        "| `base` (random init, 0.80M parameters) | — | — | — | — "
        "| 0.0% [0.0%, 5.7%] | 50.0% [38.1%, 61.9%] | — |"
    )
    assert lines[4] == (
        "| `dpo` (100 steps) | dpo-0 | dpo-1 | dpo-2 | dpo-3 | dpo-4 | dpo-5 "
        "| val preference accuracy 0.985, margin 1.74 |"
    )
    assert "last step's reward mean 0.719" in lines[5]
    assert "reward hacking not suspected" in lines[6]
    assert lines[7].endswith("| val pairwise accuracy 0.880, margin 8.72 |")


def test_a_figure_that_is_not_the_runs_is_named_and_rewritten(tmp_path: Path) -> None:
    run = fake_run(tmp_path)
    rendered = {"tiny-results": tiny_results(run)}
    doc = "intro\n\n<!-- figures:tiny-results -->\n" + rendered["tiny-results"] + "<!-- /figures -->\n"
    assert block_errors("README.md", doc, rendered) == []
    stale = doc.replace("margin 8.72", "margin 8.70")
    errors = block_errors("README.md", stale, rendered)
    assert len(errors) == 1 and errors[0].startswith("README.md:3: the 'tiny-results' block is not")
    assert rewrite_blocks(stale, rendered) == doc
    assert block_errors("x.md", "<!-- figures:nope -->\n<!-- /figures -->", {}) == [
        "x.md:1: no rendering for a figures block named 'nope'"
    ]


def test_outputs_that_are_not_the_locks_are_named(tmp_path: Path) -> None:
    run = fake_run(tmp_path)
    outs = [{"path": rel, "md5": dvc_hash(run.root / rel)} for rel in OUTPUTS if (run.root / rel).exists()]
    lock = yaml.safe_dump({"stages": {"all": {"outs": outs}}})
    assert differences_from_lock(run.root, lock) == []
    (run.root / "results/sft/metrics.json").write_text("{}")
    found = differences_from_lock(run.root, lock)
    assert len(found) == 1 and found[0].startswith("results/sft is ")
    shutil.rmtree(run.root / "results/rm")
    assert "results/rm is missing" in differences_from_lock(run.root, lock)


def test_stage_lists_counts_and_loose_figures_are_read() -> None:
    lock = yaml.safe_dump(
        {"stages": {n: {} for n in ("prep", "convert@dpo", "convert@rlvr", "evaluate")}}, sort_keys=False
    )
    assert stage_list(lock) == "`dvc repro` runs 4 stages: `prep`, `convert@{dpo,rlvr}`, `evaluate`.\n"
    text = "Ten stages in `dvc.yaml`, 16 stages in all, and five stages."
    assert stage_count_errors("d.md", text, 16, 10) == ["d.md:1: 'five stages', but there are 16"]
    assert figures_outside_blocks("0.530 and +15.0 points, NeMo-RL 0.7.0, 0.4.13, 12% and 0.8M") == [
        "0.530",
        "+15.0",
    ]


# --------------------------------------------------------------------------- regeneration


def main() -> int:
    """Rewrite the figures blocks and the chart from the working tree, if it is the committed run."""
    differences = differences_from_lock(REPO, (REPO / "dvc.lock").read_text())
    if differences:
        print("the working tree is not the run dvc.lock records; `dvc repro` or `dvc checkout` first:")
        print("\n".join(f"  {d}" for d in differences))
        return 1
    run = Run(REPO)
    rendered = {name: render(run) for name, render in RUN_BLOCKS.items()}
    rendered |= {name: render((REPO / "dvc.lock").read_text()) for name, render in LOCK_BLOCKS.items()}
    for doc in FIGURE_DOCS:
        path = REPO / doc
        path.write_text(rewrite_blocks(path.read_text(), rendered))
    shutil.copyfile(REPO / "results/evaluate/comparison.png", REPO / CHART)
    print(f"rewrote the figures blocks of {', '.join(FIGURE_DOCS)} and {CHART}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
