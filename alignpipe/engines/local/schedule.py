"""NeMo-RL's learning-rate schedule (``policy.scheduler``) on an HF Trainer: the factor its
``SequentialLR`` gives at each optimizer step, stepped by a ``LambdaLR`` in place of HF's own.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from alignpipe.errors import UnsupportedSetting


def lr_factor(
    entries: Sequence[Mapping[str, Any]], where: str = "the stage's config"
) -> Callable[[int], float]:
    """NeMo-RL's ``policy.scheduler`` entries (``PolicyKeys.scheduler``) as a function of the
    optimizer step: the factor on the base learning rate that its ``SequentialLR`` over the listed
    ``LinearLR``/``ConstantLR`` gives (torch's closed forms; a missing kwarg is torch's own
    default). HF's ``constant_with_warmup`` would start the warm-up at 0, where NeMo-RL's
    ``LinearLR(start_factor=0.1)`` starts at a tenth. Other schedulers are refused."""
    phases: list[tuple[str, dict[str, Any]]] = []
    milestones: list[int] = []
    for entry in entries:
        if "milestones" in entry and "name" not in entry:
            milestones = [int(m) for m in entry["milestones"]]
            continue
        name = str(entry.get("name", "")).rsplit(".", 1)[-1]
        if name not in ("LinearLR", "ConstantLR"):
            raise UnsupportedSetting(
                f"policy.scheduler {entry.get('name')!r} in {where}: the local engine reproduces "
                "torch.optim.lr_scheduler.LinearLR and ConstantLR (NeMo-RL's warm-up then constant)"
            )
        phases.append((name, dict(entry.get("kwargs") or {})))
    if not phases:
        return lambda step: 1.0
    if len(milestones) != len(phases) - 1:
        raise UnsupportedSetting(
            f"policy.scheduler in {where}: {len(phases)} schedulers need {len(phases) - 1} milestones"
        )

    def one(name: str, kw: dict[str, Any], t: int) -> float:
        if name == "LinearLR":
            start, end = float(kw.get("start_factor", 1 / 3)), float(kw.get("end_factor", 1.0))
            total = int(kw.get("total_iters", 5))
            return start + (end - start) * min(t, total) / total if total else end
        return float(kw.get("factor", 1 / 3)) if t < int(kw.get("total_iters", 5)) else 1.0

    def factor(step: int) -> float:
        k = sum(step >= m for m in milestones)
        return one(*phases[k], step - (milestones[k - 1] if k else 0))

    return factor


class NemoRLSchedule:
    """Mixin for an HF Trainer: ``create_scheduler``, the Trainer's documented override point,
    steps ``lr_factor`` (NeMo-RL's schedule) with a ``LambdaLR`` instead of HF's own schedule."""

    lr_factor: Callable[[int], float]

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        from torch.optim.lr_scheduler import LambdaLR

        if self.lr_scheduler is None:
            self.lr_scheduler = LambdaLR(optimizer or self.optimizer, self.lr_factor)
        return self.lr_scheduler


def with_nemo_rl_schedule(
    trainer_cls: type, entries: Sequence[Mapping[str, Any]], where: str = "the stage's config"
) -> type:
    """``trainer_cls`` (any HF Trainer) stepping :func:`lr_factor` of ``entries``."""
    factor = lr_factor(entries, where)
    return type(trainer_cls.__name__, (NemoRLSchedule, trainer_cls), {"lr_factor": staticmethod(factor)})
