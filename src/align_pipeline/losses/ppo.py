"""Policy-gradient losses over response tokens: PPO's clipped policy and value losses and the entropy bonus (the
REINFORCE / GRPO loss is in :mod:`align_pipeline.losses.reinforce`).

Every loss returns ``(loss_sum, count, metrics)`` per :mod:`align_pipeline.losses.base` with ``count`` = number of
response tokens (``mask.sum()``) and every metric a sum over those tokens: after the trainer reduces over micro-batches
and data-parallel ranks, ``metric / count`` is a per-token mean (``clip_fraction / count`` is the fraction of clipped
tokens, ``ratio / count`` the mean ratio). Being per-token sums, outputs that share a batch share a count and add up:
``policy_sum + c1 · value_sum - c2 · entropy_sum`` is PPO eq. 9 (the value loss is usually a separate critic model
with its own step).

Shapes: ``logp``, ``old_logp``, ``ref_logp``, ``values``, ``old_values``, ``returns``, ``advantages`` and ``mask`` are
[B, T]; ``mask`` (float or bool) is 1 on response tokens. Position t holds the action y_t: ``logp[b, t]`` =
log π(y_t | x, y_<t). Only ``logp`` and ``values`` carry gradient; the other inputs are detached. Masked positions are
replaced by 0 before any arithmetic, so garbage there (even inf/NaN) reaches neither the loss nor the gradient.
Computation is float32 (float64 for float64 input).
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
from align_pipeline.rl.kl import kl_k3


def ppo_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float,
) -> LossOutput:
    """PPO clipped surrogate (Schulman et al. 2017, "Proximal Policy Optimization Algorithms", eq. 7), per token.

    ::

        ρ_t    = exp(logp_t - old_logp_t)                                       π_θ / π_θ_old
        loss_t = -min(ρ_t Â_t, clip(ρ_t, 1 - ε, 1 + ε) Â_t)  =  max(-ρ_t Â_t, -clip(ρ_t) Â_t)

    The gradient is 0 where the clipped term is the larger loss: ρ > 1 + ε with Â > 0, or ρ < 1 - ε with Â < 0.

    Args:
      logp: [B, T], log-probs of the sampled tokens under the current policy (carries grad).
      old_logp: [B, T], the same under the rollout policy π_θ_old.
      advantages: [B, T], Â (e.g. whitened GAE).
      mask: [B, T], 1 on response tokens.
      clip_eps: ε in (0, 1).

    Returns ``(loss_sum, count = response tokens, metrics)``; metrics (sums over tokens):
      ``policy_loss`` (= loss_sum), ``clip_fraction`` (1 where the clipped term is strictly the larger loss, i.e. the
      token's gradient is zeroed; a ratio exactly at 1 ± ε is not clipped), ``approx_kl`` (k3 estimate of
      KL(π_θ_old ‖ π_θ) = (ρ - 1) - log ρ, Schulman 2020: unbiased under the rollout samples and ≥ 0),
      ``ratio`` (ρ).
    """
    check_tokens("ppo_policy_loss", logp=logp, old_logp=old_logp, advantages=advantages, mask=mask)
    check_clip("ppo_policy_loss", clip_eps)
    m = mask.bool()  # [B, T]
    dtype = float_dtype(logp)
    logp_, old_ = fill(logp, m, dtype), fill(old_logp.detach(), m, dtype)  # [B, T]
    adv = fill(advantages.detach(), m, dtype)  # [B, T]
    losses, clipped, ratio = clipped_surrogate(logp_, old_, adv, clip_eps)  # [B, T] ×3
    loss_sum = masked_sum(losses, m)  # []
    with torch.no_grad():
        metrics = {
            "policy_loss": loss_sum.detach(),
            "clip_fraction": masked_sum(clipped.to(dtype), m),
            "approx_kl": masked_sum(kl_k3(old_, logp_), m),  # r = exp(logp - old_logp) = ρ
            "ratio": masked_sum(ratio, m),
        }
    return loss_sum, count_tokens(m), metrics


def ppo_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float | None,
) -> LossOutput:
    """Clipped value loss (the L^VF of PPO eq. 9 with OpenAI baselines' ``ppo2`` / NeMo-Aligner's clipping), per token.

    ::

        V_clip = V_old + clip(V - V_old, -ε, ε)
        loss_t = ½ · max((V - R̂)², (V_clip - R̂)²)

    The value may move at most ε (in reward units, not a ratio) from its rollout-time estimate before the gradient
    stops pulling it further (in the direction that the clipped error is the larger one).

    Args:
      values: [B, T], V(s_t) from the critic being trained (carries grad).
      old_values: [B, T], V(s_t) at rollout time (used by GAE).
      returns: [B, T], targets R̂ (e.g. GAE returns, un-whitened).
      mask: [B, T], 1 on response tokens.
      clip_eps: ε > 0, or None for the plain squared error ½ (V - R̂)² (no clipping).

    Returns ``(loss_sum, count = response tokens, metrics)``; metrics: ``value_loss`` (= loss_sum),
    ``value_clip_fraction`` (1 where the clipped error is strictly larger).
    """
    check_tokens("ppo_value_loss", values=values, old_values=old_values, returns=returns, mask=mask)
    if clip_eps is not None and not (math.isfinite(clip_eps) and clip_eps > 0):
        raise ValueError(f"ppo_value_loss: clip_eps must be None or a finite number > 0, got {clip_eps}")
    m = mask.bool()  # [B, T]
    dtype = float_dtype(values)
    v = fill(values, m, dtype)  # [B, T]
    v_old, ret = fill(old_values.detach(), m, dtype), fill(returns.detach(), m, dtype)  # [B, T]
    err = (v - ret) ** 2  # [B, T]
    err_clipped = err if clip_eps is None else (v_old + (v - v_old).clamp(-clip_eps, clip_eps) - ret) ** 2
    losses = 0.5 * torch.maximum(err, err_clipped)  # [B, T]
    loss_sum = masked_sum(losses, m)  # []
    with torch.no_grad():
        metrics = {
            "value_loss": loss_sum.detach(),
            "value_clip_fraction": masked_sum((err_clipped > err).to(dtype), m),
        }
    return loss_sum, count_tokens(m), metrics


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the next-token distribution, H = logsumexp(z) - Σ_v softmax(z)_v z_v. [B, T, V] → [B, T].

    Needs the full vocabulary on this rank: with tensor-parallel (vocab-sharded) logits, compute the entropy with the
    TP all-reduces in the trainer and pass it to :func:`entropy_bonus` instead.
    """
    z = logits.to(float_dtype(logits))  # [B, T, V]
    return torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(dim=-1)  # [B, T]


def entropy_bonus(entropy_or_logits: torch.Tensor, mask: torch.Tensor) -> LossOutput:
    """Entropy bonus S of PPO eq. 9, as a loss to be *added* with weight c2: ``loss_t = -H_t``.

    Args:
      entropy_or_logits: [B, T] per-token entropy, or [B, T, V] logits (entropy computed by
        :func:`entropy_from_logits`). Carries grad.
      mask: [B, T], 1 on response tokens.

    Returns ``(-Σ H, count = response tokens, {"entropy": Σ H})``; the trainer adds ``c2 · loss_sum``.
    """
    if entropy_or_logits.dim() == 3:
        entropy = entropy_from_logits(entropy_or_logits)  # [B, T]
    else:
        entropy = entropy_or_logits  # [B, T]
    check_tokens("entropy_bonus", entropy=entropy, mask=mask)
    m = mask.bool()
    h_sum = masked_sum(fill(entropy, m, float_dtype(entropy)), m)  # []
    return -h_sum, count_tokens(m), {"entropy": h_sum.detach()}
