"""The learning-rate schedule on both engines: the local trainers' LambdaLR (schedule.lr_factor)
against torch's own schedulers assembled from the rendered ``policy.scheduler`` the way NeMo-RL
v0.7.0 assembles them (models/automodel/setup.py ``setup_model_and_optimizer``: each entry's
class with its kwargs, then ``SequentialLR`` over the ``milestones`` entry). That module imports
nemo_automodel, which does not install here, so its ten lines of assembly are restated below;
the schedulers doing the arithmetic are torch's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra.utils import get_class

from alignpipe.engines.local.schedule import lr_factor
from alignpipe.errors import UnsupportedSetting
from tests.test_nemo_rl_render import rendered


def nemo_rl_scheduler(optimizer, entries):
    schedulers, milestones = [], []
    for entry in entries:
        if "name" in entry:
            schedulers.append(get_class(entry["name"])(optimizer, **entry["kwargs"]))
        else:
            milestones = entry["milestones"]
    return torch.optim.lr_scheduler.SequentialLR(optimizer, schedulers, milestones)


@pytest.mark.parametrize("stage", ["sft", "rm", "dpo", "rlvr", "rlhf"])
@pytest.mark.parametrize("profile", ["tiny", "small", "default"])
def test_local_lr_schedule_equals_nemo_rls(stage: str, profile: str, tmp_path: Path) -> None:
    cfg = rendered(stage, profile, tmp_path)
    entries = cfg["policy"]["scheduler"]
    param = torch.nn.Parameter(torch.zeros(1))
    theirs_opt = torch.optim.SGD([param], lr=1.0)
    theirs = nemo_rl_scheduler(theirs_opt, entries)
    ours_opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    ours = torch.optim.lr_scheduler.LambdaLR(ours_opt, lr_factor(entries))
    warmup = max(e.get("milestones", [0])[0] for e in entries if "milestones" in e)
    seen = []
    for _ in range(warmup + 200):  # the warm-up and what follows it (tiny rm: a decay over 140 steps)
        assert ours_opt.param_groups[0]["lr"] == pytest.approx(theirs_opt.param_groups[0]["lr"], rel=1e-9)
        seen.append(ours_opt.param_groups[0]["lr"])
        for opt, sched in ((theirs_opt, theirs), (ours_opt, ours)):
            opt.step()
            sched.step()
    assert 0 < seen[0] < seen[warmup] == pytest.approx(1.0)  # a warm-up that starts above 0 (0.1 on NeMo-RL)


def test_other_schedulers_are_refused() -> None:
    entries = [{"name": "torch.optim.lr_scheduler.CosineAnnealingLR", "kwargs": {"T_max": 10}}]
    with pytest.raises(UnsupportedSetting, match="CosineAnnealingLR.*LinearLR and ConstantLR"):
        lr_factor(entries)


def test_a_local_trainer_steps_that_schedule_and_one_built_without_it_is_refused(tmp_path: Path) -> None:
    """What a local trainer steps is the LambdaLR above, built by the trainer itself
    (``create_scheduler``); a trainer class not built with ``checkpoints.scheduled`` would step
    HF's own schedule, so ``train_resumable`` refuses it."""
    from transformers import Trainer, TrainingArguments

    from alignpipe.engines.local.checkpoints import train_resumable
    from alignpipe.engines.local.schedule import with_nemo_rl_schedule

    entries = rendered("sft", "small", tmp_path)["policy"]["scheduler"]  # a warm-up from 0.1
    args = TrainingArguments(output_dir=str(tmp_path / "out"), learning_rate=1.0, report_to=[], use_cpu=True)
    trainer = with_nemo_rl_schedule(Trainer, entries)(model=torch.nn.Linear(2, 2), args=args)
    trainer.create_optimizer_and_scheduler(num_training_steps=20)
    factor, seen = lr_factor(entries), []
    for _ in range(10):
        seen.append(trainer.optimizer.param_groups[0]["lr"])
        trainer.optimizer.step()
        trainer.lr_scheduler.step()
    assert seen == pytest.approx([factor(step) for step in range(10)], rel=1e-12)
    assert seen[0] < seen[-1] == 1.0  # not HF's constant schedule
    with pytest.raises(TypeError, match=r"Trainer was not built with checkpoints.scheduled"):
        train_resumable(None, Trainer(model=torch.nn.Linear(2, 2), args=args), None, {})
