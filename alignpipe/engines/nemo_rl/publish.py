"""Publishing a NeMo-RL run: the chosen checkpoint copied or converted into the stage's output
(HF weights, a PEFT adapter as ``checkpoint_lora``, or a Megatron step copy), its TensorBoard
metrics imported into DVCLive, held-out accuracy added, and ``artifact.json`` written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from alignpipe.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS, canonical_adapter
from alignpipe.artifacts import RESOLVED_CONFIG, staged_dir, write_manifest, write_text_atomic
from alignpipe.config import get_path
from alignpipe.engines.nemo_rl import convert as CV
from alignpipe.engines.nemo_rl.checkpoints import Choice, select_checkpoint
from alignpipe.engines.nemo_rl.inputs import start_from_published_adapter
from alignpipe.engines.nemo_rl.metrics import import_metrics
from alignpipe.engines.nemo_rl.programs import CommandRunner, NemoRLFailed, nemo_rl_dir, run_command
from alignpipe.engines.nemo_rl.render import (
    NEMO_RL_CONFIG,
    RunPaths,
    config_header,
    entry_argv,
    render_for,
    to_yaml,
)
from alignpipe.errors import ConfigError

POLICY_STAGES = ("sft", "dpo", "rlvr", "rlhf")


def _copy_tree_contents(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for item in sorted(src.iterdir()):
        target = dst / item.name
        if item.is_dir():
            shutil.copytree(item, target, dirs_exist_ok=True)
        else:
            shutil.copy2(item, target)


def mark_sequence_classifier(hf_dir: Path) -> None:
    """convert_dcp_to_hf.py saves AutoConfig of policy.model_name (a *ForCausalLM config);
    the RM's weights carry a 1-label ``score`` head, so say so for AutoModelFor* loaders."""

    path = hf_dir / "config.json"
    if not path.is_file():
        return
    config = json.loads(path.read_text())
    archs = config.get("architectures") or []
    config["architectures"] = [a.replace("ForCausalLM", "ForSequenceClassification") for a in archs] or archs
    config["num_labels"] = 1
    config.pop("id2label", None)
    config.pop("label2id", None)
    write_text_atomic(path, json.dumps(config, indent=2) + "\n")


def export_checkpoint(
    choice: Choice,
    fmt: str,
    out: Path,
    cfg: dict[str, Any],
    paths: RunPaths,
    runner: CommandRunner,
    workdir: Path,
) -> str:
    """Put the chosen checkpoint into ``out`` as HF files, a PEFT adapter or a Megatron step copy;
    returns which (the manifest's ``format``: hf, peft or megatron_bridge)."""
    policy = choice.path / "policy"
    if fmt == CV.MEGATRON_LORA:
        return export_megatron_lora(choice, out, cfg, paths, runner, workdir)
    if fmt == CV.HF_CONSOLIDATED:
        _copy_tree_contents(policy / "weights" / "model" / "consolidated", out)
        if (policy / "tokenizer").is_dir():
            _copy_tree_contents(policy / "tokenizer", out)
    elif fmt == CV.PEFT:
        for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
            shutil.copy2(policy / "weights" / "model" / name, out / name)
        if (policy / "tokenizer").is_dir():
            _copy_tree_contents(policy / "tokenizer", out)
    elif fmt == CV.DCP:
        converted = paths.converted / f"{choice.path.name}-hf"
        shutil.rmtree(converted, ignore_errors=True)  # the converter refuses an existing dir
        code = runner(CV.converter_argv(choice.path, CV.DCP, converted), workdir)
        if code != 0:
            raise NemoRLFailed(f"convert_dcp_to_hf.py failed on {choice.path} (exit {code})", code)
        _copy_tree_contents(converted, out)
    elif fmt == CV.MEGATRON:
        # Kept as NeMo-RL wrote it (a step_N copy without the optimizer state) so the next
        # stage loads it with checkpointing.pretrained_checkpoint and `convert` can export it.
        for name in ("config.yaml", "training_info.json"):
            if (choice.path / name).is_file():
                shutil.copy2(choice.path / name, out / name)
        shutil.copytree(policy / "weights", out / "policy" / "weights")
        if (policy / "tokenizer").is_dir():
            shutil.copytree(policy / "tokenizer", out / "policy" / "tokenizer")
    else:
        raise CV.CheckpointFormatError(f"cannot export checkpoint format '{fmt}'")
    return {CV.PEFT: "peft", CV.MEGATRON: "megatron_bridge"}.get(fmt, "hf")


def export_megatron_lora(
    choice: Choice, out: Path, cfg: dict[str, Any], paths: RunPaths, runner: CommandRunner, workdir: Path
) -> str:
    """A Megatron LoRA run's adapter, through NeMo-RL's convert_lora_to_hf.py with the base it was
    trained on. Over HF weights (NeMo-RL's cached conversion of ``policy.model_name``) the adapter
    alone is published, as HF PEFT, like a DTensor LoRA run's. Over a Megatron checkpoint (sft's,
    via ``pretrained_checkpoint``) there is no HF base for peft to apply it to, so the adapter is
    merged into it and the full HF model is published."""
    over_megatron = bool((cfg.get("checkpointing") or {}).get("pretrained_checkpoint"))
    converted = paths.converted / f"{choice.path.name}-hf"
    shutil.rmtree(converted, ignore_errors=True)  # the converter refuses an existing dir
    argv = CV.lora_converter_argv(
        choice.path,
        converted,
        base_ckpt=CV.megatron_base_checkpoint(cfg),
        hf_model_name=str(cfg["policy"]["model_name"]),
        adapter_only=not over_megatron,
    )
    code = runner(argv, workdir)
    if code != 0:
        raise NemoRLFailed(f"convert_lora_to_hf.py failed on {choice.path} (exit {code})", code)
    if over_megatron:
        _copy_tree_contents(converted, out)
    else:
        for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
            shutil.copy2(converted / name, out / name)
    if (choice.path / "policy" / "tokenizer").is_dir():
        _copy_tree_contents(choice.path / "policy" / "tokenizer", out)
    return "hf" if over_megatron else "peft"


def heldout_for(ctx, model_dir: Path) -> dict[str, Any] | None:
    """Held-out accuracy of the published policy (an adapter: its chain merged), by the local
    engine's one definition. ``heldout.backend: vllm`` (the GPU profiles) draws the samples with
    vLLM, which the image has; else transformers does. The samples are published beside the
    weights (``heldout_samples.jsonl``), so evaluate reuses them when its settings match."""
    settings = ctx.settings.heldout
    if ctx.name not in POLICY_STAGES or not settings.enabled:
        return None
    from alignpipe.measure import heldout as H

    rows = H.heldout_rows(ctx, settings)
    system = ctx.system_prompt
    if H.drawing_backend(settings) == "vllm":
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        completions, tool_use = H.vllm_completions(ctx, model_dir, rows, settings, system), None
    else:
        from alignpipe.measure.logprobs import load_policy

        model, tokenizer = load_policy(model_dir)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        completions, tool_use = H.heldout_completions(model, tokenizer, rows, settings, system)
        settings = H.drawn_with(settings, "hf")
    key = H.sampling_key(rows, settings, system)
    held = H.HeldoutSamples(rows, completions, key, system=system, tool_use=tool_use)
    for name, text in H.samples_file(held).items():
        write_text_atomic(model_dir / name, text)
    return H.heldout_accuracy(tokenizer, rows, completions, tool_use)


def validation_answers(ctx, cfg: dict[str, Any]) -> int | None:
    """How many answers each of NeMo-RL's GRPO validations scores: ``validate()`` samples every
    prompt of the first ``max_val_samples // val_batch_size`` batches of the validation split
    once. None for a stage without GRPO validation data."""
    path = get_path(ctx.config, "data.validation.data_path")
    batch, most = get_path(cfg, "grpo.val_batch_size"), get_path(cfg, "grpo.max_val_samples")
    if not (path and batch and most):
        return None
    with (ctx.root / path).open() as f:
        rows = sum(1 for line in f if line.strip())
    return min(rows, int(most) // int(batch) * int(batch))


def adapter_record(ctx, out: Path) -> dict[str, Any]:
    """The published adapter's lineage (as the local engine records it): the policy it applies
    to, by repo-relative path (set in its adapter_config.json) and content hash, and its shape.
    The policy is the rendered ``policy.model_name`` input (or the adapter that replaces sft's
    Megatron checkpoint, ``start_from_published_adapter``), before any merge for NeMo-RL."""

    start = render_for(ctx)
    start_from_published_adapter(start)
    base = Path(get_path(start, "policy.model_name")).resolve()
    try:
        relative = base.relative_to(ctx.root.resolve()).as_posix()
    except ValueError as e:
        raise ConfigError(
            f"stage '{ctx.name}': policy.model_name {base} is outside the repository, so a LoRA adapter "
            "trained on it could not name its base; start LoRA from a pipeline model (models/...)"
        ) from e
    canonical_adapter(out, base=relative)
    config = json.loads((out / ADAPTER_CONFIG).read_text())
    return {
        "applies_to": {"path": relative, "hash": ctx.content_hash(base)},
        "peft_type": config.get("peft_type"),
        "rank": config.get("r"),
        "alpha": config.get("lora_alpha"),
    }


def _port(ctx, types: tuple[str, ...]):
    for port in ctx.contract.produces:
        if port.type in types:
            return port
    raise ConfigError(f"stages/{ctx.name}/stage.toml produces no output of type {' or '.join(types)}")


def publish(
    ctx,
    cfg: dict[str, Any],
    paths: RunPaths,
    *,
    runner: CommandRunner = run_command,
    workdir: Path | None = None,
) -> dict[str, Any]:
    """Publish the run's chosen checkpoint and metrics; returns the manifest."""
    workdir = workdir or nemo_rl_dir(ctx)
    ckpt = cfg.get("checkpointing") or {}
    choice = select_checkpoint(
        paths.checkpoints, ckpt.get("metric_name"), bool(ckpt.get("higher_is_better", True))
    )
    fmt = CV.checkpoint_format(choice.path)
    model_port = _port(ctx, ("checkpoint_hf", "checkpoint_megatron"))
    metrics_port = next((p for p in ctx.contract.produces if p.type == "dvclive"), None)
    print(
        f"nemo_rl: publishing {choice.path.name} ({choice.reason}, format {fmt}) -> {ctx.output(model_port.name)}"
    )

    with staged_dir(ctx.output(model_port.name)) as out:
        published = export_checkpoint(choice, fmt, out, cfg, paths, runner, workdir)
        is_hf = published != "megatron_bridge"
        is_lora = published == "peft"
        adapter = adapter_record(ctx, out) if is_lora else None
        if ctx.name == "rm" and is_hf:
            mark_sequence_classifier(out)
        heldout = heldout_for(ctx, out) if is_hf else None
        extra_summary = {"heldout": heldout} if heldout else None
        summary: dict[str, Any] = {}
        if metrics_port is not None:
            with staged_dir(ctx.output(metrics_port.name)) as mdir:
                answers = validation_answers(ctx, cfg)
                summary = import_metrics(ctx.name, paths.logs, mdir, extra_summary, cfg, answers)
                write_text_atomic(mdir / RESOLVED_CONFIG, ctx.resolved_config_yaml())
        elif heldout:
            summary = {"heldout": heldout}
        rendered = to_yaml(cfg, config_header(ctx))
        write_text_atomic(out / RESOLVED_CONFIG, ctx.resolved_config_yaml())
        write_text_atomic(out / NEMO_RL_CONFIG, rendered)
        manifest = write_manifest(
            out,
            type="checkpoint_lora" if is_lora else "checkpoint_hf" if is_hf else "checkpoint_megatron",
            format=published,
            stage=ctx.name,
            engine="nemo_rl",
            inputs=ctx.input_hashes,
            metrics=summary,
            image=ctx.runtime.get("image"),
            source_model=ctx.source_model,
            system_prompt=ctx.system_prompt,
            extra={
                **({"adapter": adapter} if adapter else {}),
                "nemo_rl": {
                    "version": "0.7.0",
                    "checkpoint": choice.path.name,
                    "step": choice.step,
                    "selected_by": choice.reason,
                    "checkpoint_format": fmt,
                    "entry": entry_argv(ctx.name, cfg, paths.config)[1:],
                },
            },
        )
    return manifest
