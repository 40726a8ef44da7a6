"""GRPO's clipped policy-gradient term and its reductions (alignpipe.rl.policy_gradient), by hand.
Agreement with NeMo-RL's ClippedPGLossFn, gradient included, is tests/test_equivalence_grpo.py."""

from __future__ import annotations

import math

import pytest
import torch

from alignpipe.rl.policy_gradient import clipped_policy_gradient, grpo_loss, reduce_tokens


def test_the_clip_bounds_the_ratio_in_the_advantages_direction() -> None:
    # ratios e^0.5 = 1.65 (past 1 + 0.2) and e^-0.5 = 0.61 (past 1 - 0.2)
    logps = torch.tensor([[0.5, -0.5], [0.5, -0.5]])
    old = torch.zeros(2, 2)
    adv = torch.tensor([1.0, -1.0])
    loss, ratio = clipped_policy_gradient(logps, old, adv, torch.ones(2, 2), clip_low=0.2, clip_high=0.2)
    # A > 0: min(1.65, 1.2) = 1.2 and min(0.61, 0.8) = 0.61; A < 0: min(-1.65, -1.2), min(-0.61, -0.8)
    want = torch.tensor([[-1.2, -math.exp(-0.5)], [math.exp(0.5), 0.8]])
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(ratio, torch.exp(logps))


def test_sequence_level_ratio_is_the_exp_of_the_mean_log_ratio_over_valid_tokens() -> None:
    logps = torch.tensor([[0.3, 0.1, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])  # the padded token never counts
    _, ratio = clipped_policy_gradient(
        logps, torch.zeros(1, 3), torch.tensor([1.0]), mask, clip_low=0.2, clip_high=0.2, sequence_level=True
    )
    assert ratio.shape == (1, 1) and ratio.item() == pytest.approx(math.exp(0.2))


def test_token_level_pools_tokens_and_sequence_level_weighs_sequences_equally() -> None:
    x = torch.tensor([[1.0, 1.0, 1.0, 1.0], [3.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    assert reduce_tokens(x, mask, token_level=True, normalizer=5.0).item() == pytest.approx(7 / 5)
    assert reduce_tokens(x, mask, token_level=False, normalizer=1.0).item() == pytest.approx((1 + 3) / 2)


def test_the_kl_term_is_reduced_on_its_own_and_needs_the_reference() -> None:
    logps = torch.zeros(1, 2, requires_grad=True)
    ref = torch.tensor([[0.5, 0.5]])
    common = dict(clip_low=0.2, clip_high=0.2, sequence_level=False, token_level=True, normalizer=2.0)
    adv, mask = torch.tensor([0.0]), torch.ones(1, 2)
    out = grpo_loss(logps, logps.detach(), adv, mask, kl_penalty=0.1, ref_logps=ref, **common)
    k3 = math.exp(0.5) - 1 - 0.5
    assert out.loss.item() == pytest.approx(0.1 * k3)  # the advantage is 0: only the KL term
    with pytest.raises(ValueError, match="ref_logps"):
        grpo_loss(logps, logps.detach(), adv, mask, kl_penalty=0.1, **common)
