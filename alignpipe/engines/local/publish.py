"""Publishing a model the local engine trained: an HF directory with its manifest and resolved
config, swapped in atomically."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from alignpipe.adapters import canonical_adapter
from alignpipe.artifacts import RESOLVED_CONFIG, staged_dir, write_manifest, write_text_atomic
from alignpipe.context import StageContext


def publish_model(
    ctx: StageContext,
    output: str,
    model,
    tokenizer,
    metrics: dict[str, Any],
    extra: dict[str, Any] | None = None,
    source_model: dict[str, Any] | None = None,
    files: dict[str, str] | None = None,
) -> Path:
    """Save an HF directory with its manifest and resolved config, atomically; ``files``: more
    text files to publish with it (name -> content), e.g. the model's held-out samples.

    A PEFT model is published as its adapter alone (``checkpoint_lora``), its manifest naming the
    policy it applies to (``adapter.applies_to``: path and content hash)."""
    final = ctx.output(output)
    base = ctx.inputs.get("base_model")
    adapter = adapter_record(ctx, model)
    if adapter:
        extra = {**(extra or {}), "adapter": {**adapter, **(extra or {}).get("adapter", {})}}
    elif base is not None and (base / "generation_config.json").is_file():
        from transformers import GenerationConfig

        # The starting model's, as it came: trainers edit the live one (TRL's GRPO turns
        # eos_token_id into a list and sets its rollout sampling), which is not the model's.
        model.generation_config = GenerationConfig.from_pretrained(base, local_files_only=True)
    with staged_dir(final) as out:
        model.save_pretrained(out, safe_serialization=True)
        if adapter:
            canonical_adapter(out)
        tokenizer.save_pretrained(out)
        for name, text in (files or {}).items():
            write_text_atomic(out / name, text)
        write_record(out, ctx, type="checkpoint_lora" if adapter else "checkpoint_hf",
                     format="peft" if adapter else "hf", metrics=metrics, extra=extra,
                     source_model=source_model or ctx.source_model,
                     system_prompt=ctx.system_prompt)  # fmt: skip
    return final


def adapter_record(ctx: StageContext, model) -> dict[str, Any] | None:
    """For a PEFT model: the policy its adapter applies to (``base_model_name_or_path``, set by
    ``lora.adapter_of``) with that directory's content hash, and the adapter's shape."""
    configs = getattr(model, "peft_config", None)
    if not configs:
        return None
    config = next(iter(configs.values()))
    applies_to = ctx.root / config.base_model_name_or_path
    return {
        "applies_to": {"path": config.base_model_name_or_path, "hash": ctx.content_hash(applies_to)},
        "peft_type": str(config.peft_type.value),
        "rank": config.r,
        "alpha": config.lora_alpha,
    }


def write_record(out: Path, ctx: StageContext, *, type: str, format: str, **fields: Any) -> None:
    """What every output directory of this engine carries: resolved_config.yaml and artifact.json
    (with the stage's input hashes as lineage)."""
    write_text_atomic(out / RESOLVED_CONFIG, ctx.resolved_config_yaml())
    fields.setdefault("source_model", ctx.source_model)
    write_manifest(
        out, type=type, format=format, stage=ctx.name, engine="local", inputs=ctx.input_hashes, **fields
    )


def write_hf_manifest(out: Path, ctx: StageContext, **fields: Any) -> None:
    """artifact.json of an HF checkpoint directory this engine wrote (``system_prompt``: what it
    is to be prompted with, which measuring stages read back)."""
    fields.setdefault("source_model", ctx.source_model)
    write_manifest(out, type="checkpoint_hf", format="hf", stage=ctx.name, engine="local", **fields)
