"""Preference losses and pair metrics as pure tensor functions: DPO (NeMo-RL's ``DPOLossFn``) and
the Bradley-Terry reward model (``PreferenceLossFn``) share one margin and one summary.

Shapes: ``N`` pairs; per-pair tensors ``[N]``; per-token ``[N, T]`` with a 0/1 ``mask``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["bradley_terry_loss", "chosen_nll", "dpo_loss", "pair_summary"]


def bradley_terry_loss(margin: torch.Tensor) -> torch.Tensor:
    """``-log sigmoid(margin)`` per pair ``[N]``: the chosen side should score higher."""
    return -F.logsigmoid(margin)


def dpo_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    *,
    beta: float,
    tokens: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """DPO's loss per pair ``[N]``: ``BT(beta * (ratio_chosen - ratio_rejected))`` with
    ``ratio = sum_t (log pi - log pi_ref)`` over the response, or that sum divided by the
    response's token count (``tokens``: chosen and rejected counts ``[N]``; NeMo-RL's
    ``preference_average_log_probs``)."""
    chosen = chosen_logps - ref_chosen_logps
    rejected = rejected_logps - ref_rejected_logps
    if tokens is not None:
        chosen = chosen / tokens[0].clamp(min=1.0)
        rejected = rejected / tokens[1].clamp(min=1.0)
    return bradley_terry_loss(beta * (chosen - rejected))


def chosen_nll(per_token_logps: torch.Tensor, mask: torch.Tensor, average: bool) -> torch.Tensor:
    """DPO's SFT term (NeMo-RL's ``NLLLossFn(dpo_loss=True)``): each chosen response's NLL, summed
    over its tokens or averaged (``sft_average_log_probs``), then the mean over pairs. Rows are
    ``[chosen..., rejected...]`` (``[2N, T]``)."""
    chosen, _ = per_token_logps.chunk(2, dim=0)
    chosen_mask, _ = mask.chunk(2, dim=0)
    nll = -(chosen * chosen_mask).sum(-1)
    if average:
        nll = nll / chosen_mask.sum(-1).clamp(min=1)
    return nll.mean()


def pair_summary(chosen: torch.Tensor, rejected: torch.Tensor) -> dict[str, float]:
    """How scores ``[N]`` rank pairs: ``loss`` (Bradley-Terry on the margin), ``accuracy`` (chosen
    strictly higher; exact ties, as where a policy still equals its reference, count as wrong),
    the mean ``margin`` and each side's mean."""
    margin = chosen - rejected
    return {
        "loss": float(bradley_terry_loss(margin).mean()),
        "accuracy": float((margin > 0).float().mean()),
        "margin": float(margin.mean()),
        "chosen": float(chosen.mean()),
        "rejected": float(rejected.mean()),
    }
