"""Stage ``rm`` on the local engine: a Bradley-Terry reward model with TRL's RewardTrainer.

The SFT policy gets a one-label sequence-classification head (``num_labels=1``; the
transformer body is the SFT weights, the ``score`` head starts random) and is trained on
preference pairs with NeMo-RL's loss (§8.4): ``mean(-logsigmoid(r_chosen - r_rejected))``,
where ``r`` is the score at the last non-pad token. Pairs are conversational, so the chat
template wraps prompt and answer exactly as it did in SFT.

NeMo-RL ``rm.yaml`` key -> TRL (see also ``trl_args.trl_common_args``):

| NeMo-RL key                                  | TRL / here                                              |
|----------------------------------------------|---------------------------------------------------------|
| rm.max_num_steps, rm.max_num_epochs          | max_steps = min(steps, epochs x steps/epoch); -1: epochs |
| rm.val_period, val_at_start, val_at_end      | our validation callback (``pairwise_metrics``)           |
| rm.val_batches x val_global_batch_size       | validation pairs scored (-1: all)                       |
| rm.val_micro_batch_size                      | pairs per forward pass in validation                    |
| rm.seed                                      | seed, data_seed, and the score head's initialisation    |
| policy.train_global/micro_batch_size (pairs) | per_device_train_batch_size, gradient_accumulation      |
| policy.max_total_sequence_length             | RewardConfig.max_length (longer pairs are dropped)      |
| policy.optimizer.kwargs, scheduler, grad norm| learning_rate, adam_*, lr_factor (LambdaLR), max_grad_norm |
| policy.reward_model_cfg                      | must be ``{enabled: true, reward_model_type: bradley_terry}`` |
| checkpointing.save_period / keep_top_k       | save_steps / save_total_limit (scratch dir, resumable)  |

Validation metrics are computed here on the validation split, not read from TRL's logs.
"""

from __future__ import annotations

import os
from typing import Any

from alignpipe import console
from alignpipe.context import StageContext
from alignpipe.engines.local import live_log, lora
from alignpipe.engines.local.checkpoints import publish_trained, scheduled, train_then_validate
from alignpipe.engines.local.micro_batches import length_sorted
from alignpipe.engines.local.nemo_rl_keys import rm_keys, stage_keys
from alignpipe.engines.local.preference_pairs import preference_splits
from alignpipe.engines.local.torch_threads import apply_torch_threads
from alignpipe.engines.local.trl_args import refuse_gpu_only_settings, step_budget, trl_common_args
from alignpipe.errors import UnsupportedSetting
from alignpipe.measure.heldout import published_samples, scores_file
from alignpipe.measure.logprobs import LOCAL_DTYPE
from alignpipe.measure.metrics import local_keys
from alignpipe.measure.reward_model import RewardModelScorer

# trainer / validation log key -> pipeline metric name (same names on the NeMo-RL engine)
METRICS = local_keys("rm")  # TRL log key -> pipeline metric (measure/metrics.py)


def check_reward_model_cfg(ctx: StageContext) -> None:
    """Only a Bradley-Terry head is implemented (as in NeMo-RL v0.7.0's run_rm.py)."""
    rm = rm_keys(ctx)
    where = f"stages/{ctx.name}/config/{ctx.profile}.yaml"
    if not rm.reward_model_enabled:
        raise UnsupportedSetting(
            f"{where}: policy.reward_model_cfg.enabled must be true for the rm stage "
            "(it trains a reward model, not a policy)"
        )
    kind = rm.reward_model_type
    if kind != "bradley_terry":
        raise UnsupportedSetting(
            f"{where}: policy.reward_model_cfg.reward_model_type={kind!r} is not supported; "
            "the local engine (and NeMo-RL v0.7.0) trains only 'bradley_terry' reward models"
        )


def score_sequences(model, tokenizer, sequences: list[list[int]], batch_size: int):
    """The reward model's scalar score for each token sequence (a 1-D float tensor)."""
    import torch

    scores = []
    pad = tokenizer.pad_token_id
    with torch.no_grad():
        for start in range(0, len(sequences), batch_size):
            chunk = sequences[start : start + batch_size]
            width = max(len(s) for s in chunk)
            ids = torch.tensor([s + [pad] * (width - len(s)) for s in chunk])
            mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in chunk])
            scores.append(model(input_ids=ids, attention_mask=mask).logits.squeeze(-1).float())
    return torch.cat(scores) if scores else torch.zeros(0)


def pairwise_metrics(model, tokenizer, pairs: list[dict[str, Any]], batch_size: int = 64) -> dict[str, float]:
    """Bradley-Terry quality of ``model`` on preference ``pairs``.

    ``pairwise_accuracy``: fraction of pairs with r(chosen) > r(rejected) (ties count as
    wrong); ``reward_margin``: mean r(chosen) - r(rejected); ``loss``: the BT loss.
    Keys carry a ``val_`` prefix, matching ``METRICS``.
    """
    from alignpipe.rl.preference import pair_summary

    chosen = score_sequences(model, tokenizer, [p["chosen_input_ids"] for p in pairs], batch_size)
    rejected = score_sequences(model, tokenizer, [p["rejected_input_ids"] for p in pairs], batch_size)
    ranked = pair_summary(chosen, rejected)
    return {
        "val_loss": ranked["loss"],
        "val_pairwise_accuracy": ranked["accuracy"],
        "val_reward_margin": ranked["margin"],
        "val_chosen_reward": ranked["chosen"],
        "val_rejected_reward": ranked["rejected"],
    }


def load_reward_model(path: str, tokenizer):
    """The SFT policy with a fresh one-label score head; padding tells it where sequences end."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(
        path, num_labels=1, local_files_only=True, dtype=LOCAL_DTYPE
    )
    model.config.pad_token_id = tokenizer.pad_token_id
    # transformers' load report (in logs/rm.log) lists lm_head as unused and score as new: by design.
    print(
        f"rm: reward head initialised on {os.path.relpath(path)} (expected: its lm_head is dropped)",
        flush=True,
    )
    return model


def reference_scores(ctx: StageContext, model, tokenizer) -> dict[str, str]:
    """This RM's scores of the held-out samples its starting policy (models/sft) published, to
    publish with it: rlhf and evaluate both need the SFT reference's RM scores, and would otherwise
    each score the same samples with the same model again. Nothing when models/sft carries no
    samples for these held-out settings (then they score them themselves)."""
    held = published_samples(ctx, ctx.input("policy"))
    if held is None:
        return {}
    scores = RewardModelScorer(model, tokenizer, ctx.system_prompt)(held.prompts, held.completions)
    return scores_file(ctx.input_hashes["policy"]["hash"], held, scores)


def run(ctx: StageContext) -> None:
    # Refuse impossible settings before the (slow) ML imports.
    refuse_gpu_only_settings(ctx)
    check_reward_model_cfg(ctx)
    lora.lora_settings(ctx)  # refuses LoRA for the reward model, with the reason
    from datasets import Dataset
    from transformers import AutoTokenizer, set_seed
    from trl import RewardConfig, RewardTrainer

    keys, rm = stage_keys(ctx), rm_keys(ctx)
    # An SFT adapter stands for its base with the adapter merged (adapters.merged_dir).
    model_path = str(lora.full_policy_dir(ctx, ctx.root / keys.policy.model_name, LOCAL_DTYPE))
    tokenizer_path = str(ctx.root / keys.policy.tokenizer_name)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, local_files_only=True)
    train_pairs, val_pairs = preference_splits(ctx, tokenizer)

    apply_torch_threads(ctx)
    trl_args = trl_common_args(ctx, ctx.scratch_dir)
    # Validation is ours (the callback below), so the trainer never evaluates by itself.
    trl_args.update(eval_strategy="no", eval_steps=None, max_steps=step_budget(ctx, len(train_pairs)))
    # The score head is initialised randomly: seed it so a rerun builds the same head.
    set_seed(trl_args["seed"])
    model = load_reward_model(model_path, tokenizer)

    args = RewardConfig(
        **trl_args,
        max_length=keys.policy.max_total_sequence_length,
        disable_dropout=True,
    )
    live = live_log.open_live(ctx)
    validation = live_log.make_validation_callback(
        live,
        METRICS,
        rm.val_period if val_pairs else 0,
        lambda m: pairwise_metrics(m, tokenizer, val_pairs, rm.val_micro_batch_size),
        at_start=bool(val_pairs) and rm.val_at_start,
    )
    # A pair is scored as two rows padded together: its longer answer sets its width.
    pair_width = lambda row: max(len(row["chosen_ids"]), len(row["rejected_ids"]))  # noqa: E731
    trainer = scheduled(ctx, length_sorted(RewardTrainer, pair_width))(
        model=model,
        args=args,
        # NeMo-RL's tokens (preference_pairs.preference_examples), as RewardTrainer's pre-tokenised rows
        train_dataset=Dataset.from_list(
            [
                {"chosen_ids": p["chosen_input_ids"], "rejected_ids": p["rejected_input_ids"]}
                for p in train_pairs
            ]
        ),
        processing_class=tokenizer,
        callbacks=[live_log.make_live_callback(live, METRICS), validation],
    )
    model = train_then_validate(ctx, trainer, live, METRICS, validation, bool(val_pairs))

    extra = {"reward_model_type": "bradley_terry"}
    files = reference_scores(ctx, model, tokenizer)
    metrics = publish_trained(ctx, "reward_model", model, tokenizer, live, extra=extra, files=files)
    acc = metrics.get("val/pairwise_accuracy")
    console.outcome(
        "rm", {"val/pairwise_accuracy": acc}, ctx.output("reward_model").relative_to(ctx.root), ctx.started
    )
