"""The starting model, ``model.name`` in conf/config.yaml: every policy descends from it.

* null: the tiny model built offline (``alignpipe.tiny``);
* a local Hugging Face directory: copied as it is;
* a Hub id: read offline from the Hugging Face cache (``HF_HOME`` / ``HF_HUB_CACHE``, where
  ``hf download`` puts it) at ``model.revision``; fetched into that cache first only when
  ``model.download`` allows it. Either way recorded with the commit the revision resolved to.

Only the ``base`` stage materialises it, into ``models/base``, a DVC output that every later
stage loads (on both engines): the starting model is content-hashed like any other artifact,
and no other stage touches the Hub.
"""

from __future__ import annotations

import fnmatch
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from alignpipe.artifacts import dvc_hash
from alignpipe.errors import ConfigError

# What `base` copies from a model directory: the files `from_pretrained` reads. Training
# state (optimizer.pt, trainer_state.json ...) and hidden entries (.git, .cache) stay behind.
SKIP = {"optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json", "training_args.bin"}
# What base never takes from a Hub snapshot: other weight formats (safetensors is what every
# stage and both engines load) and hidden entries.
HUB_SKIP = ["*.pt", "*.pth", "*.bin", "*.msgpack", "*.h5", "*.onnx*", "*.gguf", ".*"]


@dataclass(frozen=True)
class ModelSource:
    name: str | None
    revision: str | None = None
    download: bool = False

    @property
    def kind(self) -> str:
        if self.name is None:
            return "tiny"
        return "local" if _looks_local(self.name) else "hub"


def _looks_local(name: str) -> bool:
    # A Hub id is "org/name" (or "name"); anything absolute, relative-looking or existing is a path.
    return Path(name).expanduser().exists() or name.startswith(("/", "./", "../", "~"))


def model_source(params: dict[str, Any]) -> ModelSource:
    """``model`` from params.yaml, checked."""
    section = params.get("model") or {}
    if not isinstance(section, dict):
        raise ConfigError(
            "params.yaml: 'model' must be a mapping with name, revision, download (conf/config.yaml)"
        )
    name = section.get("name")
    if name is not None and (not isinstance(name, str) or not name.strip()):
        raise ConfigError(
            f"params.yaml: model.name must be null (the tiny model), a local Hugging Face directory "
            f"or a Hub id such as HuggingFaceTB/SmolLM2-135M-Instruct; got {name!r}"
        )
    if name is not None and _looks_local(name):
        check_dep(name, section.get("dep"))
    revision = section.get("revision")
    return ModelSource(name=name, revision=None if revision is None else str(revision),
                       download=bool(section.get("download", False)))  # fmt: skip


def check_dep(name: str, dep: str | None) -> None:
    """``model.dep`` (what DVC hashes; conf/config.yaml) must name the same directory as
    ``model.name``, or DVC would not see edits to the model: params.yaml was edited by hand."""
    if dep is not None and Path(dep).expanduser().resolve() == Path(name).expanduser().resolve():
        return
    raise ConfigError(
        f"params.yaml: model.dep is {dep!r} but model.name is the directory {name}, so DVC would not "
        f"hash the model; set model.name through DVC (dvc exp run -S model.name={name}) or in "
        f"conf/config.yaml followed by `alignpipe params`, which derive model.dep from it"
    )


def copy_local(src: Path, dst: Path, skip: list[str] = ()) -> list[str]:
    """Copy a local model directory's files into ``dst``; returns the names copied."""
    if not src.is_dir():
        raise ConfigError(
            f"params.yaml: model.name {src} is not a directory (a Hugging Face model directory is)"
        )
    if not (src / "config.json").is_file():
        raise ConfigError(
            f"params.yaml: model.name {src} holds no config.json; point it at a Hugging Face model "
            f"directory (what save_pretrained writes, or a Hub snapshot)"
        )
    copied = []
    for item in sorted(src.iterdir()):
        if item.name.startswith(".") or item.name in SKIP or not item.is_file():
            continue
        if any(fnmatch.fnmatch(item.name, pattern) for pattern in skip):
            continue
        shutil.copyfile(item, dst / item.name)  # follows links: Hub snapshots are symlinks into blobs
        copied.append(item.name)
    return copied


def hub_cache() -> str:
    """The Hugging Face cache huggingface_hub reads (``HF_HUB_CACHE``, else ``$HF_HOME/hub``)."""
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def snapshot(source: ModelSource) -> Path:
    """The Hub model's snapshot directory in the Hugging Face cache, at ``model.revision``.

    Offline, the cache must already hold it (``hf download``, or gpu.yml's runner cache); with
    ``model.download`` huggingface_hub first fetches what the cache lacks. The directory's name
    is the commit the revision resolved to.
    """
    from huggingface_hub import snapshot_download

    revision = source.revision or "main"
    if not source.download:
        try:
            return Path(snapshot_download(source.name, revision=source.revision, local_files_only=True))
        except Exception as e:  # not cached (at that revision): say where we looked and both fixes
            raise ConfigError(
                f"params.yaml: model.name {source.name} is a Hub id and the Hugging Face cache "
                f"{hub_cache()} holds no snapshot of it at revision {revision} ({type(e).__name__}). "
                f"Download it there (`hf download {source.name} --revision {revision}`, with HF_HOME or "
                f"HF_HUB_CACHE set as the stages will see it), or let base fetch it: set "
                f"model.download=true (dvc exp run -S model.download=true), or set model.name to a "
                f"local directory"
            ) from e
    try:
        return Path(snapshot_download(source.name, revision=source.revision, ignore_patterns=HUB_SKIP))
    except Exception as e:  # offline, gated, unknown id or revision: say which and how to fix it
        raise ConfigError(
            f"params.yaml: model.name {source.name} (revision {revision}) could not be fetched from the "
            f"Hugging Face Hub into {hub_cache()}: {type(e).__name__}: {e}. Check the id and revision, "
            f"HF_TOKEN for gated models, and network access; or set model.name to a local directory"
        ) from e


def copy_snapshot(source: ModelSource, src: Path, dst: Path) -> str:
    """Copy the Hub model's cached snapshot ``src`` (``snapshot``) into ``dst``; returns its commit."""
    if not any(src.glob("*.safetensors")):
        raise ConfigError(
            f"params.yaml: model.name {source.name}: the cached snapshot {src} holds no *.safetensors "
            f"weights (every stage loads safetensors); download them: "
            f"hf download {source.name} --revision {source.revision or 'main'} --include '*.safetensors'"
        )
    copy_local(src, dst, skip=HUB_SKIP)
    return src.name


def lineage(source: ModelSource, src_dir: Path, commit: str | None = None) -> dict[str, Any]:
    """What artifact.json and model cards say about the starting model."""
    if source.kind == "local":
        return {
            "kind": "local",
            "name": str(Path(source.name).expanduser().resolve()),
            "hash": dvc_hash(src_dir),
        }
    return {"kind": "hub", "name": f"{source.name}@{commit}", "revision": source.revision or "main",
            "commit": commit, "hash": dvc_hash(src_dir)}  # fmt: skip


def ensure_pad_token(tokenizer) -> bool:
    """Batching needs a pad token; many instruct models ship none. Fall back to EOS (what TRL
    and NeMo-RL do), once, here, so every later stage and evaluate pad the same way."""
    if tokenizer.pad_token is not None:
        return False
    if tokenizer.eos_token is None:
        raise ConfigError(
            "the starting model's tokenizer has neither a pad nor an eos token; set one in its tokenizer_config.json"
        )
    tokenizer.pad_token = tokenizer.eos_token
    return True


def count_parameters(model_dir: Path) -> int:
    """Parameters in the safetensors shards, from their headers (no weights loaded)."""
    from safetensors import safe_open

    total = 0
    for shard in sorted(model_dir.glob("*.safetensors")):
        with safe_open(shard, framework="pt") as f:
            for key in f.keys():
                n = 1
                for dim in f.get_slice(key).get_shape():
                    n *= dim
                total += n
    return total
