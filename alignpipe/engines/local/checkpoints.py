"""Resumable training on the local engine: scratch checkpoints (``ctx.scratch_dir``, outside DVC's
outputs), resuming from the newest one with the DVCLive curves replayed, the progress bar, and
how every trainer stage ends (``publish_trained``: publish, then drop the checkpoints).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

from alignpipe import console
from alignpipe.context import StageContext
from alignpipe.engines.local import live_log, publish
from alignpipe.engines.local.live_log import replay_history
from alignpipe.engines.local.nemo_rl_keys import stage_keys
from alignpipe.engines.local.schedule import NemoRLSchedule, with_nemo_rl_schedule

_CKPT = re.compile(r"^checkpoint-(\d+)$")


def latest_checkpoint(scratch: Path) -> Path | None:
    """The newest complete ``checkpoint-N`` in ``scratch`` (trainer_state.json written last)."""
    if not scratch.is_dir():
        return None
    found = [
        (int(m.group(1)), p)
        for p in scratch.iterdir()
        if (m := _CKPT.match(p.name)) and (p / "trainer_state.json").is_file()
    ]
    return max(found)[1] if found else None


def scheduled(ctx: StageContext, trainer_cls: type) -> type:
    """``trainer_cls`` stepping the stage's NeMo-RL learning-rate schedule (``policy.scheduler``)."""
    return with_nemo_rl_schedule(
        trainer_cls, stage_keys(ctx).policy.scheduler, f"stages/{ctx.name}/config/{ctx.profile}.yaml"
    )


def train_resumable(ctx: StageContext, trainer, live, rename: dict[str, str]) -> None:
    """``trainer.train()``, resuming from the newest scratch checkpoint of this exact run.

    DVC deletes a stage's outputs before re-running it, so checkpoints live in
    ``ctx.scratch_dir``; after a resume the DVCLive curves are replayed from the
    checkpoint's trainer_state so they stay whole, and come out byte-identical to an
    uninterrupted run's (``log_at_checkpoints``; tests/test_resume.py).
    """
    if not isinstance(trainer, NemoRLSchedule):  # HF's own schedule would run silently
        raise TypeError(f"{type(trainer).__name__} was not built with checkpoints.scheduled(ctx, ...)")
    show_progress(ctx, trainer)
    trainer.add_callback(log_at_checkpoints())
    if not stage_keys(ctx).algorithm.val_at_end:
        trainer.add_callback(no_validation_at_end())
    resume = latest_checkpoint(ctx.scratch_dir)
    if resume is not None:
        print(f"{ctx.name}: resuming from {resume}")
        replay_history(live, rename, resume)
        if restore_finished_run(trainer, resume):
            return
        trainer.args.eval_on_start = False  # step 0's validation is in the replayed history
    trainer.train(resume_from_checkpoint=str(resume) if resume else None)


def log_at_checkpoints():
    """A callback that logs at every checkpoint step as well as every ``logging_steps``.

    transformers' ``loss`` (and TRL's averaged metrics) cover the steps since the last log,
    and a resumed run starts that window at its checkpoint: with a checkpoint between two
    logging steps, the next log would average fewer steps than an uninterrupted run's. Logging
    at each checkpoint closes the window there in both runs, so their curves are the same.
    """
    from transformers import TrainerCallback

    class LogAtCheckpoints(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if control.should_save:
                control.should_log = True

    return LogAtCheckpoints()


def no_validation_at_end():
    """A callback for ``<algo>.val_at_end: false``: transformers validates after the last step
    whenever that step is off the validation period (DefaultFlowCallback); NeMo-RL then
    validates only on the period. Added after transformers' own, it takes that back."""
    from transformers import TrainerCallback

    class NoValidationAtEnd(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if (
                state.global_step >= state.max_steps
                and state.eval_steps
                and state.global_step % state.eval_steps
            ):
                control.should_evaluate = False

    return NoValidationAtEnd()


# Trainer log keys shown on the progress bar, under short names.
HEADLINE = {"loss": "loss", "reward": "reward", "kl": "kl", "rewards/accuracies": "pref_acc"}


def show_progress(ctx: StageContext, trainer) -> None:
    """One progress bar (console.progress_callback) instead of HF's log-dict printer."""
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    trainer.add_callback(
        console.progress_callback(ctx.name, HEADLINE, console.raw_log_path(ctx.root, ctx.name))
    )


def restore_finished_run(trainer, checkpoint: Path) -> bool:
    """If ``checkpoint`` is the run's last step, load it into ``trainer`` and say so.

    transformers' loop takes one more optimizer step when resumed at ``max_steps`` (it
    checks the limit after a step), so a run killed after its final checkpoint would end
    one step past an uninterrupted one. A finished run needs no training: its weights and
    state are the checkpoint's.
    """
    from transformers import TrainerState

    state = TrainerState.load_from_json(str(checkpoint / "trainer_state.json"))
    if state.global_step < state.max_steps:
        return False
    trainer._load_from_checkpoint(str(checkpoint))
    trainer.state = state
    return True


def train_then_validate(
    ctx: StageContext, trainer, live, rename: dict[str, str], validation, has_validation: bool
):
    """``train_resumable``, then one last validation (``<algo>.val_at_end``) unless the last
    step already ran one; returns the trained model."""
    train_resumable(ctx, trainer, live, rename)
    if has_validation and stage_keys(ctx).algorithm.val_at_end and not validation.ran_at(trainer.state):
        validation.run(trainer.model, trainer.state)
    return trainer.model


def publish_trained(
    ctx: StageContext,
    output: str,
    model,
    tokenizer,
    live,
    *,
    extra: dict[str, Any] | None = None,
    files: dict[str, str] | None = None,
) -> dict[str, Any]:
    """How every training stage ends: close its DVCLive run (the final metrics), publish the
    model with those metrics, then drop its resume checkpoints, which the published model
    supersedes. Returns the metrics."""
    metrics = live_log.close(ctx, live)
    publish.publish_model(ctx, output, model, tokenizer, metrics, extra=extra, files=files)
    shutil.rmtree(ctx.scratch_dir, ignore_errors=True)
    return metrics
