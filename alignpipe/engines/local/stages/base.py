"""Stage ``base``: the starting model, into models/base (``model.name``; alignpipe.starting_model).

Null builds the tiny offline model (a tokenizer trained on the prepared text); a local
Hugging Face directory is copied, and a Hub id copied from the Hugging Face cache (fetched
into it first when model.download allows). Either way the chat template and
generation config are the model's own; a missing pad token falls back to EOS here, once.
"""

from __future__ import annotations

import json
from pathlib import Path

from alignpipe import console, tiny
from alignpipe import starting_model as SM
from alignpipe.artifacts import staged_dir
from alignpipe.context import StageContext, lift_offline_env
from alignpipe.engines.local import publish
from alignpipe.errors import ConfigError

# A prepared row's bookkeeping, which no model reads: a hex id would teach the tokenizer words.
NOT_TEXT = frozenset({"id", "task", "verifier"})


def corpus(prepared) -> list[str]:
    """Every string a model may read in the prepared JSONL files (not a row's bookkeeping,
    ``NOT_TEXT``): the tokenizer must cover all of them."""
    texts: list[str] = []

    def walk(value, top: bool = False) -> None:
        if isinstance(value, str):
            texts.append(value)
        elif isinstance(value, dict):
            for k, v in value.items():
                if not (top and k in NOT_TEXT):
                    walk(v)
        elif isinstance(value, list):
            for v in value:
                walk(v)

    for path in sorted(prepared.rglob("*.jsonl")):
        with path.open() as f:
            for line in f:
                walk(json.loads(line), top=True)
    return texts


def run(ctx: StageContext) -> None:
    source = SM.model_source(ctx.params)
    if source.kind == "hub" and source.download:
        # Every stage runs offline (alignpipe.context.OFFLINE_ENV); this fetch is the one exception.
        lift_offline_env()
        print(f"base: model.download=true: fetching {source.name} (revision {source.revision or 'main'}) "
              f"from the Hugging Face Hub into {SM.hub_cache()}; offline mode lifted for this stage",
              flush=True)  # fmt: skip
    if source.kind == "tiny":
        build_tiny(ctx)
    else:
        materialise(ctx, source)


def materialise(ctx: StageContext, source: SM.ModelSource) -> None:
    """A local directory or Hub model into models/base, checked to load, with its lineage."""
    final = ctx.output("model")
    src = Path(source.name).expanduser() if source.kind == "local" else SM.snapshot(source)
    parameters = SM.count_parameters(src)  # the copy below holds the same shards, byte for byte
    refuse_oversized(ctx, source, parameters)  # before copying gigabytes
    with staged_dir(final) as out:
        if source.kind == "local":
            SM.copy_local(src, out)
            origin = SM.lineage(source, src)
        else:
            commit = SM.copy_snapshot(source, src, out)
            origin = SM.lineage(source, out, commit)
        # Imported once the files are here: a wrong path or a refused download fails in a second.
        from transformers import AutoConfig, AutoTokenizer

        try:
            config = AutoConfig.from_pretrained(out, local_files_only=True)
            tokenizer = AutoTokenizer.from_pretrained(out, local_files_only=True)
        except Exception as e:
            raise ConfigError(
                f"model.name {source.name}: transformers cannot load it ({type(e).__name__}: {e})"
            ) from e
        if not tokenizer.chat_template:
            raise ConfigError(
                f"model.name {source.name}: its tokenizer has no chat template, and every stage formats "
                f"conversations with it; use an instruct model, or add chat_template.jinja to the directory"
            )
        pad_from_eos = SM.ensure_pad_token(tokenizer)
        if pad_from_eos:
            tokenizer.save_pretrained(out)
        origin["pad_token"] = "eos (the model has none)" if pad_from_eos else tokenizer.pad_token
        publish.write_record(out, ctx, type="checkpoint_hf", format="hf",
                             metrics={"parameters": parameters, "vocab_size": len(tokenizer)}, source_model=origin,
                             extra={"architecture": (config.architectures or [None])[0]})  # fmt: skip
    console.outcome("base", {"model": origin["name"], "parameters": f"{parameters:,}", "vocabulary": len(tokenizer)},
                    final.relative_to(ctx.root), ctx.started)  # fmt: skip


def refuse_oversized(ctx: StageContext, source: SM.ModelSource, parameters: int) -> None:
    """A profile tuned for its own from-scratch model (``max_starting_parameters``) refuses a
    larger starting model: its learning rates and step counts would wreck a pretrained one."""
    limit = ctx.config.get("max_starting_parameters")
    if limit is not None and parameters > limit:
        raise ConfigError(
            f"model.name {source.name} has {parameters:,} parameters, and profile {ctx.profile} is tuned "
            f"for its own tiny model trained from scratch (stages/base/config/{ctx.profile}.yaml: "
            f"max_starting_parameters {limit:,}): its learning rates and step counts would wreck a "
            f"pretrained model. fix: dvc exp run -S profile=small -S model.name={source.name}"
        )


def build_tiny(ctx: StageContext) -> None:
    cfg = ctx.config
    texts = corpus(ctx.input("data"))
    if not texts:
        raise SystemExit(f"no text found under {ctx.input('data')}; run the prep stage first")
    kind = cfg["tokenizer"]["kind"]
    if kind not in tiny.TOKENIZER_KINDS:
        raise ConfigError(
            f"stages/base/config/{ctx.profile}.yaml: tokenizer.kind {kind!r} is not one of "
            f"{', '.join(sorted(tiny.TOKENIZER_KINDS))}"
        )
    tokenizer = tiny.train_tokenizer(
        texts, kind, min_frequency=cfg["tokenizer"]["min_frequency"], tools=bool(cfg["tokenizer"]["tools"])
    )
    model = tiny.build_causal_lm(tokenizer, cfg["model"], seed=ctx.seed)
    publish.publish_model(
        ctx,
        "model",
        model,
        tokenizer,
        {"parameters": tiny.count_parameters(model), "vocab_size": len(tokenizer)},
        source_model={
            "kind": "tiny",
            "name": "tiny (built offline from data/prepared and stages/base/config)",
        },
    )
    console.outcome(
        "base",
        {"parameters": f"{tiny.count_parameters(model):,}", "vocabulary": len(tokenizer)},
        ctx.output("model").relative_to(ctx.root),
        ctx.started,
    )
