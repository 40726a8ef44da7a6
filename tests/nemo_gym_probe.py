"""Resolve a rendered ``env.nemo_gym`` section with NeMo-Gym's own parser. Runs in the Gym venv.

Called by tests/test_nemo_gym_contract.py as ``python nemo_gym_probe.py < rendered_config.yaml``
with the Gym 0.4.0 venv's interpreter (Python >= 3.12); imports nothing from alignpipe. It builds
the initial global config exactly as NeMo-RL v0.7.0 does (nemo_rl/algorithms/grpo.py
``_spinup_nemo_gym`` and nemo_rl/environments/nemo_gym.py ``NemoGym._spinup``), then calls
``GlobalConfigDictParser().parse`` as ``RunHelper.start`` does, and validates every server's
own config with the config class its app declares. Prints one JSON object.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import json
import sys
import tempfile
import traceback
import types
from pathlib import Path

import yaml

# GPU-only libraries a server app imports at module level (genrm_model -> local_vllm_model ->
# vllm): inert stand-ins, so the app's config class can be imported and used on CPU.
GPU_ONLY = ("vllm",)


class _Inert(types.ModuleType):
    __path__: list[str] = []

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (), {"__init__": lambda self, *a, **k: None})


class _StandIns(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] in GPU_ONLY:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return _Inert(spec.name)

    def exec_module(self, module):
        pass


def initial_global_config(nemo_gym: dict, model_name: str, base_url: str) -> dict:
    d = dict(nemo_gym)
    for key in ("is_trajectory_collection", "invalid_tool_call_patterns", "thinking_tags", "effort_levels"):
        d.pop(key, None)  # NeMo-RL-side knobs it pops before Gym sees the dict
    d.pop("rollout_max_attempts_to_avoid_lp_nan", None)
    d["policy_model_name"] = model_name
    d["policy_api_key"] = "dummy_key"
    d["policy_base_url"] = [base_url]
    d.setdefault("default_host", "127.0.0.1")
    d.setdefault("global_aiohttp_connector_limit_per_host", 16_384)
    d.setdefault("global_aiohttp_connector_limit", 65_536)
    d["ray_head_node_address"] = "127.0.0.1:6379"
    d["head_server"] = {"host": "127.0.0.1", "port": int(d.get("port_range_low", 15001))}
    return d


def server_config_class(server_type: str, name_in_code: str):
    """The config class an app's server class declares (``config: <Class>`` on the server)."""
    from nemo_gym.server_utils import BaseServerConfig

    module = importlib.import_module(f"{server_type}.{name_in_code}.app")
    found = [
        obj
        for obj in vars(module).values()
        if isinstance(obj, type) and issubclass(obj, BaseServerConfig) and obj.__module__ == module.__name__
    ]
    return found[0] if found else None


def main() -> None:
    from nemo_gym.global_config import GlobalConfigDictParser, GlobalConfigDictParserConfig
    from omegaconf import DictConfig, OmegaConf

    sys.meta_path.append(_StandIns())
    rendered = yaml.safe_load(sys.stdin)
    nemo_gym = rendered["env"]["nemo_gym"]
    initial = initial_global_config(nemo_gym, rendered["policy"]["model_name"], "http://127.0.0.1:8000/v1")
    out: dict = {"ok": False}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            parsed = GlobalConfigDictParser().parse(
                GlobalConfigDictParserConfig(
                    dotenv_path=Path(tmp) / "nemo_gym_env.yaml",  # NeMo-RL's, absent in a clean checkout
                    initial_global_config_dict=DictConfig(initial),
                    skip_load_from_cli=True,
                )
            )
        servers = []
        parser = GlobalConfigDictParser()
        for instance in parser.filter_for_server_instance_configs(parsed):
            ref = instance.get_server_ref()
            inner = OmegaConf.to_container(instance.get_inner_run_server_config_dict(), resolve=True)
            code_name = (
                instance.get_inner_run_server_config_name()
                if hasattr(instance, "get_inner_run_server_config_name")
                else next(iter(parsed[instance.name][ref.type]))
            )
            cls = server_config_class(ref.type, code_name)
            if cls is not None:
                cls.model_validate({**inner, "name": instance.name} if "name" in cls.model_fields else inner)
            servers.append(
                {
                    "instance": instance.name,
                    "type": ref.type,
                    "code": code_name,
                    "config_class": cls.__name__ if cls else None,
                }
            )
        out = {"ok": True, "servers": servers}
    except Exception as e:  # report, do not crash: the test prints it
        out = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
