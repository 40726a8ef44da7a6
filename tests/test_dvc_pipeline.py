"""The DVC layer: the stale-lock CI gate, and dvc.yaml's wiring (graph, params, metrics, plots, artifacts).

The gate runs on a throwaway two-stage DVC repository (the real pipeline takes minutes);
the wiring is read through DVC's own parser, so what is checked is what `dvc repro` sees.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import warnings
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO

CHECK_LOCK = REPO / "benchmarks" / "check_lock.sh"


def sh(cwd: Path, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, cwd=cwd, env=os.environ, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(argv)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.fixture
def tiny_dvc_repo(tmp_path: Path) -> Path:
    """git + DVC repo with params, code and two chained stages, reproduced and committed."""
    root = tmp_path / "tiny"
    root.mkdir()
    (root / "params.yaml").write_text("train:\n  lr: 0.1\n")
    (root / "make.py").write_text(
        "import sys, yaml\n"
        "lr = yaml.safe_load(open('params.yaml'))['train']['lr']\n"
        "open(sys.argv[1], 'w').write(f'model lr={lr}\\n')\n"
    )
    (root / "dvc.yaml").write_text(
        yaml.safe_dump(
            {
                "stages": {
                    "train": {
                        "cmd": "python make.py model.txt",
                        "deps": ["make.py"],
                        "params": ["train"],
                        "outs": ["model.txt"],
                    },
                    "export": {
                        "cmd": "cp model.txt export.txt",
                        "deps": ["model.txt"],
                        "outs": ["export.txt"],
                    },
                }
            },
            sort_keys=False,
        )
    )
    sh(root, "git", "init", "-q")
    sh(root, "dvc", "init", "-q")
    sh(root, "dvc", "repro", "-q")
    sh(root, "git", "add", "-A")
    sh(root, "git", "commit", "-qm", "pipeline")
    return root


def check_lock(root: Path) -> subprocess.CompletedProcess:
    return sh(root, "bash", str(CHECK_LOCK), str(root), check=False)


def test_check_lock_passes_on_a_fresh_lock_and_a_clone_without_data(tiny_dvc_repo: Path, tmp_path: Path):
    assert check_lock(tiny_dvc_repo).returncode == 0
    # CI's view: a clone has the lock but none of the DVC-tracked outputs.
    clone = tmp_path / "clone"
    sh(tmp_path, "git", "clone", "-q", str(tiny_dvc_repo), str(clone))
    assert not (clone / "model.txt").exists()
    result = check_lock(clone)
    assert result.returncode == 0, result.stderr
    assert "up to date" in result.stdout


def test_check_lock_names_the_stage_a_param_change_made_stale(tiny_dvc_repo: Path):
    (tiny_dvc_repo / "params.yaml").write_text("train:\n  lr: 0.2\n")
    result = check_lock(tiny_dvc_repo)
    assert result.returncode == 1
    assert "dvc.lock is stale" in result.stderr
    assert "  - train" in result.stderr


def test_check_lock_catches_a_code_change_and_a_missing_lock(tiny_dvc_repo: Path):
    with (tiny_dvc_repo / "make.py").open("a") as f:
        f.write("# changed\n")
    assert check_lock(tiny_dvc_repo).returncode == 1
    sh(tiny_dvc_repo, "git", "checkout", "-q", "make.py")
    assert check_lock(tiny_dvc_repo).returncode == 0
    (tiny_dvc_repo / "dvc.lock").unlink()
    result = check_lock(tiny_dvc_repo)
    assert result.returncode == 1 and "dvc.lock is missing" in result.stderr


# ----------------------------------------------------------------------------- the real dvc.yaml


def test_bytecode_caches_are_outside_code_deps():
    """Python writes __pycache__/ beside the code a stage runs. DVC must not hash it into a
    directory dep (alignpipe/measure, ...), or running anything makes the lock look stale."""
    assert (
        sh(
            REPO, "dvc", "check-ignore", "alignpipe/measure/__pycache__/heldout.cpython-311.pyc", check=False
        ).returncode
        == 0
    )
    assert sh(REPO, "dvc", "check-ignore", "alignpipe/measure/heldout.py", check=False).returncode == 1


def test_stage_docs_are_outside_stage_deps():
    """stages/<name>/ is a dep (config, stage.toml); its README is documentation the stage never reads."""
    assert sh(REPO, "dvc", "check-ignore", "stages/rlvr/README.md", check=False).returncode == 0
    assert sh(REPO, "dvc", "check-ignore", "stages/rlvr/config/tiny.yaml", check=False).returncode == 1


@pytest.fixture(scope="module")
def index():
    """The pipeline as DVC parses it (foreach expanded), with no git or data needed."""
    from dvc.repo import Repo

    with Repo(str(REPO), uninitialized=True) as repo:
        stages = {s.addressing: s for s in repo.index.stages}
        yield {
            name: {
                "deps": {str(Path(d.def_path)) for d in s.deps if not d.def_path.endswith(".yaml")},
                "params": {p for d in s.deps if hasattr(d, "params") for p in (d.params or [])},
                "outs": {str(Path(o.def_path)) for o in s.outs},
            }
            for name, s in stages.items()
        }


def downstream(index: dict, changed: set[str]) -> set[str]:
    """Stages that re-run when ``changed`` stages produce new outputs (DVC's cascade)."""
    result = set(changed)
    grew = True
    while grew:
        outs = {o for name in result for o in index[name]["outs"]}
        new = {
            n
            for n, s in index.items()
            if n not in result
            and any(d == o or d.startswith(o + "/") or o.startswith(d + "/") for d in s["deps"] for o in outs)
        }
        result |= new
        grew = bool(new)
    return result


def test_convert_is_one_stage_per_policy_reading_only_its_model(index):
    for item in ("dpo", "rlvr", "rlhf"):
        stage = index[f"convert@{item}"]
        assert f"models/{item}" in stage["deps"]
        assert stage["outs"] == {f"exports/{item}"}
        others = {f"models/{o}" for o in ("dpo", "rlvr", "rlhf") if o != item}
        assert not others & stage["deps"]
    assert {f"exports/{i}" for i in ("dpo", "rlvr", "rlhf")} | {"models/sft", "models/rm"} <= index[
        "evaluate"
    ]["deps"]


def test_an_rlhf_knob_reruns_exactly_rlhf_its_export_its_benchmark_and_evaluate(index):
    reading = {n for n, s in index.items() if any(p == "rlhf" or p.startswith("rlhf.") for p in s["params"])}
    assert reading == {"rlhf"}
    assert downstream(index, reading) == {"rlhf", "convert@rlhf", "benchmark@rlhf", "evaluate"}


def test_benchmark_is_one_stage_per_policy_reading_only_that_policy(index):
    policies = {"base": "models/base", "sft": "models/sft", "dpo": "exports/dpo", "rlvr": "exports/rlvr",
                "rlhf": "exports/rlhf"}  # fmt: skip
    for name, path in policies.items():
        stage = index[f"benchmark@{name}"]
        assert stage["outs"] == {f"results/benchmark/{name}"}
        assert path in stage["deps"] and "stages/benchmark" in stage["deps"]
        assert not (set(policies.values()) - {path}) & stage["deps"]
    # the task YAMLs, their data and the harness version (a config value) are what it hashes
    assert downstream(index, {"prep"}) >= {f"benchmark@{n}" for n in policies}


def test_top_level_metrics_plots_and_artifacts_point_at_stage_outputs():
    doc = yaml.safe_load((REPO / "dvc.yaml").read_text())
    stage_outs = set()
    for stage in doc["stages"].values():
        body = stage.get("do", stage)
        items = stage.get("foreach", [None])
        pairs = items.items() if isinstance(items, dict) else [(item, item) for item in items]
        for key, item in pairs:
            for out in body.get("outs", []):
                out = next(iter(out)) if isinstance(out, dict) else out
                stage_outs.add(out.replace("${item}", str(item)).replace("${key}", str(key)))

    def produced(path: str) -> bool:
        return any(path == o or path.startswith(o + "/") for o in stage_outs)

    for metric in doc["metrics"]:
        assert produced(metric), f"metrics: {metric} is no stage's output"
    # every DVCLive results dir has its metrics.json listed (so `dvc exp show` has a column for it)
    for out in stage_outs:
        if out.startswith("results/"):
            assert f"{out}/metrics.json" in doc["metrics"], f"{out}/metrics.json missing from metrics:"
    for plot in doc["plots"]:
        # No path ids (a directory, an image): DVC lists them while saving an experiment, which
        # fails on a clone without every output (test_a_targeted_experiment_on_a_fresh_clone_is_saved).
        assert isinstance(plot, dict) and isinstance(next(iter(plot.values())).get("y"), dict), plot
        ((pid, spec),) = plot.items()
        files = list(spec["y"])
        for path in files:
            assert produced(path), f"plot {pid}: {path} is no stage's output"
    for name, art in doc["artifacts"].items():
        assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", name), name
        assert art["type"] == "model" and art["path"] in stage_outs


@pytest.mark.slow
def test_a_targeted_experiment_on_a_fresh_clone_is_saved(tmp_path: Path) -> None:
    """`dvc exp run -S ... TARGET` on a clone with no cache (the other stages' outputs nowhere)
    runs the target's chain and saves the experiment: rc 0, and `dvc exp show` lists it."""
    from tests.conftest import copy_repo

    root = copy_repo(tmp_path / "repo", git=True)
    env = {**os.environ, "ALIGNPIPE_SCRATCH": str(tmp_path / "scratch"), "PYTHONHASHSEED": "0"}
    run = subprocess.run(["dvc", "exp", "run", "-n", "narrow", "-S", "base.model.hidden_size=64", "base"],
                         cwd=root, env=env, capture_output=True, text=True)  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert re.findall(r"Running stage '([^']+)'", run.stdout) == ["prep", "base"]
    shown = subprocess.run(
        ["dvc", "exp", "show", "--json"], cwd=root, env=env, capture_output=True, text=True
    )
    names = [e.get("name") for row in json.loads(shown.stdout) for e in (row.get("experiments") or [])]
    assert "narrow" in names, shown.stdout[-2000:]


def test_stages_run_in_the_directory_dvc_runs_them_in_not_dvc_root(tmp_path: Path, monkeypatch):
    """`dvc exp run --queue/--temp` runs stages in a copy but sets DVC_ROOT to the parent
    workspace; outputs must go to the copy (the cwd), or queued experiments write into the workspace."""
    from alignpipe.config import repo_root

    for name in ("workspace", "workspace/.dvc/tmp/exps/tmp1"):
        (tmp_path / name / "stages").mkdir(parents=True)
        (tmp_path / name / "dvc.yaml").write_text("stages: {}\n")
    executor = tmp_path / "workspace/.dvc/tmp/exps/tmp1"
    monkeypatch.delenv("ALIGNPIPE_ROOT", raising=False)
    monkeypatch.setenv("DVC_ROOT", str(tmp_path / "workspace"))
    monkeypatch.chdir(executor)
    assert repo_root() == executor.resolve()
    monkeypatch.chdir(tmp_path)  # outside any repo: DVC_ROOT is the fallback
    assert repo_root() == (tmp_path / "workspace").resolve()


# ----------------------------------------------------------------------------- the real pipeline, run


def lock_differences(got: str, want: str, *, skip_outs_of: set[str] = frozenset()) -> list[str]:
    """Stages whose dvc.lock entries differ, each with the paths whose hashes moved. The outputs
    of ``skip_outs_of`` stages (and the deps that are those) are left out."""
    got_stages, want_stages = yaml.safe_load(got)["stages"], yaml.safe_load(want)["stages"]
    skipped = {out["path"] for name in skip_outs_of for out in want_stages.get(name, {}).get("outs", [])}

    def kept(entry: dict) -> dict:
        return {
            kind: [e for e in value if e.get("path") not in skipped] if kind in ("deps", "outs") else value
            for kind, value in entry.items()
        }

    differences = []
    for name in sorted(set(got_stages) | set(want_stages)):
        a, b = kept(got_stages.get(name, {})), kept(want_stages.get(name, {}))
        if a != b:
            moved = [
                e["path"] for kind in ("deps", "outs") for e in a.get(kind, []) if e not in b.get(kind, [])
            ]
            differences.append(f"{name}: {moved or 'params/cmd'}")
    return differences


# What decides a trained output's bytes: the CPU kernels that computed it and the torch build
# (alignpipe/cpu_kernels.py; each artifact.json records them). benchmarks/lock_kernels.json holds
# those of the run dvc.lock records. Where a run's kernels are the same (any x86-64 CPU with
# AVX2, either vendor, under the default portable kernels) the lock must come out byte for byte;
# elsewhere (arm64, `ALIGNPIPE_CPU_KERNELS=native`, another torch) the check keeps to what no
# kernel changes (code, params, prepared data, the starting model), and the stage tests and the
# figures test hold the trained outcomes.
LOCK_KERNELS = REPO / "benchmarks" / "lock_kernels.json"


def run_kernels(root: Path) -> dict:
    """The kernels that trained a run's sft policy (its artifact.json)."""
    import json

    return json.loads((root / "models" / "sft" / "artifact.json").read_text())["cpu_kernels"]


def computing_stages(index: dict) -> set[str]:
    """Stages whose outputs hold what a model computed (weights trained, scores measured):
    every stage after base. prep and base themselves are exact anywhere."""
    return downstream(index, {"base"}) - {"base"}


@pytest.mark.slow
def test_the_pipeline_reproduces_its_lock_and_an_rlhf_experiment_reruns_only_its_chain(
    tiny_pipeline, index, tmp_path: Path
):
    """What `make repro` does on a fresh clone, for real (the session's ``tiny_pipeline``): every
    stage runs and dvc.lock comes out byte-identical to the committed one (every output's hash:
    each model, export and score) wherever the CPU kernels are the lock's (``LOCK_KERNELS``). Then `dvc exp run` with another rlhf knob runs exactly rlhf,
    its export, its benchmark and evaluate, and `dvc metrics show` has every policy's benchmark
    scores."""
    import json

    from tests.conftest import writable_copy

    committed = tiny_pipeline.committed_lock
    assert set(tiny_pipeline.ran) == set(yaml.safe_load(committed)["stages"]), tiny_pipeline.ran
    got = (tiny_pipeline.root / "dvc.lock").read_text()
    kernels, locked = run_kernels(tiny_pipeline.root), json.loads(LOCK_KERNELS.read_text())["cpu_kernels"]
    if kernels == locked:
        differences = lock_differences(got, committed)
        assert not differences, "dvc.lock is not what the committed run produced:\n" + "\n".join(differences)
    else:  # other kernels: everything but the trained floats, and say so
        warnings.warn(
            f"trained bytes not compared: kernels {kernels}, the lock's {locked}; the figures move as with "
            "another training seed (README.md, Reproducibility), and the stage tests hold the claimed gains",
            stacklevel=1,
        )
        differences = lock_differences(got, committed, skip_outs_of=computing_stages(index))
        assert not differences, "dvc.lock differs beyond trained weights:\n" + "\n".join(differences)

    root = writable_copy(tiny_pipeline.root, tmp_path / "repo")
    env = {**os.environ, "ALIGNPIPE_SCRATCH": str(tmp_path / "scratch"), "PYTHONHASHSEED": "0"}

    def dvc(*argv: str) -> str:
        proc = subprocess.run(["dvc", *argv], cwd=root, env=env, capture_output=True, text=True)
        assert proc.returncode == 0, (
            f"dvc {' '.join(argv)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
        return proc.stdout

    # This machine's run is the baseline (on another CPU kind its outputs are not the committed ones).
    subprocess.run(
        ["git", "commit", "--allow-empty", "-qam", "this machine's run"], cwd=root, env=env, check=True
    )
    steps = json.loads((root / "results" / "rlhf" / "metrics.json").read_text())["step"]
    knobs = ["-S", "rlhf.grpo.max_num_steps=2", "-S", "rlhf.loss_fn.reference_policy_kl_penalty=0.5"]
    ran = re.findall(r"Running stage '([^']+)'", dvc("exp", "run", "-n", "kl-0.5", *knobs))
    assert sorted(ran) == ["benchmark@rlhf", "convert@rlhf", "evaluate", "rlhf"], ran

    # `alignpipe compare`: every policy, paired per prompt; only rlhf's samples can have moved.
    compare = subprocess.run(["alignpipe", "compare", "HEAD", "kl-0.5", "--json"], cwd=root, env=env,
                             capture_output=True, text=True)  # fmt: skip
    assert compare.returncode == 0, compare.stderr
    rows = {(r["policy"], r["figure"]): r for r in json.loads(compare.stdout)[0]["rows"]}
    for policy in ("sft", "dpo", "rlvr", "rlhf"):
        row = rows[(policy, "heldout_accuracy")]
        assert (
            row["n"] == 300
            and row["b_minus_a"]["low"] <= row["b_minus_a"]["value"] <= row["b_minus_a"]["high"]
        )
        assert (policy, "rm_score") in rows and (policy, "heldout_exact/exact_match") in rows, policy
        if policy != "rlhf":
            assert row["b_minus_a"] == {"value": 0.0, "low": 0.0, "high": 0.0}, (policy, row)
    shown = json.loads(dvc("metrics", "show", "--json"))[""]["data"]
    for policy in ("base", "sft", "dpo", "rlvr", "rlhf"):
        tasks = shown[f"results/benchmark/{policy}/metrics.json"]["data"]["tasks"]
        assert {"heldout_exact", "preference_choice"} <= set(tasks), (policy, tasks)
    assert shown["results/rlhf/metrics.json"]["data"]["step"] < steps  # the experiment's shorter rlhf


def test_the_pipelines_console_is_each_stages_header_progress_and_outcome(tiny_pipeline) -> None:
    """`dvc repro`'s console holds no third-party progress bar (lm-eval's request loops, dataset
    maps, weight loading): each stage prints its header, its own progress lines and one outcome."""
    bars = [line for line in tiny_pipeline.log.splitlines() if re.search(r"\d+%\|", line)]
    assert not bars, "third-party progress bars on the console:\n" + "\n".join(b[:160] for b in bars[:5])
    for stage in tiny_pipeline.ran:
        assert re.search(rf"^{re.escape(stage)}: .* -> ", tiny_pipeline.log, re.M), (
            f"{stage}: no outcome line"
        )


@pytest.mark.slow
def test_a_launcher_or_renderer_edit_reruns_no_tiny_stage_and_a_trainer_edit_its_stage(
    tiny_pipeline, tmp_path: Path
):
    """The tiny stages depend on the code they run and nothing else: editing the Slurm launcher
    or NeMo-RL's config renderer leaves `dvc repro --dry` with nothing to do; editing the local
    DPO trainer makes dpo, and only dpo, stale (what reads its outputs re-runs when they change);
    editing a user tool's module makes rlvr stale."""
    from tests.conftest import writable_copy

    root = writable_copy(tiny_pipeline.root, tmp_path / "repo")

    def would_run() -> set[str]:
        proc = sh(root, "dvc", "repro", "--dry")
        return set(re.findall(r"Running stage '([^']+)'", proc.stdout))

    edited = ["alignpipe/launch/slurm.py", "alignpipe/engines/nemo_rl/render.py"]
    for rel in edited:
        with (root / rel).open("a") as f:
            f.write("# an edit\n")
    assert would_run() == set()
    with (root / "alignpipe/engines/local/stages/dpo.py").open("a") as f:
        f.write("# an edit\n")
    assert would_run() == {"dpo"}
    with (root / "tools/units.py").open("a") as f:  # a user tool's module: rlvr imports it from tools/
        f.write("# an edit\n")
    assert would_run() == {"dpo", "rlvr"}
