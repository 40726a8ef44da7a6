"""What a person sees: a header, one progress bar with step/s and ETA, a one-line outcome;
the libraries' raw output goes to logs/<stage>.log."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.conftest import OFFLINE, run_cli, set_params, writable_copy


@pytest.fixture
def sft_repo(trained_sft: Path, tmp_path: Path) -> Path:
    root = writable_copy(trained_sft, tmp_path / "repo")
    set_params(root, {"sft": {"sft": {"max_num_steps": 20}}})
    return root


def test_a_stage_prints_a_header_a_plain_bar_and_one_outcome_line(sft_repo: Path, tmp_path: Path):
    proc = run_cli(sft_repo, "run", "sft", env={"ALIGNPIPE_SCRATCH": str(tmp_path / "scratch")})
    lines = proc.stdout.splitlines()
    assert lines[0] == "sft · engine local · profile tiny · model models/base"
    bar = [line for line in lines if line.startswith("sft step ")]
    assert 2 <= len(bar) <= 11, bar  # about ten lines over the run when stderr is no terminal
    assert all(re.match(r"sft step \d+/20  [\d.]+ step/s  ETA \d+:\d\d", line) for line in bar), bar
    assert re.fullmatch(r"sft: heldout/accuracy \d\.\d{3} -> models/sft \(\d+ s\)", lines[-1]), lines[-1]
    # No HF-Trainer log dicts, dataset-map or shard-writing bars on the console ...
    for noise in ("{'loss'", "Tokenizing", "Writing model shards", "Loading weights"):
        assert noise not in proc.stdout + proc.stderr, noise
    # ... they are in the raw log, beside the workspace and outside DVC's outputs.
    assert "'loss'" in (sft_repo / "logs" / "sft.log").read_text()


def test_on_a_terminal_the_bar_is_tqdm(sft_repo: Path, tmp_path: Path):
    env = {**os.environ, **OFFLINE, "ALIGNPIPE_ROOT": str(sft_repo), "ALIGNPIPE_SCRATCH": str(tmp_path / "s")}
    # `script` gives the stage a pseudo-terminal, as an interactive `dvc repro` has.
    proc = subprocess.run(
        ["script", "-qec", "alignpipe run sft", "/dev/null"],
        cwd=sft_repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"sft: +100%\|.*\| 20/20 \[", proc.stdout), proc.stdout[-2000:]
    assert "sft step " not in proc.stdout  # the plain lines are only for non-terminals
