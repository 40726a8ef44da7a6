"""GRPO advantage math, as pure tensor functions (verl ``core_algos`` style).

Matches NeMo-RL v0.7.0 (``nemo_rl/algorithms/utils.py::calculate_baseline_and_std_per_prompt``
and ``advantage_estimator.py::GRPOAdvantageEstimator``):

* for sample ``i`` the baseline set ``S`` is its group minus ``i`` with the leave-one-out
  baseline (default), or the whole group without it; ``n = |S|`` counts valid samples;
* ``b_i = mean_{j in S} r_j``;
* ``std_i = sqrt((mean_{j in S} r_j^2 - b_i^2) * n / (n - 1))`` -- the *unbiased* (Bessel)
  sample std over ``S``; NaN (``n == 1``) becomes 0;
* a group with at most one valid sample gets ``b_i = r_i`` (advantage 0);
* ``A_i = r_i - b_i``; with ``normalize_rewards``, and only where ``std_i > 0``,
  ``A_i = A_i / (std_i + 1e-6)``. Zero-variance groups are left unnormalized (their
  advantage is 0 anyway).

Shapes: ``B`` = batch of samples = ``num_groups * G`` when groups are contiguous blocks of
``G`` (``group_size``), or any layout given ``group_ids`` of shape ``[B]``.
"""

from __future__ import annotations

import math

import numpy as np
import torch

__all__ = [
    "EPSILON",
    "baseline_and_std_per_group",
    "clip_advantages",
    "compute_grpo_advantages",
    "exact_sqrt",
    "expand_to_tokens",
    "frac_zero_std_groups",
    "group_ids_from_size",
    "group_normalized_advantages",
    "leave_one_out_advantages",
    "reward_std",
    "step_advantages",
]

EPSILON = 1e-6  # NeMo-RL's epsilon in A / (std + eps)


def group_ids_from_size(batch_size: int, group_size: int, device=None) -> torch.Tensor:
    """Group ids ``[B]`` for contiguous groups: ``[0]*G + [1]*G + ...``.

    Raises ``ValueError`` unless ``batch_size`` is a multiple of ``group_size``.
    """
    if group_size < 1 or batch_size % group_size:
        raise ValueError(f"batch size {batch_size} is not a multiple of group size {group_size}")
    return torch.arange(batch_size // group_size, device=device).repeat_interleave(group_size)


def _resolve_groups(rewards: torch.Tensor, group_size: int | None, group_ids: torch.Tensor | None):
    if rewards.dim() != 1:
        raise ValueError(f"rewards must have shape [B], got {tuple(rewards.shape)}")
    if (group_size is None) == (group_ids is None):
        raise ValueError("give exactly one of group_size or group_ids")
    if group_ids is None:
        return group_ids_from_size(rewards.shape[0], group_size, rewards.device)
    if group_ids.shape[0] != rewards.shape[0]:
        raise ValueError(f"group_ids {tuple(group_ids.shape)} do not match rewards {tuple(rewards.shape)}")
    return group_ids.to(rewards.device)


def baseline_and_std_per_group(
    rewards: torch.Tensor,
    group_size: int | None = None,
    *,
    group_ids: torch.Tensor | None = None,
    valid_mask: torch.Tensor | None = None,
    leave_one_out_baseline: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample baseline and std, NeMo-RL v0.7.0 convention.

    Args:
        rewards: ``[B]`` float rewards.
        group_size: ``G``, for contiguous groups (``B % G == 0``); or
        group_ids: ``[B]`` ints (or ``[B, S]`` prompt token ids) naming each sample's group.
        valid_mask: ``[B]`` 0/1; 0 excludes a sample from every baseline (default all 1).
        leave_one_out_baseline: exclude sample ``i`` from its own baseline (RLOO).

    Returns:
        ``(baseline [B], std [B])`` on ``rewards.device``.
    """
    if group_ids is not None and group_ids.dim() == 2:  # prompt token ids, as NeMo-RL groups
        group_ids = torch.unique(group_ids, dim=0, return_inverse=True)[1]
    gids = _resolve_groups(rewards, group_size, group_ids)
    r = rewards.float() if not rewards.is_floating_point() else rewards
    valid = torch.ones_like(r) if valid_mask is None else valid_mask.to(r.dtype).to(r.device)
    baseline = torch.zeros_like(r)
    std = torch.zeros_like(r)
    for g in torch.unique(gids):
        idx = torch.nonzero(gids == g, as_tuple=True)[0]
        k = idx.numel()
        rg, vg = r[idx], valid[idx]
        if vg.sum() <= 1:
            baseline[idx] = rg  # nothing to compare with: advantage 0
            continue
        if leave_one_out_baseline:
            m = 1 - torch.eye(k, dtype=r.dtype, device=r.device)
        else:
            m = torch.ones((k, k), dtype=r.dtype, device=r.device)
        n = vg.sum() - int(leave_one_out_baseline)
        b = (m @ (rg * vg)) / n
        sq = (m @ (rg.pow(2) * vg)) / n
        baseline[idx] = b
        std[idx] = exact_sqrt((sq - b.square()) * (n / (n - 1))).nan_to_num(0)
    return baseline, std


def compute_grpo_advantages(
    rewards: torch.Tensor,
    group_size: int | None = None,
    *,
    group_ids: torch.Tensor | None = None,
    valid_mask: torch.Tensor | None = None,
    normalize_rewards: bool = True,
    leave_one_out_baseline: bool = True,
    epsilon: float = EPSILON,
) -> torch.Tensor:
    """GRPO advantages ``[B]`` (NeMo-RL ``GRPOAdvantageEstimator``, defaults as in its configs).

    ``A = r - b``; if ``normalize_rewards``: ``A / (std + epsilon)`` where ``std > 0``.
    Use :func:`expand_to_tokens` for the ``[B, T]`` token-level form.
    """
    baseline, std = baseline_and_std_per_group(
        rewards,
        group_size,
        group_ids=group_ids,
        valid_mask=valid_mask,
        leave_one_out_baseline=leave_one_out_baseline,
    )
    adv = rewards.to(baseline.dtype) - baseline
    if normalize_rewards:
        nz = std > 0  # don't sharpen groups with no variation
        adv = torch.where(nz, adv / (std + epsilon), adv)
    return adv


def step_advantages(
    rewards: torch.Tensor,
    prompt_ids: torch.Tensor,
    *,
    normalize_rewards: bool,
    leave_one_out_baseline: bool,
    clip: tuple[float | None, float | None] = (None, None),
) -> torch.Tensor:
    """One GRPO step's advantages ``[B]`` as NeMo-RL v0.7.0's grpo_train computes them.

    A group is every sample whose prompt token ids ``[B, S]`` are identical, so a prompt drawn
    twice in one step forms one group of ``2G`` (NeMo-RL's ``prompt_ids_for_adv``), not two
    blocks of ``G``. A NaN reward (unknown: a judge that failed) is left out of every baseline
    and gets advantage 0. Then ``clamp(clip_low, clip_high)`` (``_clip_grpo_advantages``).
    """
    valid = ~torch.isnan(rewards)
    adv = compute_grpo_advantages(
        torch.nan_to_num(rewards, nan=0.0),
        group_ids=prompt_ids,
        valid_mask=valid,
        normalize_rewards=normalize_rewards,
        leave_one_out_baseline=leave_one_out_baseline,
    )
    adv = torch.where(valid, adv, torch.zeros_like(adv))
    return clip_advantages(adv, *clip)


def group_normalized_advantages(
    rewards: torch.Tensor, group_size: int, epsilon: float = EPSILON
) -> torch.Tensor:
    """Plain GRPO: ``(r - mean_group) / (std_group + eps)``, unbiased std over the whole group.

    ``rewards [B]`` -> ``[B]``; zero-variance groups get 0.
    """
    return compute_grpo_advantages(
        rewards, group_size, normalize_rewards=True, leave_one_out_baseline=False, epsilon=epsilon
    )


def leave_one_out_advantages(
    rewards: torch.Tensor,
    group_size: int,
    normalize_rewards: bool = False,
    epsilon: float = EPSILON,
) -> torch.Tensor:
    """RLOO: ``r_i - mean_{j != i} r_j`` (``[B]`` -> ``[B]``); optionally divided by the LOO std."""
    return compute_grpo_advantages(
        rewards,
        group_size,
        normalize_rewards=normalize_rewards,
        leave_one_out_baseline=True,
        epsilon=epsilon,
    )


def frac_zero_std_groups(rewards: torch.Tensor, group_size: int) -> float:
    """Fraction of groups whose rewards are all equal (no learning signal for GRPO).

    ``rewards [B]`` with contiguous groups of ``group_size``; returns a float in [0, 1].
    """
    if rewards.numel() == 0:
        return 0.0
    grouped = rewards.reshape(-1, group_size) if rewards.numel() % group_size == 0 else None
    if grouped is None:
        raise ValueError(f"batch size {rewards.numel()} is not a multiple of group size {group_size}")
    zero = grouped.max(dim=1).values == grouped.min(dim=1).values
    return float(zero.float().mean().item())


def reward_std(rewards: torch.Tensor) -> float:
    """The batch's sample std (Bessel), NaN rewards left out, as TRL logs ``reward_std``, with
    an IEEE-rounded square root (see :func:`exact_sqrt`): TRL's own differed between Intel and
    AMD CPUs."""
    r = rewards[~rewards.isnan()].double()
    return math.sqrt(r.var().item()) if r.numel() > 1 else math.nan


def exact_sqrt(x: torch.Tensor) -> torch.Tensor:
    """``x.sqrt()`` rounded as IEEE 754 asks, on any CPU. torch's CPU ``sqrt`` is not, in float32
    nor float64: MKL's vector math starts from the CPU's approximate reciprocal square root, so
    some values are 1 ULP off, and which ones differs between CPU makers (benchmarks/RESULTS.md,
    "torch's sqrt"). numpy's root is the CPU's own square-root instruction, exact on every CPU.
    Negative inputs give NaN, as ``torch.sqrt``."""
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.float64) or x.requires_grad:
        return x.sqrt()
    with np.errstate(invalid="ignore"):
        return torch.from_numpy(np.sqrt(x.numpy()))


def expand_to_tokens(advantages: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Broadcast ``[B]`` sample advantages to ``[B, T]`` tokens, zero where ``response_mask`` is 0."""
    return advantages.unsqueeze(-1).expand(response_mask.shape) * response_mask.to(advantages.dtype)


def clip_advantages(
    advantages: torch.Tensor, low: float | None = None, high: float | None = None
) -> torch.Tensor:
    """``clamp(A, low, high)`` if either bound is set (NeMo-RL ``advantage_clip_low/high``)."""
    if low is None and high is None:
        return advantages
    return advantages.clamp(min=low, max=high)
