"""Artifacts: content hashes, ``artifact.json`` manifests, and atomic publishing.

Hashes use DVC 3's scheme (raw-byte md5 for files; for directories the md5 of the
sorted ``[{"md5", "relpath"}]`` JSON plus ``.dir``), so the lineage recorded in a
manifest can be matched against ``dvc.lock`` by eye or by script.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

MANIFEST = "artifact.json"
# Stages whose floats no CPU kernel computes: prep (none), base (a seeded random draw, or a copy
# of the starting model), convert (a copy of the policy's weights). The same bytes on any CPU.
KERNEL_FREE_STAGES = {"prep", "base", "convert"}
RESOLVED_CONFIG = "resolved_config.yaml"

# Artifact types, Nemotron steps vocabulary (plus the DVCLive directory). checkpoint_lora: a PEFT
# adapter; its manifest's adapter.applies_to names the exact policy (path and hash) it goes on.
ARTIFACT_TYPES = {
    "training_jsonl",
    "checkpoint_hf",
    "checkpoint_lora",
    "checkpoint_megatron",
    "dvclive",
    "report",
}


def md5_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.md5()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def dvc_hash(path: Path) -> str:
    """DVC 3 hash of a file or directory (``<md5>`` or ``<md5>.dir``)."""
    path = Path(path)
    if path.is_file():
        return md5_file(path)
    if not path.is_dir():
        raise FileNotFoundError(f"cannot hash {path}: it does not exist")
    entries = [
        {"md5": md5_file(p), "relpath": p.relative_to(path).as_posix()}
        for p in sorted(path.rglob("*"))
        if p.is_file()
    ]
    entries.sort(key=lambda e: e["relpath"])
    text = json.dumps(entries, sort_keys=True)
    return hashlib.md5(text.encode()).hexdigest() + ".dir"


def package_hash(package: Path) -> str:
    """md5 over a Python package's sources (paths and bytes of its ``*.py`` files): equal
    exactly when two copies would run the same code, whatever their bytecode caches hold."""
    digest = hashlib.md5()
    for path in sorted(Path(package).rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _as_if_created_normally(path: Path | str, directory: bool = False) -> None:
    """mkstemp/mkdtemp create 0600/0700 entries; published artifacts follow the umask like any
    other file, so a shared DVC cache or a teammate can read them."""
    os.chmod(path, (0o777 if directory else 0o666) & ~_umask())


def shareable(path: Path | str) -> None:
    """Give a file another library wrote privately the permissions of any published file."""
    _as_if_created_normally(path)


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write JSON through a temp file and rename, so readers never see half a file."""
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def write_text_atomic(path: Path, text: str) -> None:
    """Write text through a temp file and rename, so readers never see half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        _as_if_created_normally(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def staged_dir(final: Path) -> Iterator[Path]:
    """Yield an empty sibling directory; on success it replaces ``final`` in one rename.

    On any exception the staging directory is deleted and ``final`` is left as it was,
    so a failed or interrupted stage never publishes half an artifact.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.staging-", dir=final.parent))
    _as_if_created_normally(staging, directory=True)
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    publish_dir(staging, final)


def publish_dir(staging: Path, final: Path) -> None:
    """Move a finished directory into place, replacing what was there."""
    old = None
    if final.exists() or final.is_symlink():
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        os.replace(final, old)
    os.replace(staging, final)
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink()


def lineage(inputs: dict[str, Path]) -> dict[str, dict[str, str]]:
    return {name: {"path": str(p), "hash": dvc_hash(p)} for name, p in inputs.items() if Path(p).exists()}


def write_manifest(
    directory: Path,
    *,
    type: str,
    format: str,
    stage: str,
    engine: str,
    inputs: dict[str, dict[str, str]] | None = None,
    metrics: dict[str, Any] | None = None,
    image: str | None = None,
    source_model: dict[str, Any] | None = None,
    system_prompt: str | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write ``artifact.json``: what this is, who made it, from what, and how good it is."""
    if type not in ARTIFACT_TYPES:
        raise ValueError(f"unknown artifact type '{type}'; expected one of {sorted(ARTIFACT_TYPES)}")
    manifest = {
        "type": type,
        "format": format,
        "stage": stage,
        "engine": engine,
        "image": image,
        "inputs": inputs or {},
        "metrics": metrics or {},
        # No timestamp: artifact.json is part of a DVC output, and a changing byte would change
        # every output hash downstream, so dvc.lock could never be reproduced (CI checks it is).
        "alignpipe_version": _version(),
        # The code that ran is the repository's (alignpipe.stage.check_running_code refuses any
        # other), whose files dvc.lock hashes as this stage's deps.
        "code": "repository",
    }
    # The slurm and ray launchers export the scheduler's job id ("slurm:123", "ray:<id>").
    if os.environ.get("ALIGNPIPE_JOB_ID"):
        manifest["job"] = os.environ["ALIGNPIPE_JOB_ID"]
    if source_model:  # the starting model this descends from (models/base's; starting_model.py)
        manifest["source_model"] = source_model
    if system_prompt:  # the system turn a policy was trained after: measure and serve it with it
        manifest["system_prompt"] = system_prompt
    if engine == "local" and stage not in KERNEL_FREE_STAGES and "torch" in sys.modules:
        from alignpipe.cpu_kernels import chosen  # the kernels that computed its floats decide its bytes

        manifest["cpu_kernels"] = chosen()
    if extra:
        manifest.update(extra)
    write_json_atomic(Path(directory) / MANIFEST, manifest)
    return manifest


def read_manifest(directory: Path) -> dict[str, Any]:
    path = Path(directory) / MANIFEST
    with path.open() as f:
        return json.load(f)


def _version() -> str:
    from alignpipe import __version__

    return __version__
