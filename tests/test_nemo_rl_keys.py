"""The typed view of the NeMo-RL keys each local trainer reads (engines/local/nemo_rl_keys.py):
every local profile provides every key, and a profile without one is refused, naming the key and
the file that should set it, before anything trains."""

from __future__ import annotations

import copy
import dataclasses
import importlib

import pytest

from alignpipe.context import build_context
from alignpipe.engines.local import lora
from alignpipe.engines.local import nemo_rl_keys as K
from alignpipe.errors import ConfigError
from tests.conftest import REPO

TRAINERS = {"sft": K.SftKeys, "dpo": K.DpoKeys, "rm": K.RmKeys, "rlvr": K.GrpoKeys, "rlhf": K.GrpoKeys}


@pytest.mark.parametrize("profile", ["tiny", "small"])
@pytest.mark.parametrize("stage", sorted(TRAINERS))
def test_every_local_profile_provides_every_key(stage: str, profile: str) -> None:
    ctx = build_context(REPO, stage, profile)
    keys = K.stage_keys(ctx)
    assert isinstance(keys.algorithm, TRAINERS[stage])
    assert K.stage_keys(ctx) is keys  # read once per stage
    assert keys.algorithm.seed == ctx.seed  # params.yaml's seed, written into the section
    assert keys.data.train_path.startswith("data/prepared/")
    assert keys.policy.train_global_batch_size % keys.policy.train_micro_batch_size == 0
    lora.lora_settings(ctx)  # lora_cfg is read strictly too (off on the committed params)


def without(cfg: dict, dotted: str) -> dict:
    cfg = copy.deepcopy(cfg)
    *parents, last = dotted.split(".")
    node = cfg
    for part in parents:
        node = node[part]
    del node[last]
    return cfg


@pytest.mark.parametrize(
    ("stage", "key"),
    [
        ("sft", "policy.train_global_batch_size"),
        ("sft", "data.add_eos"),
        ("dpo", "dpo.sft_loss_weight"),
        ("rm", "data.default.prompt_key"),
        ("rlvr", "grpo.max_num_steps"),
        ("rlvr", "grpo.advantage_clip_low"),  # null is allowed (no clip); absent is not
        ("rlhf", "policy.generation.max_new_tokens"),
    ],
)
def test_a_profile_missing_a_key_is_refused_naming_it_and_the_file(stage: str, key: str) -> None:
    ctx = build_context(REPO, stage, "tiny")
    broken = dataclasses.replace(ctx, config=without(ctx.config, key))
    module = importlib.import_module(f"alignpipe.engines.local.stages.{stage}")
    with pytest.raises(ConfigError) as info:
        module.run(broken)  # refused before any model loads
    message = str(info.value)
    assert f"{key} is missing" in message
    assert f"stages/{stage}/config/tiny.yaml (or params.yaml)" in message


def test_a_value_of_the_wrong_type_is_refused() -> None:
    ctx = build_context(REPO, "dpo", "tiny")
    cfg = copy.deepcopy(ctx.config)
    cfg["dpo"]["val_period"] = "often"
    with pytest.raises(
        ConfigError, match=r"dpo.val_period='often': expected an integer; fix it in stages/dpo"
    ):
        K.stage_keys(dataclasses.replace(ctx, config=cfg))


def test_lora_keys_are_required_when_lora_is_on() -> None:
    ctx = build_context(REPO, "sft", "tiny")
    cfg = without(ctx.config, f"{lora.LORA_KEY}.dim")
    cfg["policy"]["dtensor_cfg"]["lora_cfg"]["enabled"] = True
    with pytest.raises(
        ConfigError, match=r"policy.dtensor_cfg.lora_cfg.dim is missing.*stages/sft/config/tiny"
    ):
        lora.lora_settings(dataclasses.replace(ctx, config=cfg))
