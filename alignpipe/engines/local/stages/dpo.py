"""Stage ``dpo`` on the local engine: TRL's DPOTrainer from the SFT policy, which is also
the frozen reference.

The loss is NeMo-RL's DPOLossFn (§8.3):
``L = preference_loss_weight * -logsigmoid(beta * (r_chosen - r_rejected)) + sft_loss_weight * L_sft``
with implicit reward ``r = sum_t (log pi - log pi_ref)`` over the response tokens
(divided by their number when ``dpo.preference_average_log_probs``).

NeMo-RL ``dpo.yaml`` key -> TRL (see also ``trl_args.trl_common_args``):

| NeMo-RL key                                   | TRL DPOConfig / here                                         |
|-----------------------------------------------|--------------------------------------------------------------|
| dpo.reference_policy_kl_penalty               | beta                                                         |
| dpo.preference_average_log_probs: false       | loss_type ``sigmoid`` (summed log-prob ratios)                |
| dpo.preference_average_log_probs: true        | loss_type ``sigmoid_norm`` (ratios divided by response tokens) |
| dpo.preference_loss_weight                    | loss_weights[0]                                              |
| dpo.sft_loss_weight, dpo.sft_average_log_probs | ``chosen_nll`` (per response, then the mean; TRL's ``sft`` pools tokens) |
| dpo.max_num_steps, dpo.max_num_epochs         | max_steps = min(steps, epochs x steps/epoch)                 |
| dpo.val_period, val_at_start, val_at_end      | our validation callback (``preference_metrics``)              |
| dpo.val_batches x val_global_batch_size       | validation pairs scored (-1: all)                            |
| dpo.seed                                      | seed, data_seed                                              |
| policy.train_global/micro_batch_size (pairs)  | gradient_accumulation_steps / per_device_train_batch_size (pairs) |
| policy.max_total_sequence_length              | max_length (truncation keep_start)                           |
| policy.optimizer.kwargs, scheduler, grad norm | learning_rate, adam_*, lr_factor (LambdaLR), max_grad_norm    |
| checkpointing.save_period / keep_top_k        | save_steps / save_total_limit (scratch dir, resumable)       |

Validation metrics are computed here on the validation split (``preference_metrics``),
not read from TRL's logs; ``heldout/*`` is ``measure.heldout.log_heldout``, as for every policy.
"""

from __future__ import annotations

from typing import Any

from alignpipe import console
from alignpipe.context import StageContext
from alignpipe.engines.local import live_log, lora
from alignpipe.engines.local.checkpoints import publish_trained, scheduled, train_then_validate
from alignpipe.engines.local.micro_batches import length_sorted
from alignpipe.engines.local.nemo_rl_keys import DpoKeys, dpo_keys, stage_keys
from alignpipe.engines.local.preference_pairs import preference_splits
from alignpipe.engines.local.torch_threads import apply_torch_threads
from alignpipe.engines.local.trl_args import refuse_gpu_only_settings, step_budget, trl_common_args
from alignpipe.engines.local.trl_seams import Seams
from alignpipe.errors import UnsupportedSetting
from alignpipe.measure.heldout import headline, log_heldout, sample_heldout, samples_file
from alignpipe.measure.logprobs import LOCAL_DTYPE
from alignpipe.measure.metrics import local_keys

# trainer / validation log key -> pipeline metric name (same names on the NeMo-RL engine)
METRICS = local_keys("dpo")  # TRL log key -> pipeline metric (measure/metrics.py)


def loss_settings(dpo: DpoKeys, where: str = "the stage's config") -> dict[str, Any]:
    """NeMo-RL's DPO loss keys -> DPOConfig's beta / loss_type / loss_weights."""
    beta = dpo.reference_policy_kl_penalty
    if beta <= 0:
        raise UnsupportedSetting(f"{where}: dpo.reference_policy_kl_penalty (beta) must be > 0, got {beta}")
    return {
        "beta": beta,
        "loss_type": ["sigmoid_norm" if dpo.preference_average_log_probs else "sigmoid"],
        "loss_weights": [dpo.preference_loss_weight],
        # NeMo-RL's SFT term, added by TokenizedDPOTrainer (TRL's "sft" pools the batch's tokens)
        "sft": {"weight": dpo.sft_loss_weight, "average": dpo.sft_average_log_probs},
    }


def pair_tensors(tokenizer, pairs: list[dict[str, Any]]):
    """Padded [chosen..., rejected...] batch of tokenised pairs (``preference_pairs.preference_examples``)
    with the mask of the response tokens NeMo-RL's DPO loss counts."""
    import torch

    seqs = [p[f"{side}_input_ids"] for side in ("chosen", "rejected") for p in pairs]
    masks = [p[f"{side}_completion_mask"] for side in ("chosen", "rejected") for p in pairs]
    width = max(len(s) for s in seqs)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([s + [pad] * (width - len(s)) for s in seqs])
    attention = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    response = torch.tensor([m + [0] * (width - len(m)) for m in masks])
    return ids, attention, response


# What TokenizedDPOTrainer overrides and calls of TRL's DPOTrainer (engines/local/trl_seams.py).
DPO_SEAMS = Seams(
    overrides={
        "_prepare_dataset": ("self", "dataset", "processing_class", "args", "dataset_name"),
        "_compute_loss": ("self", "model", "inputs", "return_outputs"),
    },
    calls={"compute_ref_log_probs": ("model", "inputs")},
)

# DPOConfig options that change TRL's DPO loss, at the values the owned loss assumes (loss_settings
# and run() never set them: a change here is a TRL default that moved).
_LOSS_DEFAULTS = {
    "ld_alpha": None,
    "f_divergence_type": ("reverse_kl",),
    "use_weighting": False,
    "precompute_ref_log_probs": False,
}
# Batch entries that are not model inputs.
_NOT_MODEL_INPUTS = {"completion_mask", "ref_chosen_logps", "ref_rejected_logps"}


def make_trainer_class():
    """Built lazily so importing this module does not import TRL."""
    from trl import DPOTrainer

    from alignpipe.engines.local.trl_seams import check_seams
    from alignpipe.rl.preference import chosen_nll, dpo_loss

    check_seams(DPOTrainer, DPO_SEAMS)

    class TokenizedDPOTrainer(DPOTrainer):
        """DPOTrainer over pairs tokenised as NeMo-RL tokenises them (:func:`trl_pairs`), with
        NeMo-RL's DPO loss computed by ``alignpipe.rl.preference``. Two seams (``DPO_SEAMS``):
        ``_prepare_dataset`` (rows that already carry ``prompt_ids`` pass through; TRL 1.16
        re-tokenises every dataset itself) and ``_compute_loss``."""

        def __init__(self, *args, sft: dict[str, Any] | None = None, **kwargs):
            super().__init__(*args, **kwargs)
            moved = {
                k: getattr(self.args, k, None)
                for k, v in _LOSS_DEFAULTS.items()
                if getattr(self.args, k, None) not in (v if isinstance(v, tuple) else (v,))
            }
            if moved or not set(self.loss_types) <= {"sigmoid", "sigmoid_norm"} or len(self.loss_types) != 1:
                raise UnsupportedSetting(
                    f"DPOConfig sets {moved or self.loss_types}: the local DPO loss does not implement them"
                )
            self.sft = sft or {"weight": 0.0, "average": True}

        def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
            if "prompt_ids" in dataset.column_names:
                return dataset
            return super()._prepare_dataset(dataset, processing_class, args, dataset_name)

        def _compute_loss(self, model, inputs, return_outputs):
            """``preference_loss_weight * dpo_loss + sft_loss_weight * chosen_nll`` on one batch of
            ``[chosen..., rejected...]`` rows; the reference's log-probs from TRL's
            ``compute_ref_log_probs`` (the frozen copy, or the policy with its adapter off)."""
            if return_outputs:
                raise UnsupportedSetting(
                    "the local DPO trainer returns no outputs: validation is its own callback"
                )
            completion_mask = inputs["completion_mask"]
            mask = completion_mask[..., 1:]  # position t predicts token t + 1
            model_inputs = {k: v for k, v in inputs.items() if k not in _NOT_MODEL_INPUTS}
            labels = inputs["input_ids"].masked_fill(completion_mask == 0, -100)
            outputs = model(**model_inputs, use_cache=False, labels=labels, fused_lm_head=True)
            per_token = outputs.log_probs[:, -mask.size(1) :]
            chosen_logps, rejected_logps = per_token.sum(dim=1).chunk(2, dim=0)
            ref_chosen, ref_rejected = self.compute_ref_log_probs(
                self.ref_model if self.ref_model is not None else model, inputs
            )
            tokens = (
                completion_mask.sum(dim=1).chunk(2, dim=0) if self.loss_types == ["sigmoid_norm"] else None
            )
            pairs = dpo_loss(
                chosen_logps, rejected_logps, ref_chosen, ref_rejected, beta=self.beta, tokens=tokens
            )
            loss = pairs.mean() * self.loss_weights[0]

            mode = "train" if self.model.training else "eval"
            chosen = self.beta * (chosen_logps - ref_chosen).detach()  # TRL's implicit rewards, summed
            rejected = self.beta * (rejected_logps - ref_rejected).detach()
            gather = self.accelerator.gather
            self._metrics[mode]["rewards/chosen"].append(gather(chosen).mean().item())
            self._metrics[mode]["rewards/rejected"].append(gather(rejected).mean().item())
            self._metrics[mode]["rewards/accuracies"].append(
                gather((chosen > rejected).float()).mean().item()
            )
            self._metrics[mode]["rewards/margins"].append(gather(chosen - rejected).mean().item())
            if self.sft["weight"]:
                term = chosen_nll(per_token, mask, self.sft["average"])
                self._metrics[mode]["sft_loss"].append(gather(term.detach()).mean().item())
                loss = loss + self.sft["weight"] * term
            return loss

    return TokenizedDPOTrainer


def trl_pairs(pairs: list[dict[str, Any]]) -> list[dict[str, list[int]]]:
    """Tokenised pairs as DPOTrainer's pre-tokenised rows: the shared prompt, then each answer
    (the tokens NeMo-RL's mask trains, its assistant header included)."""
    rows = []
    for p in pairs:
        start = p["chosen_completion_mask"].index(1)
        prompt = p["chosen_input_ids"][:start]
        if p["rejected_input_ids"][:start] != prompt or p["rejected_completion_mask"].index(1) != start:
            raise ValueError("chosen and rejected do not share their prompt tokens")  # same context turns
        rows.append(
            {
                "prompt_ids": prompt,
                "chosen_ids": p["chosen_input_ids"][start:],
                "rejected_ids": p["rejected_input_ids"][start:],
            }
        )
    return rows


def response_stats(policy, reference, tokenizer, pairs: list[dict[str, Any]]):
    """Per sequence ([chosen..., rejected...]): policy and reference log-prob of the response
    (summed over its tokens), the token count, and summed per-token KL(policy || reference)."""
    import torch

    ids, attention, response = pair_tensors(tokenizer, pairs)
    targets = ids[:, 1:]
    mask = response[:, 1:].float()  # position t predicts token t+1
    with torch.no_grad():
        logp = torch.log_softmax(policy(input_ids=ids, attention_mask=attention).logits[:, :-1].float(), -1)
        logq = torch.log_softmax(
            reference(input_ids=ids, attention_mask=attention).logits[:, :-1].float(), -1
        )
    policy_lp = (logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1) * mask).sum(-1)
    ref_lp = (logq.gather(-1, targets.unsqueeze(-1)).squeeze(-1) * mask).sum(-1)
    kl = ((logp.exp() * (logp - logq)).sum(-1) * mask).sum(-1)  # exact over the vocabulary
    return policy_lp, ref_lp, mask.sum(-1), kl


def preference_metrics(
    policy,
    reference,
    tokenizer,
    pairs: list[dict[str, Any]],
    *,
    beta: float,
    average_log_probs: bool,
    batch_size: int = 64,
) -> dict[str, float]:
    """How the policy's implicit reward ``beta * (log pi - log pi_ref)`` ranks held-out pairs.

    ``preference_accuracy``: fraction of pairs whose chosen response gets the strictly higher
    reward (exact ties, e.g. at the start where pi == pi_ref, count as wrong);
    ``chosen_reward``/``rejected_reward``: mean rewards; ``reward_margin``: their mean difference;
    ``loss``: the preference loss; ``kl_to_reference``: mean over chosen-response tokens of the
    exact KL(pi || pi_ref) of the next-token distributions (teacher-forced on the chosen answer).
    Log-probs are per-token averages when ``average_log_probs`` (NeMo-RL's
    preference_average_log_probs). Keys carry a ``val_`` prefix, matching ``METRICS``.
    """
    import torch

    from alignpipe.rl.preference import pair_summary

    chosen, rejected, kl_sum, kl_tokens = [], [], 0.0, 0.0
    for start in range(0, len(pairs), batch_size):
        chunk = pairs[start : start + batch_size]
        policy_lp, ref_lp, tokens, kl = response_stats(policy, reference, tokenizer, chunk)
        ratio = policy_lp - ref_lp
        if average_log_probs:
            ratio = ratio / tokens.clamp(min=1)
        reward = beta * ratio
        n = len(chunk)
        chosen.append(reward[:n])
        rejected.append(reward[n:])
        kl_sum += float(kl[:n].sum())
        kl_tokens += float(tokens[:n].sum())
    pairs_ranked = pair_summary(torch.cat(chosen), torch.cat(rejected))
    return {
        "val_loss": pairs_ranked["loss"],
        "val_preference_accuracy": pairs_ranked["accuracy"],
        "val_chosen_reward": pairs_ranked["chosen"],
        "val_rejected_reward": pairs_ranked["rejected"],
        "val_reward_margin": pairs_ranked["margin"],
        "val_kl_to_reference": kl_sum / max(kl_tokens, 1.0),
    }


def run(ctx: StageContext) -> None:
    # Refuse impossible settings before the (slow) ML imports.
    refuse_gpu_only_settings(ctx)
    keys, dpo = stage_keys(ctx), dpo_keys(ctx)
    losses = loss_settings(dpo, f"stages/{ctx.name}/config/{ctx.profile}.yaml")
    adapter = lora.lora_settings(ctx)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig

    policy_dir = ctx.root / keys.policy.model_name
    # An SFT adapter stands for its base with the adapter merged (adapters.merged_dir).
    model_path = str(lora.full_policy_dir(ctx, policy_dir, LOCAL_DTYPE))
    tokenizer_path = str(ctx.root / keys.policy.tokenizer_name)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, local_files_only=True)
    train_pairs, val_pairs = preference_splits(ctx, tokenizer)

    model = AutoModelForCausalLM.from_pretrained(model_path, local_files_only=True, dtype=LOCAL_DTYPE)
    if adapter:
        # The reference is the policy with its adapter disabled (TRL's, and validation's below):
        # no second copy of the weights.
        reference, peft = None, {"peft_config": lora.peft_config(model, adapter)}
    else:
        # The reference is the same SFT policy, loaded separately and frozen.
        reference = AutoModelForCausalLM.from_pretrained(
            model_path, local_files_only=True, dtype=LOCAL_DTYPE
        ).eval()
        reference.requires_grad_(False)
        peft = {}

    apply_torch_threads(ctx)
    trl_args = trl_common_args(ctx, ctx.scratch_dir)
    # Validation is ours (the callback below), so the trainer never evaluates by itself.
    trl_args.update(eval_strategy="no", eval_steps=None, max_steps=step_budget(ctx, len(train_pairs)))
    sft = losses.pop("sft")
    args = DPOConfig(
        **trl_args,
        **losses,
        max_length=keys.policy.max_total_sequence_length,
        precompute_ref_log_probs=False,
        disable_dropout=True,
    )
    live = live_log.open_live(ctx)
    validation = live_log.make_validation_callback(
        live,
        METRICS,
        dpo.val_period if val_pairs else 0,
        lambda m: preference_metrics(
            m,
            reference if reference is not None else lora.AdapterDisabled(m),
            tokenizer,
            val_pairs,
            beta=losses["beta"],
            average_log_probs=dpo.preference_average_log_probs,
            batch_size=dpo.val_micro_batch_size,
        ),
        at_start=bool(val_pairs) and dpo.val_at_start,
    )
    longest_side = lambda row: len(row["prompt_ids"]) + max(len(row["chosen_ids"]), len(row["rejected_ids"]))  # noqa: E731
    trainer = scheduled(ctx, length_sorted(make_trainer_class(), longest_side))(
        sft=sft,
        model=model,
        ref_model=reference,
        args=args,
        train_dataset=Dataset.from_list(trl_pairs(train_pairs)),
        processing_class=tokenizer,
        callbacks=[live_log.make_live_callback(live, METRICS), validation],
        **peft,
    )
    if adapter:
        lora.prepare(ctx, trainer.model, adapter, policy_dir, dpo.seed)
    model = train_then_validate(ctx, trainer, live, METRICS, validation, bool(val_pairs))

    samples = sample_heldout(ctx, model, tokenizer)
    heldout = log_heldout(live, tokenizer, samples)
    metrics = publish_trained(ctx, "policy_out", model, tokenizer, live, files=samples_file(samples))
    console.outcome(
        "dpo",
        {
            "val/preference_accuracy": metrics.get("val/preference_accuracy"),
            "heldout/accuracy": headline(heldout),
        },
        ctx.output("policy_out").relative_to(ctx.root),
        ctx.started,
    )
