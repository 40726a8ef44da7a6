"""GRPO advantages on hand-computed examples (NeMo-RL v0.7.0 conventions)."""

import math

import numpy as np
import pytest
import torch

from alignpipe.rl.advantages import (
    baseline_and_std_per_group,
    clip_advantages,
    compute_grpo_advantages,
    exact_sqrt,
    expand_to_tokens,
    frac_zero_std_groups,
    group_ids_from_size,
    group_normalized_advantages,
    leave_one_out_advantages,
)

EPS = 1e-6


def close(a, b, tol=1e-5):
    assert torch.allclose(
        torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32), atol=tol
    ), (a, b)


def test_group_normalized_unbiased_std():
    # Group [1, 0, 0, 0]: mean 0.25; squared deviations 0.5625 + 3 * 0.0625 = 0.75;
    # unbiased variance 0.75 / 3 = 0.25 -> std 0.5 (the population std would be 0.433).
    r = torch.tensor([1.0, 0.0, 0.0, 0.0])
    adv = group_normalized_advantages(r, 4)
    close(adv, [0.75 / (0.5 + EPS), -0.25 / (0.5 + EPS), -0.25 / (0.5 + EPS), -0.25 / (0.5 + EPS)])
    close(adv, [1.5, -0.5, -0.5, -0.5])


def test_group_normalized_two_groups():
    # Group A [2, 4]: mean 3, unbiased std sqrt((1 + 1) / 1) = sqrt(2) -> -+1/sqrt(2).
    # Group B [5, 5, ...] is zero variance -> 0.
    r = torch.tensor([2.0, 4.0, 5.0, 5.0])
    adv = group_normalized_advantages(r, 2)
    s = math.sqrt(2)
    close(adv, [-1 / (s + EPS), 1 / (s + EPS), 0.0, 0.0])


def test_leave_one_out_baseline_unnormalized():
    # [1, 0, 0, 0]: b_0 = mean(0, 0, 0) = 0 -> A_0 = 1; b_1 = mean(1, 0, 0) = 1/3 -> A_1 = -1/3.
    r = torch.tensor([1.0, 0.0, 0.0, 0.0])
    close(leave_one_out_advantages(r, 4), [1.0, -1 / 3, -1 / 3, -1 / 3])
    # [3, 1, 2]: b = [1.5, 2.5, 2.0] -> A = [1.5, -1.5, 0.0]
    close(leave_one_out_advantages(torch.tensor([3.0, 1.0, 2.0]), 3), [1.5, -1.5, 0.0])


def test_leave_one_out_normalized_matches_nemo_rl():
    # [1, 0, 0, 0] with LOO std over S = group minus i, unbiased:
    # i = 0: S = {0, 0, 0}, std 0 -> left unnormalized: A_0 = 1.
    # i = 1: S = {1, 0, 0}, b = 1/3, mean r^2 = 1/3, (1/3 - 1/9) * 3/2 = 1/3 -> std = 1/sqrt(3);
    #        A_1 = (-1/3) / (1/sqrt(3) + 1e-6) = -0.57735
    r = torch.tensor([1.0, 0.0, 0.0, 0.0])
    adv = compute_grpo_advantages(r, 4)  # defaults: LOO on, normalize on
    s = 1 / math.sqrt(3)
    close(adv, [1.0, (-1 / 3) / (s + EPS), (-1 / 3) / (s + EPS), (-1 / 3) / (s + EPS)])
    b, std = baseline_and_std_per_group(r, 4)
    close(b, [0.0, 1 / 3, 1 / 3, 1 / 3])
    close(std, [0.0, s, s, s])


def test_group_std_is_exactly_rounded():
    """The group std scales every normalised advantage: it must be the IEEE-rounded root on any
    CPU, not torch's CPU sqrt (1 ULP off on about one float32 value in seven, differently by CPU
    maker). 0.23809524 is the variance of a leave-one-out group of 7 with 2 ones (rlvr's)."""
    x = torch.cat(
        [
            torch.tensor([0.0, 1.0, 0.23809524, 2.0]),
            torch.rand(100_000, generator=torch.Generator().manual_seed(0)) * 4,
        ]
    )
    exact = torch.from_numpy(np.sqrt(x.numpy().astype(np.float64)).astype(np.float32))
    assert torch.equal(exact_sqrt(x), exact)
    # float64 too: torch's own float64 root is off on about one value in eighty here.
    wide = x[:20_000].double() * (1 + 1e-9)
    assert exact_sqrt(wide).tolist() == [math.sqrt(v) for v in wide.tolist()]
    assert exact_sqrt(torch.tensor([-1e-9, math.nan])).isnan().all()  # as torch.sqrt, no warning
    ones = [1.0, 1.0] + [0.0] * 6
    _, std = baseline_and_std_per_group(torch.tensor(ones), 8)  # LOO: 2 ones of 7, or 1 of 7
    var = torch.tensor([1 / 7, 0.23809524]).double()  # the unbiased variances, exactly
    want = np.sqrt(var.numpy()).astype(np.float32)
    assert std[:2].tolist() == [want[0]] * 2 and std[2:].tolist() == [want[1]] * 6


def test_leave_one_out_group_of_two():
    # G = 2 with LOO: S has one sample, n = 1, the n/(n-1) factor gives NaN -> std 0,
    # so the advantage is the unnormalized difference r_i - r_j.
    r = torch.tensor([2.0, 4.0])
    b, std = baseline_and_std_per_group(r, 2)
    close(b, [4.0, 2.0])
    close(std, [0.0, 0.0])
    close(compute_grpo_advantages(r, 2), [-2.0, 2.0])


def test_zero_variance_group_gives_zero_advantage():
    r = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    for loo in (True, False):
        for norm in (True, False):
            adv = compute_grpo_advantages(r, 4, leave_one_out_baseline=loo, normalize_rewards=norm)
            assert torch.equal(adv, torch.zeros(8)), (loo, norm, adv)
            assert torch.isfinite(adv).all()


def test_normalize_off_is_plain_baseline():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0])
    close(
        compute_grpo_advantages(r, 4, normalize_rewards=False, leave_one_out_baseline=False),
        [0.75, -0.25, -0.25, -0.25],
    )


def test_group_ids_any_layout_matches_contiguous():
    r = torch.tensor([1.0, 5.0, 0.0, 7.0, 0.0, 6.0])
    gids = torch.tensor([0, 1, 0, 1, 0, 1])
    adv = compute_grpo_advantages(r, group_ids=gids)
    contiguous = compute_grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 5.0, 7.0, 6.0]), 3)
    close(adv[[0, 2, 4, 1, 3, 5]], contiguous)
    # prompt token ids [B, S] group like NeMo-RL's torch.unique(prompts, dim=0)
    prompts = torch.tensor([[1, 2], [3, 4], [1, 2], [3, 4], [1, 2], [3, 4]])
    close(compute_grpo_advantages(r, group_ids=prompts), adv)


def test_valid_mask_excludes_samples_and_singletons():
    # Only one valid sample in the group -> baseline = reward, advantage 0 for all.
    r = torch.tensor([1.0, 0.0, 0.0])
    adv = compute_grpo_advantages(r, 3, valid_mask=torch.tensor([1, 0, 0]))
    close(adv, [0.0, 0.0, 0.0])
    # Without LOO, invalid sample 2 is excluded from the mean: b = mean(4, 2) = 3.
    b, _ = baseline_and_std_per_group(
        torch.tensor([4.0, 2.0, 100.0]), 3, valid_mask=torch.tensor([1, 1, 0]), leave_one_out_baseline=False
    )
    close(b, [3.0, 3.0, 3.0])


def test_frac_zero_std_groups():
    r = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5, 0.5])
    assert frac_zero_std_groups(r, 2) == pytest.approx(0.75)  # groups [1,1] [0,1] [0,0] [.5,.5]
    assert frac_zero_std_groups(r, 4) == 0.0
    assert frac_zero_std_groups(torch.tensor([]), 4) == 0.0
    with pytest.raises(ValueError):
        frac_zero_std_groups(r, 3)


def test_shapes_and_helpers():
    assert group_ids_from_size(6, 3).tolist() == [0, 0, 0, 1, 1, 1]
    with pytest.raises(ValueError):
        group_ids_from_size(5, 2)
    with pytest.raises(ValueError):
        compute_grpo_advantages(torch.zeros(4))  # neither group_size nor group_ids
    adv = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    close(expand_to_tokens(adv, mask), [[1.0, 1.0, 0.0], [-2.0, 0.0, 0.0]])
    close(clip_advantages(torch.tensor([-5.0, 0.5, 5.0]), -1.0, 1.0), [-1.0, 0.5, 1.0])
    close(clip_advantages(torch.tensor([-5.0, 5.0]), None, 1.0), [-5.0, 1.0])
    assert compute_grpo_advantages(torch.tensor([1, 0, 0, 0]), 4).dtype == torch.float32  # int rewards ok
