"""The environment lock: lock/requirements.txt agrees with pyproject.toml, and `make venv` installs
exactly it (this suite runs in that venv)."""

from __future__ import annotations

import importlib.metadata
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from packaging.markers import default_environment
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "lock"))
import check  # noqa: E402  (lock/check.py, what `make venv` runs)

EXTRAS = re.search(r"^LOCK_EXTRAS := (.+)$", (ROOT / "Makefile").read_text(), re.M).group(1).split()


def _copy(tmp_path: Path) -> Path:
    (tmp_path / "lock").mkdir()
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    shutil.copy(ROOT / "lock" / "requirements.txt", tmp_path / "lock")
    return tmp_path


def test_the_committed_lock_agrees_with_pyproject():
    assert check.disagreements(ROOT / "pyproject.toml", ROOT / "lock" / "requirements.txt", EXTRAS) == []


def test_a_requirement_the_lock_does_not_meet_is_named_with_its_line(tmp_path):
    root = _copy(tmp_path)
    pyproject = root / "pyproject.toml"
    pyproject.write_text(
        pyproject.read_text().replace('"transformers>=5.5,<5.9"', '"transformers>=5.5,<5.6"')
    )
    problems = check.disagreements(pyproject, root / "lock" / "requirements.txt", EXTRAS)
    locked = re.search(r"^transformers==(\S+)", (root / "lock" / "requirements.txt").read_text(), re.M).group(
        1
    )
    assert len(problems) == 3  # once per platform the lock serves
    assert f"transformers=={locked}" in problems[0]
    assert "[project.optional-dependencies].local: `transformers<5.6,>=5.5`" in problems[0]
    assert "run `make lock`" in problems[0]
    assert re.search(r"requirements\.txt:\d+: ", problems[0])


def test_a_new_requirement_and_a_dropped_one_are_both_refused(tmp_path):
    root = _copy(tmp_path)
    pyproject = root / "pyproject.toml"
    text = pyproject.read_text().replace('  "gguf>=0.17",\n', '  "cowsay>=6",\n')
    pyproject.write_text(text)
    problems = check.disagreements(pyproject, root / "lock" / "requirements.txt", EXTRAS)
    assert any("no pin for `cowsay` on Linux x86-64" in p for p in problems)
    assert any("gguf is locked as a requirement of" in p and "no longer asks for it" in p for p in problems)


def test_make_venv_refuses_a_disagreeing_lock_before_installing(tmp_path):
    root = _copy(tmp_path)
    pyproject = root / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace('"trl>=1.16,<1.17"', '"trl>=1.17"'))
    shutil.copy(ROOT / "lock" / "check.py", root / "lock")
    run = subprocess.run([sys.executable, "lock/check.py", *EXTRAS], cwd=root, capture_output=True, text=True)
    assert run.returncode == 1
    assert "trl==" in run.stderr and "`trl>=1.17`" in run.stderr


def test_this_venv_holds_exactly_the_lock():
    """Every locked package at its locked version, nothing else but this project (`uv pip sync`)."""
    env = default_environment()
    wanted = {
        p.name: p.version
        for p in check.read_lock(ROOT / "lock" / "requirements.txt")
        if p.marker is None or p.marker.evaluate(env)
    }
    # This venv's own site-packages: other tests put wheels on sys.path (test_lora's --target dir).
    site = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    installed = {
        canonicalize_name(d.metadata["Name"]): d.version for d in importlib.metadata.distributions(path=site)
    }
    installed.pop("alignpipe")
    assert {n: v for n, v in installed.items() if wanted.get(n) != v} == {}, (
        f"this venv differs from lock/requirements.txt on {platform.machine()}: rebuild it (make venv)"
    )
    assert set(wanted) - set(installed) == set()


def test_the_gym_lock_pins_what_gym_in_asks_for():
    """lock/gym.txt (NeMo-Gym's venv, .ci/install-gym.sh) holds each lock/gym.in requirement at a
    version it admits, and nothing else claims to come from gym.in: `make lock` was run after an edit."""
    from packaging.requirements import Requirement

    asked = {
        canonicalize_name(r.name): r
        for line in (ROOT / "lock" / "gym.in").read_text().splitlines()
        if line.strip() and not line.startswith("#")
        for r in [Requirement(line)]
    }
    pinned = {p.name: p for p in check.read_lock(ROOT / "lock" / "gym.txt")}
    admitted = {n: r for n, r in asked.items() if n in pinned and r.specifier.contains(pinned[n].version)}
    assert {n: str(r.specifier) for n, r in asked.items() if n not in admitted} == {}
    assert {n for n, p in pinned.items() if p.comes_from("-r lock/gym.in")} == set(asked)
