"""How a local trainer cuts an optimizer step's rows into micro-batches: shortest first, so each
micro-batch pads to its own longest row (tests/test_micro_batches.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def length_sorted_micro_batches(trainer, length: Callable[[dict[str, Any]], int]) -> None:
    """Cut each optimizer step's rows into micro-batches by length: the rows of a step (a global
    batch) are drawn as the trainer draws them (accelerate's seeded sampler, ``data_seed``), then
    ordered shortest first, so a micro-batch pads to its own longest row instead of the step's.
    The step's gradient is unchanged (equal-size micro-batches, averaged), as with NeMo-RL's
    dynamic batching; padding is most of a step's work when a few rows (conversations) are
    several times longer than the rest. ``length(row)``: a row of the trainer's own (prepared)
    dataset, in tokens. One micro-batch per step: nothing to sort."""
    steps = trainer.args.gradient_accumulation_steps
    if steps == 1:
        return
    from accelerate.data_loader import SeedableRandomSampler
    from torch.utils.data import Sampler

    rows = trainer.args.per_device_train_batch_size * steps

    class SortedWithinSteps(Sampler):
        # Not a RandomSampler: accelerate would swap it for its own and drop the ordering.
        def __init__(self, dataset) -> None:
            self.drawn = SeedableRandomSampler(data_source=dataset, data_seed=trainer.args.data_seed)
            self.lengths = [length(row) for row in dataset]

        def set_epoch(self, epoch: int) -> None:  # the trainer's per-epoch reseed
            self.drawn.set_epoch(epoch)

        def __len__(self) -> int:
            return len(self.drawn)

        def __iter__(self):
            step: list[int] = []
            for index in self.drawn:
                step.append(index)
                if len(step) == rows:
                    yield from sorted(step, key=self.lengths.__getitem__)
                    step = []
            yield from sorted(step, key=self.lengths.__getitem__)

    trainer._get_train_sampler = lambda dataset=None: SortedWithinSteps(dataset or trainer.train_dataset)
