"""DVCLive logging of the local trainers: TRL log keys -> pipeline metric names, periodic
validation, and curves that survive a resume."""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from alignpipe.artifacts import staged_dir
from alignpipe.context import StageContext
from alignpipe.timing import record_timing


def open_live(ctx: StageContext):
    """DVCLive writing into the run's scratch dir, never touching dvc.yaml.

    Metrics reach the stage's results dir only through ``close``, in one rename: a killed
    run never leaves a half-written metrics.json for ``dvc metrics show`` to present. The
    curves are rebuilt from the checkpoint's history on resume (``replay_history``).
    """
    from dvclive import Live

    live_dir = ctx.scratch_dir / "metrics" / ctx.name  # the dir name is the stage name (timing records)
    shutil.rmtree(live_dir, ignore_errors=True)
    return Live(str(live_dir), dvcyaml=None, save_dvc_exp=False, report=None)


def make_live_callback(live, rename: dict[str, str]):
    """A TRL/transformers callback that logs chosen metrics to DVCLive under our names.

    ``rename`` maps trainer log keys (``loss``, ``eval_loss``, ``mean_token_accuracy``)
    to pipeline metric names (``train/loss``, ``val/loss``, ``train/token_accuracy``).
    """
    from transformers import TrainerCallback

    class LiveCallback(TrainerCallback):
        first_step_seen = False

        def on_step_begin(self, args, state, control, **kwargs):
            if not self.first_step_seen:
                self.first_step_seen = True
                record_timing(Path(live.dir).name, "first_step")

        def on_log(self, args, state, control, logs=None, **kwargs):
            if state.is_world_process_zero and logs:
                log_to_live(live, rename, logs, state.global_step)

    return LiveCallback()


def log_to_live(live, rename: dict[str, str], logs: dict[str, Any], step: int) -> None:
    wrote = False
    for key, name in rename.items():
        value = logs.get(key)
        if isinstance(value, (int, float)) and math.isfinite(value):
            live.step = step
            live.log_metric(name, float(value))
            wrote = True
    if wrote:
        live.make_summary()


# Marks the log_history entries ValidationCallback wrote (kept in checkpoints' trainer_state.json).
VALIDATED = "alignpipe_validation"


def make_validation_callback(
    live,
    rename: dict[str, str],
    period: int,
    evaluate: Callable[[Any], dict[str, float]],
    *,
    at_start: bool = False,
):
    """A callback that runs ``evaluate(model)`` every ``period`` optimizer steps.

    For metrics the stage defines itself rather than reading TRL's log keys. Results go
    to DVCLive (through ``rename``) and into the trainer's ``log_history``, so they are
    saved in checkpoints and ``replay_history`` restores them after a resume. The
    callback's ``run(model, state)`` evaluates on demand (e.g. once more after training);
    ``ran_at(state)`` says whether the current step already was.
    """
    from transformers import TrainerCallback

    class ValidationCallback(TrainerCallback):
        def run(self, model, state) -> dict[str, float]:
            was_training = model.training
            model.eval()
            try:
                logs = evaluate(model)
            finally:
                model.train(was_training)
            state.log_history.append({**logs, "step": state.global_step, VALIDATED: True})
            log_to_live(live, rename, logs, state.global_step)
            return logs

        def ran_at(self, state) -> bool:
            """Whether ``state``'s step is validated already, by this process or, after a
            resume, by the run that wrote the checkpoint (its ``log_history`` says so)."""
            return any(e.get(VALIDATED) and e.get("step") == state.global_step for e in state.log_history)

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            if at_start and state.global_step == 0 and model is not None:
                self.run(model, state)

        def on_step_end(self, args, state, control, model=None, **kwargs):
            if period > 0 and state.global_step % period == 0 and model is not None:
                self.run(model, state)

    return ValidationCallback()


def replay_history(live, rename: dict[str, str], checkpoint: Path) -> None:
    """After a resume, re-log what the checkpoint's trainer_state recorded, so curves are whole."""
    state_file = checkpoint / "trainer_state.json"
    if state_file.is_file():
        for entry in json.loads(state_file.read_text()).get("log_history", []):
            log_to_live(live, rename, entry, int(entry.get("step", 0)))


def close(ctx: StageContext, live) -> dict[str, float]:
    """Write the summary, end the run, move its files into the stage's results dir in one
    rename, and return its metrics flat (for manifests and model cards)."""
    live.make_summary()
    live.end()
    with staged_dir(ctx.output("metrics")) as out:
        shutil.copytree(live.dir, out, dirs_exist_ok=True)
    return flat_metrics(live.summary)


def flat_metrics(summary: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """``{"val": {"loss": 1}}`` -> ``{"val/loss": 1}`` for manifests and model cards."""
    out: dict[str, float] = {}
    for key, value in summary.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat_metrics(value, f"{name}/"))
        elif isinstance(value, (int, float)):
            out[name] = value
    return out
