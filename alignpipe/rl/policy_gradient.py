"""GRPO's loss as pure tensor functions: the clipped policy-gradient term and its reductions.

Matches NeMo-RL v0.7.0's ``ClippedPGLossFn`` (algorithms/loss_functions.py) for the settings
the local engine maps (tests/test_equivalence_grpo.py runs both on one batch):

* ``ratio = exp(lp - lp_old)`` per token, or per sequence (the mean log-ratio over its tokens)
  with ``sequence_level`` (GSPO, NeMo-RL's ``sequence_level_importance_ratios``);
* ``pg = -min(ratio * A, clamp(ratio, 1 - clip_low, 1 + clip_high) * A)``;
* the reference KL (:func:`alignpipe.rl.kl.reference_kl`) is reduced on its own and added
  with its coefficient, as NeMo-RL adds its ``kl`` term to the actor loss.

Shapes: ``B`` sequences of ``T`` completion tokens; ``logps``, ``old_logps``, ``mask``
``[B, T]``; ``advantages`` ``[B]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from alignpipe.rl.kl import reference_kl

__all__ = ["PolicyLoss", "clipped_policy_gradient", "grpo_loss", "reduce_tokens"]


def clipped_policy_gradient(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    sequence_level: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate, negated for minimising: ``(per-token loss, ratio)``, each ``[B, T]``
    (``[B, 1]`` with ``sequence_level``: one ratio per sequence, broadcast over its tokens)."""
    log_ratio = logps - old_logps
    if sequence_level:
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    ratio = torch.exp(log_ratio)
    adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    clipped = torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    return -torch.min(ratio * adv, clipped * adv), ratio


def reduce_tokens(
    per_token: torch.Tensor, mask: torch.Tensor, *, token_level: bool, normalizer: torch.Tensor | float
) -> torch.Tensor:
    """A per-token quantity ``[B, T]`` (or ``[B, 1]``) -> the scalar a micro-batch contributes.

    ``token_level`` (NeMo-RL's ``token_level_loss``, DAPO): ``sum(x * mask) / normalizer``,
    where ``normalizer`` is the global batch's valid-token count scaled to this micro-batch's
    share, so the micro-batches of an optimizer step add up to one token mean. Otherwise the
    mean over sequences of each sequence's token mean, divided by ``normalizer`` (the number of
    micro-batches the step accumulates)."""
    if token_level:
        return (per_token * mask).sum() / normalizer
    return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / normalizer


@dataclass(frozen=True)
class PolicyLoss:
    """One micro-batch's GRPO loss and what a trainer logs of it (all ``[B, T]`` but ``loss``)."""

    loss: torch.Tensor  # scalar, to backpropagate
    ratio: torch.Tensor  # importance ratio; [B, 1] at sequence level
    kl: torch.Tensor | None  # reference_kl per token; None without a KL penalty

    def clipped(self, advantages: torch.Tensor, clip_low: float, clip_high: float) -> torch.Tensor:
        """Where the clip bound the objective: the ratio past it in the advantage's direction."""
        adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
        return ((self.ratio < 1 - clip_low) & (adv < 0)) | ((self.ratio > 1 + clip_high) & (adv > 0))


def grpo_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    sequence_level: bool,
    token_level: bool,
    normalizer: torch.Tensor | float,
    kl_penalty: float = 0.0,
    ref_logps: torch.Tensor | None = None,
    kl_input_clamp: float | None = 20.0,
    kl_output_clamp: float | None = 10.0,
) -> PolicyLoss:
    """``reduce(pg) + kl_penalty * reduce(reference_kl)``, each term reduced as :func:`reduce_tokens`
    says (``kl_penalty`` is NeMo-RL's ``reference_policy_kl_penalty``; ``ref_logps`` is required
    when it is not 0)."""
    per_token, ratio = clipped_policy_gradient(
        logps,
        old_logps,
        advantages,
        mask,
        clip_low=clip_low,
        clip_high=clip_high,
        sequence_level=sequence_level,
    )
    loss = reduce_tokens(per_token, mask, token_level=token_level, normalizer=normalizer)
    kl = None
    if kl_penalty:
        if ref_logps is None:
            raise ValueError("a KL penalty needs the reference's log-probs (ref_logps)")
        kl = reference_kl(logps, ref_logps, kl_input_clamp, kl_output_clamp)
        loss = loss + kl_penalty * reduce_tokens(kl, mask, token_level=token_level, normalizer=normalizer)
    return PolicyLoss(loss=loss, ratio=ratio, kl=kl)
