"""A NeMo-RL run's inputs, prepared before its entry script starts: the rendered config written
to the run's scratch dir, with what NeMo-RL cannot read directly made readable (a Megatron warm
start for a DTensor-only stage converted to HF; an adapter input, also one in place of sft's
Megatron checkpoint, merged with its chain; a Megatron stage's HF weights named by content, as
NeMo-RL caches their conversion by path; NeMo-Gym rows)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from alignpipe.adapters import is_adapter, merged_dir
from alignpipe.artifacts import write_text_atomic
from alignpipe.config import get_path
from alignpipe.context import scratch_root
from alignpipe.engines.nemo_rl import convert as CV
from alignpipe.engines.nemo_rl.programs import CommandRunner, NemoRLFailed
from alignpipe.engines.nemo_rl.render import RunPaths, config_header, render_for, to_yaml, uses_nemo_gym


def artifact_type(path: Path) -> str | None:
    manifest = Path(path) / "artifact.json"
    if not manifest.is_file():
        return None

    return json.loads(manifest.read_text()).get("type")


def convert_megatron_inputs(
    cfg: dict[str, Any], paths: RunPaths, runner: CommandRunner, workdir: Path
) -> None:
    """DTensor stages (rm, the RM env) need HF weights; a checkpoint_megatron input is converted first."""
    megatron_policy = bool(get_path(cfg, "policy.megatron_cfg.enabled", False))
    for key in ("policy.model_name", "env.reward_model.model_name"):
        value = get_path(cfg, key)
        if not value or (key == "policy.model_name" and megatron_policy):
            continue
        if artifact_type(Path(value)) != "checkpoint_megatron":
            continue
        out = paths.converted / Path(value).name
        if not (out / "config.json").is_file():
            shutil.rmtree(out, ignore_errors=True)
            argv = CV.converter_argv(Path(value), CV.MEGATRON, out)
            code = runner(argv, workdir)
            if code != 0:
                raise NemoRLFailed(f"converting the Megatron input {value} to HF failed (exit {code})", code)
        section = key.rsplit(".", 1)[0]
        node = cfg
        for part in section.split("."):
            node = node[part]
        node["model_name"] = str(out)
        if isinstance(node.get("tokenizer"), dict):
            # The Megatron export may not carry the tokenizer; the artifact does (policy/tokenizer).
            has_tokenizer = (out / "tokenizer_config.json").is_file()
            node["tokenizer"]["name"] = str(out if has_tokenizer else Path(value) / "policy" / "tokenizer")


def published_artifact(path: Path) -> Path | None:
    """The published artifact ``path`` lies in (``models/sft`` for ``models/sft/policy/weights``)."""
    for candidate in (Path(path), *Path(path).parents):
        if (candidate / "artifact.json").is_file():
            return candidate
    return None


def start_from_published_adapter(cfg: dict[str, Any]) -> None:
    """On default_megatron, dpo, rlvr and rlhf start from sft's Megatron checkpoint
    (``checkpointing.pretrained_checkpoint``). When sft trained a LoRA adapter instead (a
    ``checkpoint_lora``: HF PEFT, no Megatron weights), the stage starts from that policy as HF
    weights, its chain merged (``merge_adapter_inputs``), as on DTensor and the local engine."""
    pretrained = (cfg.get("checkpointing") or {}).get("pretrained_checkpoint")
    artifact = published_artifact(Path(pretrained["path"])) if pretrained else None
    if artifact is None or artifact_type(artifact) != "checkpoint_lora":
        return
    del cfg["checkpointing"]["pretrained_checkpoint"]
    cfg["policy"]["model_name"] = str(artifact)
    if isinstance(cfg["policy"].get("tokenizer"), dict):
        cfg["policy"]["tokenizer"]["name"] = str(artifact)  # published with the adapter


def merge_adapter_inputs(ctx, cfg: dict[str, Any], paths: RunPaths) -> None:
    """NeMo-RL loads ``policy.model_name`` (and the RM environment's model) as full HF weights
    only: a LoRA stage's adapter input (a ``checkpoint_lora``) is merged with its chain first,
    as the local engine's trainers do, into the run's scratch dir."""
    from alignpipe.measure.logprobs import LOCAL_DTYPE

    for key in ("policy.model_name", "env.reward_model.model_name"):
        value = get_path(cfg, key)
        if not value or not is_adapter(value):
            continue
        merged = merged_dir(Path(value), ctx.root, paths.converted / "merged", LOCAL_DTYPE)
        print(f"nemo_rl: {key} {value} is a LoRA adapter: merged with its chain -> {merged}")
        section = key.rsplit(".", 1)[0]
        node = cfg
        for part in section.split("."):
            node = node[part]
        node["model_name"] = str(merged)


# Links, under the scratch root, through which Megatron stages name their HF starting weights.
MEGATRON_HF_LINKS = "megatron-hf"


def key_megatron_conversion(ctx, cfg: dict[str, Any], paths: RunPaths) -> None:
    """NeMo-RL converts a Megatron stage's HF ``policy.model_name`` once and caches it by path
    (``<megatron_checkpoint_dir>/model_<path>``), reusing it whatever the directory holds later:
    a new starting model at models/base would train on the old one's weights. So the stage names
    its HF weights through a link keyed by their content (a merged chain: its chain key), which
    NeMo-RL converts once per content, and a LoRA run's adapter names that exact base."""
    if not get_path(cfg, "policy.megatron_cfg.enabled") or get_path(
        cfg, "checkpointing.pretrained_checkpoint"
    ):
        return
    model = Path(cfg["policy"]["model_name"])
    if not model.is_dir():
        return  # a Hub id: NeMo-RL's cache is keyed by the id, as the Hub's files are
    if model.parent == paths.converted / "merged":
        label = f"merged-{model.name}"  # merged_dir's name is already the chain's content key
    else:
        label = f"{model.name}-{ctx.content_hash(model).removesuffix('.dir')[:16]}"
    link = scratch_root(ctx.params) / MEGATRON_HF_LINKS / label
    link.parent.mkdir(parents=True, exist_ok=True)
    staging = link.with_name(f".{label}.{os.getpid()}")
    staging.unlink(missing_ok=True)
    staging.symlink_to(model.resolve(), target_is_directory=True)
    os.replace(staging, link)  # a merged chain is re-made in each run's scratch: point at this one
    cfg["policy"]["model_name"] = str(link)


def write_gym_data(ctx, cfg: dict[str, Any], paths: RunPaths) -> None:
    from alignpipe.engines.nemo_rl.nemo_gym_data import agent_ref, convert_file

    ref = agent_ref(ctx.settings.nemo_gym.default_agent_ref)
    for split in ("train", "validation"):
        src = get_path(ctx.config, f"data.{split}.data_path")
        if not src:
            continue
        count = convert_file(ctx.root / src, paths.gym_data / f"{split}.jsonl", ref)
        print(f"nemo_rl: {count} {split} rows -> {paths.gym_data / f'{split}.jsonl'} (NeMo-Gym format)")


def prepare(ctx, paths: RunPaths, runner: CommandRunner, workdir: Path) -> dict[str, Any]:
    cfg = render_for(ctx, paths.scratch)
    paths.scratch.mkdir(parents=True, exist_ok=True)
    convert_megatron_inputs(cfg, paths, runner, workdir)
    start_from_published_adapter(cfg)
    merge_adapter_inputs(ctx, cfg, paths)
    key_megatron_conversion(ctx, cfg, paths)
    if uses_nemo_gym(cfg):
        write_gym_data(ctx, cfg, paths)
    write_text_atomic(paths.config, to_yaml(cfg, config_header(ctx)))
    return cfg
