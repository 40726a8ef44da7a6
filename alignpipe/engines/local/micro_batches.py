"""How a local trainer cuts an optimizer step's rows into micro-batches: shortest first, so each
micro-batch pads to its own longest row (tests/test_micro_batches.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def length_sorted(trainer_cls: type, length: Callable[[dict[str, Any]], int]) -> type:
    """``trainer_cls`` (a transformers Trainer) cutting each optimizer step's rows into
    micro-batches by length: the rows of a step (a global batch) are drawn as the trainer draws
    them (accelerate's seeded sampler, ``data_seed``), then ordered shortest first, so a
    micro-batch pads to its own longest row instead of the step's. The step's gradient is
    unchanged (equal-size micro-batches, averaged), as with NeMo-RL's dynamic batching; padding
    is most of a step's work when a few rows (conversations) are several times longer than the
    rest. ``length(row)``: a row of the trainer's own (prepared) dataset, in tokens. One
    micro-batch per step: nothing to sort, the trainer's own sampler."""
    from accelerate.data_loader import SeedableRandomSampler
    from torch.utils.data import Sampler

    class SortedWithinSteps(Sampler):
        # Not a RandomSampler: accelerate would swap it for its own and drop the ordering.
        def __init__(self, dataset, rows: int, data_seed: int | None) -> None:
            self.drawn = SeedableRandomSampler(data_source=dataset, data_seed=data_seed)
            self.lengths = [length(row) for row in dataset]
            self.rows = rows

        def set_epoch(self, epoch: int) -> None:  # the trainer's per-epoch reseed
            self.drawn.set_epoch(epoch)

        def __len__(self) -> int:
            return len(self.drawn)

        def __iter__(self):
            step: list[int] = []
            for index in self.drawn:
                step.append(index)
                if len(step) == self.rows:
                    yield from sorted(step, key=self.lengths.__getitem__)
                    step = []
            yield from sorted(step, key=self.lengths.__getitem__)

    class LengthSorted(trainer_cls):
        def _get_train_sampler(self, train_dataset=None):
            steps = self.args.gradient_accumulation_steps
            if steps == 1:
                return super()._get_train_sampler(train_dataset)
            rows = self.args.per_device_train_batch_size * steps
            return SortedWithinSteps(train_dataset or self.train_dataset, rows, self.args.data_seed)

    LengthSorted.__name__ = LengthSorted.__qualname__ = trainer_cls.__name__
    return LengthSorted
