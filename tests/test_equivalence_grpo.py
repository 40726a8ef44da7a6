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

from alignpipe.engines.local.nemo_rl_keys import advantage_settings, grpo_keys
from alignpipe.errors import ConfigError, UnsupportedSetting
from alignpipe.rl.advantages import step_advantages
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
    # Seven answers scored alike and one not, as a learned reward model scores a group of
    # identical samples: the odd one's leave-one-out std is sqrt(E[r^2] - E[r]^2) of seven equal
    # floats, cancellation noise, and normalising divides by it (the tiny rlhf turns it off).
    "tied_real_scores": step([(A, [3.9] * 7 + [3.6]), (C, [0.3, -1.2, 2.5, 0.7])]),
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
    # NeMo-RL's own estimator blows the tied group's odd answer up, leave-one-out and normalised:
    # the loss spikes of a normalised tiny rlhf run (benchmarks/grpo_stages.md) are upstream's math.
    blown = [theirs[7].item() for case, theirs in zip(advantage_cases, upstream, strict=True)
             if case["step"] == "tied_real_scores" and case["grpo"].get("normalize_rewards")
             and case["grpo"].get("use_leave_one_out_baseline") and case["grpo"].get("advantage_clip_low") is None]  # fmt: skip
    assert blown and all(a < -100 for a in blown), blown


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


# ----------------------------------------------------------------------------- loss

# Reference log-prob offsets from the policy's, per completion token: inside every clamp, past
# the output clamp (k3(3) = e^3 - 4 > 10) and past the input clamp (|logr| > 20).
OFFSETS = torch.tensor(
    [
        [0.1, -0.3, 0.5, 0.0, -1.0, 0.2],
        [3.0, -0.2, 25.0, 0.4, -25.0, 0.0],
        [-2.0, 2.8, 0.05, -0.5, 1.5, 0.3],
        [0.0, 0.7, -0.7, 4.0, 0.0, 0.0],
    ]
)
LOSS_VARIANTS = {
    "as_rendered": {},
    "strong_kl": {"reference_policy_kl_penalty": 0.5},
    "strong_kl_sequence_mean": {"reference_policy_kl_penalty": 0.5, "token_level_loss": False},
    # Only the output clamp off: without the input clamp too, the 25-nat offset makes float32
    # compute e^25 - e^25 (catastrophic cancellation) on both engines, and the gradient is noise.
    "no_output_clamp": {"reference_policy_kl_penalty": 0.5, "kl_output_clamp_value": None},
    "asymmetric_clip": {"reference_policy_kl_penalty": 0.2, "ratio_clip_min": 0.1, "ratio_clip_max": 0.3},
    # GSPO: one importance ratio per sequence (NeMo-RL requires the sequence-mean loss with it)
    "sequence_ratios": {
        "reference_policy_kl_penalty": 0.5,
        "sequence_level_importance_ratios": True,
        "token_level_loss": False,
    },
}


@pytest.fixture(scope="module")
def tiny_policy(tmp_path_factory) -> Path:
    """A saved tiny Llama: TRL loads its reference copy from the policy's path, as in a stage."""
    from alignpipe.tiny import build_causal_lm, train_tokenizer

    where = tmp_path_factory.mktemp("policy")
    tokenizer = train_tokenizer(["0123456789 sort add reverse: abcdefghijklmnopqrstuvwxyz"], "char")
    dims = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
    build_causal_lm(tokenizer, dims, seed=0).save_pretrained(where)
    tokenizer.save_pretrained(where)
    return where


def local_trainer(loss_fn: dict, policy: Path, tmp: Path):
    """The local engine's GRPO trainer as run_grpo builds it, for the tiny rlvr profile with
    ``loss_fn`` overridden as a params.yaml knob would."""
    from datasets import Dataset
    from trl import GRPOConfig

    from alignpipe.config import load_params
    from alignpipe.context import build_context
    from alignpipe.engines.local import grpo
    from alignpipe.measure.logprobs import load_policy
    from tests.conftest import REPO

    params = load_params(REPO)
    params["rlvr"] = {**(params.get("rlvr") or {}), "loss_fn": loss_fn}
    ctx = build_context(REPO, "rlvr", params=params)
    model, tokenizer = load_policy(policy)
    # No validation set here: the loss is what is compared, so no validation pass either.
    args = GRPOConfig(
        **{**grpo.grpo_args(ctx, tmp), "report_to": [], "eval_strategy": "no", "eval_on_start": False}
    )
    trainer = grpo.make_trainer_class()(
        model=model,
        reward_funcs=[grpo.RewardFn(lambda *a: [])],
        args=args,
        train_dataset=Dataset.from_list([{"prompt": [{"role": "user", "content": "sort 21"}]}]),
        processing_class=tokenizer,
        advantage_settings=dict(grpo_keys(ctx).advantages),
        kl_settings=grpo_keys(ctx).loss_fn.kl_settings,
    )
    return trainer, ctx


def test_grpo_loss_and_gradient_equal_nemo_rls_clipped_pg_loss(
    nemo_rl_runtime, tiny_policy: Path, tmp_path: Path
) -> None:
    """One batch through the local trainer's own loss (TRL's clipped PG term + reference_kl)
    and through NeMo-RL's ClippedPGLossFn built from the same rendered loss_fn: the same loss,
    KL metric and gradient with respect to the logits, clamps and on-policy weight included."""
    prompt_ids = torch.tensor(
        [[0, 0, 11, 12, 13], [14, 15, 16, 17, 18], [0, 19, 20, 21, 22], [0, 0, 0, 23, 24]]
    )
    completion_ids = torch.tensor([[4, 5, 6, 7, 8, 9]] * 2 + [[9, 8, 7, 6, 5, 4]] * 2)
    completion_mask = torch.tensor(
        [[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0]]
    )
    prompt_mask = (prompt_ids != 0).long()
    advantages = torch.tensor([1.2, -0.7, 0.3, -1.5])
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    P, C = prompt_ids.shape[1], completion_ids.shape[1]

    cases, ours = [], []
    for name, knobs in LOSS_VARIANTS.items():
        trainer, ctx = local_trainer(knobs, tiny_policy, tmp_path / name)
        model = trainer.model
        model.eval()  # tiny Llama has no dropout; eval keeps TRL's reduction free of accumulation
        # TRL scores completions through a fused LM head (no logits tensor): the last tensor
        # both engines share is the final hidden state, so it is captured, and NeMo-RL is fed
        # the logits that hidden state gives, h @ W^T.
        captured = {}
        hook = model.model.norm.register_forward_hook(
            lambda module, args, output, seen=captured: (
                seen.__setitem__("hidden", output) if output.requires_grad else None
            )
        )
        with torch.no_grad():
            lp = trainer._get_per_token_logps_and_entropies(
                model, input_ids, torch.cat([prompt_mask, completion_mask], 1), C
            )[0]
        inputs = {
            "prompt_ids": prompt_ids,
            "prompt_mask": prompt_mask,
            "completion_ids": completion_ids,
            "completion_mask": completion_mask,
            "advantages": advantages,
            "ref_per_token_logps": lp + OFFSETS,
            "num_items_in_batch": completion_mask.sum(),
        }
        loss = trainer._compute_loss(model, inputs)
        hook.remove()
        hidden = captured["hidden"]  # [B, P + C, H]
        hidden.retain_grad()
        loss.backward()
        ours.append(
            {"loss": loss.detach(), "grad": hidden.grad.clone(), "kl": trainer._metrics["eval"]["kl"][-1]}
        )

        weight = model.lm_head.weight.detach()
        full = hidden.detach() @ weight.T
        reference = torch.zeros(input_ids.shape)
        reference[:, P:] = lp + OFFSETS
        rendered_loss_fn = (
            rendered("rlvr", "tiny", tmp_path)["loss_fn"] if not knobs else ctx.config["loss_fn"]
        )
        cases.append({"loss_fn": rendered_loss_fn, "logits": full, "input_ids": input_ids,
                      "token_mask": torch.cat([torch.zeros_like(prompt_ids), completion_mask], 1).float(),
                      "advantages": advantages, "reference_logprobs": reference,
                      "temperature": float(ctx.config["policy"]["generation"]["temperature"])})  # fmt: skip

    upstream = nemo_rl_runtime("grpo_loss", {"cases": cases})
    for name, mine, theirs in zip(LOSS_VARIANTS, ours, upstream, strict=True):
        torch.testing.assert_close(
            mine["loss"], theirs["loss"].to(mine["loss"].dtype), rtol=0, atol=1e-5, msg=name
        )
        grad_logits = theirs["grad"]  # [B, P + C, V]
        assert grad_logits[:, : P - 1].abs().max() == 0, name  # the prompt carries no loss on NeMo-RL either
        assert grad_logits[:, P - 1 :].abs().max() > 1e-3, name  # ...and the completion does
        # chain rule through the LM head: d loss / d h = (d loss / d logits) @ W
        torch.testing.assert_close(mine["grad"], grad_logits @ weight, rtol=0, atol=1e-4, msg=name)
        if theirs["metrics"]["kl_penalty"] and LOSS_VARIANTS[name].get("token_level_loss", True):
            assert mine["kl"] == pytest.approx(theirs["metrics"]["kl_penalty"], rel=1e-5), name


def test_reference_kl_clamps_as_nemo_rl_does() -> None:
    """By hand: past the output clamp a token has value 10 and no gradient; inside every clamp
    the gradient carries the on-policy term."""
    from alignpipe.rl.kl import reference_kl

    lp = torch.zeros(4, requires_grad=True)
    ref = torch.tensor([0.5, 3.0, 25.0, -25.0])
    kl = reference_kl(lp, ref)
    k3 = lambda x: torch.exp(x) - 1 - x  # noqa: E731
    # k3(0.5) inside; k3(3) = 16.1 and k3(-20) = 19 both cut to 10 by the output clamp
    want = torch.stack([k3(ref[0]), torch.tensor(10.0), torch.tensor(10.0), torch.tensor(10.0)])
    torch.testing.assert_close(kl.detach(), want)
    assert k3(torch.tensor(-20.0)).item() > 10 and k3(torch.tensor(3.0)).item() > 10
    kl.sum().backward()
    # d/dlp [w * k3(ref - lp)] at w = 1: k3 + (1 - e^(ref - lp))
    assert lp.grad[0].item() == pytest.approx((k3(ref[0]) + 1 - torch.exp(ref[0])).item(), rel=1e-6)
    assert lp.grad[1].item() == 0.0 and lp.grad[2].item() == 0.0 and lp.grad[3].item() == 0.0
