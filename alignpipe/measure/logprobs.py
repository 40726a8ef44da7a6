"""Log-probabilities of sampled answers, and the one KL estimator every reported KL uses.

KL(policy || reference) is estimated on the policy's own samples with Schulman's k3 estimator
per sampled token: ``r = log p_ref(t) - log p_policy(t)``, ``k3 = exp(r) - r - 1`` (>= 0,
unbiased), averaged over all sampled tokens (the EOS included when the sample ended on it).
It is the estimator of GRPO's KL penalty (NeMo-RL's ``loss_fn.reference_policy_kl_type: k3``,
TRL's ``beta`` term), so ``train/kl``, ``heldout/kl_to_reference`` (rlvr, rlhf) and evaluate's
``kl_to_sft`` are one quantity, in nats per token.
"""

from __future__ import annotations

from pathlib import Path

from alignpipe.adapters import adapter_chain, is_adapter, merge_chain
from alignpipe.config import repo_root
from alignpipe.errors import ConfigError
from alignpipe.measure.generation import Prompt, prompt_messages

# The local engine trains and measures in float32: transformers 5 loads a checkpoint in the
# dtype it was stored in, and bf16 weights on a CPU are slow and drop small AdamW updates.
LOCAL_DTYPE = "float32"


def load_policy(where: Path | str):
    """An HF causal LM and its tokenizer from a model directory, offline; a LoRA adapter's
    directory gives its chain merged (``alignpipe.adapters``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where = Path(where)
    if is_adapter(where):
        model = merge_chain(adapter_chain(where, repo_root(where)), LOCAL_DTYPE)
        return model, AutoTokenizer.from_pretrained(where, local_files_only=True)
    if not (where / "config.json").is_file():
        raise ConfigError(
            f"{where} is not a Hugging Face model directory (config.json missing); "
            "run `dvc repro` for the stage that makes it"
        )
    model = AutoModelForCausalLM.from_pretrained(where, local_files_only=True, dtype=LOCAL_DTYPE)
    return model, AutoTokenizer.from_pretrained(where, local_files_only=True)


def completion_ids(tokenizer, completion: str, max_new_tokens: int) -> list[int]:
    """Token ids of a decoded sample; a sample shorter than the budget stopped on EOS, so EOS is part of it."""
    ids = tokenizer(completion, add_special_tokens=False)["input_ids"]
    if len(ids) < max_new_tokens:
        ids = ids + [tokenizer.eos_token_id]
    return ids


def token_logprobs(
    model, prompt_ids: list[list[int]], answer_ids: list[list[int]], pad_id: int, batch_size: int = 64
):
    """Per-token log-probabilities of each answer after its prompt (list of 1-D tensors)."""
    import torch

    model.eval()
    out = []
    for start in range(0, len(prompt_ids), batch_size):
        pairs = list(
            zip(prompt_ids[start : start + batch_size], answer_ids[start : start + batch_size], strict=True)
        )
        seqs = [p + a for p, a in pairs]
        width = max(len(s) for s in seqs)
        ids = torch.tensor([s + [pad_id] * (width - len(s)) for s in seqs], device=model.device)
        mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs], device=model.device)
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits.float(), dim=-1).cpu()
        for row, (p, a) in enumerate(pairs):
            # Token t is predicted by the logits at position t-1.
            pos = torch.arange(len(p) - 1, len(p) + len(a) - 1)
            out.append(logp[row, pos, torch.tensor(a)])
    return out


def kl_to_reference(
    policy,
    reference,
    tokenizer,
    prompts: list[Prompt],
    completions: list[str],
    max_new_tokens: int,
    system: str | None = None,
) -> float:
    """Mean per-token k3 estimate of KL(policy || reference) on the policy's own samples, both
    models conditioned on the prompts as the samples were drawn (``system``: their system turn)."""
    import torch

    prompt_ids = [
        list(
            tokenizer.apply_chat_template(
                prompt_messages(p, system), tokenize=True, add_generation_prompt=True, return_dict=True
            )["input_ids"]
        )
        for p in prompts
    ]
    answer_ids = [completion_ids(tokenizer, c, max_new_tokens) for c in completions]
    pad = tokenizer.pad_token_id
    lp_policy = torch.cat(token_logprobs(policy, prompt_ids, answer_ids, pad))
    lp_ref = torch.cat(token_logprobs(reference, prompt_ids, answer_ids, pad))
    r = lp_ref - lp_policy
    return float((torch.exp(r) - r - 1).mean()) if r.numel() else 0.0
