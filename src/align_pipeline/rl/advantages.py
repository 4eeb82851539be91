"""Rewards, returns and advantages: PPO's per-token rewards and GAE, masked whitening, and the group baselines of the
REINFORCE family (RLOO, GRPO).

Layout conventions (shared by every function here and by :mod:`align_pipeline.losses.ppo`):

* Token tensors are [B, T]; ``mask`` is float or bool [B, T] with 1 on response tokens (the tokens the policy
  generated, EOS included) and 0 on prompt and padding. Position t holds quantities of the action y_t: its
  log-prob, the value V(s_t) of the state it was taken in, its reward r_t. Every output is 0 where the mask is 0, and
  values in masked positions never reach an output (they may be garbage, even NaN).
* Group tensors (RLOO, GRPO) are [P, n]: row p holds the scores of the n samples drawn for prompt p. A flat
  prompt-major batch of P·n scores is ``scores.view(P, n)`` (``view(-1, n)``); ``.flatten()`` the advantages back.
* Nothing here carries gradient into a model: rewards, values, advantages and returns are targets. The functions
  compute in float32 (float64 where the input is float64) and detach their inputs.
"""

from __future__ import annotations

import math

import torch


def token_rewards(scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, beta: float) -> torch.Tensor:
    """Per-token PPO rewards: a KL penalty on every response token, the sequence score on the last one.

    Ziegler et al. 2019, eq. 2 (``R(x, y) = r(x, y) - β log(π(y|x) / ρ(y|x))``), spread over tokens as in their code
    and in InstructGPT (Ouyang et al. 2022, eq. 2)::

        R_{b,t} = -β · kl_{b,t} · m_{b,t}  +  [t = last_b] · score_b,     last_b = max{t : m_{b,t} = 1}

    Args:
      scores: [B], sequence-level reward r(x, y) (reward model or verifiable reward).
      kl: [B, T], per-token KL estimate (e.g. ``kl_penalty(logp, ref_logp, "k1")``); masked positions are ignored.
      mask: [B, T], 1 on response tokens. Rows may have different lengths and any padding side; every row needs at
        least one response token (``ValueError`` otherwise).
      beta: β ≥ 0 (a KL controller's ``value``).

    Returns [B, T] rewards, 0 outside the response.
    """
    _check_tokens("token_rewards", kl=kl, mask=mask)
    if scores.shape != kl.shape[:1]:
        raise ValueError(f"token_rewards: scores must be [B] = [{kl.shape[0]}], got {tuple(scores.shape)}")
    if not (math.isfinite(beta) and beta >= 0):
        raise ValueError(f"token_rewards: beta must be a finite number >= 0, got {beta}")
    m = mask.bool()  # [B, T]
    if not bool(m.any(dim=1).all()):
        raise ValueError("token_rewards: every row of mask needs at least one response token")
    dtype = _float_dtype(kl)
    rewards = torch.where(m, -beta * kl.detach().to(dtype), 0.0)  # [B, T]
    last = m.shape[1] - 1 - m.flip(dims=[1]).to(torch.uint8).argmax(dim=1)  # [B]  index of the last 1 in each row
    rows = torch.arange(m.shape[0], device=m.device)  # [B]
    rewards[rows, last] += scores.detach().to(dtype)  # [B, T]
    return rewards


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2016, "High-Dimensional Continuous Control Using GAE").

    ::

        δ_t   = r_t + γ V(s_{t+1}) - V(s_t)                       (eq. 10)
        Â_t   = Σ_l (γλ)^l δ_{t+l}  =  δ_t + γλ Â_{t+1}            (eq. 16, computed backwards)
        R̂_t  = Â_t + V(s_t)                                       (the λ-return, the value target)

    The episode ends at each row's last response token: V(s_{t+1}) and Â_{t+1} are taken as 0 wherever
    ``mask[t+1] = 0`` (or t + 1 = T), so rows of different lengths, padded on either side, need no special handling
    (a truncated response is treated as terminal too, as in RLHF practice). Masked positions are skipped.

    Args:
      rewards: [B, T], per-token rewards (see :func:`token_rewards`).
      values: [B, T], V(s_t) from the critic at rollout time.
      mask: [B, T], 1 on response tokens.
      gamma: discount γ in [0, 1].
      lam: λ in [0, 1]; λ = 0 gives the one-step TD error, λ = 1 the Monte-Carlo return minus V.

    Returns ``(advantages, returns)``, both [B, T], un-whitened, 0 outside the response (whiten the advantages after
    computing the returns; see :func:`whiten_with`).
    """
    _check_tokens("gae", rewards=rewards, values=values, mask=mask)
    for name, x in (("gamma", gamma), ("lam", lam)):
        if not 0.0 <= x <= 1.0:
            raise ValueError(f"gae: {name} must be in [0, 1], got {x}")
    m = mask.bool()  # [B, T]
    dtype = _float_dtype(values)
    r = torch.where(m, rewards.detach().to(dtype), 0.0)  # [B, T]
    v = torch.where(m, values.detach().to(dtype), 0.0)  # [B, T]  so V past the end is 0
    advantages = torch.zeros_like(v)  # [B, T]
    next_value = torch.zeros_like(v[:, 0])  # [B]  V(s_{t+1}), 0 past the end
    next_adv = torch.zeros_like(v[:, 0])  # [B]  Â_{t+1}, 0 past the end
    for t in reversed(range(v.shape[1])):
        delta = r[:, t] + gamma * next_value - v[:, t]  # [B]
        next_adv = torch.where(m[:, t], delta + gamma * lam * next_adv, 0.0)  # [B]  Â_t
        advantages[:, t] = next_adv
        next_value = v[:, t]  # [B]  already 0 where masked
    returns = torch.where(m, advantages + v, 0.0)  # [B, T]
    return advantages, returns


def gae_over_turns(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`gae` over each row's response tokens taken in order, the positions outside ``mask`` skipped: in a
    multi-turn episode the environment's turns sit between the policy's, and the state after a policy turn's last
    token is the next policy turn's first (not the end of the episode, as :func:`gae` would take a gap)::

        δ_k = r_k + γ V(s_{k+1}) - V(s_k),   Â_k = δ_k + γλ Â_{k+1}      (k over the masked positions, in order)

    Same arguments and shapes as :func:`gae`; equal to it on rows whose response tokens are contiguous."""
    _check_tokens("gae_over_turns", rewards=rewards, values=values, mask=mask)
    m = mask.bool()  # [B, T]
    order = torch.argsort((~m).to(torch.int8), dim=1, stable=True)  # [B, T] response positions first, in order
    packed = [x.gather(1, order) for x in (rewards, values, mask)]  # [B, T] each, the response tokens contiguous
    advantages, returns = gae(*packed, gamma, lam)  # [B, T]
    return (torch.zeros_like(advantages).scatter(1, order, advantages),
            torch.zeros_like(returns).scatter(1, order, returns))


# --------------------------------------------------------------------------------------------------------------------
# Masked whitening (advantage normalisation)
# --------------------------------------------------------------------------------------------------------------------


def masked_moments(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(Σ x, Σ x², count)`` over the entries where ``mask`` is 1, as float64 scalars.

    All three are sums, so a trainer can all-reduce them (SUM) over data-parallel ranks, e.g. as one
    ``torch.stack`` of the three, then call :func:`moments_to_mean_var` and :func:`whiten_with`. float64 keeps
    ``Σx²/n - mean²`` accurate.

    Args:
      x: [B, T] (any shape matching ``mask``).
      mask: [B, T], 1 on the entries to count.
    """
    _check_tokens("masked_moments", x=x, mask=mask)
    m = mask.bool()
    xd = torch.where(m, x.detach().double(), 0.0)  # [B, T]
    return xd.sum(), (xd * xd).sum(), m.sum().double()


def moments_to_mean_var(
    x_sum: torch.Tensor, x_sum_sq: torch.Tensor, count: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mean, var)`` from :func:`masked_moments` (possibly reduced over ranks); var is the population variance
    (unbiased=False), clamped at 0 against rounding. A count of 0 gives mean 0, var 0."""
    n = count.clamp(min=1)
    mean = x_sum / n
    var = (x_sum_sq / n - mean * mean).clamp(min=0.0)
    return mean, var


def whiten_with(
    x: torch.Tensor,
    mask: torch.Tensor,
    mean: torch.Tensor | float,
    var: torch.Tensor | float,
    shift_mean: bool = True,
    eps: float = 1e-8,
) -> torch.Tensor:
    """Whiten ``x`` with given statistics: ``(x - mean) / sqrt(var + eps)`` (``+ mean`` back if not ``shift_mean``).

    Args:
      x: [B, T].
      mask: [B, T]; the output is 0 where it is 0.
      mean, var: scalars (e.g. from :func:`moments_to_mean_var` after an all-reduce).
      shift_mean: False keeps the original mean (only rescales), as in TRL / lm-human-preferences ``whiten``.
      eps: added to the variance.

    Returns [B, T] in ``x``'s floating dtype (float32 for non-float input).
    """
    _check_tokens("whiten_with", x=x, mask=mask)
    dtype = _float_dtype(x)
    mean = torch.as_tensor(mean, dtype=torch.float64, device=x.device)
    var = torch.as_tensor(var, dtype=torch.float64, device=x.device)
    out = (x.detach().double() - mean) * torch.rsqrt(var + eps)  # [B, T]
    if not shift_mean:
        out = out + mean
    return torch.where(mask.bool(), out, 0.0).to(dtype)  # [B, T]


def rloo_advantages(scores: torch.Tensor) -> torch.Tensor:
    """REINFORCE Leave-One-Out baseline (Ahmadian et al. 2024, "Back to Basics", the RLOO estimator; Kool et al. 2019)::

        A_i = r_i - 1/(n-1) Σ_{j≠i} r_j  =  n/(n-1) · (r_i - mean_j r_j)

    Non-finite scores (NaN, ±inf: a reward function or reward model that failed on a sample) take no part: such a
    sample gets A = 0, and the others' baselines are the mean over the k finite scores of the group but their own
    (1/(k-1) Σ_{j≠i, finite}); a group with fewer than two finite scores has no baseline and gets 0 throughout.

    Args:
      scores: [P, n], n ≥ 2 samples per prompt (row = prompt; a flat prompt-major [P·n] is ``view(-1, n)``).

    Returns [P, n] advantages (sum to 0 over the finite samples of each group; exactly 0 in a group of equal scores).
    """
    r = _check_groups("rloo_advantages", scores)  # [P, n]
    finite = torch.isfinite(r)  # [P, n]
    x = torch.where(finite, r, 0.0)  # [P, n]  non-finite scores out of the sums
    k = finite.sum(dim=1, keepdim=True)  # [P, 1]  finite scores per group
    baseline = (x.sum(dim=1, keepdim=True) - x) / (k - 1).clamp(min=1)  # [P, n]  mean of the other k-1
    return _zero_constant_groups(r, finite, x - baseline)


def grpo_advantages(scores: torch.Tensor, eps: float = 1e-6, scale: bool = True) -> torch.Tensor:
    """GRPO outcome-supervision advantages (Shao et al. 2024, "DeepSeekMath", §4.1.2, the r̃_i under eq. 3)::

        A_i = (r_i - mean(r)) / (std(r) + eps)      (scale=True)
        A_i =  r_i - mean(r)                        (scale=False: Dr. GRPO's advantage, Liu et al. 2025)

    over the group of n samples of one prompt; every token of sample i gets A_i.

    ``std`` is the *sample* standard deviation (Bessel's n-1), as TRL's ``GRPOTrainer`` and verl's
    ``compute_grpo_outcome_advantage`` use (``torch.std``' default): the paper does not say which, and matching those
    keeps their hyper-parameters and published curves comparable. With n-1 the advantages of a group have variance
    (n-1)/n rather than 1; for binary rewards with n = 4 and one success: sample std 0.5, population std 0.433.
    (:func:`whiten_with` uses the population variance; it normalises many tokens, where the difference is negligible.)

    Non-finite scores (NaN, ±inf) take no part: mean and std are over the k finite scores of the group (std with
    k-1), such a sample gets A = 0, and a group with fewer than two finite scores gets 0 throughout.

    Args:
      scores: [P, n], n ≥ 2 samples per prompt (row = prompt; a flat prompt-major [P·n] is ``view(-1, n)``).
      eps: added to the std (``reinforce.loss.std_eps``; TRL's ``GRPOTrainer`` uses 1e-4): bounds the scale of a
        group whose scores barely differ (1 / eps at most).
      scale: divide by the group std.

    Returns [P, n] advantages; exactly 0 in a group whose finite scores are all equal (no learning signal).
    """
    r = _check_groups("grpo_advantages", scores)  # [P, n]
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"grpo_advantages: eps must be a finite number >= 0, got {eps}")
    finite = torch.isfinite(r)  # [P, n]
    if bool(finite.all()):  # every score finite: torch's own mean / std
        adv = r - r.mean(dim=1, keepdim=True)  # [P, n]
        if scale:
            adv = adv / (r.std(dim=1, keepdim=True) + eps)  # [P, n]  sample std (n-1)
        return _zero_constant_groups(r, finite, adv)
    x = torch.where(finite, r, 0.0)  # [P, n]
    k = finite.sum(dim=1, keepdim=True)  # [P, 1]
    adv = torch.where(finite, x - x.sum(dim=1, keepdim=True) / k.clamp(min=1), 0.0)  # [P, n]  over finite scores
    if scale:
        std = ((adv * adv).sum(dim=1, keepdim=True) / (k - 1).clamp(min=1)).sqrt()  # [P, 1]  sample std (k-1)
        adv = adv / (std + eps)  # [P, n]
    return _zero_constant_groups(r, finite, adv)


def groups_without_signal(scores: torch.Tensor) -> torch.Tensor:
    """[P, n] scores -> [P] bool: the groups whose finite scores are all equal (fewer than two finite scores
    included): their advantages are 0 under both baselines."""
    r = _check_groups("groups_without_signal", scores)  # [P, n]
    return _constant_groups(r, torch.isfinite(r))[:, 0]


# --------------------------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------------------------


def _float_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _check_tokens(fn: str, **tensors: torch.Tensor) -> None:
    shapes = {name: tuple(x.shape) for name, x in tensors.items()}
    first = next(iter(shapes.values()))
    if len(first) != 2 or any(s != first for s in shapes.values()):
        raise ValueError(f"{fn}: expected [B, T] tensors of one shape; got {shapes}")


def _check_groups(fn: str, scores: torch.Tensor) -> torch.Tensor:
    if scores.dim() != 2 or scores.shape[1] < 2:
        raise ValueError(
            f"{fn}: scores must be [P, n] with n >= 2 samples per prompt (flat prompt-major: scores.view(-1, n)); "
            f"got shape {tuple(scores.shape)}"
        )
    return scores.detach().to(_float_dtype(scores))


def _constant_groups(r: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
    """[P, 1] bool: the finite scores of the group are all equal, or fewer than two are finite."""
    high = torch.where(finite, r, -math.inf).amax(dim=1, keepdim=True)  # [P, 1]
    low = torch.where(finite, r, math.inf).amin(dim=1, keepdim=True)  # [P, 1]
    return (high == low) | (finite.sum(dim=1, keepdim=True) < 2)


def _zero_constant_groups(r: torch.Tensor, finite: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
    """Exact zeros for groups with equal (finite) scores: r_i - mean is otherwise a rounding error of ~1 ulp, which an
    eps of 1e-6 would blow up to O(0.01); and for every non-finite score."""
    return torch.where(_constant_groups(r, finite) | ~finite, 0.0, adv)  # [P, n]


def overlong_shaping(lengths: torch.Tensor, max_tokens: int, buffer: int) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, "DAPO", eq. 13), per response [n] from its length [n]::

        R_length(y) = 0                                  |y| <= L_max - L_cache
                    = ((L_max - L_cache) - |y|) / L_cache   L_max - L_cache < |y| <= L_max
                    = -1                                 |y| > L_max

    with L_max = ``max_tokens`` (the generation budget) and L_cache = ``buffer`` (> 0): a response entering the last
    ``buffer`` tokens of the budget is penalised linearly, down to -1 at the limit, instead of all at once."""
    if buffer <= 0 or buffer > max_tokens:
        raise ValueError(f"overlong_shaping: buffer must be in (0, max_tokens={max_tokens}], got {buffer}")
    lengths = lengths.to(torch.float64)
    soft = max_tokens - buffer
    band = (soft - lengths) / buffer  # [n]
    return torch.where(lengths <= soft, torch.zeros_like(band), torch.where(lengths <= max_tokens, band, -1.0))
