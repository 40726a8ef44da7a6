"""What a person sees: a header, one progress bar with speed and ETA, a one-line outcome;
the libraries' raw output goes to logs/<stage>.log."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from alignpipe.console import duration, progress_callback
from tests.conftest import OFFLINE, run_cli, set_params, writable_copy

# One plain progress line: speed (step/s, or s/step when a step takes over a second) and ETA.
SPEED_ETA = r"(?:\d+\.\d step/s|\d+(?:\.\d)? s/step)  ETA (?:\d+s|\d+m\d\ds|\d+h\d\dm)"


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
    assert all(re.match(rf"sft step \d+/20  {SPEED_ETA}", line) for line in bar), bar
    # The held-out accuracy with its 95% interval, as results/sft/metrics.json records them.
    shown = re.fullmatch(r"sft: heldout/accuracy (\S+) \[(\S+), (\S+)\] -> models/sft \(\d+ s\)", lines[-1])
    assert shown, lines[-1]
    held = json.loads((sft_repo / "results" / "sft" / "metrics.json").read_text())["heldout"]
    want = (held["accuracy"], held["intervals"]["accuracy"]["low"], held["intervals"]["accuracy"]["high"])
    assert shown.groups() == tuple(f"{v:.3f}" for v in want), (lines[-1], held)
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


def plain_lines(
    steps: list[tuple[int, float]],
    *,
    max_steps: int,
    first_step: int = 0,
    logs: dict | None = None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> list[str]:
    """Drive the callback as transformers' Trainer does, with real TrainingArguments and
    TrainerState, through ``steps`` = [(global_step, clock seconds)], starting at clock 0."""
    from transformers import TrainerControl, TrainerState, TrainingArguments

    monkeypatch.setattr(sys, "stderr", io.StringIO())  # no terminal: the plain lines
    now = [0.0]
    callback = progress_callback("grpo", {"loss": "loss"}, clock=lambda: now[0])
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    state, control = TrainerState(max_steps=max_steps, global_step=first_step), TrainerControl()
    callback.on_train_begin(args, state, control)
    if logs:
        callback.on_log(args, state, control, logs=logs)
    for step, t in steps:
        now[0], state.global_step = t, step
        callback.on_step_end(args, state, control)
    callback.on_train_end(args, state, control)
    return capsys.readouterr().out.splitlines()


def test_slow_steps_show_seconds_per_step_and_a_real_eta(tmp_path, monkeypatch, capsys):
    # 41 s a step, 20 steps: a line every second step (PLAIN_LINES), 18 steps left at step 2.
    lines = plain_lines(
        [(n, 41.0 * n) for n in range(1, 5)],
        max_steps=20,
        logs={"loss": 1.23456},
        tmp_path=tmp_path,
        monkeypatch=monkeypatch,
        capsys=capsys,
    )
    assert lines == [
        "grpo step 2/20  41 s/step  ETA 12m18s  loss 1.23",
        "grpo step 4/20  41 s/step  ETA 10m56s  loss 1.23",
    ]
    # Under ten seconds a step keeps one decimal; the ETA counts from the measured pace.
    lines = plain_lines([(2, 5.0)], max_steps=20, tmp_path=tmp_path, monkeypatch=monkeypatch, capsys=capsys)
    assert lines == ["grpo step 2/20  2.5 s/step  ETA 45s"]


def test_slow_steps_print_at_least_once_a_minute(tmp_path, monkeypatch, capsys):
    # 100 steps would print every 10th step: at 41 s a step that is 7 minutes of silence.
    lines = plain_lines(
        [(n, 41.0 * n) for n in range(1, 6)],
        max_steps=100,
        tmp_path=tmp_path,
        monkeypatch=monkeypatch,
        capsys=capsys,
    )
    assert lines == [
        "grpo step 2/100  41 s/step  ETA 1h06m",
        "grpo step 4/100  41 s/step  ETA 1h05m",
    ]


def test_fast_steps_keep_steps_per_second(tmp_path, monkeypatch, capsys):
    lines = plain_lines(
        [(n, 0.05 * n) for n in range(1, 21)],
        max_steps=20,
        tmp_path=tmp_path,
        monkeypatch=monkeypatch,
        capsys=capsys,
    )
    assert len(lines) == 10 and lines[-1] == "grpo step 20/20  20.0 step/s  ETA 0s"
    assert lines[0] == "grpo step 2/20  20.0 step/s  ETA 1s"
    # A resumed run measures only the steps it took: 10 in 2 s after resuming at step 90.
    lines = plain_lines(
        [(90 + n, 0.2 * n) for n in range(1, 11)],
        max_steps=200,
        first_step=90,
        tmp_path=tmp_path,
        monkeypatch=monkeypatch,
        capsys=capsys,
    )
    assert lines == ["grpo step 100/200  5.0 step/s  ETA 20s"]


def test_durations_read_like_a_clock():
    assert [duration(s) for s in (0, 0.4, 59.4, 200, 3599.6, 3690, 7530)] == [
        "0s",
        "0s",
        "59s",
        "3m20s",
        "1h00m",
        "1h01m",
        "2h05m",
    ]
