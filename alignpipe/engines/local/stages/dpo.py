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
| dpo.sft_loss_weight, dpo.sft_average_log_probs | ``sft_term`` (per response, then the mean; TRL's ``sft`` pools tokens) |
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
from alignpipe.config import get_path
from alignpipe.context import StageContext
from alignpipe.engines.local import live_log, lora
from alignpipe.engines.local.checkpoints import publish_trained, train_then_validate
from alignpipe.engines.local.micro_batches import length_sorted_micro_batches
from alignpipe.engines.local.preference_pairs import preference_splits
from alignpipe.engines.local.torch_threads import apply_torch_threads
from alignpipe.engines.local.trl_args import refuse_gpu_only_settings, step_budget, trl_common_args
from alignpipe.errors import UnsupportedSetting
from alignpipe.measure.heldout import headline, log_heldout, sample_heldout, samples_file
from alignpipe.measure.logprobs import LOCAL_DTYPE
from alignpipe.measure.metrics import local_keys

# trainer / validation log key -> pipeline metric name (same names on the NeMo-RL engine)
METRICS = local_keys("dpo")  # TRL log key -> pipeline metric (measure/metrics.py)


def loss_settings(ctx: StageContext) -> dict[str, Any]:
    """NeMo-RL's DPO loss keys -> DPOConfig's beta / loss_type / loss_weights."""
    cfg = ctx.config
    where = f"stages/{ctx.name}/config/{ctx.profile}.yaml"
    beta = float(get_path(cfg, "dpo.reference_policy_kl_penalty", 0.05))
    if beta <= 0:
        raise UnsupportedSetting(f"{where}: dpo.reference_policy_kl_penalty (beta) must be > 0, got {beta}")
    average = bool(get_path(cfg, "dpo.preference_average_log_probs", False))
    pref_weight = float(get_path(cfg, "dpo.preference_loss_weight", 1.0))
    sft_weight = float(get_path(cfg, "dpo.sft_loss_weight", 0.0) or 0.0)
    return {
        "beta": beta,
        "loss_type": ["sigmoid_norm" if average else "sigmoid"],
        "loss_weights": [pref_weight],
        # NeMo-RL's SFT term, added by TokenizedDPOTrainer (TRL's "sft" pools the batch's tokens)
        "sft": {"weight": sft_weight, "average": bool(get_path(cfg, "dpo.sft_average_log_probs", average))},
    }


def sft_term(per_token_logps, shift_completion_mask, average: bool):
    """NeMo-RL's DPO SFT term (``DPOLossFn`` with ``NLLLossFn(dpo_loss=True)``): each chosen
    response's NLL, summed over its tokens or averaged (``sft_average_log_probs``), then the mean
    over chosen responses. Rows are [chosen..., rejected...]."""
    chosen, _ = per_token_logps.chunk(2, dim=0)
    mask, _ = shift_completion_mask.chunk(2, dim=0)
    nll = -(chosen * mask).sum(-1)
    if average:
        nll = nll / mask.sum(-1).clamp(min=1)
    return nll.mean()


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


def make_trainer_class():
    """Built lazily so importing this module does not import TRL."""
    from trl import DPOTrainer

    class TokenizedDPOTrainer(DPOTrainer):
        """DPOTrainer over pairs tokenised as NeMo-RL tokenises them (:func:`trl_pairs`), plus
        NeMo-RL's SFT term (:func:`sft_term`). TRL 1.16 re-tokenises every dataset itself; rows
        that already carry ``prompt_ids`` pass through."""

        def __init__(self, *args, sft: dict[str, Any] | None = None, **kwargs):
            super().__init__(*args, **kwargs)
            self.sft = sft or {"weight": 0.0, "average": True}

        def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
            if "prompt_ids" in dataset.column_names:
                return dataset
            return super()._prepare_dataset(dataset, processing_class, args, dataset_name)

        def _compute_loss(self, model, inputs, return_outputs):
            if not self.sft["weight"]:
                return super()._compute_loss(model, inputs, return_outputs)
            seen = {}

            def keep_first(module, args, output) -> None:
                # The policy's forward (TRL's fused head, the first call) returns the per-token
                # log-probs: keep them. Return None: a hook's return value replaces the output, and
                # with a LoRA adapter TRL's reference pass is a second call of this same module.
                seen.setdefault("out", output)

            hook = model.register_forward_hook(keep_first)
            try:
                result = super()._compute_loss(model, inputs, return_outputs)
            finally:
                hook.remove()
            mask = inputs["completion_mask"][..., 1:]
            term = sft_term(seen["out"].log_probs[:, -mask.size(1) :], mask, self.sft["average"])
            mode = "train" if self.model.training else "eval"
            self._metrics[mode]["sft_loss"].append(self.accelerator.gather(term.detach()).mean().item())
            if return_outputs:
                loss, outputs = result
                return loss + self.sft["weight"] * term, outputs
            return result + self.sft["weight"] * term

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
    import torch.nn.functional as F

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
    c, r = torch.cat(chosen), torch.cat(rejected)
    margin = c - r
    return {
        "val_loss": float(-F.logsigmoid(margin).mean()),
        "val_preference_accuracy": float((margin > 0).float().mean()),
        "val_chosen_reward": float(c.mean()),
        "val_rejected_reward": float(r.mean()),
        "val_reward_margin": float(margin.mean()),
        "val_kl_to_reference": kl_sum / max(kl_tokens, 1.0),
    }


def run(ctx: StageContext) -> None:
    # Refuse impossible settings before the (slow) ML imports.
    refuse_gpu_only_settings(ctx)
    losses = loss_settings(ctx)
    adapter = lora.lora_settings(ctx)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig

    cfg = ctx.config
    policy_dir = ctx.root / cfg["policy"]["model_name"]
    # An SFT adapter stands for its base with the adapter merged (adapters.merged_dir).
    model_path = str(lora.full_policy_dir(ctx, policy_dir, LOCAL_DTYPE))
    tokenizer_path = str(ctx.root / get_path(cfg, "policy.tokenizer.name", cfg["policy"]["model_name"]))
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, local_files_only=True)
    train_pairs, val_pairs = preference_splits(ctx, "dpo", tokenizer)

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
    trl_args = trl_common_args(ctx, "dpo", ctx.scratch_dir)
    # Validation is ours (the callback below), so the trainer never evaluates by itself.
    trl_args.update(eval_strategy="no", eval_steps=None, max_steps=step_budget(ctx, "dpo", len(train_pairs)))
    sft = losses.pop("sft")
    args = DPOConfig(
        **trl_args,
        **losses,
        max_length=int(cfg["policy"]["max_total_sequence_length"]),
        precompute_ref_log_probs=False,
        disable_dropout=True,
    )
    live = live_log.open_live(ctx)
    average = bool(get_path(cfg, "dpo.preference_average_log_probs", False))
    val_batch = int(get_path(cfg, "dpo.val_micro_batch_size", 64) or 64)
    validation = live_log.make_validation_callback(
        live,
        METRICS,
        int(get_path(cfg, "dpo.val_period", 0) or 0) if val_pairs else 0,
        lambda m: preference_metrics(
            m,
            reference if reference is not None else lora.AdapterDisabled(m),
            tokenizer,
            val_pairs,
            beta=losses["beta"],
            average_log_probs=average,
            batch_size=val_batch,
        ),
        at_start=bool(val_pairs) and bool(get_path(cfg, "dpo.val_at_start", False)),
    )
    trainer = make_trainer_class()(
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
        lora.prepare(ctx, trainer.model, adapter, policy_dir, int(get_path(cfg, "dpo.seed", ctx.seed)))
    length_sorted_micro_batches(
        trainer, lambda row: len(row["prompt_ids"]) + max(len(row["chosen_ids"]), len(row["rejected_ids"]))
    )
    model = train_then_validate(ctx, trainer, live, METRICS, validation, "dpo", bool(val_pairs))

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
