"""`alignpipe compare`: two runs' figures paired per prompt, read through DVC (the cache, a
revision, an experiment), and the runs it refuses to compare."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from alignpipe.measure import compare as K
from alignpipe.measure.intervals import paired_difference

# A stand-in evaluate stage: writes samples.jsonl as the evaluate stage does, from params.yaml.
# `solved` prompts (of 40) right for policy `tuned`; `sft` always solves the first 10.
WRITER = """
import json, os, yaml
p = yaml.safe_load(open("params.yaml"))
os.makedirs("results/evaluate", exist_ok=True)
os.makedirs("results/benchmark/tuned/samples", exist_ok=True)
with open("results/evaluate/samples.jsonl", "w") as f:
    for policy, solved in (("sft", 10), ("tuned", p["solved"])):
        for i in range(p["prompts"]):
            f.write(json.dumps({"policy": policy, "id": str(i), "task": "add" if i % 2 else "sort",
                                "prompt": f"q{i}", "completion": "", "correct": float(i < solved),
                                "rm_score": i * 0.01 + (0.5 if policy == "tuned" else 0.0)}) + "\\n")
with open("results/benchmark/tuned/samples/heldout_exact.jsonl", "w") as f:
    for d in range(20):
        f.write(json.dumps({"doc_id": d, "scores": {"exact_match": float(d < p["solved"] // 2)}}) + "\\n")
"""


def dvc_repo(tmp_path: Path) -> tuple[Path, dict]:
    root = tmp_path / "repo"
    root.mkdir()
    env = dict(os.environ)
    (root / "write.py").write_text(WRITER)
    (root / "params.yaml").write_text("solved: 10\nprompts: 40\n")
    (root / "dvc.yaml").write_text(
        "stages:\n  evaluate:\n    cmd: python write.py\n    deps: [write.py]\n"
        "    params: [solved, prompts]\n    outs: [results/evaluate, results/benchmark]\n"
    )
    for argv in (["git", "init", "-q"], ["dvc", "init", "-q"], ["dvc", "repro", "-q"],
                 ["git", "add", "-A"], ["git", "commit", "-qm", "baseline"]):  # fmt: skip
        subprocess.run(argv, cwd=root, env=env, check=True, capture_output=True)
    return root, env


def cli(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "alignpipe", "compare", *args],
        cwd=root, env={**os.environ, "ALIGNPIPE_ROOT": str(root)}, capture_output=True, text=True,
    )  # fmt: skip


@pytest.fixture(scope="module")
def experiment(tmp_path_factory) -> Path:
    """A git + DVC repo whose baseline solves 10 of 40 prompts, and an experiment `more` (solved=30)."""
    root, env = dvc_repo(tmp_path_factory.mktemp("compare"))
    run = subprocess.run(["dvc", "exp", "run", "-q", "-n", "more", "-S", "solved=30"], cwd=root, env=env,
                         capture_output=True, text=True)  # fmt: skip
    assert run.returncode == 0, run.stderr
    return root


def test_an_experiment_is_compared_with_its_baseline_prompt_by_prompt(experiment):
    proc = cli(experiment, "HEAD", "more", "--json")
    assert proc.returncode == 0, proc.stderr
    [report] = json.loads(proc.stdout)
    rows = {(r["policy"], r["figure"]): r for r in report["rows"]}
    tuned = rows[("tuned", "heldout_accuracy")]
    assert (tuned["a"], tuned["b"], tuned["n"]) == (0.25, 0.75, 40)
    a = [float(i < 10) for i in range(40)]
    b = [float(i < 30) for i in range(40)]
    assert tuned["b_minus_a"] == pytest.approx(paired_difference(b, a))
    assert tuned["verdict"] == "B higher"
    # The policy the experiment did not change: the same samples, a difference of exactly zero.
    assert rows[("sft", "heldout_accuracy")]["b_minus_a"] == {"value": 0.0, "low": 0.0, "high": 0.0}
    assert rows[("sft", "heldout_accuracy")]["verdict"] == "not resolved"
    assert {("tuned", "heldout_accuracy_add"), ("tuned", "heldout_accuracy_sort"), ("tuned", "rm_score"),
            ("tuned", "heldout_exact/exact_match")} <= set(rows)  # fmt: skip
    assert rows[("tuned", "heldout_exact/exact_match")]["n"] == 20
    assert report["a"].startswith("HEAD (") and report["b"].startswith("more (")  # each with its commit


def test_the_markdown_report_names_both_runs_and_each_interval(experiment):
    proc = cli(experiment, "HEAD", "more")
    assert proc.returncode == 0, proc.stderr
    assert "A = HEAD and B = more" in proc.stdout
    assert "| tuned | heldout_accuracy | 0.250 | 0.750 | +0.500 [" in proc.stdout
    # accuracy, its two tasks and the RM score per policy; tuned's benchmark besides
    assert (proc.stdout.count("\n| sft |"), proc.stdout.count("\n| tuned |")) == (4, 5)


def test_an_unknown_revision_is_refused_before_anything_is_read(experiment):
    proc = cli(experiment, "HEAD", "more", "no-such-run")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == (
        "alignpipe: error: no git revision or DVC experiment named 'no-such-run' (see `git log`, `dvc exp show`)"
    )


def test_a_revision_whose_outputs_are_not_in_the_cache_is_refused(experiment, tmp_path):
    root = tmp_path / "clone"
    shutil.copytree(experiment, root)
    shutil.rmtree(root / ".dvc" / "cache")
    proc = cli(root, "HEAD", "workspace")
    assert proc.returncode == 2
    assert "HEAD's results/evaluate/samples.jsonl is not in the DVC cache or the remote: `dvc pull` it" in (
        proc.stderr
    )
    assert len(proc.stderr.strip().splitlines()) == 1


def test_runs_on_different_held_out_sets_are_refused(experiment, tmp_path):
    root = tmp_path / "clone"
    shutil.copytree(experiment, root)
    env = dict(os.environ)
    run = subprocess.run(["dvc", "exp", "run", "-q", "-n", "fewer", "-S", "prompts=30"], cwd=root, env=env,
                         capture_output=True, text=True)  # fmt: skip
    assert run.returncode == 0, run.stderr
    proc = cli(root, "HEAD", "fewer")
    assert proc.returncode == 2
    assert proc.stderr.strip().endswith(
        "evaluated sft on different held-out sets (40 prompts against 30; prompt 31 is id '30' in HEAD, "
        "absent in fewer): a paired comparison needs the same prompts"
    )


def _run(name: str, correct: list[float], docs: dict[int, dict[str, float]] | None = None) -> K.Run:
    samples = [{"id": str(i), "prompt": f"q{i}", "task": "t", "correct": c, "rm_score": None}
               for i, c in enumerate(correct)]  # fmt: skip
    return K.Run(name, name, {"p": samples}, {"p": {"bench": docs}} if docs else {})


def test_benchmarks_on_other_documents_are_refused():
    a = _run("a", [1.0, 0.0], {0: {"acc": 1.0}, 1: {"acc": 0.0}})
    b = _run("b", [1.0, 1.0], {0: {"acc": 1.0}, 2: {"acc": 0.0}})
    with pytest.raises(K.CompareError, match="scored p on different documents of benchmark bench"):
        K.compare(a, b)


def test_a_policy_or_figure_only_one_run_has_is_noted_not_compared():
    a = _run("a", [1.0, 0.0])
    b = _run("b", [1.0, 0.0])
    b.heldout["new"] = b.heldout["p"]
    rows, notes = K.compare(a, b)
    assert {r.policy for r in rows} == {"p"}
    assert notes == ["new: only in b"]
    assert not any(r.figure == "rm_score" for r in rows)  # a run without a reward model
