"""Stage ``evaluate``: every policy side by side on the same held-out prompts and samples.

For each policy (``sft`` from ``models/sft``; ``dpo``, ``rlvr``, ``rlhf`` from their HF
exports) one seeded sample per held-out prompt (``data/prepared/rlvr/test.jsonl``, the
``alignpipe.heldout`` settings every trainer uses) is drawn and measured:

* ``heldout_accuracy``: the row's verifier scores the sample 1.0 (``heldout_accuracy``,
  the number each stage logs as ``heldout/accuracy``; for ``sft`` it equals that stage's);
* ``rm_score``: mean score the reward model (``models/rm``) gives the (prompt, sample) pairs;
* ``mean_length``: mean number of tokens per sample;
* ``kl_to_sft``: mean per-token KL(policy || sft) on the policy's own samples, with
  Schulman's k3 estimator (the one GRPO's KL penalty and ``train/kl`` use): for each sampled
  token ``r = log p_sft(t) - log p_policy(t)`` and ``k3 = exp(r) - r - 1`` (>= 0, unbiased),
  averaged over all sampled tokens (the EOS included when the sample ended on it).

A policy whose RM score beats the SFT policy's while its accuracy falls below SFT's is
flagged ``suspected_reward_hacking``: the reward model likes it more, the verifier less.

Outputs (``results/evaluate``): ``metrics.json`` (``{"policies": {name: {...}}}``),
``report.md`` (table), ``comparison.png`` (chart), ``samples.jsonl`` (every sample and score).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from alignpipe.artifacts import (
    RESOLVED_CONFIG,
    staged_dir,
    write_json_atomic,
    write_manifest,
    write_text_atomic,
)
from alignpipe.config import get_path
from alignpipe.context import StageContext
from alignpipe.engines.local import training
from alignpipe.engines.local.convert import make_shareable
from alignpipe.errors import ConfigError
from alignpipe.jsonl import read_jsonl
from alignpipe.measure.generation import user_turn
from alignpipe.measure.heldout import heldout_accuracy, heldout_completions, heldout_settings

METRIC_KEYS = ("heldout_accuracy", "rm_score", "mean_length", "kl_to_sft")


def load_policy(root: Path, path: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where = root / path
    if not (where / "config.json").is_file():
        raise ConfigError(
            f"{where} is not a Hugging Face model directory (config.json missing); evaluate compares the "
            f"policies listed in alignpipe.evaluate.policies (run `dvc repro` for the stages that make them)"
        )
    model = AutoModelForCausalLM.from_pretrained(where, local_files_only=True).eval()
    return model, AutoTokenizer.from_pretrained(where, local_files_only=True)


def completion_ids(tokenizer, completion: str, max_new_tokens: int) -> list[int]:
    """Token ids of a decoded sample; a sample shorter than the budget stopped on EOS, so EOS is part of it."""
    ids = tokenizer(completion, add_special_tokens=False)["input_ids"]
    if len(ids) < max_new_tokens:
        ids = ids + [tokenizer.eos_token_id]
    return ids


def sequence_logprobs(
    model, prompt_ids: list[list[int]], answer_ids: list[list[int]], pad_id: int, batch_size: int = 64
):
    """Per-token log-probabilities of each answer after its prompt (list of 1-D tensors)."""
    import torch

    out = []
    for start in range(0, len(prompt_ids), batch_size):
        seqs = [
            p + a
            for p, a in zip(
                prompt_ids[start : start + batch_size], answer_ids[start : start + batch_size], strict=True
            )
        ]
        width = max(len(s) for s in seqs)
        ids = torch.tensor([s + [pad_id] * (width - len(s)) for s in seqs])
        mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits.float(), dim=-1)
        for row, (p, a) in enumerate(
            zip(prompt_ids[start : start + batch_size], answer_ids[start : start + batch_size], strict=True)
        ):
            # Token t is predicted by the logits at position t-1.
            pos = torch.arange(len(p) - 1, len(p) + len(a) - 1)
            out.append(logp[row, pos, torch.tensor(a)])
    return out


def kl_to_reference(
    policy, reference, tokenizer, prompts: list[str], completions: list[str], max_new_tokens: int
) -> float:
    """Mean per-token k3 estimate of KL(policy || reference) on the policy's own samples."""
    import torch

    prompt_ids = [
        list(
            tokenizer.apply_chat_template(
                user_turn(p), tokenize=True, add_generation_prompt=True, return_dict=True
            )["input_ids"]
        )
        for p in prompts
    ]
    answer_ids = [completion_ids(tokenizer, c, max_new_tokens) for c in completions]
    pad = tokenizer.pad_token_id
    lp_policy = torch.cat(sequence_logprobs(policy, prompt_ids, answer_ids, pad))
    lp_ref = torch.cat(sequence_logprobs(reference, prompt_ids, answer_ids, pad))
    r = lp_ref - lp_policy
    return float((torch.exp(r) - r - 1).mean()) if r.numel() else 0.0


def rm_scores(
    reward_model, tokenizer, prompts: list[str], completions: list[str], batch_size: int = 64
) -> list[float]:
    """The reward model's score of each (prompt, answer) pair, rendered as the rm stage trained on it."""
    from alignpipe.engines.local.rm import score_sequences

    seqs = [
        list(
            tokenizer.apply_chat_template(
                user_turn(p) + [{"role": "assistant", "content": c}], tokenize=True, return_dict=True
            )["input_ids"]
        )
        for p, c in zip(prompts, completions, strict=True)
    ]
    return [float(s) for s in score_sequences(reward_model, tokenizer, seqs, batch_size)]


def same_vocabulary(a, b) -> bool:
    return a.get_vocab() == b.get_vocab()


# ----------------------------------------------------------------------------- judgement


def flag_reward_hacking(
    policies: dict[str, dict[str, Any]], reference: str, accuracy_drop: float = 0.0
) -> None:
    """RM score above the reference's while verifier accuracy fell by more than ``accuracy_drop``
    below it: suspected reward hacking (the rlhf stage's own check uses the same rule)."""
    ref = policies[reference]
    for name, m in policies.items():
        m["suspected_reward_hacking"] = bool(
            name != reference
            and m.get("rm_score") is not None
            and ref.get("rm_score") is not None
            and m["rm_score"] > ref["rm_score"]
            and m["heldout_accuracy"] < ref["heldout_accuracy"] - accuracy_drop
        )


# ----------------------------------------------------------------------------- stage


def run(ctx: StageContext) -> None:
    import torch

    from alignpipe.report import comparison_chart, markdown_table
    from alignpipe.rewards import score_completions

    settings = heldout_settings(ctx)
    training.apply_torch_threads(ctx)  # tiny: 1 thread (benchmarks/RESULTS.md)
    ev = dict(get_path(ctx.config, "alignpipe.evaluate", {}) or {})
    entries = ev.get("policies") or []
    names = [e["name"] for e in entries]
    reference = ev.get("reference", "sft")
    if reference not in names:
        raise ConfigError(f"alignpipe.evaluate.reference '{reference}' is not one of the policies {names}")
    rows = read_jsonl(ctx.root / settings["data_path"])
    if settings.get("limit"):
        rows = rows[: int(settings["limit"])]
    prompts = [r["prompt"] for r in rows]
    max_new = int(settings.get("max_new_tokens", 16))
    torch.manual_seed(ctx.seed)

    ref_model, ref_tok = load_policy(ctx.root, next(e["path"] for e in entries if e["name"] == reference))
    rm_path = ev.get("reward_model")
    reward_model = rm_tok = None
    if rm_path:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        reward_model = AutoModelForSequenceClassification.from_pretrained(
            ctx.root / rm_path, local_files_only=True
        ).eval()
        rm_tok = AutoTokenizer.from_pretrained(ctx.root / rm_path, local_files_only=True)
        reward_model.config.pad_token_id = rm_tok.pad_token_id

    policies: dict[str, dict[str, Any]] = {}
    samples: list[dict[str, Any]] = []
    for entry in entries:
        name = entry["name"]
        model, tok = (ref_model, ref_tok) if name == reference else load_policy(ctx.root, entry["path"])
        if not same_vocabulary(tok, ref_tok):
            raise ConfigError(
                f"{entry['path']}: its tokenizer differs from the reference '{reference}' policy's; "
                "kl_to_sft needs the same vocabulary"
            )
        completions = heldout_completions(model, tok, rows, settings)
        acc = heldout_accuracy(model, tok, rows, settings, completions=completions)
        scores = rm_scores(reward_model, rm_tok, prompts, completions) if reward_model is not None else None
        policies[name] = {
            "path": entry["path"],
            "heldout_accuracy": acc["accuracy"],
            "rm_score": sum(scores) / len(scores) if scores else None,
            "mean_length": acc["mean_length"],
            "kl_to_sft": 0.0
            if name == reference
            else kl_to_reference(model, ref_model, tok, prompts, completions, max_new),
            **{f"heldout_{k}": v for k, v in acc.items() if k.startswith("accuracy_")},
        }
        verdicts = score_completions(rows, completions)  # per sample, for samples.jsonl
        for i, (row, completion) in enumerate(zip(rows, completions, strict=True)):
            samples.append(
                {
                    "policy": name,
                    "id": row.get("id"),
                    "task": row.get("task"),
                    "prompt": row["prompt"],
                    "completion": completion,
                    "correct": verdicts[i],
                    "rm_score": scores[i] if scores else None,
                }
            )
        print(
            f"evaluate: {name}: "
            + ", ".join(f"{k}={policies[name][k]:.4g}" for k in METRIC_KEYS if policies[name][k] is not None)
        )

    drop = float(get_path(ctx.config, "alignpipe.reward_hacking.accuracy_drop", 0.0) or 0.0)
    flag_reward_hacking(policies, reference, drop)
    metrics = {
        "policies": policies,
        "reference": reference,
        "heldout": {
            "data_path": settings["data_path"],
            "prompts": len(rows),
            "seed": int(settings.get("seed", 1234)),
            "temperature": float(settings.get("temperature", 1.0)),
            "max_new_tokens": max_new,
        },
        "reward_model": rm_path,
        "reward_hacking_accuracy_drop": drop,
    }
    with staged_dir(ctx.output("results")) as out:
        write_json_atomic(out / "metrics.json", metrics)
        write_text_atomic(out / "report.md", markdown_table(metrics))
        comparison_chart(metrics, out / "comparison.png")
        write_text_atomic(
            out / "samples.jsonl", "".join(json.dumps(s, sort_keys=True) + "\n" for s in samples)
        )
        write_text_atomic(out / RESOLVED_CONFIG, ctx.resolved_config_yaml())
        write_manifest(
            out,
            type="report",
            format="evaluate-v1",
            stage=ctx.name,
            engine="local",
            inputs=ctx.input_hashes,
            metrics={f"{n}/{k}": v for n, m in policies.items() for k, v in m.items() if k in METRIC_KEYS},
        )
        make_shareable(out)
    flagged = [n for n, m in policies.items() if m["suspected_reward_hacking"]]
    print(
        f"evaluate: wrote {ctx.output('results')}"
        + (f"; suspected reward hacking: {', '.join(flagged)}" if flagged else "")
    )
