"""LoRA adapters as checkpoints: which policy an adapter applies to, and the full model it
stands for.

A LoRA stage publishes a PEFT adapter directory (``adapter_config.json`` and
``adapter_model.safetensors``: what peft's ``PeftModel`` and vLLM's ``--enable-lora`` load) whose
``base_model_name_or_path`` is the repo-relative directory of the policy it was trained on. That
policy may be an adapter too (a LoRA sft, then a LoRA dpo on it), so an adapter stands for a
chain: a full checkpoint at the root, then each adapter merged in order. Whatever needs a full
model (the next trainer, convert) asks :func:`merged_dir`, which merges the chain once with peft's
``merge_and_unload`` into a cache outside the DVC outputs, keyed by every directory's content.
A merged chain holds full weights (float32: 4 bytes per parameter), so one unused for
``MERGED_KEEP_DAYS`` is deleted when another is merged.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from pathlib import Path

from alignpipe.artifacts import dvc_hash, shareable, staged_dir, write_text_atomic
from alignpipe.errors import ConfigError

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# An adapter on an adapter on ... : far beyond any pipeline's depth, so a loop is named, not followed.
MAX_CHAIN = 16
# A merged chain not used for this long is deleted when the next one is merged: an experiment
# sweep reuses its chains within hours, and each is a full float32 copy of the model.
MERGED_KEEP_DAYS = 7


def is_adapter(directory: Path | str) -> bool:
    return (Path(directory) / ADAPTER_CONFIG).is_file()


def wildcard_match(pattern: str, name: str) -> bool:
    """NeMo Automodel's module pattern (what NeMo-RL's ``lora_cfg.target_modules`` means): ``*``
    after a dot spans any run of characters (dots included), as does a bare ``*``; the whole
    full name must match."""
    regex = re.sub(r"(?<!\.)\*", ".*", pattern)
    regex = regex.replace(".*", "(.*)")
    return re.fullmatch(regex, name) is not None


def canonical_adapter(out: Path, base: str | None = None) -> None:
    """A published adapter directory, made the same bytes on every run. peft lists
    target_modules in set order (which varies with PYTHONHASHSEED) and adds a template README.md
    naming the base by absolute path (the manifest carries the lineage); weights are written
    0600 (published files follow the umask). ``base``: the repo-relative policy it applies to,
    for adapter_config.json's ``base_model_name_or_path``."""
    config = out / ADAPTER_CONFIG
    data = json.loads(config.read_text())
    if isinstance(data.get("target_modules"), list):
        data["target_modules"] = sorted(data["target_modules"])
    if base is not None:
        data["base_model_name_or_path"] = base
    write_text_atomic(config, json.dumps(data, indent=2, sort_keys=True) + "\n")
    (out / "README.md").unlink(missing_ok=True)
    shareable(out / ADAPTER_WEIGHTS)


def adapter_base(directory: Path | str, root: Path) -> Path:
    """The directory (under ``root``) that the adapter in ``directory`` applies to."""
    path = Path(directory) / ADAPTER_CONFIG
    try:
        base = json.loads(path.read_text()).get("base_model_name_or_path")
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e}); re-run the stage that published it") from e
    if not base:
        raise ConfigError(f"{path}: base_model_name_or_path is empty, so the adapter's base is unknown")
    found = (root / base).resolve()
    if not found.is_dir():
        raise ConfigError(
            f"{path}: base_model_name_or_path '{base}' is not a directory under {root}; "
            f"the adapter applies to it (run `dvc pull {base}` or `dvc repro` for the stage that makes it)"
        )
    return found


def adapter_chain(directory: Path | str, root: Path) -> list[Path]:
    """``[full checkpoint, adapter, ..., directory]``: what ``directory`` stands for, root first."""
    chain = [Path(directory).resolve()]
    while is_adapter(chain[0]):
        if len(chain) > MAX_CHAIN:
            raise ConfigError(f"{directory}: more than {MAX_CHAIN} adapters in a chain (a loop?): {chain}")
        chain.insert(0, adapter_base(chain[0], root))
    return chain


def chain_key(chain: list[Path]) -> str:
    """Content key of a chain: equal exactly when every directory in it holds the same bytes."""
    hashes = [dvc_hash(d) for d in chain]
    return hashlib.md5(json.dumps(hashes).encode()).hexdigest()[:16]


def merge_chain(chain: list[Path], dtype: str):
    """The full causal LM a chain stands for: the root checkpoint with each adapter merged in."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(chain[0], local_files_only=True, dtype=dtype)
    for adapter in chain[1:]:
        model = PeftModel.from_pretrained(model, adapter, local_files_only=True).merge_and_unload()
    return model


def merged_dir(directory: Path | str, root: Path, cache: Path, dtype: str) -> Path:
    """A full HF directory for ``directory``: itself when it holds full weights, else its
    chain merged (once: later calls find it in ``cache``) with the adapter's tokenizer."""
    directory = Path(directory)
    if not is_adapter(directory):
        return directory
    chain = adapter_chain(directory, root)
    out = Path(cache) / chain_key(chain)
    if (out / "config.json").is_file():
        os.utime(out)  # used: kept by prune_merged
        return out
    from transformers import AutoTokenizer

    model = merge_chain(chain, dtype)
    with staged_dir(out) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        AutoTokenizer.from_pretrained(directory, local_files_only=True).save_pretrained(tmp)
    prune_merged(Path(cache), keep=out)
    return out


def prune_merged(cache: Path, keep: Path, now: float | None = None) -> list[Path]:
    """Delete the merged chains (and interrupted merges) in ``cache`` unused for ``MERGED_KEEP_DAYS``."""
    cutoff = (now or time.time()) - MERGED_KEEP_DAYS * 86400
    stale = [d for d in cache.iterdir() if d.is_dir() and d != keep and d.stat().st_mtime < cutoff]
    for entry in stale:
        shutil.rmtree(entry, ignore_errors=True)
    return stale
