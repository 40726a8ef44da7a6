"""``<algo>.val_at_end`` on the local engine means what it means to NeMo-RL: with ``false``, a run
validates on its period only. transformers validates after the last step whenever that step is off
the period; ``checkpoints.no_validation_at_end`` (added by ``train_resumable`` for ``false``) takes
that back. A run with ``true`` validates at the end either way (tests/test_rlhf.py, test_resume.py).
"""

from __future__ import annotations

from pathlib import Path

import torch

from alignpipe.engines.local.checkpoints import no_validation_at_end


class Toy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))

    def forward(self, x, labels=None):
        return {"loss": ((self.w - x) ** 2).mean()}


def validated_steps(tmp_path: Path, callbacks: list) -> list[int]:
    from transformers import Trainer, TrainingArguments

    rows = [{"x": torch.tensor([float(i)])} for i in range(8)]
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=5,
        eval_strategy="steps",
        eval_steps=2,  # the period: steps 2 and 4; the last step, 5, is off it
        per_device_train_batch_size=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = Trainer(model=Toy(), args=args, train_dataset=rows, eval_dataset=rows[:2], callbacks=callbacks)
    trainer.train()
    return [e["step"] for e in trainer.state.log_history if "eval_runtime" in e]


def test_a_run_without_val_at_end_validates_on_its_period_only(tmp_path: Path) -> None:
    assert validated_steps(tmp_path / "hf", []) == [2, 4, 5]  # transformers on its own
    assert validated_steps(tmp_path / "nemo_rl", [no_validation_at_end()]) == [2, 4]
