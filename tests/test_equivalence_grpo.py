"""GRPO on both engines: NeMo-RL v0.7.0's own estimator and loss against the local engine's.

NeMo-RL's code runs from the vendored source in a subprocess (``nemo_rl_runtime``,
tests/nemo_rl_probe.py); the local side is the function the local trainer itself calls.
Configs are the rendered ones, per profile, so a profile or knob change that makes the two
engines disagree fails here.
"""

from __future__ import annotations

import copy
import itertools
from pathlib import Path

import pytest
import torch

from alignpipe.engines.local.grpo import advantage_settings
from alignpipe.errors import ConfigError, UnsupportedSetting
from alignpipe.rewards.advantages import step_advantages
from tests.test_nemo_rl_render import rendered

PROFILES = ("tiny", "small", "default", "nemo_gym")


def prompt_layouts(prompts: list[list[int]], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The same prompts as each engine holds them: NeMo-RL right-pads its flat prompt ids with
    the pad token; TRL left-pads, and the local trainer masks the padding out (-1)."""
    width = max(len(p) for p in prompts)
    right = torch.tensor([p + [pad] * (width - len(p)) for p in prompts])
    left = torch.tensor([[-1] * (width - len(p)) + p for p in prompts])
    return right, left


def step(groups: list[tuple[list[int], list[float]]]) -> dict:
    """One rollout batch: (prompt tokens, rewards of its G completions) per drawn prompt."""
    prompts = [p for p, rewards in groups for _ in rewards]
    right, left = prompt_layouts(prompts)
    return {"right": right, "left": left, "rewards": torch.tensor([float(r) for _, rs in groups for r in rs])}


A, B, C = [5, 6, 7], [5, 6], [9]  # B is a prefix of A: only padding tells them apart
STEPS = {
    # the same prompt drawn twice in one step: one group of 2G on NeMo-RL
    "duplicated_prompt": step([(A, [1, 0, 0, 0]), (B, [1, 1, 0, 1]), (A, [1, 1, 1, 0])]),
    "zero_variance_group": step([(A, [1, 1, 1, 1]), (B, [0, 0, 0, 0]), (C, [0.5, 0.0, 0.25, 1.0])]),
    "one_sample_groups": step([(A, [1.0]), (B, [0.0]), (C, [0.3]), (A, [0.0])]),
    "real_valued": step([(A, [0.3, -1.2, 2.5, 0.7]), (C, [-0.1, -0.1, 0.4, 3.0])]),
}


def variants(grpo: dict) -> list[dict]:
    """The rendered grpo section, then each estimator setting flipped the way a user flips it
    (params.yaml sets the top-level key; the profile interpolates it into adv_estimator), plus
    NeMo-RL's fallback when the section is absent, and advantage clipping."""
    out = []
    for normalize, loo in itertools.product((True, False), repeat=2):
        g = copy.deepcopy(grpo)
        g["normalize_rewards"], g["use_leave_one_out_baseline"] = normalize, loo
        if "adv_estimator" in g:
            g["adv_estimator"].update(normalize_rewards=normalize, use_leave_one_out_baseline=loo)
        out.append(g)
    bare = copy.deepcopy(grpo)
    bare.pop("adv_estimator", None)
    bare.pop("use_leave_one_out_baseline", None)  # NeMo-RL's fallback is *off*
    out.append(bare)
    clipped = copy.deepcopy(grpo)
    clipped.update(advantage_clip_low=-0.5, advantage_clip_high=0.75)
    out.append(clipped)
    return out


@pytest.fixture(scope="module")
def advantage_cases(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("render")
    cases = []
    for profile in PROFILES:
        cfg = rendered("rlvr", profile, tmp)
        for grpo in variants(cfg["grpo"]):
            for name, batch in STEPS.items():
                cases.append({"profile": profile, "step": name, "grpo": grpo, "loss_fn": cfg["loss_fn"],
                              "prompt_ids": batch["right"], "left": batch["left"], "rewards": batch["rewards"]})  # fmt: skip
    return cases


def test_advantages_equal_nemo_rls_estimator(advantage_cases, nemo_rl_runtime) -> None:
    upstream = nemo_rl_runtime("advantages", {"cases": advantage_cases})
    assert len(upstream) == len(advantage_cases)
    seen_nonzero = 0
    for case, theirs in zip(advantage_cases, upstream, strict=True):
        settings = advantage_settings({"grpo": case["grpo"], "loss_fn": case["loss_fn"]})
        ours = step_advantages(case["rewards"], case["left"], **settings)
        label = f"{case['profile']}/{case['step']} grpo={ {k: v for k, v in case['grpo'].items() if 'adv' in k or 'norm' in k or 'leave' in k} }"
        torch.testing.assert_close(ours, theirs.to(ours.dtype), rtol=0, atol=1e-6, msg=label)
        seen_nonzero += bool(theirs.abs().sum() > 0)
    assert seen_nonzero > len(advantage_cases) // 2  # the cases carry signal, not only zeros


def test_duplicated_prompt_forms_one_group() -> None:
    """The case NeMo-RL and contiguous blocks disagree on, by hand: A drawn twice is one group."""
    batch = STEPS["duplicated_prompt"]
    adv = step_advantages(
        batch["rewards"], batch["left"], normalize_rewards=False, leave_one_out_baseline=False
    )
    a_mean = (1 + 0 + 0 + 0 + 1 + 1 + 1 + 0) / 8
    assert adv[0].item() == pytest.approx(1 - a_mean) and adv[8].item() == pytest.approx(1 - a_mean)


def test_disagreeing_estimator_keys_are_refused(tmp_path: Path) -> None:
    grpo = copy.deepcopy(rendered("rlvr", "default", tmp_path)["grpo"])
    grpo["adv_estimator"]["use_leave_one_out_baseline"] = False  # top level still says True
    with pytest.raises(
        UnsupportedSetting, match=r"grpo.use_leave_one_out_baseline=True but grpo.adv_estimator"
    ):
        advantage_settings({"grpo": grpo}, "stages/rlvr/config/default.yaml")
    del grpo["adv_estimator"]["normalize_rewards"]
    with pytest.raises(ConfigError, match="grpo.adv_estimator.normalize_rewards is missing"):
        advantage_settings({"grpo": grpo})
