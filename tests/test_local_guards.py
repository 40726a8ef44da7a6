"""The local engine refuses settings it cannot honour instead of silently ignoring them."""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace

import pytest

from alignpipe.engines.local import trl_args
from alignpipe.errors import UnsupportedSetting
from tests.conftest import copy_repo, run_cli, set_params

# Every guarded setting, switched on.
ALL_GUARDED = [(key, on) for key, on, _ in trl_args._GPU_ONLY] + [
    (key, 2) for key, _ in trl_args._MUST_BE_ONE
]


def nested(dotted: str, value) -> dict:
    out: dict = value
    for part in reversed(dotted.split(".")):
        out = {part: out}
    return out


def merge(base: dict, new: dict) -> dict:
    for k, v in new.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            merge(base[k], v)
        else:
            base[k] = v
    return base


@pytest.mark.parametrize(("key", "value"), ALL_GUARDED, ids=[k for k, _ in ALL_GUARDED])
def test_each_guarded_setting_is_refused_by_name(key, value):
    ctx = SimpleNamespace(name="dpo", profile="tiny", config=merge({"policy": {}}, nested(key, value)))
    with pytest.raises(UnsupportedSetting) as err:
        trl_args.refuse_gpu_only_settings(ctx)
    assert key in str(err.value)
    assert "runtime.engine=nemo_rl" in str(err.value)  # says how to get it


def test_settings_left_off_pass():
    off = {
        "policy": {
            "megatron_cfg": {"enabled": False},
            "generation": {"backend": "hf"},
            "dtensor_cfg": {"tensor_parallel_size": 1, "context_parallel_size": 1, "cpu_offload": False},
        },
        "cluster": {"num_nodes": 1},
    }
    trl_args.refuse_gpu_only_settings(SimpleNamespace(name="rm", profile="tiny", config=off))


# Guarded keys that exist in every trainer's tiny profile (params knobs must name existing keys;
# generation, async GRPO and NeMo-Gym keys belong to the RL stages' profiles). rlhf's come from
# rlvr's profile, which it extends.
STAGE_KEYS = [
    ("policy.megatron_cfg.enabled", True),
    ("policy.dtensor_cfg.cpu_offload", True),
    ("policy.dtensor_cfg.sequence_parallel", True),
    ("policy.dtensor_cfg.tensor_parallel_size", 2),
    ("policy.dtensor_cfg.context_parallel_size", 2),
    ("policy.sequence_packing.enabled", True),
    ("policy.dynamic_batching.enabled", True),
    ("cluster.num_nodes", 2),
]
CASES = [(stage, key, value) for stage in ("sft", "rm", "dpo") for key, value in STAGE_KEYS]
CASES += [
    (stage, key, value) for stage in ("rlvr", "rlhf") for key, value in STAGE_KEYS[:1] + STAGE_KEYS[-1:]
]


@pytest.fixture(scope="module")
def guard_repo(tmp_path_factory) -> tuple[Path, str]:
    """A repo copy without data or models: the stage must fail before it needs either."""
    root = copy_repo(tmp_path_factory.mktemp("guards") / "repo")
    return root, (root / "params.yaml").read_text()


@pytest.mark.parametrize(("stage", "key", "value"), CASES, ids=[f"{s}:{k}" for s, k, _ in CASES])
def test_stage_exits_2_naming_the_setting(guard_repo, stage, key, value):
    root, pristine = guard_repo
    (root / "params.yaml").write_text(pristine)
    set_params(root, {stage: nested(key, copy.deepcopy(value))})
    proc = run_cli(root, "run", stage, check=False, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert key in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (root / "models" / stage).exists()
