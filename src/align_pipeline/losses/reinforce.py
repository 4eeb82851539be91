"""The REINFORCE-family loss (RLOO, GRPO): per-token policy gradient with a group baseline's advantages, optionally
PPO's clipped ratio, plus a KL-to-reference term. Conventions (shapes, masking, sums and counts) as in
:mod:`align_pipeline.losses.ppo`.
"""

from __future__ import annotations

import math

import torch

from align_pipeline.losses.base import (
    LossOutput,
    check_clip,
    check_tokens,
    clipped_surrogate,
    count_tokens,
    fill,
    float_dtype,
    masked_sum,
)
from align_pipeline.rl.kl import KLEstimator, kl_penalty


def reinforce_loss(
    logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    ref_logp: torch.Tensor | None = None,
    beta: float = 0.0,
    estimator: KLEstimator = "k3",
    old_logp: torch.Tensor | None = None,
    clip_eps: float = 0.2,
) -> LossOutput:
    """REINFORCE-family per-token policy-gradient loss with an optional KL-to-reference term (RLOO, GRPO).

    Without ``old_logp`` (on-policy, one gradient step per rollout; RLOO, Ahmadian et al. 2024)::

        loss_t = -A · logπ_θ(y_t)  +  β · KL_t

    With ``old_logp`` (several steps per rollout; GRPO, Shao et al. 2024 "DeepSeekMath" eq. 3), PPO's clipped
    surrogate replaces the first term (see :func:`ppo_policy_loss`)::

        loss_t = -min(ρ_t A, clip(ρ_t, 1 - ε, 1 + ε) A)  +  β · KL_t,     ρ_t = π_θ(y_t) / π_θ_old(y_t)

    KL_t = ``kl_penalty(logp, ref_logp, estimator)``; the default ``"k3"`` is DeepSeekMath eq. 4. Its gradient flows
    through ``logp`` only. Normalisation is per token over the whole batch (count = response tokens, as DAPO /
    Dr. GRPO), not eq. 3's per-sequence 1/|o_i| followed by a mean over the group.

    Args:
      logp: [B, T], log-probs of the sampled tokens under the policy (carries grad).
      advantages: [B] (one per sequence, e.g. ``rloo_advantages(...).flatten()``) or [B, T].
      mask: [B, T], 1 on response tokens.
      ref_logp: [B, T], log-probs under the frozen reference; needed when ``beta > 0``; when given, the ``kl``
        metric is reported even with ``beta = 0``.
      beta: β ≥ 0, the KL coefficient.
      estimator: ``"k2"`` | ``"k3"`` (``"k1"`` only with ``beta = 0``, as a reported metric: as a loss term its
        gradient ∇ log π is zero in expectation under the policy's own samples, so it only adds noise).
      old_logp: [B, T], log-probs under the rollout policy; switches on the clipped ratio form.
      clip_eps: ε in (0, 1), used only with ``old_logp``.

    Returns ``(loss_sum, count = response tokens, metrics)``; metrics: ``pg_loss`` (Σ of the policy-gradient term),
    ``kl`` (Σ KL_t, unweighted; 0 without ``ref_logp``), and with ``old_logp`` also ``clip_fraction`` and ``ratio``.
    """
    check_tokens("reinforce_loss", logp=logp, mask=mask)
    m = mask.bool()  # [B, T]
    dtype = float_dtype(logp)
    if advantages.dim() == 1 and advantages.shape[0] == logp.shape[0]:
        advantages = advantages[:, None].expand_as(logp)  # [B] → [B, T]
    check_tokens("reinforce_loss", logp=logp, advantages=advantages)
    if not (math.isfinite(beta) and beta >= 0):
        raise ValueError(f"reinforce_loss: beta must be a finite number >= 0, got {beta}")
    if beta > 0 and ref_logp is None:
        raise ValueError("reinforce_loss: beta > 0 needs ref_logp")
    if beta > 0 and estimator == "k1":
        raise ValueError("reinforce_loss: k1's gradient is zero in expectation as a loss term (E_pi[grad log pi] = 0); "
                         "use k3 (or k2)")
    logp_ = fill(logp, m, dtype)  # [B, T]
    adv = fill(advantages.detach(), m, dtype)  # [B, T]
    metrics: dict[str, torch.Tensor] = {}
    if old_logp is None:
        pg = -adv * logp_  # [B, T]
    else:
        check_tokens("reinforce_loss", logp=logp, old_logp=old_logp)
        check_clip("reinforce_loss", clip_eps)
        pg, clipped, ratio = clipped_surrogate(logp_, fill(old_logp.detach(), m, dtype), adv, clip_eps)  # [B, T]
        with torch.no_grad():
            metrics["clip_fraction"] = masked_sum(clipped.to(dtype), m)
            metrics["ratio"] = masked_sum(ratio, m)
    losses = pg  # [B, T]
    if ref_logp is not None:
        check_tokens("reinforce_loss", logp=logp, ref_logp=ref_logp)
        kl = kl_penalty(logp_, fill(ref_logp.detach(), m, dtype), estimator)  # [B, T]
        if beta > 0:
            losses = losses + beta * kl  # [B, T]
        kl_sum = masked_sum(kl.detach(), m)
    else:
        kl_sum = torch.zeros((), dtype=dtype, device=logp.device)
    loss_sum = masked_sum(losses, m)  # []
    metrics = {"pg_loss": masked_sum(pg.detach(), m), "kl": kl_sum, **metrics}
    return loss_sum, count_tokens(m), metrics


# --------------------------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------------------------
