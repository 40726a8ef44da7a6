"""Check a rendered config and a launch command with NeMo-RL's own code. Runs standalone.

This file is executed by path (``python schema_check.py ...``) in whatever interpreter can
import NeMo-RL's config stack: the image's, or a small venv with NeMo-RL's uv.lock pins of
pydantic, omegaconf and hydra-core. It imports nothing from alignpipe. Modules that NeMo-RL
imports only at run time (torch, ray, vllm, megatron, ...) are replaced by inert stand-ins
when they are not installed: the config TypedDicts carry no validators, so the pydantic
schema is the whole validation and needs none of them.

    python schema_check.py config --src SRC --entry examples/run_grpo.py --config C.yaml [overrides]
    python schema_check.py argv --src SRC -- python examples/run_dpo.py --config C.yaml [overrides]
    python schema_check.py stage --src SRC --entry examples/run_dpo.py --config C.yaml -- python ...

``stage`` is both in one process, as the pre-flight runs them: ``{"config": ..., "argv": ...}``
(NeMo-RL's config stack takes about a second to import).

Prints one JSON object: ``{"ok": bool, "errors": [...], "unknown": [...], ...}``.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
import types
import typing
from pathlib import Path

ENTRY_MODULE = "_entry_under_check"  # the entry script, loaded to call its parse_args()
_PASSTHROUGH_DUNDERS = ("__file__", "__spec__", "__loader__", "__path__", "__all__", "__wrapped__")


class _Inert:
    """Stands for any object of a runtime-only library: callable, subscriptable, subclassable."""

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return _Inert()

    def __getattr__(self, name):
        return _Inert()

    def __getitem__(self, key):
        return _Inert()

    def __iter__(self):
        return iter(())

    def __mro_entries__(self, bases):
        return (object,)

    def __or__(self, other):
        return typing.Any

    __ror__ = __or__


class _InertModule(types.ModuleType):
    __path__: list[str] = []

    def __getattr__(self, name):
        if name in _PASSTHROUGH_DUNDERS:
            raise AttributeError(name)
        if name == "__version__":  # version gates in NeMo-RL's own modules
            return {"transformers": "5.8.1"}.get(self.__name__.split(".")[0], "2.10.0")
        return _Inert()


class _StandIns(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Last on sys.meta_path: a module NeMo-RL imports that is not installed becomes inert.

    Only imports made by NeMo-RL's code (and submodules of inert modules) are stood in for, so
    a library probing for an optional dependency still sees it missing."""

    def find_spec(self, fullname, path, target=None):
        root = fullname.split(".")[0]
        if root in ("nemo_rl", "examples") or root in sys.stdlib_module_names or root.startswith("_"):
            return None
        frame = sys._getframe(1)
        while frame and frame.f_globals.get("__name__", "").startswith(("importlib", "_frozen_importlib")):
            frame = frame.f_back
        importer = frame.f_globals.get("__name__", "") if frame else ""
        parent = sys.modules.get(fullname.rpartition(".")[0])
        if importer.startswith(("nemo_rl", "examples", ENTRY_MODULE)) or isinstance(parent, _InertModule):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return _InertModule(spec.name)

    def exec_module(self, module):
        pass


def _prepare(src: Path) -> None:
    if getattr(_prepare, "done", False):
        os.chdir(src)
        return
    _prepare.done = True
    import typing_extensions

    # pydantic refuses typing.TypedDict on Python < 3.12; typing_extensions' has the same meaning.
    typing.TypedDict = typing_extensions.TypedDict
    sys.meta_path.append(_StandIns())
    sys.path.insert(0, str(src))
    os.chdir(src)  # entry scripts resolve examples/configs/... relative to the checkout


def master_config_module(entry: Path) -> str:
    """The module whose ``MasterConfig`` the entry script validates with (read from its imports)."""
    tree = ast.parse(entry.read_text())
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.ImportFrom)
            and node.module
            and any(a.name == "MasterConfig" for a in node.names)
        ):
            return node.module
    raise SystemExit(f"{entry}: imports no MasterConfig")


# ----------------------------------------------------------------------------- unknown keys


def _typed_dict_of(hint) -> type | None:
    """The TypedDict inside ``hint`` (through Optional, NotRequired, Required, Annotated), if any."""
    import typing_extensions

    origin = typing_extensions.get_origin(hint)
    if origin in (typing_extensions.NotRequired, typing_extensions.Required, typing_extensions.Annotated):
        return _typed_dict_of(typing_extensions.get_args(hint)[0])
    if origin is typing.Union or isinstance(hint, types.UnionType):
        found = [t for t in (_typed_dict_of(a) for a in typing_extensions.get_args(hint)) if t]
        return found[0] if len(found) == 1 else None
    return hint if typing_extensions.is_typeddict(hint) else None


# Sections whose keys configure the algorithm itself: an unknown key there is a typo that
# silently keeps a default. Elsewhere (policy, cluster, logger, data, env, top level) NeMo-RL
# reads some keys straight from the raw dict (e.g. its own dpo.yaml's
# policy.offload_optimizer_for_logprob), so an unknown key is only a warning.
ALGORITHM_SECTIONS = ("sft", "dpo", "rm", "grpo", "loss_fn", "checkpointing", "distillation")
# Typed configs that NeMo-RL narrows by backend (GenerationConfig -> VllmConfig, ...): their
# subclasses' keys are defined too.
_BACKEND_CONFIG_MODULES = (
    "nemo_rl.models.generation.vllm.config",
    "nemo_rl.models.generation.megatron.config",
    "nemo_rl.models.generation.sglang.config",
)


def _subclasses(schema) -> list:
    """TypedDicts declared on top of ``schema`` (they keep it in __orig_bases__, not __bases__)."""
    for name in _BACKEND_CONFIG_MODULES:
        try:
            importlib.import_module(name)
        except Exception:  # an optional backend's module may need what a stand-in cannot give
            pass
    found, todo = [], [schema]
    while todo:
        base = todo.pop()
        for module in list(sys.modules.values()):
            if not getattr(module, "__name__", "").startswith("nemo_rl"):
                continue
            for obj in vars(module).values():
                if isinstance(obj, type) and base in getattr(obj, "__orig_bases__", ()) and obj not in found:
                    found.append(obj)
                    todo.append(obj)
    return found


def _fields(schema) -> dict:
    import typing_extensions

    if hasattr(schema, "model_fields"):
        return {name: field.annotation for name, field in schema.model_fields.items()}
    hints: dict = {}
    for cls in (schema, *_subclasses(schema)):
        for key, hint in typing_extensions.get_type_hints(cls, include_extras=True).items():
            hints.setdefault(key, hint)
    return hints


def unknown_keys(value: dict, schema, prefix: str = "") -> list[dict]:
    """Keys of ``value`` the schema (a TypedDict or a pydantic model) does not define.

    NeMo-RL's validation ignores them, so a typo in an optional key silently keeps the default.
    ``error`` is true inside ``ALGORITHM_SECTIONS``."""
    hints = _fields(schema)
    found = []
    for key, sub in value.items():
        path = f"{prefix}{key}"
        if key not in hints:
            close = difflib.get_close_matches(str(key), list(hints), n=1, cutoff=0.6)
            section = path.split(".")[0]
            found.append(
                {
                    "key": path,
                    "suggestion": close[0] if close else None,
                    "error": bool(prefix) and section in ALGORITHM_SECTIONS,
                }
            )
            continue
        inner = _typed_dict_of(hints[key])
        if inner is not None and isinstance(sub, dict):
            found += unknown_keys(sub, inner, f"{path}.")
    return found


# ----------------------------------------------------------------------------- commands


def readable_errors(raw: list[dict], plain: dict) -> list[dict]:
    """pydantic's errors as config key paths. A union (e.g. MegatronConfig | MegatronConfigDisabled)
    reports every member's mismatch under the member's name: keep the intended member's only,
    the one whose literal fields (``enabled: Literal[False]``) match, with the fewest errors."""
    parsed = []
    for err in raw:
        node, keys, tag = plain, [], None
        for part in err["loc"]:
            if isinstance(node, dict) and part in node:
                node = node[part]
                keys.append(str(part))
            elif isinstance(node, list) and isinstance(part, int) and part < len(node):
                node = node[part]
                keys.append(str(part))
            elif tag is None and isinstance(part, str):
                tag = (".".join(keys), part)  # a union member's name, not a key
            else:
                keys.append(str(part))  # a missing key
        parsed.append(
            (tag, {"key": ".".join(keys), "message": err["msg"], "input": repr(err.get("input"))[:80]})
        )
    counts: dict = {}
    for (tag, _), err in zip(parsed, raw, strict=True):
        if tag:
            rank = counts.setdefault(tag[0], {}).setdefault(tag[1], [0, 0])
            rank[0] += err["type"] == "literal_error"  # a discriminator that does not match
            rank[1] += 1
    best = {where: min(members, key=lambda m: members[m]) for where, members in counts.items()}
    return [err for tag, err in parsed if tag is None or best[tag[0]] == tag[1]]


def check_config(src: Path, entry: str, config: Path, overrides: list[str]) -> dict:
    """What ``examples/run_*.py`` does before training: load, override, resolve, validate."""
    _prepare(src)
    from nemo_rl.utils import config as nemo_config
    from omegaconf import OmegaConf
    from pydantic import ValidationError

    if hasattr(nemo_config, "register_omegaconf_resolvers"):  # ${mul:...} etc., as main() does first
        nemo_config.register_omegaconf_resolvers()
    module = master_config_module(src / entry)
    master = importlib.import_module(module).MasterConfig
    cfg = nemo_config.load_config(str(config))
    if overrides:
        cfg = nemo_config.parse_hydra_overrides(cfg, overrides)
    plain = OmegaConf.to_container(cfg, resolve=True)
    errors = []
    try:
        master(**plain)
    except ValidationError as e:
        errors = readable_errors(e.errors(), plain)
    unknown = unknown_keys(plain, master)
    ok = not errors and not any(u["error"] for u in unknown)
    return {"ok": ok, "schema": f"{module}.MasterConfig", "errors": errors, "unknown": unknown}


def check_argv(src: Path, argv: list[str]) -> dict:
    """A launch command: its script exists, its own ``parse_args()`` accepts the arguments,
    and every leftover is a valid Hydra override."""
    if argv[1:3] == ["-m", "alignpipe.engines.nemo_rl.grpo_driver"]:
        # The driver registers alignpipe's env, then runs the script after --entry with the rest.
        rest = argv[3:]
        i = rest.index("--entry")
        script, args = rest[i + 1], rest[:i] + rest[i + 2 :]
    else:
        script, args = argv[1], argv[2:]
    path = src / script
    if not path.is_file():
        return {"ok": False, "errors": [{"key": "argv", "message": f"{script} does not exist in {src}"}]}
    _prepare(src)
    sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(ENTRY_MODULE, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.argv = [str(path), *args]
    try:
        parsed = module.parse_args()
    except SystemExit as e:
        return {
            "ok": False,
            "errors": [{"key": "argv", "message": f"{script}'s parse_args() exited ({e.code})"}],
        }
    overrides = parsed[1] if isinstance(parsed, tuple) else []
    from hydra.core.override_parser.overrides_parser import OverridesParser

    errors = []
    for text in overrides:
        try:
            OverridesParser.create().parse_override(text)
        except Exception as e:  # hydra raises OverrideParseException and friends
            errors.append({"key": "argv", "message": f"not a Hydra override: {text!r} ({e})"})
    return {"ok": not errors, "script": script, "overrides": list(overrides), "errors": errors}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    cfg = sub.add_parser("config")
    cfg.add_argument("--src", required=True, type=Path)
    cfg.add_argument("--entry", required=True)
    cfg.add_argument("--config", required=True, type=Path)
    cfg.add_argument("overrides", nargs="*")
    cmd = sub.add_parser("argv")
    cmd.add_argument("--src", required=True, type=Path)
    cmd.add_argument("argv", nargs=argparse.REMAINDER)
    stage = sub.add_parser("stage")
    stage.add_argument("--src", required=True, type=Path)
    stage.add_argument("--entry", required=True)
    stage.add_argument("--config", required=True, type=Path)
    stage.add_argument("argv", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    argv = args.argv[1:] if getattr(args, "argv", [])[:1] == ["--"] else getattr(args, "argv", [])
    if args.what == "config":
        result = check_config(args.src.resolve(), args.entry, args.config.resolve(), args.overrides)
    elif args.what == "argv":
        result = check_argv(args.src.resolve(), argv)
    else:  # the config first: the launch check runs the entry script's module code
        config = check_config(args.src.resolve(), args.entry, args.config.resolve(), [])
        result = {"config": config, "argv": check_argv(args.src.resolve(), argv)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
