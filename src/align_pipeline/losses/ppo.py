"""Policy-gradient losses over response tokens: PPO's clipped policy and value losses, the entropy bonus, and the
REINFORCE / GRPO loss.

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

from align_pipeline.losses.base import LossOutput
from align_pipeline.rl.kl import KLEstimator, kl_k3, kl_penalty


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
    _check_tokens("ppo_policy_loss", logp=logp, old_logp=old_logp, advantages=advantages, mask=mask)
    _check_clip("ppo_policy_loss", clip_eps)
    m = mask.bool()  # [B, T]
    dtype = _float_dtype(logp)
    logp_, old_ = _fill(logp, m, dtype), _fill(old_logp.detach(), m, dtype)  # [B, T]
    adv = _fill(advantages.detach(), m, dtype)  # [B, T]
    losses, clipped, ratio = _clipped_surrogate(logp_, old_, adv, clip_eps)  # [B, T] ×3
    loss_sum = _masked_sum(losses, m)  # []
    with torch.no_grad():
        metrics = {
            "policy_loss": loss_sum.detach(),
            "clip_fraction": _masked_sum(clipped.to(dtype), m),
            "approx_kl": _masked_sum(kl_k3(old_, logp_), m),  # r = exp(logp - old_logp) = ρ
            "ratio": _masked_sum(ratio, m),
        }
    return loss_sum, _count(m), metrics


def ppo_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float,
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
      clip_eps: ε > 0.

    Returns ``(loss_sum, count = response tokens, metrics)``; metrics: ``value_loss`` (= loss_sum),
    ``value_clip_fraction`` (1 where the clipped error is strictly larger).
    """
    _check_tokens("ppo_value_loss", values=values, old_values=old_values, returns=returns, mask=mask)
    if not (math.isfinite(clip_eps) and clip_eps > 0):
        raise ValueError(f"ppo_value_loss: clip_eps must be a finite number > 0, got {clip_eps}")
    m = mask.bool()  # [B, T]
    dtype = _float_dtype(values)
    v = _fill(values, m, dtype)  # [B, T]
    v_old, ret = _fill(old_values.detach(), m, dtype), _fill(returns.detach(), m, dtype)  # [B, T]
    v_clipped = v_old + (v - v_old).clamp(-clip_eps, clip_eps)  # [B, T]
    err, err_clipped = (v - ret) ** 2, (v_clipped - ret) ** 2  # [B, T]
    losses = 0.5 * torch.maximum(err, err_clipped)  # [B, T]
    loss_sum = _masked_sum(losses, m)  # []
    with torch.no_grad():
        metrics = {
            "value_loss": loss_sum.detach(),
            "value_clip_fraction": _masked_sum((err_clipped > err).to(dtype), m),
        }
    return loss_sum, _count(m), metrics


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the next-token distribution, H = logsumexp(z) - Σ_v softmax(z)_v z_v. [B, T, V] → [B, T].

    Needs the full vocabulary on this rank: with tensor-parallel (vocab-sharded) logits, compute the entropy with the
    TP all-reduces in the trainer and pass it to :func:`entropy_bonus` instead.
    """
    z = logits.to(_float_dtype(logits))  # [B, T, V]
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
    _check_tokens("entropy_bonus", entropy=entropy, mask=mask)
    m = mask.bool()
    h_sum = _masked_sum(_fill(entropy, m, _float_dtype(entropy)), m)  # []
    return -h_sum, _count(m), {"entropy": h_sum.detach()}


def reinforce_loss(
    logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
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
      ref_logp: [B, T], log-probs under the frozen reference; needed when ``kl_coef > 0``; when given, the ``kl``
        metric is reported even with ``kl_coef = 0``.
      kl_coef: β ≥ 0.
      estimator: ``"k1"`` | ``"k2"`` | ``"k3"``.
      old_logp: [B, T], log-probs under the rollout policy; switches on the clipped ratio form.
      clip_eps: ε in (0, 1), used only with ``old_logp``.

    Returns ``(loss_sum, count = response tokens, metrics)``; metrics: ``pg_loss`` (Σ of the policy-gradient term),
    ``kl`` (Σ KL_t, unweighted; 0 without ``ref_logp``), and with ``old_logp`` also ``clip_fraction`` and ``ratio``.
    """
    _check_tokens("reinforce_loss", logp=logp, mask=mask)
    m = mask.bool()  # [B, T]
    dtype = _float_dtype(logp)
    if advantages.dim() == 1 and advantages.shape[0] == logp.shape[0]:
        advantages = advantages[:, None].expand_as(logp)  # [B] → [B, T]
    _check_tokens("reinforce_loss", logp=logp, advantages=advantages)
    if not (math.isfinite(kl_coef) and kl_coef >= 0):
        raise ValueError(f"reinforce_loss: kl_coef must be a finite number >= 0, got {kl_coef}")
    if kl_coef > 0 and ref_logp is None:
        raise ValueError("reinforce_loss: kl_coef > 0 needs ref_logp")
    logp_ = _fill(logp, m, dtype)  # [B, T]
    adv = _fill(advantages.detach(), m, dtype)  # [B, T]
    metrics: dict[str, torch.Tensor] = {}
    if old_logp is None:
        pg = -adv * logp_  # [B, T]
    else:
        _check_tokens("reinforce_loss", logp=logp, old_logp=old_logp)
        _check_clip("reinforce_loss", clip_eps)
        pg, clipped, ratio = _clipped_surrogate(logp_, _fill(old_logp.detach(), m, dtype), adv, clip_eps)  # [B, T]
        with torch.no_grad():
            metrics["clip_fraction"] = _masked_sum(clipped.to(dtype), m)
            metrics["ratio"] = _masked_sum(ratio, m)
    losses = pg  # [B, T]
    if ref_logp is not None:
        _check_tokens("reinforce_loss", logp=logp, ref_logp=ref_logp)
        kl = kl_penalty(logp_, _fill(ref_logp.detach(), m, dtype), estimator)  # [B, T]
        if kl_coef > 0:
            losses = losses + kl_coef * kl  # [B, T]
        kl_sum = _masked_sum(kl.detach(), m)
    else:
        kl_sum = torch.zeros((), dtype=dtype, device=logp.device)
    loss_sum = _masked_sum(losses, m)  # []
    metrics = {"pg_loss": _masked_sum(pg.detach(), m), "kl": kl_sum, **metrics}
    return loss_sum, _count(m), metrics


# --------------------------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------------------------


def _clipped_surrogate(
    logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, clip_eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token ``(loss, clipped, ratio)`` of PPO eq. 7 on already-filled [B, T] tensors."""
    ratio = torch.exp(logp - old_logp)  # [B, T]  ρ
    unclipped = -adv * ratio  # [B, T]
    clipped = -adv * ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps)  # [B, T]
    return torch.maximum(unclipped, clipped), (clipped > unclipped).detach(), ratio.detach()


def _fill(x: torch.Tensor, m: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x where m, else 0 (before any arithmetic, so masked garbage cannot make NaN gradients)."""
    return torch.where(m, x.to(dtype), 0.0)


def _masked_sum(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return torch.where(m, x, 0.0).sum()


def _count(m: torch.Tensor) -> torch.Tensor:
    return m.sum().to(torch.int)


def _float_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _check_clip(fn: str, clip_eps: float) -> None:
    if not (math.isfinite(clip_eps) and 0 < clip_eps < 1):
        raise ValueError(f"{fn}: clip_eps must be in (0, 1), got {clip_eps}")


def _check_tokens(fn: str, **tensors: torch.Tensor) -> None:
    shapes = {name: tuple(x.shape) for name, x in tensors.items()}
    first = next(iter(shapes.values()))
    if len(first) != 2 or any(s != first for s in shapes.values()):
        raise ValueError(f"{fn}: expected [B, T] tensors of one shape; got {shapes}")
