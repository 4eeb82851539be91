"""The REINFORCE-family loss (RLOO, GRPO): per-token policy gradient with a group baseline's advantages, optionally
PPO's clipped ratio, plus a KL-to-reference term. Conventions (shapes, masking, sums and counts) as in
:mod:`align_pipeline.losses.ppo`.
"""

from __future__ import annotations

import math
from typing import Literal

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

RolloutCorrection = Literal["none", "tis", "mis"]
Objective = Literal["clip", "cispo"]
Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "dr_grpo"]
RatioLevel = Literal["token", "sequence"]


def sequence_ratio(logp: torch.Tensor, old_logp: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """GSPO's importance ratio, per token ([B, T], filled inputs): its value is the whole response's length-normalised
    ratio s_i = exp(mean_t (logπ_θ - logπ_old)) on every token of row i, and its gradient is s_i ∇logπ_θ(y_t)
    (GSPO-token, Zheng et al. 2025 "Group Sequence Policy Optimization", eq. 13/14: s_i,t = sg[s_i] · π_θ(y_t) /
    sg[π_θ(y_t)])."""
    lengths = m.sum(-1, keepdim=True).clamp(min=1)  # [B, 1]
    log_s = (torch.where(m, logp - old_logp, 0.0).sum(-1, keepdim=True) / lengths).detach()  # [B, 1]
    return torch.exp(log_s + logp - logp.detach())  # [B, T]


def rollout_correction_weights(train_logp: torch.Tensor, rollout_logp: torch.Tensor, m: torch.Tensor,
                               correction: RolloutCorrection, tis_cap: float, mis_low: float, mis_high: float
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token importance weights for the rollout-training mismatch, and which tokens were dropped ([B, T] each).

    The rollout engine samples with its own kernels (KV-cached decode, CUDA graphs, other precisions), so its
    log-probs differ from the training forward's for the same policy: the samples come from π_rollout while the
    gradient assumes π_θ_old. With ``r_t = π_θ_old(y_t) / π_rollout(y_t)``::

        none   w_t = 1                                   (the mismatch is ignored, as before)
        tis    w_t = min(r_t, C)                         truncated IS (Yao et al. 2025, "Your Efficient RL Framework
                                                         Secretly Brings You Off-Policy RL Training"; TRL's
                                                         vllm_importance_sampling_cap, default 2)
        mis    w_t = r_t if low <= r_t <= high, else 0   masked IS: tokens whose engine log-prob strays beyond the
                                                         band are left out of the gradient, the rest reweighted

    Both are exactly 1 when the two log-probs agree (the identity the tests check). Inputs are filled [B, T]
    tensors; no gradient flows through the weights."""
    ratio = torch.exp((train_logp - rollout_logp).detach())  # [B, T]  r_t
    if correction == "tis":
        return torch.clamp(ratio, max=tis_cap), torch.zeros_like(m)
    if correction == "mis":
        keep = (ratio >= mis_low) & (ratio <= mis_high) & m  # [B, T]
        return torch.where(keep, ratio, 0.0), m & ~keep
    return torch.ones_like(ratio), torch.zeros_like(m)


def reinforce_loss(
    logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    ref_logp: torch.Tensor | None = None,
    beta: float = 0.0,
    estimator: KLEstimator = "k3",
    old_logp: torch.Tensor | None = None,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    objective: Objective = "clip",
    ratio_level: RatioLevel = "token",
    aggregation: Aggregation = "token_mean",
    max_tokens: int | None = None,
    rollout_logp: torch.Tensor | None = None,
    correction: RolloutCorrection = "none",
    tis_cap: float = 2.0,
    mis_low: float = 0.5,
    mis_high: float = 2.0,
) -> LossOutput:
    """REINFORCE-family per-token policy-gradient loss with an optional KL-to-reference term (RLOO, GRPO).

    Without ``old_logp`` (on-policy, one gradient step per rollout; RLOO, Ahmadian et al. 2024)::

        loss_t = -A · logπ_θ(y_t)  +  β · KL_t

    With ``old_logp`` (several steps per rollout; GRPO, Shao et al. 2024 "DeepSeekMath" eq. 3), PPO's clipped
    surrogate replaces the first term (see :func:`ppo_policy_loss`)::

        loss_t = -min(ρ_t A, clip(ρ_t, 1 - ε, 1 + ε) A)  +  β · KL_t,     ρ_t = π_θ(y_t) / π_θ_old(y_t)

    KL_t = ``kl_penalty(logp, ref_logp, estimator)``; the default ``"k3"`` is DeepSeekMath eq. 4. Its gradient flows
    through ``logp`` only. Normalisation is per token over the whole batch (count = response tokens: DAPO's
    token-level loss, TRL's ``loss_type="dapo"``), not eq. 3's per-sequence 1/|o_i| followed by a mean over the group,
    nor Dr. GRPO's constant normaliser (Liu et al. 2025 divide by a fixed generation budget, not by the tokens).

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
      clip_eps: ε in (0, 1), used only with ``old_logp``: the ratio's lower clip 1 - ε, and its upper one unless
        ``clip_eps_high`` is given (DAPO's decoupled "clip-higher", Yu et al. 2025: e.g. 0.2 / 0.28).
      objective: with ``old_logp``: ``"clip"`` is PPO's clipped surrogate above; ``"cispo"`` (MiniMax-M1, 2025) keeps
        every token's gradient and clips the importance weight instead, stop-gradient:
        loss_t = -sg[clip(ρ_t, 1 - ε, 1 + ε_high)] · A · logπ_θ(y_t) (``clip_fraction``: weights that were clipped).
      ratio_level: ``"token"`` (ρ_t per token) or ``"sequence"`` (GSPO: :func:`sequence_ratio`, one ratio per
        response, clipped as a whole; TRL's ``importance_sampling_level="sequence"``).
      aggregation: how the per-token losses l_i,t of the step's responses y_i become one number (the returned
        ``count`` is what the trainer divides the summed loss by, over every micro-batch and DP rank)::

            token_mean            Σ_i Σ_t l_i,t / Σ_i |y_i|        (DAPO's token-level loss; TRL loss_type="dapo")
            seq_mean_token_mean   Σ_i (Σ_t l_i,t / |y_i|) / N      (DeepSeekMath eq. 3; TRL loss_type="grpo")
            seq_mean_token_sum    Σ_i Σ_t l_i,t / N
            dr_grpo               Σ_i Σ_t l_i,t / (N · max_tokens) (Dr. GRPO, Liu et al. 2025: a constant
                                                                   normaliser, the generation budget; TRL "dr_grpo")

        N = responses with at least one token. The metrics stay per-token sums (``_tokens`` tells the trainer).
      max_tokens: the constant of ``dr_grpo`` (the generation budget, ``generation.max_new_tokens``).
      rollout_logp: [B, T], the rollout engine's log-probs of the sampled tokens (what it sampled from). When given,
        the mismatch with the training side (``old_logp``, else this forward's ``logp``, detached: on-policy they are
        the same policy) is reported, and ``correction`` may reweight the policy-gradient term per token
        (:func:`rollout_correction_weights`: ``"tis"`` with cap ``tis_cap``, ``"mis"`` with the band
        [``mis_low``, ``mis_high``]). The KL term is not reweighted.

    Returns ``(loss_sum, count, metrics)`` (count: response tokens, or per ``aggregation``); metrics: ``pg_loss`` (Σ of the policy-gradient term),
    ``kl`` (Σ KL_t, unweighted; 0 without ``ref_logp``), with ``old_logp`` also ``clip_fraction`` and ``ratio``,
    and with ``rollout_logp`` also ``logprob_diff`` (Σ |train − rollout| log-prob), ``is_weight`` (Σ w_t) and
    ``is_dropped`` (tokens ``"mis"`` left out).
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
        if clip_eps_high is not None and not (math.isfinite(clip_eps_high) and clip_eps_high > 0):
            raise ValueError(f"reinforce_loss: clip_eps_high must be > 0, got {clip_eps_high}")
        old_ = fill(old_logp.detach(), m, dtype)  # [B, T]
        ratio_t = sequence_ratio(logp_, old_, m) if ratio_level == "sequence" else torch.exp(logp_ - old_)  # [B, T]
        if objective == "cispo":
            high = clip_eps if clip_eps_high is None else clip_eps_high
            weight = ratio_t.detach().clamp(1.0 - clip_eps, 1.0 + high)  # [B, T]  sg[clip(ρ)]
            pg = -adv * weight * logp_  # [B, T]
            clipped, ratio = weight != ratio_t.detach(), ratio_t.detach()
        else:
            pg, clipped, ratio = clipped_surrogate(logp_, old_, adv, clip_eps, clip_eps_high, ratio_t)  # [B, T]
        with torch.no_grad():
            metrics["clip_fraction"] = masked_sum(clipped.to(dtype), m)
            metrics["ratio"] = masked_sum(ratio, m)
    if rollout_logp is not None:
        check_tokens("reinforce_loss", logp=logp, rollout_logp=rollout_logp)
        train_side = fill(old_logp.detach(), m, dtype) if old_logp is not None else logp_.detach()  # [B, T]
        behaviour = fill(rollout_logp.detach(), m, dtype)  # [B, T]
        weights, dropped = rollout_correction_weights(train_side, behaviour, m, correction, tis_cap, mis_low,
                                                      mis_high)
        pg = pg * weights  # [B, T]
        with torch.no_grad():
            metrics["logprob_diff"] = masked_sum((train_side - behaviour).abs(), m)
            metrics["is_weight"] = masked_sum(weights, m)
            metrics["is_dropped"] = masked_sum(dropped.to(dtype), m)
    elif correction != "none":
        raise ValueError(f"reinforce_loss: correction={correction!r} needs rollout_logp (the engine's log-probs)")
    losses = pg  # [B, T]
    if ref_logp is not None:
        check_tokens("reinforce_loss", logp=logp, ref_logp=ref_logp)
        kl = kl_penalty(logp_, fill(ref_logp.detach(), m, dtype), estimator)  # [B, T]
        if beta > 0:
            losses = losses + beta * kl  # [B, T]
        kl_sum = masked_sum(kl.detach(), m)
    else:
        kl_sum = torch.zeros((), dtype=dtype, device=logp.device)
    metrics = {"pg_loss": masked_sum(pg.detach(), m), "kl": kl_sum, **metrics}
    if aggregation == "token_mean":
        return masked_sum(losses, m), count_tokens(m), metrics
    per_seq = torch.where(m, losses, 0.0).sum(-1)  # [B]
    lengths = m.sum(-1)  # [B]
    answered = lengths > 0  # [B]
    responses = answered.sum().to(torch.int)
    if aggregation == "seq_mean_token_mean":
        loss_sum, count = (per_seq[answered] / lengths[answered]).sum(), responses
    elif aggregation == "seq_mean_token_sum":
        loss_sum, count = per_seq.sum(), responses
    elif aggregation == "dr_grpo":
        if not max_tokens or max_tokens < 1:
            raise ValueError(f"reinforce_loss: aggregation='dr_grpo' needs max_tokens >= 1, got {max_tokens}")
        loss_sum, count = per_seq.sum(), responses * int(max_tokens)
    else:
        raise ValueError(f"reinforce_loss: unknown aggregation {aggregation!r}")
    metrics["_tokens"] = count_tokens(m).to(dtype)  # the metrics stay per-token sums
    return loss_sum, count, metrics


# --------------------------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------------------------
