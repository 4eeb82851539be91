"""On-policy distillation: the student samples, and each sampled token is pulled towards the teacher by a per-token
reverse KL (Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from Self-Generated Mistakes"
(GKD) with the reverse-KL divergence on student samples). Conventions (shapes, masking, sums and counts) as in
:mod:`align_pipeline.losses.ppo`.
"""

from __future__ import annotations

import math

import torch

from align_pipeline.losses.base import LossOutput, check_tokens, count_tokens, fill, float_dtype, masked_sum


def distill_loss(
    logp: torch.Tensor,
    teacher_logp: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float = 1.0,
    advantages: torch.Tensor | None = None,
    reward_weight: float = 0.0,
) -> LossOutput:
    """Per-token reverse KL to a frozen teacher on the student's own samples, optionally mixed with a task reward.

    With ``d_t = logπ_s(y_t) − logπ_t(y_t)`` on the student's sampled tokens y_t ~ π_s::

        loss_t = kl_coef · ½ d_t²  −  reward_weight · A · logπ_s(y_t)

    The first term is the k2 estimator of KL(π_s ‖ π_t) at each position. Its gradient, d_t ∇logπ_s(y_t), is the
    policy gradient of the per-token reverse KL whose reward at t is −d_t, with no credit to earlier tokens (the
    "on-policy distillation" objective: a per-token advantage −d_t, discount 0); the term E[∇logπ_s] that the exact
    derivative of KL adds is zero in expectation under the student's own samples. With the teacher in the place of
    the KL reference this is REINFORCE's KL term with β = ``kl_coef`` and the k2 estimator (the tests check both
    the value and the gradient). The reported ``reverse_kl`` is Σ d_t, the unbiased (k1) estimate of the per-token
    reverse KL; it falls to 0 when the student matches the teacher.

    Args:
      logp: [B, T], log-probs of the sampled tokens under the student (carries grad).
      teacher_logp: [B, T], the same tokens under the frozen teacher.
      mask: [B, T], 1 on the student's tokens (its response; its turns in an episode).
      kl_coef: > 0, the weight of the reverse-KL term.
      advantages: [B] or [B, T], the task reward's advantages (e.g. RLOO's); needed when ``reward_weight`` > 0.
      reward_weight: >= 0, the weight of the task reward's policy-gradient term; 0 = pure distillation.

    Returns ``(loss_sum, count, metrics)``; count: the student's tokens; metrics (sums over them): ``distill_loss``
    (Σ ½ d_t²), ``reverse_kl`` (Σ d_t) and, with a task reward, ``pg_loss`` (Σ −A logπ_s).
    """
    check_tokens("distill_loss", logp=logp, mask=mask, teacher_logp=teacher_logp)
    if not (math.isfinite(kl_coef) and kl_coef > 0):
        raise ValueError(f"distill_loss: kl_coef must be a finite number > 0, got {kl_coef}")
    if not (math.isfinite(reward_weight) and reward_weight >= 0):
        raise ValueError(f"distill_loss: reward_weight must be a finite number >= 0, got {reward_weight}")
    m = mask.bool()  # [B, T]
    dtype = float_dtype(logp)
    logp_ = fill(logp, m, dtype)  # [B, T]
    d = logp_ - fill(teacher_logp.detach(), m, dtype)  # [B, T]  logπ_s − logπ_t
    k2 = 0.5 * d * d  # [B, T]
    losses = kl_coef * k2  # [B, T]
    metrics = {"distill_loss": masked_sum(k2.detach(), m), "reverse_kl": masked_sum(d.detach(), m)}
    if reward_weight > 0:
        if advantages is None:
            raise ValueError("distill_loss: reward_weight > 0 needs advantages")
        if advantages.dim() == 1 and advantages.shape[0] == logp.shape[0]:
            advantages = advantages[:, None].expand_as(logp)  # [B] → [B, T]
        check_tokens("distill_loss", logp=logp, advantages=advantages)
        pg = -fill(advantages.detach(), m, dtype) * logp_  # [B, T]
        losses = losses + reward_weight * pg  # [B, T]
        metrics["pg_loss"] = masked_sum(pg.detach(), m)
    return masked_sum(losses, m), count_tokens(m), metrics
