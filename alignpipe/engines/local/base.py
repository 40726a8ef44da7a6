"""Stage ``base``: the tiny offline base model (tokenizer trained on the prepared text)."""

from __future__ import annotations

import json

from alignpipe import console, tiny
from alignpipe.context import StageContext
from alignpipe.engines.local import publish


def corpus(prepared) -> list[str]:
    """Every string in the prepared JSONL files: the tokenizer must cover all of them."""
    texts: list[str] = []

    def walk(value) -> None:
        if isinstance(value, str):
            texts.append(value)
        elif isinstance(value, dict):
            for v in value.values():
                walk(v)
        elif isinstance(value, list):
            for v in value:
                walk(v)

    for path in sorted(prepared.rglob("*.jsonl")):
        with path.open() as f:
            for line in f:
                walk(json.loads(line))
    return texts


def run(ctx: StageContext) -> None:
    cfg = ctx.config
    texts = corpus(ctx.input("data"))
    if not texts:
        raise SystemExit(f"no text found under {ctx.input('data')}; run the prep stage first")
    tokenizer = tiny.train_char_tokenizer(texts, min_frequency=cfg["tokenizer"].get("min_frequency", 1))
    model = tiny.build_causal_lm(tokenizer, cfg["model"], seed=ctx.seed)
    publish.publish_model(
        ctx, "model", model, tokenizer, {"parameters": tiny.count_parameters(model), "vocab_size": len(tokenizer)}
    )
    console.outcome("base", {"parameters": f"{tiny.count_parameters(model):,}", "vocabulary": len(tokenizer)},
                    ctx.output("model").relative_to(ctx.root), ctx.started)
