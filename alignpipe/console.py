"""What a person sees while a stage runs: a header, one progress bar, a one-line outcome.

Everything else the libraries print (HF-Trainer log dicts, dataset-map and shard-writing
bars, load reports, warnings) goes to a raw log file, ``logs/<stage>.log``, beside the
workspace and outside DVC's outputs, so published results stay byte-reproducible.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Library switches read at import time: set before transformers/datasets/hf_hub load.
QUIET_ENV = {
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    # Every other tqdm bar (lm-eval's request loops): tqdm reads it once, on its first import,
    # which torch does; the stage's own bar (``progress_callback``) asks for itself explicitly.
    "TQDM_DISABLE": "1",
}
# When stderr is no terminal (CI logs, `dvc repro > log`), the bar is one line this often,
# and at least once this many seconds when steps are slow.
PLAIN_LINES = 10
PLAIN_EVERY_S = 60.0


def raw_log_path(root: Path, stage: str) -> Path:
    return root / "logs" / f"{stage}.log"


def quiet_libraries(log_file: Path) -> None:
    """Route library logging and warnings into ``log_file``; keep the console for people."""
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    # A library imported before this (a notebook, a test running the stage in its process) read
    # those switches already: tell it directly.
    if "huggingface_hub" in sys.modules:
        sys.modules["huggingface_hub"].utils.disable_progress_bars()
    if "transformers" in sys.modules:
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()
        transformers_logging.set_verbosity_error()
    if "datasets" in sys.modules:
        sys.modules["datasets"].disable_progress_bars()
    log_file.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(log_file, mode="w", encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s"))
    root = logging.getLogger()
    for previous in root.handlers:  # a second stage in one process (tests) replaces the first's file
        previous.close()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    logging.captureWarnings(True)
    warnings.simplefilter("default")
    for name in ("transformers", "trl", "datasets", "accelerate", "huggingface_hub"):
        library = logging.getLogger(name)
        library.handlers[:] = []
        library.propagate = True


def header(stage: str, engine: str, profile: str, model: str | None) -> float:
    """Print the stage's header line; return the start time for ``outcome``."""
    print(
        f"{stage} · engine {engine} · profile {profile}" + (f" · model {model}" if model else ""), flush=True
    )
    return time.monotonic()


def outcome(stage: str, headline: dict[str, Any], output: Path | str, started: float) -> None:
    """One line: the headline metrics, where the result is, and how long it took. A value given
    as ``(value, low, high)`` is shown with its interval: ``0.530 [0.474, 0.586]``."""
    shown = ", ".join(f"{k} {_fmt(v)}" for k, v in headline.items() if v is not None)
    print(f"{stage}: {shown} -> {output} ({time.monotonic() - started:.0f} s)", flush=True)


def _fmt(value: Any) -> str:
    if isinstance(value, tuple) and len(value) == 3:
        return f"{_fmt(value[0])} [{_fmt(value[1])}, {_fmt(value[2])}]"
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def speed(done: int, elapsed: float, left: int) -> str:
    """``12.5 step/s  ETA 8s`` for fast steps, ``41 s/step  ETA 3m25s`` once a step takes over a second."""
    if done <= 0 or elapsed <= 0:
        return "ETA ?"
    per_step = elapsed / done
    if per_step > 1.0:
        rate = f"{per_step:.0f} s/step" if per_step >= 10 else f"{per_step:.1f} s/step"
    else:
        rate = f"{done / elapsed:.1f} step/s"
    return f"{rate}  ETA {duration(left * per_step)}"


def duration(seconds: float) -> str:
    """``45s``, ``3m20s``, ``2h05m``: whole seconds, the two largest units."""
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def progress_callback(
    stage: str,
    headline: dict[str, str],
    log_file: Path | None = None,
    clock: Callable[[], float] = time.monotonic,
):
    """A transformers callback: one bar with speed (step/s, or s/step for slow steps), ETA and
    ``headline`` metrics.

    ``headline`` maps trainer log keys to the short names shown (``{"loss": "loss"}``).
    A tqdm bar on a terminal; otherwise ``PLAIN_LINES`` plain lines over the run, and one at
    least every ``PLAIN_EVERY_S`` seconds. Every log dict the trainer emits goes to
    ``log_file`` instead of the console. ``clock`` is for tests.
    """
    from transformers import TrainerCallback

    class ConsoleProgress(TrainerCallback):
        bar = None
        started = 0.0
        printed = 0.0
        first_step = 0
        shown: dict[str, float] = {}

        def on_train_begin(self, args, state, control, **kwargs):
            self.started, self.first_step, self.shown = clock(), state.global_step, {}
            self.printed = self.started
            if sys.stderr.isatty():
                from tqdm.auto import tqdm

                # A pty that reports no size (0x0) would hide tqdm's bar: fall back to 100x20.
                size = shutil.get_terminal_size((100, 20))
                self.bar = tqdm(
                    total=state.max_steps,
                    initial=state.global_step,
                    desc=stage,
                    unit="step",
                    ncols=size.columns,
                    nrows=size.lines,
                    disable=False,  # over QUIET_ENV's TQDM_DISABLE
                )

        def on_step_end(self, args, state, control, **kwargs):
            if self.bar is not None:
                self.bar.update(state.global_step - self.bar.n)
                self.bar.set_postfix({k: f"{v:.3g}" for k, v in self.shown.items()}, refresh=False)
                return
            every = max(1, state.max_steps // PLAIN_LINES)
            now = clock()
            if (
                state.global_step % every == 0
                or state.global_step == state.max_steps
                or now - self.printed >= PLAIN_EVERY_S
            ):
                self.printed = now
                print(self._line(state, now), flush=True)

        def on_log(self, args, state, control, logs=None, **kwargs):
            for key, name in headline.items():
                value = (logs or {}).get(key)
                if isinstance(value, (int, float)):
                    self.shown[name] = float(value)
            if log_file is not None and logs:
                with open(log_file, "a", encoding="utf-8") as f:
                    f.write(f"step {state.global_step}: {logs}\n")

        def on_train_end(self, args, state, control, **kwargs):
            if self.bar is not None:
                self.bar.close()

        def _line(self, state, now: float) -> str:
            done = state.global_step - self.first_step
            elapsed = now - self.started
            metrics = "  ".join(f"{k} {v:.3g}" for k, v in self.shown.items())
            return (
                f"{stage} step {state.global_step}/{state.max_steps}  "
                f"{speed(done, elapsed, state.max_steps - state.global_step)}  {metrics}"
            ).rstrip()

    return ConsoleProgress()
