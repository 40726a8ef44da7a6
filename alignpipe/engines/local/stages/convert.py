"""Stage ``convert`` (``convert@dpo|rlvr|rlhf``): a policy checkpoint -> a self-contained HF export.

``alignpipe run convert --source dpo`` reads ``models/dpo`` and publishes ``exports/dpo``:
``model.safetensors`` (optionally cast to ``alignpipe.export.dtype``), the tokenizer,
``generation_config.json``, a model card (``README.md``) with lineage, the producing
stage's resolved config (``training_config.yaml``), this stage's own
``resolved_config.yaml`` and ``artifact.json``.

The source's ``artifact.json`` ``format`` picks the path in:

* ``hf`` (local engine) and NeMo-RL's ``hf_consolidated`` (DTensor V2 with
  ``save_consolidated``): already Hugging Face, loaded directly;
* ``peft`` (a LoRA stage's adapter, ``alignpipe.adapters``): the adapter chain is merged into
  full weights (peft's ``merge_and_unload``), and verified against the unmerged base + adapter.
  When the adapter applies to a full checkpoint, it is exported alone too (``adapter/``), for
  serving on that base with vLLM's ``--enable-lora`` or peft's ``PeftModel``;
* NeMo-RL's ``dcp`` and ``megatron`` (``torch_dist``): NeMo-RL's own converter
  (``alignpipe.engines.nemo_rl.convert.converter_argv``) writes an HF directory first.
  It needs NeMo-RL, so on a host without it the whole stage runs inside the NeMo-RL image
  (``needs_image``; alignpipe.stage launches it there).

Before anything is published the export is verified the way a user will load it:
``AutoModelForCausalLM.from_pretrained(..., local_files_only=True)``, greedy generation
on held-out prompts, and (when no dtype cast happened) logits equal to the source's
within ``alignpipe.export.verify.logits_atol``. A failed check publishes nothing.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import shutil
import subprocess
from pathlib import Path
from typing import Any

from alignpipe import console
from alignpipe.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS, adapter_chain, merge_chain
from alignpipe.artifacts import (
    MANIFEST,
    RESOLVED_CONFIG,
    read_manifest,
    staged_dir,
    write_text_atomic,
)
from alignpipe.context import ImageNeed, StageContext
from alignpipe.data.schema import transcript
from alignpipe.engines.local.publish import write_hf_manifest
from alignpipe.engines.local.torch_threads import apply_torch_threads
from alignpipe.errors import AlignpipeError, ConfigError
from alignpipe.measure.generation import Prompt
from alignpipe.measure.heldout import MEASURES_FILE, SAMPLES_FILE
from alignpipe.measure.logprobs import LOCAL_DTYPE
from alignpipe.settings import ExportVerify

HF_FORMATS = ("hf", "hf_consolidated", "peft")
# artifact.json format -> NeMo-RL checkpoint format (alignpipe.engines.nemo_rl.convert). The
# nemo_rl engine publishes Megatron runs as a step_N copy with format "megatron_bridge".
NEMO_RL_FORMATS = {"dcp": "dcp", "megatron": "megatron", "megatron_bridge": "megatron"}
TRAINING_CONFIG = "training_config.yaml"


class ExportVerificationError(AlignpipeError):
    pass


# ----------------------------------------------------------------------------- source


def source_manifest(ctx: StageContext) -> dict[str, Any]:
    src = ctx.input("checkpoint")
    if not (src / MANIFEST).is_file():
        raise ConfigError(
            f"{src}/{MANIFEST} is missing: convert exports what a trainer stage published "
            f"(run `dvc repro {ctx.source}` first, or point --source at a stage that writes models/<name>)"
        )
    return read_manifest(src)


def checkpoint_dir(ctx: StageContext, manifest: dict[str, Any]) -> Path:
    """Where the weights are: the source dir, or its ``checkpoint`` subdir for NeMo-RL step dirs."""
    return ctx.input("checkpoint") / manifest.get("checkpoint", ".")


def hf_source(ctx: StageContext, manifest: dict[str, Any], workdir: Path) -> tuple[Path, Path, list[str]]:
    """(HF model dir, tokenizer dir, converter argv or []) for the source checkpoint."""
    fmt = manifest.get("format", "hf")
    ckpt = checkpoint_dir(ctx, manifest).resolve()
    if fmt in ("hf", "peft"):
        return ckpt, ckpt, []
    if fmt == "hf_consolidated":
        tokenizer = ckpt / "policy" / "tokenizer"
        model = ckpt / "policy" / "weights" / "model" / "consolidated"
        return model, tokenizer if tokenizer.is_dir() else model, []
    if fmt in NEMO_RL_FORMATS:
        out = workdir / "hf"
        # Converters may leave the tokenizer out; the step dir keeps NeMo-RL's copy.
        tokenizer = ckpt / "policy" / "tokenizer"
        argv = nemo_rl_converter_argv(ctx, ckpt, NEMO_RL_FORMATS[fmt], out)
        return out, tokenizer if tokenizer.is_dir() else out, argv
    raise ConfigError(
        f"{ctx.input('checkpoint')}/{MANIFEST}: format '{fmt}' has no converter; "
        f"expected one of {', '.join([*HF_FORMATS, *NEMO_RL_FORMATS])}"
    )


def nemo_rl_converter_argv(ctx: StageContext, ckpt: Path, fmt: str, out: Path) -> list[str]:
    from alignpipe.engines.nemo_rl.convert import converter_argv

    nemo_rl_dir = str(ctx.runtime.get("nemo_rl_dir", "/opt/nemo-rl"))
    argv = converter_argv(ckpt, fmt, out, hf_model_name=ctx.settings.converter.hf_model_name)
    # Absolute script path: the launcher's working directory is the repository.
    return [a if not a.startswith("examples/converters/") else f"{nemo_rl_dir}/{a}" for a in argv]


def needs_image(ctx: StageContext) -> ImageNeed | None:
    """A NeMo-RL checkpoint goes through NeMo-RL's own converter, which runs where NeMo-RL is:
    on a host without it, the whole stage runs in the NeMo-RL image."""
    fmt = source_manifest(ctx).get("format", "hf")
    if fmt in NEMO_RL_FORMATS and importlib.util.find_spec("nemo_rl") is None:
        return ImageNeed(
            f"{ctx.input('checkpoint')} holds a NeMo-RL checkpoint ({fmt})",
            "NeMo-RL's converter",
            "use the profile that trained it (runtime.engine=nemo_rl with the container, slurm or ray "
            "launcher), or run this stage inside the NeMo-RL image",
        )
    return None


def run_converter(ctx: StageContext, argv: list[str]) -> None:
    """NeMo-RL's converter, in NeMo-RL's directory (this run is where NeMo-RL is: ``needs_image``)."""
    code = subprocess.run(argv, cwd=ctx.runtime.get("nemo_rl_dir", "/opt/nemo-rl")).returncode
    if code != 0:
        raise AlignpipeError(f"NeMo-RL converter failed (exit {code}): {' '.join(argv)}")


# ----------------------------------------------------------------------------- export


def generation_config(model, tokenizer, overrides: dict[str, Any]):
    """``generation_config.json`` of the export: the model's own (it came from the starting
    model through every stage), missing special-token ids filled from the tokenizer, then
    the profile's ``export.generation`` overrides, if any."""
    config = copy.deepcopy(model.generation_config)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(config, key, None) is None:
            setattr(config, key, getattr(tokenizer, key))
    config.update(**overrides)
    return config


def cast(model, dtype: str | None):
    import torch

    return model if dtype is None else model.to(getattr(torch, dtype))


def verify_export(
    export_dir: Path,
    source_model,
    prompts: list[Prompt],
    settings: ExportVerify,
    cast_to: str | None,
    system: str | None = None,
    merged: bool = False,
) -> dict[str, Any]:
    """Load the export offline as a user would, generate, and compare logits with the source,
    prompting as the model was trained (``system``: its system prompt). A merged LoRA chain
    (``merged``) is held to ``merged_logits_atol``: ``(W + s·BA) x`` and ``W x + s·B(A x)`` round
    differently in float32 (1.2e-4 on SmolLM2-135M's 30 layers, 1e-6 on tiny)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from alignpipe.measure.generation import generate, prompt_messages

    model = AutoModelForCausalLM.from_pretrained(export_dir, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(export_dir, local_files_only=True)
    model.eval()
    max_new = settings.max_new_tokens
    texts = generate(model, tokenizer, prompts, max_new_tokens=max_new, temperature=0.0, system=system)
    source_texts = generate(
        source_model, tokenizer, prompts, max_new_tokens=max_new, temperature=0.0, system=system
    )

    tokenizer.padding_side = "left"
    chats = [
        tokenizer.apply_chat_template(prompt_messages(p, system), tokenize=False, add_generation_prompt=True)
        + t
        for p, t in zip(prompts, source_texts, strict=True)
    ]
    enc = tokenizer(chats, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        got = model(**enc).logits.float()
        want = source_model(**enc).logits.float()
    mask = enc["attention_mask"].bool()
    diff = float((got - want).abs()[mask].max()) if mask.any() else 0.0
    top1 = float((got.argmax(-1) == want.argmax(-1))[mask].float().mean()) if mask.any() else 1.0
    result = {
        "loaded_with": "AutoModelForCausalLM.from_pretrained(local_files_only=True)",
        "dtype": str(model.dtype).removeprefix("torch."),
        "prompts": len(prompts),
        "max_abs_logit_diff": diff,
        "top1_agreement": top1,
        "greedy_matches_source": sum(a == b for a, b in zip(texts, source_texts, strict=True))
        / max(1, len(texts)),
        "samples": [
            {"prompt": transcript(p), "completion": t} for p, t in list(zip(prompts, texts, strict=True))[:3]
        ],
    }
    if mask.any() and not bool(torch.isfinite(got[mask]).all()):
        raise ExportVerificationError(f"{export_dir}: the export produces non-finite logits")
    key = "merged_logits_atol" if merged else "logits_atol"
    atol = getattr(settings, key)
    if cast_to is None and diff > atol:
        raise ExportVerificationError(
            f"{export_dir}: logits differ from the source checkpoint by up to {diff:.3g} "
            f"(allowed {atol:g}, alignpipe.export.verify.{key}); the export is not the same model"
        )
    return result


def verification_prompts(ctx: StageContext, settings: ExportVerify) -> list[str]:
    from alignpipe.jsonl import read_jsonl

    path = ctx.root / settings.data_path
    if not path.is_file():
        raise ConfigError(
            f"{path} is missing: the export is verified on held-out prompts (run `dvc repro prep`)"
        )
    rows = read_jsonl(path)[: settings.prompts]
    return [r["prompt"] for r in rows]


# ----------------------------------------------------------------------------- model card


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def card_metrics(metrics: dict[str, Any]) -> dict[str, str]:
    """The producing stage's headline metrics as the card shows them, each held-out accuracy
    with its 95% interval: ``heldout/accuracy`` -> ``0.78 [0.7297, 0.8232]``, its bounds read
    from ``heldout/intervals/accuracy/{low,high}`` (``intervals_reference`` for ``_reference``)."""
    shown = {}
    for key, value in metrics.items():
        if not key.startswith(("heldout/", "val/", "train/reward", "train/kl")) or "/intervals" in key:
            continue
        group, _, name = key.rpartition("/")
        suffix = "_reference" if name.endswith("_reference") else ""
        bounds = f"{group}/intervals{suffix}/{name.removesuffix(suffix)}"
        low, high = metrics.get(f"{bounds}/low"), metrics.get(f"{bounds}/high")
        shown[key] = _fmt(value) + (
            f" [{_fmt(low)}, {_fmt(high)}]" if low is not None and high is not None else ""
        )
    return shown


def model_card(
    ctx: StageContext,
    manifest: dict[str, Any],
    source_hash: str,
    verification: dict[str, Any],
    dtype: str,
    adapter: dict[str, Any] | None = None,
) -> str:
    """README.md: what this model is, where it came from (content hashes), how good, how to load it."""
    # Over 60 lines: one markdown template, read top to bottom like the card it writes.
    stage = manifest.get("stage", ctx.source)
    headline = card_metrics(manifest.get("metrics") or {})
    lines = [
        "---",
        "library_name: transformers",
        "pipeline_tag: text-generation",
        f"tags: [alignpipe, {stage}]",
        "---",
        f"# alignpipe `{ctx.source}` policy",
        "",
        f"Exported by the `convert@{ctx.source}` stage of alignpipe from the checkpoint the `{stage}` stage "
        f"published. Weights: `model.safetensors` ({dtype}).",
        "",
        "## Lineage",
        "",
        "| | |",
        "|---|---|",
        f"| producing stage | `{stage}` |",
        f"| engine | `{manifest.get('engine')}` |",
        f"| container image | `{manifest.get('image') or 'none (local engine)'}` |",
        f"| source checkpoint | `{ctx.input('checkpoint').relative_to(ctx.root)}` format `{manifest.get('format')}`, "
        f"DVC md5 `{source_hash}` |",
    ]
    origin = manifest.get("source_model") or {}
    if origin:
        digest = f" DVC md5 `{origin['hash']}`" if origin.get("hash") else ""
        lines.append(f"| starting model | `{origin.get('name')}`{digest} |")
    for name, entry in sorted((manifest.get("inputs") or {}).items()):
        lines.append(f"| input of `{stage}`: {name} | `{entry.get('path')}` DVC md5 `{entry.get('hash')}` |")
    lines += [
        "",
        f"The producing stage's full resolved configuration is in [`{TRAINING_CONFIG}`]({TRAINING_CONFIG}); "
        f"this export's in [`{RESOLVED_CONFIG}`]({RESOLVED_CONFIG}). The hashes are DVC 3 md5s: they match "
        "the `outs` of `dvc.lock` for the same paths.",
        "",
        "## Headline metrics (from the producing stage)",
        "",
    ]
    if headline:
        lines += ["| metric | value |", "|---|---|"]
        lines += [f"| `{k}` | {v} |" for k, v in sorted(headline.items())]
    else:
        lines.append("None recorded.")
    lines += [
        "",
        "## Verification (before publishing)",
        "",
        f"Reloaded with `{verification['loaded_with']}` and generated greedily on {verification['prompts']} "
        f"held-out prompts: max |logit difference| to the source checkpoint "
        f"{verification['max_abs_logit_diff']:.3g}, top-1 agreement {verification['top1_agreement']:.3f}, "
        f"greedy outputs identical for {verification['greedy_matches_source']:.0%} of prompts.",
        "",
        "## Use",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        f'tok = AutoTokenizer.from_pretrained("exports/{ctx.source}", local_files_only=True)',
        f'model = AutoModelForCausalLM.from_pretrained("exports/{ctx.source}", local_files_only=True)',
        *(
            [f"SYSTEM = {manifest['system_prompt']!r}  # the system prompt it was trained with"]
            if manifest.get("system_prompt")
            else []
        ),
        "messages = "
        + (
            '[{"role": "system", "content": SYSTEM}, {"role": "user", "content": PROMPT}]'
            if manifest.get("system_prompt")
            else '[{"role": "user", "content": PROMPT}]'
        ),
        'chat = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)',
        "out = model.generate(**chat)  # sampling defaults: generation_config.json",
        "```",
        "",
    ]
    if adapter:
        lines += adapter_section(ctx.source, adapter)
    return "\n".join(lines)


def adapter_section(source: str, adapter: dict[str, Any]) -> list[str]:
    base, path = adapter["applies_to"], f"exports/{source}/{adapter['path']}"
    return [
        "## The adapter alone",
        "",
        f"`{adapter['path']}/` is the LoRA adapter these weights merge, on `{base}`: serve it on that "
        "base instead of the merged copy, e.g. with vLLM (`--max-lora-rank` at least its `r`):",
        "",
        "```bash",
        f"vllm serve {base} --enable-lora --lora-modules {source}={path}",
        "```",
        "",
        f'or with peft: `PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained("{base}"), "{path}")`.',
        "",
    ]


ADAPTER_EXPORT = "adapter"


def export_adapter(chain: list[Path], root: Path, out: Path) -> dict[str, Any] | None:
    """``out/adapter``: the source's adapter as published (the bytes peft and vLLM load), when the
    base it applies to is a full checkpoint a server can load. On a deeper chain (a LoRA dpo on a
    LoRA sft) that base exists only merged, so the merged export is the one to serve."""
    if len(chain) != 2:
        return None
    (out / ADAPTER_EXPORT).mkdir()
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        shutil.copyfile(chain[-1] / name, out / ADAPTER_EXPORT / name)
    base = str(chain[0].relative_to(root.resolve()))
    return {"path": ADAPTER_EXPORT, "applies_to": base}


def make_shareable(directory: Path) -> None:
    """Staging dirs and atomic writes are created 0700/0600 (mkdtemp/mkstemp); an export is for others to read."""
    directory.chmod(0o755)
    for path in directory.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)


# ----------------------------------------------------------------------------- stage


def plan(ctx: StageContext) -> dict[str, str]:
    """``alignpipe plan convert --source X``: the config and what would run, without running it."""
    src = ctx.input("checkpoint").relative_to(ctx.root)
    lines = [f"convert@{ctx.source}: {src} -> {ctx.output('export').relative_to(ctx.root)}"]
    if (ctx.input("checkpoint") / MANIFEST).is_file():
        manifest = source_manifest(ctx)
        fmt = manifest.get("format", "hf")
        lines.append(
            f"source: stage '{manifest.get('stage')}', engine '{manifest.get('engine')}', format '{fmt}'"
        )
        if fmt in NEMO_RL_FORMATS:
            argv = nemo_rl_converter_argv(
                ctx, checkpoint_dir(ctx, manifest).resolve(), NEMO_RL_FORMATS[fmt], ctx.scratch_dir / "hf"
            )
            lines.append("NeMo-RL converter (in the container): " + " ".join(argv))
        else:
            lines.append("already Hugging Face: loaded and re-saved in-process (safetensors), no converter")
    else:
        lines.append(
            f"{src}/{MANIFEST} does not exist yet: its `format` picks the converter at run time "
            f"(hf: none; dcp/megatron: NeMo-RL's converter in the container)"
        )
    dtype = ctx.settings.export.dtype
    lines.append(f"dtype: {dtype or 'unchanged'}; verify: reload offline, greedy generate, compare logits")
    return {
        f"convert@{ctx.source}.config.yaml": ctx.resolved_config_yaml(),
        f"convert@{ctx.source}.plan.txt": "\n".join(lines) + "\n",
    }


def run(ctx: StageContext) -> None:
    from peft import PeftModel
    from transformers import AutoTokenizer

    apply_torch_threads(ctx)  # tiny: 1 thread (benchmarks/RESULTS.md)
    export = ctx.settings.export
    dtype = export.dtype
    manifest = source_manifest(ctx)
    source_hash = ctx.content_hash(ctx.input("checkpoint"))
    prompts = verification_prompts(ctx, export.verify)

    workdir = ctx.scratch_dir
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    model_dir, tokenizer_dir, argv = hf_source(ctx, manifest, workdir)
    if argv:
        run_converter(ctx, argv)

    # [full checkpoint, adapter, ...]: a LoRA stage's adapter stands for its chain merged, in the
    # dtype its adapters were trained against (the local engine's float32, whatever the base's
    # stored dtype: merging into bf16 weights would round every merged layer).
    chain = adapter_chain(model_dir, ctx.root)
    load_as = LOCAL_DTYPE if len(chain) > 1 else "auto"
    if len(chain) > 1:  # the source is the last adapter, unmerged, on the rest merged
        model = PeftModel.from_pretrained(merge_chain(chain[:-1], load_as), chain[-1]).eval()
    else:
        model = merge_chain(chain, load_as).eval()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    cast_to = dtype if dtype and str(model.dtype).removeprefix("torch.") != dtype else None
    # A cast happens in place, and a merge changes the weights, so the exported copy is loaded
    # separately then: verification compares against the untouched source.
    separate = cast_to or len(chain) > 1
    exported = cast(merge_chain(chain, load_as), cast_to) if separate else model
    final_dtype = str(exported.dtype).removeprefix("torch.")

    with staged_dir(ctx.output("export")) as out:
        # The overrides the profile sets; the model's own generation_config.json keeps the rest.
        overrides = {k: v for k, v in dataclasses.asdict(export.generation).items() if v is not None}
        exported.generation_config = generation_config(exported, tokenizer, overrides)
        exported.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)
        training_cfg = ctx.input("checkpoint") / RESOLVED_CONFIG
        if training_cfg.is_file():
            shutil.copyfile(training_cfg, out / TRAINING_CONFIG)
        write_text_atomic(out / RESOLVED_CONFIG, ctx.resolved_config_yaml())
        if not cast_to:  # the same weights: evaluate reuses their held-out samples and measures
            for name in (SAMPLES_FILE, MEASURES_FILE):
                if (ctx.input("checkpoint") / name).is_file():
                    shutil.copyfile(ctx.input("checkpoint") / name, out / name)
        # verified below: the source ``model`` is exactly this adapter unmerged on its base
        adapter = export_adapter(chain, ctx.root, out) if export.adapter else None
        system = manifest.get("system_prompt")
        verification = verify_export(
            out, model, prompts, export.verify, cast_to, system, merged=len(chain) > 1
        )
        write_text_atomic(
            out / "README.md", model_card(ctx, manifest, source_hash, verification, final_dtype, adapter)
        )
        write_hf_manifest(
            out,
            ctx,
            image=manifest.get("image"),
            inputs={
                "checkpoint": {
                    "path": str(ctx.input("checkpoint").relative_to(ctx.root)),
                    "hash": source_hash,
                }
            },
            metrics=manifest.get("metrics") or {},
            system_prompt=system,
            extra={
                "source": {k: manifest.get(k) for k in ("stage", "engine", "format", "image", "inputs")},
                "dtype": final_dtype,
                "converter": argv or None,
                # the adapters merged into this export, the full checkpoint under them first
                "merged": [str(d.relative_to(ctx.root.resolve())) for d in chain] if len(chain) > 1 else None,
                "adapter": adapter,
                "verification": verification,
            },
        )
        make_shareable(out)
    shutil.rmtree(workdir, ignore_errors=True)
    console.outcome(
        f"convert@{ctx.source}",
        {
            "from": f"{ctx.input('checkpoint').relative_to(ctx.root)} ({manifest.get('format')}, {final_dtype})",
            "max |logit diff|": f"{verification['max_abs_logit_diff']:.3g}",
            "greedy outputs match": f"{verification['greedy_matches_source']:.0%}",
        },
        ctx.output("export").relative_to(ctx.root),
        ctx.started,
    )
