"""Length-sorted micro-batches (``alignpipe.engines.local.micro_batches``): each optimizer step
trains the rows TRL's own sampler draws for it, cut into micro-batches by length, with the same
gradient and less padding. Checked on TRL's RewardTrainer and a tiny Llama, in process."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from alignpipe.engines.local.micro_batches import length_sorted

MICRO, STEPS = 4, 3  # rows per micro-batch, micro-batches per optimizer step


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory) -> Path:
    from alignpipe.tiny import build_causal_lm, train_tokenizer

    tokenizer = train_tokenizer(["0123456789 abcdefghij"], "char")
    dims = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
    out = tmp_path_factory.mktemp("rm") / "model"
    build_causal_lm(tokenizer, dims, seed=3).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def pairs() -> list[dict]:
    """Mostly short pairs and one in five several times longer, as the tiny `chat` rows are."""
    draw = random.Random(0)
    rows = []
    for i in range(60):
        width = draw.randint(30, 40) if i % 5 == 0 else draw.randint(4, 8)
        rows.append({"chosen_ids": [draw.randint(3, 12) for _ in range(width)],
                     "rejected_ids": [draw.randint(3, 12) for _ in range(width - 1)]})  # fmt: skip
    return rows


def trainer(model_dir: Path, tmp: Path, *, sorted_: bool):
    from datasets import Dataset
    from transformers import AutoTokenizer, set_seed
    from trl import RewardConfig, RewardTrainer

    from alignpipe.engines.local.stages.rm import load_reward_model

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    args = RewardConfig(output_dir=str(tmp), per_device_train_batch_size=MICRO, gradient_accumulation_steps=STEPS,
                        seed=5, data_seed=5, max_steps=4, use_cpu=True, report_to=[], disable_dropout=True)  # fmt: skip
    set_seed(5)  # the score head is initialised randomly: the same head for both orders
    cls = length_sorted(RewardTrainer, lambda row: max(len(row["chosen_ids"]), len(row["rejected_ids"])))
    made = (cls if sorted_ else RewardTrainer)(model=load_reward_model(str(model_dir), tokenizer), args=args,
                         train_dataset=Dataset.from_list(pairs()), processing_class=tokenizer)  # fmt: skip
    return made


def micro_batches(made, epoch: int = 0) -> list[list[int]]:
    loader = made.get_train_dataloader()
    loader.set_epoch(epoch)
    return [list(batch) for batch in loader.batch_sampler]


def width(rows: list[dict], batch: list[int]) -> int:
    return max(max(len(rows[i]["chosen_ids"]), len(rows[i]["rejected_ids"])) for i in batch)


@pytest.mark.parametrize("epoch", [0, 1])
def test_a_step_trains_the_rows_trl_draws_for_it_shortest_first(reward_model_dir, tmp_path, epoch) -> None:
    rows = pairs()
    plain = micro_batches(trainer(reward_model_dir, tmp_path / "a", sorted_=False), epoch)
    ordered = micro_batches(trainer(reward_model_dir, tmp_path / "b", sorted_=True), epoch)
    assert len(plain) == len(ordered) == len(rows) // MICRO
    for step in range(len(plain) // STEPS):
        mine = ordered[step * STEPS : (step + 1) * STEPS]
        theirs = plain[step * STEPS : (step + 1) * STEPS]
        assert sorted(sum(mine, [])) == sorted(sum(theirs, [])), f"step {step} trains other rows"
        widths = [width(rows, batch) for batch in mine]
        assert widths == sorted(widths)
    padded = sum(MICRO * width(rows, b) for b in ordered)
    assert padded < 0.8 * sum(MICRO * width(rows, b) for b in plain)
    assert micro_batches(trainer(reward_model_dir, tmp_path / "c", sorted_=True), 1 - epoch) != ordered


def test_a_steps_gradient_is_the_same_in_either_order(reward_model_dir, tmp_path) -> None:
    grads = []
    for sorted_ in (False, True):
        made = trainer(reward_model_dir, tmp_path / str(sorted_), sorted_=sorted_)
        made.model.zero_grad()
        loader = iter(made.get_train_dataloader())
        for _ in range(STEPS):
            (made.compute_loss(made.model, next(loader)) / STEPS).backward()
        grads.append({n: p.grad.clone() for n, p in made.model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name, grad in grads[0].items():
        assert (grad - grads[1][name]).abs().max() <= 1e-5 * max(1.0, grad.abs().max()), name
