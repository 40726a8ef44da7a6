"""Preference data for the local rm and dpo stages: prepared rows -> tokenised (chosen, rejected)
pairs as NeMo-RL's ``preference_preprocessor`` makes them, and the train and validation splits.
"""

from __future__ import annotations

from typing import Any

from alignpipe.context import StageContext
from alignpipe.engines.local.nemo_rl_keys import DpoKeys, PreferenceDataKeys, RmKeys, stage_keys
from alignpipe.jsonl import read_jsonl
from alignpipe.measure.generation import prompt_messages
from alignpipe.tokenise import preference_example


def preference_examples(
    tokenizer, rows: list[dict[str, Any]], data: PreferenceDataKeys, system: str | None = None
) -> list[dict[str, Any]]:
    """Prepared preference rows -> pairs tokenised as NeMo-RL's ``preference_preprocessor`` does
    (``alignpipe.tokenise.preference_example``): the keys are NeMo-RL's
    ``data.default.{prompt,chosen,rejected}_key``, the length limit ``data.max_input_seq_length``,
    and the prompt follows the stage's system turn (``system``) when it has one."""
    return [
        preference_example(
            tokenizer,
            prompt_messages(row[data.prompt_key], system),
            {"role": "assistant", "content": row[data.chosen_key]},
            {"role": "assistant", "content": row[data.rejected_key]},
            max_length=data.max_input_seq_length,
        )
        for row in rows
    ]


def preference_splits(ctx: StageContext, tokenizer) -> tuple[list[dict], list[dict]]:
    """Tokenised train and validation pairs of a preference stage; validation capped at
    ``<algo>.val_batches x val_global_batch_size`` pairs (``-1``: all, as in NeMo-RL).

    A pair NeMo-RL keeps at weight 0 (too long) trains and counts nothing there; TRL has no
    per-pair weight, so it is left out here (named on the console)."""
    keys = stage_keys(ctx)
    algo = keys.algorithm
    if not isinstance(algo, (DpoKeys, RmKeys)):
        raise TypeError(f"stage '{ctx.name}' trains on no preference pairs")
    data = algo.data

    def pairs(path: str, split: str) -> list[dict]:
        rows = preference_examples(tokenizer, read_jsonl(ctx.root / path), data, ctx.system_prompt)
        kept = [r for r in rows if r["weight"] > 0]
        if len(kept) < len(rows):
            limit = data.max_input_seq_length
            print(f"{ctx.name}: {len(rows) - len(kept)} {split} pairs longer than data.max_input_seq_length={limit} "
                  "left out (NeMo-RL gives them weight 0)", flush=True)  # fmt: skip
        return kept

    train = pairs(keys.data.train_path, "train")
    val_path = keys.data.validation_path
    val = pairs(val_path, "validation") if val_path else []
    if algo.val_batches > 0:
        val = val[: algo.val_batches * algo.val_global_batch_size]
    return train, val
