"""alignpipe seeds: a policy's gain over sft per run and pooled over runs (training seeds)."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from alignpipe.measure import compare as K
from alignpipe.measure import seeds as S
from tests.test_compare import dvc_repo

PROMPTS = 20


def _run(name: str, tuned_solves: int, sft_solves: int = 5, prompts: int = PROMPTS) -> K.Run:
    def samples(solved: int) -> list[dict]:
        return [{"id": str(i), "prompt": f"q{i}", "task": "sort" if i % 2 else "add",
                 "correct": float(i < solved), "rm_score": None} for i in range(prompts)]  # fmt: skip

    return K.Run(name, name, {"sft": samples(sft_solves), "tuned": samples(tuned_solves)})


def test_each_runs_paired_gain_is_pooled_with_a_t_interval_over_the_runs():
    runs = [_run("s1", 7), _run("s2", 9), _run("s3", 8)]  # +0.10, +0.20, +0.15 over sft
    rows = {(r.policy, r.figure): r for r in S.pool(runs)}
    row = rows[("tuned", "heldout_accuracy")]
    assert [round(d["value"], 3) for d in row.per_run] == [0.10, 0.20, 0.15]
    spread = math.sqrt(((0.10 - 0.15) ** 2 + (0.20 - 0.15) ** 2 + 0) / 2) / math.sqrt(3)
    assert row.pooled["value"] == pytest.approx(0.15)
    assert row.pooled["low"] == pytest.approx(0.15 - S.T975[2] * spread)
    assert row.verdict == "above zero"
    assert {f for p, f in rows if p == "tuned"} == {
        "heldout_accuracy",
        "heldout_accuracy_add",
        "heldout_accuracy_sort",
    }


def test_a_gain_one_run_shows_and_another_reverses_is_not_resolved():
    rows = S.pool([_run("s1", 10), _run("s2", 3)])  # +0.25, then -0.10
    row = next(r for r in rows if r.figure == "heldout_accuracy")
    assert row.per_run[0]["low"] > 0  # the first run alone would claim a gain
    assert row.verdict == "not resolved"
    assert "| tuned | heldout_accuracy | +0.250" in S.markdown([_run("s1", 10), _run("s2", 3)], rows)


def test_pooling_needs_two_runs_with_sft_on_the_same_prompts():
    with pytest.raises(K.CompareError, match="at least two runs, got 1"):
        S.pool([_run("s1", 7)])
    lacking = _run("s2", 7)
    del lacking.heldout["sft"]
    with pytest.raises(K.CompareError, match="s2 has no sft policy"):
        S.pool([_run("s1", 7), lacking])
    with pytest.raises(K.CompareError, match="s1 and s2 evaluated sft on different held-out sets"):
        S.pool([_run("s1", 7), _run("s2", 7, prompts=PROMPTS - 1)])


def test_the_command_pools_dvc_experiments(tmp_path):
    root, env = dvc_repo(tmp_path)  # the stand-in evaluate: sft solves 10 of 40, `tuned` solves `solved`
    for name, solved in (("seed-2", 16), ("seed-3", 14)):
        run = subprocess.run(["dvc", "exp", "run", "-q", "-n", name, "-S", f"solved={solved}"], cwd=root,
                             env=env, capture_output=True, text=True)  # fmt: skip
        assert run.returncode == 0, run.stderr
    argv = [sys.executable, "-m", "alignpipe", "seeds", "HEAD", "seed-2", "seed-3"]
    out = subprocess.run(
        argv, cwd=root, env={**env, "ALIGNPIPE_ROOT": str(root)}, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    row = next(line for line in out.stdout.splitlines() if line.startswith("| tuned | heldout_accuracy |"))
    # HEAD solves 10 (+0.000), the experiments 16 and 14 (+0.150, +0.100): pooled +0.083
    assert "+0.000 [+0.000, +0.000]" in row and "+0.150" in row and "| +0.083 [" in row
    unknown = subprocess.run([*argv[:4], "HEAD", "nope"], cwd=root, env={**env, "ALIGNPIPE_ROOT": str(root)},
                             capture_output=True, text=True)  # fmt: skip
    assert unknown.returncode == 2 and "no git revision or DVC experiment named 'nope'" in unknown.stderr
