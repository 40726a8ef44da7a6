"""The KL term of GRPO's loss against the reference policy, as a pure tensor function.

Shapes: ``B`` sequences of ``T`` tokens; inputs and output are per-token ``[B, T]``. The
estimate every *reported* KL uses (``heldout/kl_to_reference``, evaluate's ``kl_to_sft``) is
``alignpipe.measure.logprobs.kl_to_reference``: the same k3 estimator, unclamped, averaged
over sampled tokens.
"""

from __future__ import annotations

__all__ = ["reference_kl"]


def reference_kl(logps, ref_logps, input_clamp: float | None = 20.0, output_clamp: float | None = 10.0):
    """Per-token k3 KL penalty ``[B, T]`` as NeMo-RL v0.7.0's ``ClippedPGLossFn`` computes it
    (algorithms/utils.py ``calculate_kl``), so both engines follow the same gradient:

    * ``logr = clamp(ref - lp, +-input_clamp)``; ``k3 = exp(logr) - 1 - logr``;
    * times ``exp(lp - sg(lp))``: value 1, but it adds the score-function gradient of a KL
      whose samples come from the policy itself (detached where the input clamp bites);
    * then ``clamp(+-output_clamp)``: a token past it contributes no gradient.

    TRL's own term (``use_bias_correction_kl``) has the same weight but neither clamp.
    """
    import torch

    weight = torch.exp(logps - logps.detach())
    logr = ref_logps - logps
    if input_clamp is not None:
        clamped = logr.clamp(min=-input_clamp, max=input_clamp)
        weight = torch.where(logr == clamped, weight, weight.detach())
        logr = clamped
    kl = weight * (torch.exp(logr) - 1 - logr)
    if output_clamp is not None:
        kl = kl.clamp(min=-output_clamp, max=output_clamp)
    return kl
