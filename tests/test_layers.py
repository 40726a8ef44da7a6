"""The layering of docs/ARCHITECTURE.md, checked by import-linter's contracts in pyproject.toml
([tool.importlinter]): errors < ground floor < launch < engines < stage < cli, the two engines
independent, the local engine's shared pieces below its stage modules, and no import circle
among siblings."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    exe = shutil.which("lint-imports") or str(Path(sys.executable).with_name("lint-imports"))
    assert Path(exe).is_file(), "lint-imports not found: install the dev extra (pip install -e '.[dev]')"
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([exe, "--no-cache"], cwd=root, env=env, capture_output=True, text=True)


def test_import_contracts_hold():
    result = lint_imports(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_an_upward_import_breaks_the_layers(tmp_path):
    """The check can fail: a ground-floor module importing stage.py is named, with its line."""
    shutil.copytree(REPO / "alignpipe", tmp_path / "alignpipe", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    with open(tmp_path / "alignpipe" / "jsonl.py", "a") as f:
        f.write("\nfrom alignpipe.stage import run_stage  # noqa\n")
    result = lint_imports(tmp_path)
    assert result.returncode != 0
    assert "alignpipe.jsonl -> alignpipe.stage" in result.stdout, result.stdout


def test_a_shared_piece_importing_a_stage_module_is_refused(tmp_path):
    """The local engine's stage modules sit above what they share: judge.py (used by rlhf)
    importing a stage module is named."""
    shutil.copytree(REPO / "alignpipe", tmp_path / "alignpipe", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    with open(tmp_path / "alignpipe" / "engines" / "local" / "judge.py", "a") as f:
        f.write("\nfrom alignpipe.engines.local.stages import sft  # noqa\n")
    result = lint_imports(tmp_path)
    assert result.returncode != 0
    assert "the local engine's shared pieces never import a stage module BROKEN" in result.stdout, (
        result.stdout
    )
