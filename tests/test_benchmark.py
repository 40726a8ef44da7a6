"""The benchmark stage: lm-evaluation-harness on each policy, for real on the tiny models.

Bad input is refused before any model loads, naming the task and the fix (lm-eval itself
skips a YAML it cannot parse and later says only "task not found"); a real run writes fixed-name
scores DVC can show; and lm-eval's logged generations, scored by the project's own verifier,
give lm-eval's own number.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from alignpipe.measure.benchmarks import where
from alignpipe.rewards.verifiers import score_completion
from tests.conftest import REPO, run_cli, set_params, writable_copy

TASKS = "stages/benchmark/tasks"
REPO_TASKS = REPO / TASKS


@pytest.fixture(scope="module")
def benchmarked(tiny_pipeline, tmp_path_factory) -> Path:
    """Every policy benchmarked with the tiny profile's tasks by the shared ``tiny_pipeline``'s
    benchmark stages; a copy this module's tests may re-run stages in."""
    return writable_copy(tiny_pipeline.root, tmp_path_factory.mktemp("bench") / "repo")


def read(root: Path, policy: str) -> dict:
    return json.loads((root / "results" / "benchmark" / policy / "metrics.json").read_text())


def test_scores_are_published_per_policy_and_sft_learned(benchmarked: Path) -> None:
    base, sft = read(benchmarked, "base"), read(benchmarked, "sft")
    for metrics in (base, sft):
        assert metrics["lm_eval"] == "0.4.13"
        assert set(metrics["tasks"]) == {"heldout_exact", "preference_choice"}
        assert metrics["tasks"]["heldout_exact"]["samples"] == 64
        for score in (
            *metrics["tasks"]["heldout_exact"].values(),
            *metrics["tasks"]["preference_choice"].values(),
        ):
            assert score >= 0
    # The random starting model answers nothing; the SFT policy most (0.77-0.84 measured).
    assert base["tasks"]["heldout_exact"]["exact_match"] == 0.0
    assert sft["tasks"]["heldout_exact"]["exact_match"] >= 0.5
    assert sft["tasks"]["preference_choice"]["acc"] > base["tasks"]["preference_choice"]["acc"]
    manifest = json.loads((benchmarked / "results" / "benchmark" / "sft" / "artifact.json").read_text())
    assert manifest["type"] == "report" and manifest["inputs"]["policy"]["path"].endswith("models/sft")


def test_dvc_metrics_show_has_every_benchmarked_policys_scores(benchmarked: Path) -> None:
    import subprocess

    proc = subprocess.run(
        ["dvc", "metrics", "show", "--json"], cwd=benchmarked, capture_output=True, text=True
    )
    shown = json.loads(proc.stdout[proc.stdout.index("{") :])[""]["data"]
    for policy in ("base", "sft"):
        data = shown[f"results/benchmark/{policy}/metrics.json"]["data"]
        assert data["tasks"] == read(benchmarked, policy)["tasks"]
        assert 0 <= data["tasks"]["preference_choice"]["acc"] <= 1


def test_the_projects_verifier_agrees_with_lm_evals_metric_on_its_logged_generations(
    benchmarked: Path,
) -> None:
    lines = (benchmarked / "results" / "benchmark" / "sft" / "samples" / "heldout_exact.jsonl").read_text()
    records = [json.loads(line) for line in lines.splitlines()]
    assert len(records) == 64
    ours = [score_completion(r["doc"], r["resps"][0][0]) for r in records]
    theirs = [r["scores"]["exact_match"] for r in records]
    assert ours == theirs
    assert sum(theirs) / len(theirs) == read(benchmarked, "sft")["tasks"]["heldout_exact"]["exact_match"]


def test_a_rerun_writes_the_same_bytes(benchmarked: Path, tmp_path: Path) -> None:
    before = {
        p.relative_to(benchmarked): p.read_bytes()
        for p in (benchmarked / "results/benchmark/sft").rglob("*")
        if p.is_file()
    }
    shutil.rmtree(benchmarked / "results" / "benchmark" / "sft")
    run_cli(benchmarked, "run", "benchmark", "--source", "sft", env={"ALIGNPIPE_SCRATCH": str(tmp_path)})
    after = {
        p.relative_to(benchmarked): p.read_bytes()
        for p in (benchmarked / "results/benchmark/sft").rglob("*")
        if p.is_file()
    }
    assert after == before


@pytest.mark.slow
def test_evaluate_shows_benchmark_columns_and_gates_on_a_regression(benchmarked: Path) -> None:
    """evaluate reads each policy's benchmark results; the untrained base falls far below sft on
    heldout_exact, so a max_drop flags it, and fail_on_regression fails the stage unpublished."""
    evaluate = {"evaluate": {"alignpipe": {"evaluate": {
        "policies": [{"name": "sft", "path": "models/sft"}, {"name": "base", "path": "models/base"}],
        "reward_model": None}}}}  # fmt: skip
    gate = {"name": "heldout_exact", "limit": 64, "max_drop": 0.05}
    set_params(benchmarked, {**evaluate, **tasks_param(gate, {"name": "preference_choice", "limit": 64})})
    run_cli(benchmarked, "run", "evaluate")
    metrics = json.loads((benchmarked / "results" / "evaluate" / "metrics.json").read_text())
    base, sft = metrics["policies"]["base"], metrics["policies"]["sft"]
    assert sft["benchmarks"] == {t: {m: v for m, v in s.items() if m not in ("samples", "num_fewshot")}
                                 for t, s in read(benchmarked, "sft")["tasks"].items()}  # fmt: skip
    assert base["benchmark_regressions"] and base["benchmark_regressions"][0].startswith(
        "heldout_exact/exact_match"
    )
    assert sft["benchmark_regressions"] == []
    # The paired difference on the same 64 documents, read from each policy's lm-eval samples.
    vs = base["benchmark_vs_reference"]["heldout_exact"]["exact_match"]
    fall = (
        base["benchmarks"]["heldout_exact"]["exact_match"] - sft["benchmarks"]["heldout_exact"]["exact_match"]
    )
    assert vs["value"] == pytest.approx(fall) and vs["low"] < fall < vs["high"] < -0.05
    own = sft["benchmark_intervals"]["heldout_exact"]["exact_match"]
    assert own["low"] < sft["benchmarks"]["heldout_exact"]["exact_match"] < own["high"]
    report = (benchmarked / "results" / "evaluate" / "report.md").read_text()
    assert "heldout_exact exact_match" in report and "**benchmark regression**" in report

    shutil.rmtree(benchmarked / "results" / "evaluate")
    set_params(benchmarked, {"benchmark": {"alignpipe": {"benchmark": {"fail_on_regression": True}}}})
    result = run_cli(benchmarked, "run", "evaluate", check=False)
    assert result.returncode == 2 and "benchmark regression against 'sft'" in result.stderr
    assert "base: heldout_exact/exact_match" in result.stderr
    assert not (benchmarked / "results" / "evaluate").exists()


# ----------------------------------------------------------------------------- bad input


def refused(root: Path, *needles: str, source: str = "sft") -> None:
    result = run_cli(root, "run", "benchmark", "--source", source, check=False)
    assert result.returncode == 2, result.stderr
    for needle in needles:
        assert needle in result.stderr, result.stderr
    assert not (root / "results" / "benchmark" / source).exists()


def tasks_param(*tasks: dict) -> dict:
    return {"benchmark": {"alignpipe": {"benchmark": {"tasks": list(tasks)}}}}


@pytest.fixture
def bench_copy(trained_sft: Path, tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.setenv("ALIGNPIPE_SCRATCH", str(tmp_path / "scratch"))
    return writable_copy(trained_sft, tmp_path / "repo")


@pytest.fixture(scope="module")
def two_names_lm_eval_must_look_up(trained_sft: Path, tmp_path_factory) -> tuple[Path, str]:
    """One run refusing an unknown task and a builtin one with downloads off: both named in one
    error, from one build of lm-eval's task index (~15 s of CPU)."""
    tmp = tmp_path_factory.mktemp("lookup")
    root = writable_copy(trained_sft, tmp / "repo")
    set_params(root, tasks_param({"name": "heldout_exakt"}, {"name": "gsm8k", "limit": 8}))
    result = run_cli(root, "run", "benchmark", "--source", "sft", env={"ALIGNPIPE_SCRATCH": str(tmp / "s")},
                     check=False)  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert not (root / "results" / "benchmark" / "sft").exists()
    return root, result.stderr


def test_an_unknown_task_is_named_with_close_names(two_names_lm_eval_must_look_up) -> None:
    _, stderr = two_names_lm_eval_must_look_up
    assert (
        f"{where('tasks[0]')}: unknown task 'heldout_exakt'" in stderr
        and "did you mean heldout_exact" in stderr
    ), stderr


def test_a_builtin_task_with_downloads_off_names_the_knob(two_names_lm_eval_must_look_up) -> None:
    _, stderr = two_names_lm_eval_must_look_up
    assert f"{where('tasks[1]')}: 'gsm8k' is an lm-eval builtin task" in stderr, stderr
    assert "benchmark.alignpipe.benchmark.download=true" in stderr, stderr


def test_a_task_file_that_does_not_exist_is_named(bench_copy: Path) -> None:
    set_params(bench_copy, tasks_param({"name": "mine", "file": "tasks/mine.yaml"}))
    refused(bench_copy, "tasks[0].file", "tasks/mine.yaml does not exist")


def test_a_task_yaml_that_does_not_parse_names_its_line(bench_copy: Path) -> None:
    (bench_copy / TASKS / "broken.yaml").write_text(
        "task: broken\ndataset_path: json\n  output_type: [generate_until\n"
    )
    set_params(bench_copy, tasks_param({"name": "broken"}))
    refused(bench_copy, f"{bench_copy / TASKS / 'broken.yaml'}: lm-eval cannot read this task YAML", "line 3")


def test_missing_data_files_are_named(bench_copy: Path) -> None:
    text = (
        (bench_copy / TASKS / "heldout_exact.yaml").read_text().replace("rlvr/test.jsonl", "rlvr/nope.jsonl")
    )
    (bench_copy / TASKS / "heldout_exact.yaml").write_text(text)
    set_params(bench_copy, tasks_param({"name": "heldout_exact"}))
    refused(bench_copy, "dataset_kwargs.data_files names data/prepared/rlvr/nope.jsonl, which does not exist")


def test_a_chat_task_on_a_model_without_a_chat_template_is_refused(bench_copy: Path) -> None:
    config = bench_copy / "models" / "base" / "tokenizer_config.json"
    doc = json.loads(config.read_text())
    doc.pop("chat_template", None)
    config.write_text(json.dumps(doc))
    for extra in bench_copy.joinpath("models", "base").glob("chat_template.*"):
        extra.unlink()
    refused(bench_copy, "its tokenizer has no chat template", "apply_chat_template", source="base")


def test_another_harness_version_is_refused(bench_copy: Path) -> None:
    set_params(bench_copy, {"benchmark": {"alignpipe": {"benchmark": {"lm_eval_version": "0.4.9"}}}})
    refused(
        bench_copy,
        "benchmark.lm_eval_version (stages/benchmark/config/<profile>.yaml) is 0.4.9, but lm-eval 0.4.13",
    )


# ----------------------------------------------------------------------------- GPU profiles


def lm_eval_vllm_class() -> ast.ClassDef:
    """lm-eval's own VLLM backend class, read from its source (importing it needs vLLM)."""
    import lm_eval

    source = Path(lm_eval.__file__).parent / "models" / "vllm_causallms.py"
    tree = ast.parse(source.read_text())
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "VLLM")


@pytest.mark.parametrize("profile", ["default", "default_megatron", "nemo_gym"])
def test_the_gpu_invocation_is_what_lm_evals_vllm_backend_and_registry_take(
    repo_copy: Path, profile: str
) -> None:
    from lm_eval.tasks import TaskManager

    from alignpipe.settings import BenchmarkVllm

    out = repo_copy / "plan"
    run_cli(repo_copy, "plan", "benchmark", "--source", "rlhf", "--profile", profile, "--write", str(out))
    call = json.loads((out / "benchmark@rlhf.lm_eval.json").read_text())
    assert call["model"] == "vllm" and call["model_args"]["pretrained"] == str(repo_copy / "exports" / "rlhf")

    cls = lm_eval_vllm_class()
    assert any(
        isinstance(d, ast.Call) and d.args[0].value == "vllm" for d in cls.decorator_list
    )  # @register_model("vllm")
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    named = {a.arg for a in init.args.args + init.args.kwonlyargs}
    # What VLLM does not name goes on to vllm.LLM (``self.model_args.update(kwargs)``).
    assert init.args.kwarg is not None and "self.model_args.update(kwargs)" in ast.unparse(init)
    settable = {f.name for f in dataclasses.fields(BenchmarkVllm)}  # what alignpipe.benchmark.vllm takes
    assert set(call["model_args"]) - named <= {"gpu_memory_utilization"} and settable - named <= {
        "gpu_memory_utilization"
    }
    # Every task resolves in lm-eval's registry over the repository's task folder.
    registry = TaskManager(include_path=str(REPO_TASKS), include_defaults=False).all_tasks
    assert {t["name"] for t in call["tasks"]} <= set(registry)

    # The inner run goes to the pinned image through the container launcher, GPUs attached.
    launch = (out / "benchmark@rlhf.launch.sh").read_text().splitlines()[-1]
    assert launch.startswith("docker run --rm --init") and "--gpus all" in launch
    assert launch.endswith(
        f"alignpipe-nemo-rl:v0.7.0 alignpipe run benchmark --inner --profile {profile} --source rlhf"
    )


def test_vllm_without_a_launcher_to_reach_it_is_refused(trained_sft: Path, tmp_path: Path) -> None:
    root = writable_copy(trained_sft, tmp_path / "repo")
    set_params(root, {"benchmark": {"alignpipe": {"benchmark": {"backend": "vllm"}}}})
    result = run_cli(root, "run", "benchmark", "--source", "sft", check=False)
    assert result.returncode == 2 and "is vllm, but vLLM is not installed here" in result.stderr
    result = run_cli(root, "run", "benchmark", "--source", "sft", "--inner", check=False)
    assert result.returncode == 2 and "runtime.image must be the pipeline's NeMo-RL image" in result.stderr
    assert not (root / "results" / "benchmark" / "sft").exists()
