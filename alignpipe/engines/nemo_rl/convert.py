"""NeMo-RL checkpoint formats and the converter command for each (reference: nemo-rl.md §3-4).

``checkpoint_format(step_dir)`` tells what a ``step_N`` directory holds;
``converter_argv(checkpoint_dir, fmt, out_dir)`` returns the exact command (run with cwd
= the NeMo-RL checkout, inside the image) that turns it into a Hugging Face directory, or
``[]`` when no converter is needed (DTensor V2 consolidated safetensors are already HF and
are copied). Both converters refuse an existing output directory, so ``out_dir`` must not
exist yet.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from alignpipe.errors import AlignpipeError

DCP_TO_HF = "examples/converters/convert_dcp_to_hf.py"
MEGATRON_TO_HF = "examples/converters/convert_megatron_to_hf.py"
LORA_TO_HF = "examples/converters/convert_lora_to_hf.py"

# Formats of policy/weights, by backend.
HF_CONSOLIDATED = "hf_consolidated"  # DTensor V2 + save_consolidated: weights/model/consolidated
DCP = "dcp"  # DTensor V1 (or V2 with model_save_format torch_save): torch DCP .distcp + .metadata
MEGATRON = "megatron"  # Megatron-Bridge torch_dist: weights/iter_0000000/
# DTensor V2 with lora_cfg.enabled: Automodel's Checkpointer writes the adapter alone as an HF
# PEFT directory (weights/model/adapter_model.safetensors + adapter_config.json), whatever
# model_save_format and save_consolidated say; no converter reads or merges it (peft does).
PEFT = "peft"
# Megatron with megatron_cfg.peft.enabled: weights/iter_0000000 holds the adapter alone
# (Megatron-Bridge saves only the adapter keys); convert_lora_to_hf.py reads it together with
# the Megatron checkpoint NeMo-RL trained it on (megatron_base_checkpoint).
MEGATRON_LORA = "megatron_lora"
FORMATS = (HF_CONSOLIDATED, DCP, MEGATRON, PEFT, MEGATRON_LORA)


class CheckpointFormatError(AlignpipeError):
    pass


def step_config(step_dir: Path) -> dict:
    path = Path(step_dir) / "config.yaml"
    if not path.is_file():
        raise CheckpointFormatError(f"{path} is missing: not a NeMo-RL checkpoint (step_N/config.yaml)")
    return yaml.safe_load(path.read_text()) or {}


def megatron_iter_dir(weights: Path) -> Path:
    """The ``iter_*`` directory Megatron-Bridge wrote (NeMo-RL always writes iter_0000000)."""
    iters = sorted(p for p in Path(weights).glob("iter_*") if p.is_dir())
    if not iters:
        raise CheckpointFormatError(f"{weights} has no iter_* directory: not a Megatron checkpoint")
    return iters[-1]


def checkpoint_format(step_dir: Path) -> str:
    """What ``step_dir/policy/weights`` holds, from the saved config and the files on disk."""
    step_dir = Path(step_dir)
    cfg = step_config(step_dir)
    policy = cfg.get("policy") or {}
    weights = step_dir / "policy" / "weights"
    megatron = policy.get("megatron_cfg") or {}
    if megatron.get("enabled"):
        megatron_iter_dir(weights)
        return MEGATRON_LORA if (megatron.get("peft") or {}).get("enabled") else MEGATRON
    if (weights / "model" / "adapter_model.safetensors").is_file():
        return PEFT
    if (weights / "model" / "consolidated").is_dir():
        return HF_CONSOLIDATED
    if (weights / ".metadata").is_file() or (weights / "model" / ".metadata").is_file():
        return DCP
    v2 = bool((policy.get("dtensor_cfg") or {}).get("_v2"))
    raise CheckpointFormatError(
        f"{weights}: no consolidated HF dir and no DCP .metadata. "
        + (
            "A DTensor V2 run with model_save_format 'safetensors' needs checkpointing.save_consolidated: true "
            "(or model_save_format: torch_save) to be exportable."
            if v2
            else "The checkpoint looks incomplete."
        )
    )


def dcp_weights_path(step_dir: Path) -> Path:
    """``--dcp-ckpt-path``: ``policy/weights`` for both V1 (``.metadata`` there) and V2
    torch_save (``.metadata`` in ``model/``, which the converter looks into itself)."""
    weights = Path(step_dir) / "policy" / "weights"
    return weights


# The image's project venv (/opt/nemo_rl_venv, first on PATH) ends its build with a plain
# `uv sync --all-groups`: no mcore extra, so no Megatron. Megatron code runs in the venv
# NeMo-RL prefetches for its Megatron worker; in the container, prefetch_venvs.py puts a
# wrapper for it on PATH (`python-<WorkerClass>`, nemo_rl/utils/prefetch_venvs.py).
MCORE_PYTHON = "python-MegatronPolicyWorker"


def converter_argv(
    checkpoint_dir: Path,
    fmt: str,
    out_dir: Path,
    *,
    python: str | None = None,
    hf_model_name: str | None = None,
) -> list[str]:
    """The command that writes ``out_dir`` as a Hugging Face model from ``checkpoint_dir`` (a step_N dir).

    * ``dcp``: ``convert_dcp_to_hf.py --config step_N/config.yaml --dcp-ckpt-path step_N/policy/weights
      --hf-ckpt-path OUT`` (argparse, no overrides; writes pytorch_model.bin + config + tokenizer).
    * ``megatron``: ``convert_megatron_to_hf.py --config step_N/config.yaml --megatron-ckpt-path
      step_N/policy/weights/iter_0000000 --hf-ckpt-path OUT [--hf-model-name NAME]`` (CPU, gloo).
      Upstream documents ``uv run --extra mcore python ...``; in the image that is the prefetched
      Megatron worker venv, ``MCORE_PYTHON`` (uv would re-sync /opt/nemo_rl_venv instead).
    * ``hf_consolidated``: no converter (``[]``); copy ``policy/weights/model/consolidated`` and
      ``policy/tokenizer``.
    * ``peft``: no converter (``[]``); the adapter in ``policy/weights/model`` is published as it is.
    """
    step = Path(checkpoint_dir)
    config = str(step / "config.yaml")
    if fmt == DCP:
        return [
            python or "python",
            DCP_TO_HF,
            "--config",
            config,
            "--dcp-ckpt-path",
            str(dcp_weights_path(step)),
            "--hf-ckpt-path",
            str(out_dir),
        ]
    if fmt == MEGATRON:
        argv = [
            python or MCORE_PYTHON,
            MEGATRON_TO_HF,
            "--config",
            config,
            "--megatron-ckpt-path",
            str(megatron_iter_dir(step / "policy" / "weights")),
            "--hf-ckpt-path",
            str(out_dir),
        ]
        if hf_model_name:
            argv += ["--hf-model-name", hf_model_name]
        return argv
    if fmt in (HF_CONSOLIDATED, PEFT):
        return []
    if fmt == MEGATRON_LORA:
        raise CheckpointFormatError(
            "a Megatron LoRA checkpoint holds the adapter alone: convert it with lora_converter_argv, "
            "which names its base"
        )
    raise CheckpointFormatError(f"unknown checkpoint format '{fmt}'; expected one of {', '.join(FORMATS)}")


def lora_converter_argv(
    checkpoint_dir: Path,
    out_dir: Path,
    *,
    base_ckpt: Path,
    hf_model_name: str,
    adapter_only: bool,
    python: str | None = None,
) -> list[str]:
    """``convert_lora_to_hf.py`` on a Megatron LoRA ``step_N``: the adapter alone as an HF PEFT
    directory (``adapter_only``: adapter_config.json + adapter_model.safetensors, float32), or
    merged into its base as a full HF model. Megatron code, so it runs in ``MCORE_PYTHON``."""
    argv = [
        python or MCORE_PYTHON,
        LORA_TO_HF,
        "--base-ckpt",
        str(base_ckpt),
        "--adapter-ckpt",
        str(megatron_iter_dir(Path(checkpoint_dir) / "policy" / "weights")),
        "--hf-model-name",
        hf_model_name,
        "--hf-ckpt-path",
        str(out_dir),
    ]
    return argv + ["--adapter-only"] if adapter_only else argv


def megatron_checkpoint_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """Where NeMo-RL caches a Hugging Face model converted for Megatron
    (``nemo_rl.models.policy.utils.get_megatron_checkpoint_dir``)."""
    for value, tail in (
        (environ.get("NRL_MEGATRON_CHECKPOINT_DIR"), ()),
        (environ.get("HF_HOME"), ("nemo_rl",)),
    ):
        if value and value.strip():
            return Path(value, *tail)
    return Path(os.path.expanduser("~"), ".cache", "huggingface", "nemo_rl")


def megatron_base_checkpoint(cfg: dict[str, Any], environ: Mapping[str, str] = os.environ) -> Path:
    """The iteration directory NeMo-RL v0.7.0 loads as a Megatron LoRA run's base weights
    (``nemo_rl.models.megatron.setup.validate_model_paths``): ``checkpointing.pretrained_checkpoint``
    (format megatron_bridge) resolved to its ``iter_*``, else its cached conversion of
    ``policy.model_name``, ``<megatron_checkpoint_dir>/<name>/iter_0000000``."""
    policy = cfg.get("policy") or {}
    pretrained = policy.get("pretrained_checkpoint") or (cfg.get("checkpointing") or {}).get(
        "pretrained_checkpoint"
    )
    if pretrained:
        if pretrained.get("format") != "megatron_bridge":
            raise CheckpointFormatError(
                f"pretrained_checkpoint format '{pretrained.get('format')}': alignpipe exports Megatron LoRA "
                "only over a megatron_bridge base (the format its own Megatron checkpoints have)"
            )
        path = Path(pretrained["path"])
        if (path / "run_config.yaml").is_file():
            return path
        tracker = path / "latest_checkpointed_iteration.txt"
        if tracker.is_file():
            iteration = tracker.read_text().strip()
            return path / ("release" if iteration == "release" else f"iter_{int(iteration):07d}")
        return megatron_iter_dir(path)
    name = str(policy["model_name"])
    subdir = f"model_{name.replace('/', '_')}" if os.path.exists(name) else name
    overrides = policy.get("hf_config_overrides") or {}
    if overrides:
        canonical = json.dumps(overrides, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        subdir += "__hfovr_" + hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:12]
    return megatron_checkpoint_dir(environ) / subdir / "iter_0000000"
