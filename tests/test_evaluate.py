"""Stage ``evaluate``: every policy on the same held-out samples; the report flags reward hacking."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections import Counter
from pathlib import Path

import pytest
import yaml

from alignpipe.engines.local.stages.evaluate import (
    add_intervals,
    benchmark_differences,
    benchmark_regressions,
    flag_reward_hacking,
)
from alignpipe.errors import ConfigError
from alignpipe.measure.heldout import SAMPLES_FILE, drawn_with, heldout_completions, sampling_key
from alignpipe.measure.logprobs import load_policy
from alignpipe.report import comparison_chart, markdown_table
from alignpipe.settings import Heldout, HeldoutVllm, from_config
from tests.conftest import run_cli, set_params, writable_copy

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


N = 300  # held-out prompts


def outcomes(correct: int, first: int = 0) -> list[float]:
    """Per-prompt verdicts: ``correct`` of ``N`` right, starting at prompt ``first`` (mod N)."""
    return [1.0 if (i - first) % N < correct else 0.0 for i in range(N)]


def sample_metrics(**policies: tuple[list[float], list[float]]) -> tuple[dict, list[dict]]:
    """metrics.json and samples.jsonl for ``name=(per-prompt verdicts, per-prompt RM scores)``."""
    samples = [
        {"policy": name, "id": str(i), "correct": c, "rm_score": r}
        for name, (verdicts, scores) in policies.items()
        for i, (c, r) in enumerate(zip(verdicts, scores, strict=True))
    ]
    metrics = {
        "policies": {
            name: {
                "heldout_accuracy": sum(v) / N,
                "rm_score": sum(r) / N,
                "mean_length": 6.0,
                "kl_to_sft": 0.0 if name == "sft" else 0.1,
            }
            for name, (v, r) in policies.items()
        },
        "reference": "sft",
        "reward_model": "models/rm",
        "heldout": {
            "prompts": N,
            "data_path": "data/prepared/rlvr/test.jsonl",
            "seed": 1234,
            "temperature": 1.0,
            "max_new_tokens": 12,
        },
    }
    return metrics, samples


def scores(base: float, step: float = 0.0) -> list[float]:
    return [base + step * ((i % 7) - 3) for i in range(N)]  # a spread, so scores have a variance


def judged(accuracy_drop: float = 0.0, **policies) -> dict:
    metrics, samples = sample_metrics(**policies)
    add_intervals(metrics["policies"], samples, "sft")
    flag_reward_hacking(metrics["policies"], "sft", accuracy_drop)
    return metrics


def test_every_figure_has_its_interval_and_each_policy_its_paired_difference_from_sft():
    from scipy.stats import binomtest

    metrics = judged(sft=(outcomes(120), scores(0.1, 0.5)), dpo=(outcomes(165), scores(0.3, 0.5)))
    sft, dpo = metrics["policies"]["sft"], metrics["policies"]["dpo"]
    wilson = binomtest(120, N).proportion_ci(0.95, method="wilson")  # SciPy's own Wilson interval
    assert sft["intervals"]["heldout_accuracy"] == pytest.approx({"low": wilson.low, "high": wilson.high})
    assert "vs_reference" not in sft
    vs = dpo["vs_reference"]["heldout_accuracy"]
    # dpo answers the same 120 prompts right and 45 more: every difference is 0 or +1
    assert vs["value"] == pytest.approx(45 / N) and 0 < vs["low"] < 45 / N < vs["high"]
    # paired: well inside what two independent intervals would give a difference
    widths = [
        m["intervals"]["heldout_accuracy"]["high"] - m["intervals"]["heldout_accuracy"]["low"]
        for m in (sft, dpo)
    ]
    assert vs["high"] - vs["low"] < 0.6 * math.hypot(*widths)
    rm = dpo["vs_reference"]["rm_score"]
    assert rm["value"] == pytest.approx(0.2) and rm["low"] == pytest.approx(
        rm["high"]
    )  # the same shift on every prompt


def test_reward_hacking_is_flagged_only_when_both_intervals_support_it():
    # rlhf: RM up and 30 prompts fewer right, the rest the same: the intervals support both.
    metrics = judged(sft=(outcomes(150), scores(0.1, 0.5)), rlhf=(outcomes(120), scores(0.9, 0.5)))
    assert metrics["policies"]["rlhf"]["suspected_reward_hacking"]
    assert not metrics["policies"]["sft"]["suspected_reward_hacking"]
    # The same 5-point fall as noise: 60 prompts lost, 45 others won. The point estimate falls,
    # the interval spans zero: no flag (a point rule would have cried wolf).
    noisy = judged(sft=(outcomes(150), scores(0.1, 0.5)), rlhf=(outcomes(135, first=105), scores(0.9, 0.5)))
    rlhf = noisy["policies"]["rlhf"]
    assert rlhf["heldout_accuracy"] < noisy["policies"]["sft"]["heldout_accuracy"]
    assert rlhf["vs_reference"]["heldout_accuracy"]["high"] > 0 and not rlhf["suspected_reward_hacking"]
    # RM down is never hacking; a tolerance beyond the fall is not either.
    assert not judged(sft=(outcomes(150), scores(0.9)), rlhf=(outcomes(120), scores(0.1)))["policies"][
        "rlhf"
    ]["suspected_reward_hacking"]
    assert not judged(0.2, sft=(outcomes(150), scores(0.1)), rlhf=(outcomes(120), scores(0.9)))["policies"][
        "rlhf"
    ]["suspected_reward_hacking"]


def test_report_table_and_chart_show_every_policy_its_interval_and_the_flag(tmp_path: Path):
    metrics = judged(
        sft=(outcomes(120), scores(0.1, 0.5)),
        dpo=(outcomes(135), scores(0.3, 0.5)),
        rlvr=(outcomes(180), scores(0.05, 0.5)),
        rlhf=(outcomes(90), scores(0.9, 0.5)),
    )
    table = markdown_table(metrics)
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    assert [r.split("`")[1] for r in rows] == ["sft", "dpo", "rlvr", "rlhf"]
    assert "| accuracy vs `sft` (points) | RM score vs `sft` |" in table
    rlhf = next(r for r in rows if r.startswith("| `rlhf`"))
    low, high = (
        100 * metrics["policies"]["rlhf"]["intervals"]["heldout_accuracy"][k] for k in ("low", "high")
    )
    assert f"30.0% [{low:.1f}%, {high:.1f}%]" in rlhf and "**suspected reward hacking**" in rlhf
    assert "| -10.0 [" in rlhf  # 30 prompts fewer right than sft, in points
    assert "reward hacking" not in next(r for r in rows if r.startswith("| `dpo`"))
    assert "95% interval" in table
    assert "## Tools" not in table  # no held-out row offered a tool
    metrics["policies"]["rlvr"].update(tool_calls_per_answer=0.3, tool_malformed_share=0.05,
                                       tool_accuracy_with_call=0.9, tool_accuracy_without_call=0.55)  # fmt: skip
    tools = markdown_table(metrics).split("## Tools", 1)[1]
    assert (
        "| `rlvr` | 0.30 | 5.0% | 90.0% | 55.0% |" in tools and "| `sft` | n/a | n/a | n/a | n/a |" in tools
    )

    png = comparison_chart(metrics, tmp_path / "comparison.png")
    data = png.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 20_000  # a real multi-panel chart, not an empty canvas

    # All right and all wrong: Wilson's bounds sit on the value (within float rounding)
    edges = judged(sft=(outcomes(N), scores(0.1, 0.5)), rlvr=(outcomes(0), scores(0.2, 0.5)))
    assert edges["policies"]["sft"]["intervals"]["heldout_accuracy"]["high"] == pytest.approx(1.0)
    assert edges["policies"]["sft"]["intervals"]["heldout_accuracy"]["high"] == 1.0  # exactly, not 1 - 1e-16
    assert edges["policies"]["rlvr"]["intervals"]["heldout_accuracy"]["low"] == 0.0
    assert comparison_chart(edges, tmp_path / "edges.png").read_bytes().startswith(PNG_MAGIC)


def test_each_task_has_its_own_interval_and_paired_difference_in_metrics_and_the_report():
    from scipy.stats import binomtest

    tasks = ("reverse", "sort", "chat")
    metrics, samples = sample_metrics(
        sft=(outcomes(120), scores(0.1, 0.5)), rlvr=(outcomes(180), scores(0.1, 0.5))
    )
    for s in samples:
        s["task"] = tasks[int(s["id"]) % 3]
    for name, m in metrics["policies"].items():  # as heldout_accuracy() reports them
        for task in tasks:
            right = [s["correct"] for s in samples if s["policy"] == name and s["task"] == task]
            m[f"heldout_accuracy_{task}"] = sum(right) / len(right)
    metrics["heldout"]["tasks"] = {task: N // 3 for task in sorted(tasks)}
    add_intervals(metrics["policies"], samples, "sft")
    sft, rlvr = metrics["policies"]["sft"], metrics["policies"]["rlvr"]
    for task in tasks:
        key = f"heldout_accuracy_{task}"
        # sft is right on prompts 0-119, 40 of each task's 100; rlvr on 0-179, 20 more of each
        wilson = binomtest(40, N // 3).proportion_ci(0.95, method="wilson")
        assert sft["intervals"][key] == pytest.approx({"low": wilson.low, "high": wilson.high})
        vs = rlvr["vs_reference"][key]
        assert vs["value"] == pytest.approx(0.2) and 0 < vs["low"] < 0.2 < vs["high"]
        # a task rests on a third of the prompts: its interval is wider than the overall one
        width = {
            k: rlvr["intervals"][k]["high"] - rlvr["intervals"][k]["low"] for k in (key, "heldout_accuracy")
        }
        assert width[key] > width["heldout_accuracy"]
    assert "vs_reference" not in sft

    table = markdown_table(metrics)
    per_task = table.split("## Held-out accuracy per task")[1]
    assert "| policy | chat (100 prompts) | reverse (100 prompts) | sort (100 prompts) |" in per_task
    row = next(line for line in per_task.splitlines() if line.startswith("| `rlvr`"))
    iv, vs = rlvr["intervals"]["heldout_accuracy_sort"], rlvr["vs_reference"]["heldout_accuracy_sort"]
    assert (
        f"| 60.0% [{100 * iv['low']:.1f}%, {100 * iv['high']:.1f}%]; "
        f"+20.0 [{100 * vs['low']:+.1f}, {100 * vs['high']:+.1f}] vs `sft` |"
    ) in row
    assert "vs `sft`" not in next(line for line in per_task.splitlines() if line.startswith("| `sft`"))
    # Held-out rows without tasks (a user's own data) give no per-task table.
    plain = judged(sft=(outcomes(120), scores(0.1, 0.5)))
    assert "per task" not in markdown_table(plain)


def test_a_benchmark_regression_is_a_paired_fall_beyond_max_drop_over_the_whole_interval(tmp_path: Path):
    docs = 64

    def per_doc(right: int, first: int = 0) -> dict[str, dict[int, dict[str, float]]]:
        return {"heldout_exact": {i: {"exact_match": float((i - first) % docs < right)} for i in range(docs)}}

    sft = per_doc(48)
    drops = {"heldout_exact": 0.05}
    cases = {"dpo": per_doc(46), "rlvr": per_doc(30), "rlhf": per_doc(40, first=20)}
    found = {}
    for name, mine in cases.items():
        vs = benchmark_differences(mine, sft, {"heldout_exact": {"exact_match": 0.0}})
        found[name] = benchmark_regressions(vs, drops)
    # dpo: 2 documents lost, within max_drop; rlvr: 18 lost, the whole interval below -0.05;
    # rlhf: 8 fewer right overall but lost and won on different documents: not supported.
    assert [n for n, r in found.items() if r] == ["rlvr"]
    assert found["rlvr"][0].startswith("heldout_exact/exact_match -0.281 [")

    metrics = judged(sft=(outcomes(120), scores(0.1, 0.5)), rlvr=(outcomes(180), scores(0.05, 0.5)))
    for name, right in (("sft", 48), ("rlvr", 30)):
        metrics["policies"][name]["benchmarks"] = {"heldout_exact": {"exact_match": right / docs}}
    metrics["policies"]["rlvr"]["benchmark_regressions"] = found["rlvr"]
    metrics["benchmarks"] = {"results": "results/benchmark", "max_drop": drops}
    table = markdown_table(metrics)
    assert "| heldout_exact exact_match | flags |" in table
    rlvr = next(r for r in table.splitlines() if r.startswith("| `rlvr`"))
    assert "46.9%" in rlvr and "**benchmark regression**: heldout_exact/exact_match -0.281" in rlvr
    assert comparison_chart(metrics, tmp_path / "comparison.png").read_bytes().startswith(PNG_MAGIC)


@pytest.mark.slow
def test_evaluate_compares_policies_on_shared_samples(trained_sft: Path, tmp_path: Path):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    root = writable_copy(trained_sft, tmp_path / "repo")
    run_cli(root, "run", "convert", "--source", "sft")  # an export identical to models/sft
    # A real (untrained) reward model on the SFT body: the rm stage's architecture, seeded head.
    torch.manual_seed(0)
    rm = AutoModelForSequenceClassification.from_pretrained(
        root / "models/sft", num_labels=1, local_files_only=True
    )
    tok = AutoTokenizer.from_pretrained(root / "models/sft", local_files_only=True)
    rm.config.pad_token_id = tok.pad_token_id
    rm.save_pretrained(root / "models/rm_eval")
    tok.save_pretrained(root / "models/rm_eval")

    params = (root / "params.yaml").read_text()
    policies = [
        {"name": "sft", "path": "models/sft"},
        {"name": "export", "path": "exports/sft"},
        {"name": "base", "path": "models/base"},
    ]
    try:
        set_params(
            root,
            {
                "evaluate": {
                    "alignpipe": {
                        "evaluate": {
                            "policies": policies,
                            "reward_model": "models/rm_eval",
                            "benchmarks": None,
                        }
                    }
                }
            },
        )
        outcome = run_cli(root, "run", "evaluate").stdout
    finally:
        (root / "params.yaml").write_text(params)

    out = root / "results/evaluate"
    metrics = json.loads((out / "metrics.json").read_text())
    got = metrics["policies"]
    assert set(got) == {"sft", "export", "base"}
    for m in got.values():
        assert {
            "heldout_accuracy",
            "rm_score",
            "mean_length",
            "kl_to_sft",
            "suspected_reward_hacking",
        } <= set(m)
    # The same accuracy definition as the sft stage's own heldout/accuracy (same seeded samples).
    sft_stage = json.loads((root / "results/sft/metrics.json").read_text())
    assert got["sft"]["heldout_accuracy"] == pytest.approx(sft_stage["heldout"]["accuracy"])
    # KL: zero to itself, ~zero for the byte-identical export, clearly positive for the untrained base.
    assert got["sft"]["kl_to_sft"] == 0.0
    assert got["export"]["kl_to_sft"] < 1e-6
    assert got["export"]["heldout_accuracy"] == got["sft"]["heldout_accuracy"]
    assert got["base"]["kl_to_sft"] > 0.1
    assert got["base"]["heldout_accuracy"] <= got["sft"]["heldout_accuracy"]

    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    n = metrics["heldout"]["prompts"]
    assert len(samples) == 3 * n
    sft_samples = [s for s in samples if s["policy"] == "sft"]
    assert sum(s["correct"] for s in sft_samples) / n == pytest.approx(got["sft"]["heldout_accuracy"])
    assert sum(s["rm_score"] for s in sft_samples) / n == pytest.approx(got["sft"]["rm_score"])
    # Per task: the prompts counted, each accuracy recounted from the samples, in the report.
    tasks = metrics["heldout"]["tasks"]
    assert len(tasks) > 1 and tasks == Counter(s["task"] for s in sft_samples)
    for task, count in tasks.items():
        right = [s["correct"] for s in samples if s["policy"] == "base" and s["task"] == task]
        assert got["base"][f"heldout_accuracy_{task}"] == pytest.approx(sum(right) / count)
        assert f"{task} ({count} prompts)" in (out / "report.md").read_text()
        assert set(got["base"]["vs_reference"][f"heldout_accuracy_{task}"]) == {"value", "low", "high"}

    # Each policy is sampled once: sft's samples came with models/sft (drawn by the sft stage)
    # and with its unchanged export; only base, which carries none, was sampled here. They are
    # exactly what sampling the model again gives.
    assert "samples reused 2/3" in outcome
    # One console line per policy: each figure with its interval, the paired difference from sft.
    base = got["base"]
    acc, diff = base["intervals"]["heldout_accuracy"], base["vs_reference"]["heldout_accuracy"]
    assert (
        f"evaluate: base: heldout_accuracy {base['heldout_accuracy']:.3f} [{acc['low']:.3f}, {acc['high']:.3f}], "
        f"{diff['value']:+.3f} [{diff['low']:+.3f}, {diff['high']:+.3f}] vs sft, rm_score "
    ) in outcome, outcome
    published = [json.loads(line) for line in (root / "models/sft" / SAMPLES_FILE).read_text().splitlines()]
    assert [s["completion"] for s in sft_samples] == [p["completion"] for p in published]
    # The thread count the sft stage sampled with: another count changes float sums, hence samples.
    sft_config = yaml.safe_load((root / "models/sft/resolved_config.yaml").read_text())
    torch.set_num_threads(sft_config["alignpipe"]["torch_threads"])
    model, tok = load_policy(root / "models/sft")
    rows = [json.loads(line) for line in (root / metrics["heldout"]["data_path"]).read_text().splitlines()]
    resolved = yaml.safe_load((root / "results/evaluate/resolved_config.yaml").read_text())
    settings = from_config(resolved, "results/evaluate/resolved_config.yaml").heldout
    assert heldout_completions(model, tok, rows, settings) == ([p["completion"] for p in published], None)

    report = (out / "report.md").read_text()
    assert all(f"| `{name}` |" in report for name in got)
    assert (out / "comparison.png").read_bytes().startswith(PNG_MAGIC)
    assert json.loads((out / "artifact.json").read_text())["type"] == "report"


# ----------------------------------------------------------------------------- GPU profiles


@pytest.mark.parametrize("profile", ["default", "default_megatron", "nemo_gym"])
def test_gpu_evaluate_samples_with_vllm_in_the_image(repo_copy: Path, profile: str):
    """On the GPU profiles evaluate runs inside the pinned image through the NeMo-RL engine's
    launcher, GPUs attached, and vLLM draws with the trainers' held-out sampling settings."""
    from alignpipe.context import build_context

    out = repo_copy / "plan"
    run_cli(repo_copy, "plan", "evaluate", "--profile", profile, "--write", str(out))
    launch = (out / "evaluate.launch.sh").read_text().splitlines()[-1]
    assert launch.startswith("docker run --rm --init") and "--gpus all" in launch
    assert launch.endswith(f"alignpipe-nemo-rl:v0.7.0 alignpipe run evaluate --inner --profile {profile}")
    call = json.loads((out / "evaluate.vllm.json").read_text())
    settable = {f.name for f in dataclasses.fields(HeldoutVllm)}
    assert set(call["llm"]) - {"seed"} <= settable and call["llm"]["tensor_parallel_size"] == 1
    trainer = build_context(repo_copy, "sft", profile).config["alignpipe"]["heldout"]
    assert call["sampling"] == {k: trainer[k] for k in ("max_new_tokens", "temperature", "top_p", "seed")}
    assert call["policies"] == ["models/sft", "exports/dpo", "exports/rlvr", "exports/rlhf"]


def test_vllm_sampling_without_a_container_or_with_bad_settings_is_refused(repo_copy: Path):
    set_params(repo_copy, {"evaluate": {"alignpipe": {"heldout": {"backend": "vllm"}}}})
    result = run_cli(repo_copy, "run", "evaluate", check=False)
    assert (
        result.returncode == 2
        and "alignpipe.heldout.backend is vllm, but vLLM is not installed here" in result.stderr
    )
    result = run_cli(repo_copy, "run", "evaluate", "--inner", check=False)
    assert result.returncode == 2 and "runtime.image must be the pipeline's NeMo-RL image" in result.stderr
    with pytest.raises(ConfigError, match=r"'alignpipe.heldout.vllm.tp' is not a setting"):
        from_config({"alignpipe": {"heldout": {"backend": "vllm", "vllm": {"tp": 2}}}}, "evaluate.yaml")
    assert not (repo_copy / "results" / "evaluate" / "metrics.json").exists()


def test_samples_are_keyed_by_the_backend_that_drew_them():
    """vLLM's draws are not transformers' (another RNG): a vLLM evaluate never reuses the samples
    a trainer drew with transformers, while hf keys stay what they were (the committed lock)."""
    rows = [{"id": "a", "prompt": "sort 21"}]
    settings = Heldout(max_new_tokens=12, temperature=1.0, top_p=1.0, batch_size=128, seed=1234)
    hf = sampling_key(rows, settings)
    # What the committed samples carry: the five sampling settings and the prompt ids, no backend.
    sampling = {"max_new_tokens": 12, "temperature": 1.0, "top_p": 1.0, "batch_size": 128, "seed": 1234}
    assert hf == hashlib.sha256(json.dumps([sampling, ["a"]], sort_keys=True).encode()).hexdigest()[:16]
    assert sampling_key(rows, drawn_with(settings, "hf")) == hf
    assert sampling_key(rows, drawn_with(settings, "vllm")) != hf


def test_without_vllm_a_vllm_setting_reads_and_draws_with_transformers(trained_sft: Path):
    """The local engine's trainers on a GPU profile (heldout.backend vllm, no vLLM on the host)
    keep drawing with transformers, so the SFT reference's published samples are reused."""
    from alignpipe.config import compose_params_text
    from alignpipe.context import build_context
    from alignpipe.measure.heldout import drawing_backend, published_samples, sample_heldout

    params = yaml.safe_load(compose_params_text(trained_sft, ["profile=default", "runtime.engine=local"]))
    # the held-out settings models/sft was published with (tiny's), under the GPU profile's backend
    params["rlvr"].setdefault("alignpipe", {}).setdefault("heldout", {}).update(
        limit=None, max_new_tokens=12, batch_size=128
    )
    ctx = build_context(trained_sft, "rlvr", "default", params=params)
    settings = ctx.settings.heldout
    assert settings.backend == "vllm" and drawing_backend(settings) == "hf"
    assert published_samples(ctx, trained_sft / "models" / "sft") is not None
    assert sample_heldout(ctx, None, None, model_dir=trained_sft / "models" / "sft").reused
