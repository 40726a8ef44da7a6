"""Stage configuration in NeMo-RL's schema.

A stage's effective config is built in three layers, lowest first:

1. ``stages/<stage>/config/<profile>.yaml`` with NeMo-RL's ``defaults:`` inheritance
   (string or list of paths relative to the child file, parents merged in order,
   child last, a section with ``_override_: true`` replaces instead of merging);
2. the stage's knobs from ``params.yaml`` (``params[<stage>]``), written with NeMo-RL
   key paths, so ``dvc exp run -S rlvr.grpo.num_generations_per_prompt=16`` means
   NeMo-RL's ``grpo.num_generations_per_prompt=16``;
3. the pipeline-wide ``seed`` written into the algorithm section (``grpo.seed`` ...).

Interpolations (``${policy.model_name}``, ``${mul:a,b}``) resolve last, as in NeMo-RL.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf

from alignpipe import settings as S
from alignpipe.errors import ConfigError

STAGES_DIR = "stages"
PARAMS_FILE = "params.yaml"


def _register_resolvers() -> None:
    # The same resolvers NeMo-RL's run_grpo.py / run_sft.py register.
    for name, fn in {
        "mul": lambda a, b: a * b,
        "div": lambda a, b: a / b if isinstance(a, float) or isinstance(b, float) else a // b,
        "max": lambda a, b: max(a, b),
    }.items():
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)


_register_resolvers()


def repo_root(start: Path | None = None) -> Path:
    """The directory holding dvc.yaml: $ALIGNPIPE_ROOT, else the nearest parent of the working
    directory, else $DVC_ROOT.

    $DVC_ROOT comes last on purpose: `dvc exp run --queue/--temp` runs stages in a copy under
    .dvc/tmp/exps/ but sets DVC_ROOT to the *parent* workspace (for DVCLive), so trusting it
    would make every queued experiment write into the user's workspace.
    """
    if os.environ.get("ALIGNPIPE_ROOT"):
        return Path(os.environ["ALIGNPIPE_ROOT"]).resolve()
    here = (start or Path.cwd()).resolve()
    for candidate in (here, *here.parents):
        if (candidate / "dvc.yaml").is_file() and (candidate / STAGES_DIR).is_dir():
            return candidate
    if os.environ.get("DVC_ROOT"):
        return Path(os.environ["DVC_ROOT"]).resolve()
    raise ConfigError(
        f"no dvc.yaml with a stages/ folder above {here}; run alignpipe from inside the repository"
    )


def load_params(root: Path) -> dict[str, Any]:
    path = root / PARAMS_FILE
    try:
        with path.open() as f:
            params = yaml.safe_load(f) or {}
    except FileNotFoundError as e:
        raise ConfigError(f"{path} is missing; it selects the profile and holds every stage's knobs") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from e
    if not isinstance(params, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, found {type(params).__name__}")
    return params


def compose_params_text(root: Path, overrides: list[str] | None = None) -> str:
    """params.yaml as `dvc exp run` composes it from conf/ (DVC's Hydra support), ``-S``-style
    overrides included; the committed params.yaml must equal this with no overrides."""
    import tempfile

    from dvc.utils.hydra import compose_and_dump

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / PARAMS_FILE
        compose_and_dump(out, str(root / "conf"), None, "config", str(root), list(overrides or []))
        return out.read_text()


# --------------------------------------------------------------------------- contracts


@dataclass(frozen=True)
class Port:
    """One input or output of a stage, as declared in stage.toml."""

    name: str
    type: str
    path: str
    description: str = ""
    required: bool = True


@dataclass(frozen=True)
class StageContract:
    """What a stage consumes and produces (``stages/<stage>/stage.toml``)."""

    name: str
    description: str
    algorithm: str | None  # NeMo-RL top-level section that carries seed and step limits
    engines: tuple[str, ...]
    nemo_rl_entry: str | None
    consumes: tuple[Port, ...]
    produces: tuple[Port, ...]
    parameters: tuple[dict, ...] = field(default_factory=tuple)
    # A foreach stage's items -> the directory each reads (``{source_dir}`` in port paths).
    sources: dict[str, str] = field(default_factory=dict)

    def port(self, name: str) -> Port:
        for p in (*self.consumes, *self.produces):
            if p.name == name:
                return p
        raise KeyError(f"stage '{self.name}' has no input or output named '{name}'")


def stage_names(root: Path) -> list[str]:
    return sorted(p.parent.name for p in (root / STAGES_DIR).glob("*/stage.toml"))


def load_contract(root: Path, stage: str) -> StageContract:
    path = root / STAGES_DIR / stage / "stage.toml"
    if not path.is_file():
        known = ", ".join(stage_names(root)) or "none"
        raise ConfigError(f"unknown stage '{stage}': {path} does not exist (known stages: {known})")
    with path.open("rb") as f:
        try:
            doc = tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: {e}") from e
    head = doc.get("stage", {})

    def ports(key: str) -> tuple[Port, ...]:
        out = []
        for i, entry in enumerate(doc.get(key, [])):
            missing = [k for k in ("name", "type", "path") if k not in entry]
            if missing:
                raise ConfigError(f"{path}: [[{key}]] entry {i} lacks {', '.join(missing)}")
            out.append(
                Port(
                    **{k: entry[k] for k in ("name", "type", "path", "description", "required") if k in entry}
                )
            )
        return tuple(out)

    return StageContract(
        name=head.get("name", stage),
        description=head.get("description", ""),
        algorithm=head.get("algorithm"),
        engines=tuple(head.get("engines", ["local", "nemo_rl"])),
        nemo_rl_entry=head.get("nemo_rl_entry"),
        consumes=ports("consumes"),
        produces=ports("produces"),
        parameters=tuple(doc.get("parameters", [])),
        sources={str(k): str(v) for k, v in (doc.get("sources") or {}).items()},
    )


def with_source(contract: StageContract, source: str | None) -> StageContract:
    """Fill ``{source}`` in port paths: one contract serves every item of a DVC ``foreach``
    stage (``convert@dpo`` runs ``alignpipe run convert --source dpo``: models/dpo -> exports/dpo)."""
    import dataclasses
    import re

    templated = any("{source" in p.path for p in (*contract.consumes, *contract.produces))
    if not templated:
        if source:
            raise ConfigError(
                f"stage '{contract.name}' takes no --source (its stage.toml paths have no {{source}})"
            )
        return contract
    if not source:
        raise ConfigError(
            f"stage '{contract.name}' needs --source NAME (the pipeline stage whose output it reads, "
            f"e.g. `alignpipe run {contract.name} --source dpo`)"
        )
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_-]*", source):
        raise ConfigError(f"--source '{source}': expected a stage name (letters, digits, '_' or '-')")
    if contract.sources and source not in contract.sources:
        raise ConfigError(
            f"stage '{contract.name}' --source '{source}': not one of its sources "
            f"{', '.join(contract.sources)} (stages/{contract.name}/stage.toml [sources])"
        )
    source_dir = contract.sources.get(source, "")

    def fill(ports: tuple[Port, ...]) -> tuple[Port, ...]:
        return tuple(
            dataclasses.replace(
                p, path=p.path.replace("{source_dir}", source_dir).replace("{source}", source)
            )
            for p in ports
        )

    return dataclasses.replace(contract, consumes=fill(contract.consumes), produces=fill(contract.produces))


# --------------------------------------------------------------------------- profiles


def _merge(base: DictConfig, child: DictConfig) -> DictConfig:
    """OmegaConf.merge, except sections marked ``_override_: true`` replace the parent's."""
    child = child.copy()
    replaced: dict[str, Any] = {}
    for key in list(child.keys()):
        # _get_node: no interpolation resolution here (a copied section has lost its root).
        value = child._get_node(key)
        if isinstance(value, DictConfig) and value.get("_override_", False):
            section = value.copy()
            del section["_override_"]
            replaced[key] = section
            del child[key]
        elif isinstance(value, DictConfig) and isinstance(base._get_node(key), DictConfig):
            # Already base+child for this key; merging it again would undo nested _override_.
            replaced[key] = _merge(base[key], value)
            del child[key]
    merged = OmegaConf.merge(base, child)
    for key, section in replaced.items():
        merged[key] = section
    return merged


# A profile with its parents, parsed and merged, by the resolved path: the YAML and OmegaConf
# work is ~30 ms, and a process that builds many stage contexts (`alignpipe params --check`,
# the docs and settings tests: hundreds) read the same few files again and again. An entry holds
# the digest of every file's bytes (a stat's mtime can miss an edit within the same clock tick),
# so an edited profile or parent is read afresh.
_PROFILES: dict[Path, tuple[tuple[tuple[Path, Any], ...], dict[str, Any]]] = {}


def _stat(path: Path) -> Any:
    try:
        return hashlib.sha1(path.read_bytes()).digest()
    except OSError:
        return None


def load_with_defaults(path: Path) -> DictConfig:
    """NeMo-RL's ``load_config_with_inheritance``: depth-first ``defaults:``, child wins."""
    path = path.resolve()
    hit = _PROFILES.get(path)
    if hit is None or any(_stat(f) != stamp for f, stamp in hit[0]):
        files: list[Path] = []
        cfg = _load_chain(path, (), files)
        hit = _PROFILES[path] = (
            tuple((f, _stat(f)) for f in files),
            OmegaConf.to_container(cfg, resolve=False),  # type: ignore[assignment]
        )
    return OmegaConf.create(hit[1])  # new nodes: a caller may change its copy


def _load_chain(path: Path, seen: tuple[Path, ...], files: list[Path]) -> DictConfig:
    path = path.resolve()
    if path in seen:
        raise ConfigError(f"{path}: 'defaults:' cycle through {' -> '.join(map(str, seen))}")
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    files.append(path)
    try:
        cfg = OmegaConf.load(path)
    except Exception as e:  # OmegaConf wraps yaml errors in several types
        raise ConfigError(f"{path}: cannot parse: {e}") from e
    if not isinstance(cfg, DictConfig):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    defaults = cfg.pop("defaults", None)
    if defaults is None:
        return cfg
    parents = [defaults] if isinstance(defaults, str) else list(defaults)
    base = OmegaConf.create({})
    for parent in parents:
        base = _merge(base, _load_chain(path.parent / str(parent), (*seen, path), files))
    return _merge(base, cfg)


def profile_path(root: Path, stage: str, profile: str) -> Path:
    path = root / STAGES_DIR / stage / "config" / f"{profile}.yaml"
    if not path.is_file():
        available = sorted(p.stem for p in path.parent.glob("*.yaml"))
        raise ConfigError(
            f"stage '{stage}' has no profile '{profile}' ({path} is missing); "
            f"available: {', '.join(available) or 'none'}. Set 'profile' in params.yaml or pass --profile."
        )
    return path


def _apply_knobs(cfg: DictConfig, knobs: Any, where: str, src: str) -> None:
    """Write params.yaml knobs onto the profile; a knob must name an existing key."""
    if knobs is None:
        return
    if not isinstance(knobs, dict):
        raise ConfigError(f"{PARAMS_FILE}: '{where}' must be a mapping of NeMo-RL keys, found {knobs!r}")
    for key, value in knobs.items():
        dotted = f"{where}.{key}"
        node = cfg.get(key) if isinstance(cfg, DictConfig) else None
        if isinstance(cfg, DictConfig) and key not in cfg:
            close = difflib.get_close_matches(str(key), [str(k) for k in cfg.keys()], n=1, cutoff=0.6)
            hint = f"Did you mean '{where}.{close[0]}'? " if close else ""
            raise ConfigError(
                f"{PARAMS_FILE}: '{dotted}' is not a key of {src} (NeMo-RL schema). {hint}"
                f"Check the spelling against the profile, or add the key to the profile first."
            )
        if isinstance(value, dict) and isinstance(node, DictConfig):
            _apply_knobs(node, value, dotted, src)
        else:
            cfg[key] = value


def stage_knobs(params: dict[str, Any], stage: str) -> dict[str, Any]:
    return params.get(stage) or {}


def resolve_stage_config(
    root: Path, stage: str, params: dict[str, Any], profile: str | None = None
) -> dict[str, Any]:
    """The stage's effective NeMo-RL-schema config as a plain dict, interpolations resolved."""
    contract = load_contract(root, stage)
    profile = profile or params.get("profile", "tiny")
    src = profile_path(root, stage, profile)
    cfg = load_with_defaults(src)
    _apply_knobs(cfg, stage_knobs(params, stage), stage, str(src.relative_to(root)))
    if contract.algorithm and "seed" in params:
        OmegaConf.update(cfg, f"{contract.algorithm}.seed", params["seed"], force_add=True)
    try:
        resolved = OmegaConf.to_container(cfg, resolve=True)
    except Exception as e:
        raise ConfigError(f"{src}: interpolation failed after applying params.yaml knobs: {e}") from e
    # Typed here, so `alignpipe plan` and `alignpipe run` refuse a misspelt or mistyped alignpipe:
    # setting on every engine before anything runs (the nemo_rl renderer drops the section unread).
    S.from_config(resolved, setting_origin(root, src, stage, stage_knobs(params, stage)))
    return resolved  # type: ignore[return-value]


def profile_files(path: Path) -> list[Path]:
    """``path`` and every file it inherits with ``defaults:``, in merge order (parents first)."""
    parents = (yaml.safe_load(path.read_text()) or {}).get("defaults") or []
    parents = [parents] if isinstance(parents, str) else parents
    return [f for parent in parents for f in profile_files(path.parent / str(parent))] + [path.resolve()]


def setting_origin(root: Path, src: Path, stage: str, knobs: dict[str, Any]) -> Callable[[str], str]:
    """Where a dotted ``alignpipe.`` key was set, for its error: params.yaml when a knob set it, else
    the last file of the profile's ``defaults:`` chain that has it (a parent's typo breaks its children)."""
    missing = object()

    def where(dotted: str) -> str:
        key = dotted.split("[")[0]  # a list item's key: the list's
        if get_path(knobs, key, missing) is not missing:
            return f"{PARAMS_FILE} '{stage}.{key}' (over {src.relative_to(root)})"
        for path in reversed(profile_files(src)):
            if get_path(yaml.safe_load(path.read_text()) or {}, key, missing) is not missing:
                return str(path.relative_to(root.resolve()))
        return str(src.relative_to(root))

    return where


def get_path(cfg: dict[str, Any], dotted: str, default: Any = None) -> Any:
    """Read ``a.b.c`` from a nested dict; ``default`` when any part is missing."""
    node: Any = cfg
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def config_hash(cfg: Any) -> str:
    """Stable content hash of a config (and anything else JSON-serialisable)."""
    text = json.dumps(cfg, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def to_yaml(cfg: Any) -> str:
    if isinstance(cfg, (DictConfig, ListConfig)):
        cfg = OmegaConf.to_container(cfg, resolve=True)
    return yaml.safe_dump(cfg, sort_keys=False, default_flow_style=False)
