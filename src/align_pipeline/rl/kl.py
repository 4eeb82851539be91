"""Per-token KL estimators and the KL-coefficient controllers of RLHF.

Estimators (Schulman 2020, "Approximating KL divergence", http://joschu.net/blog/kl-approx.html). With tokens sampled
from the policy π and r = π_ref(y_t) / π(y_t) = exp(ref_logp - logp), each is an estimator of KL(π ‖ π_ref)::

    k1 = -log r           = logp - ref_logp           unbiased, high variance, can be negative
    k2 = ½ (log r)²       = ½ (logp - ref_logp)²      biased (low for close policies), always ≥ 0
    k3 = (r - 1) - log r                              unbiased, always ≥ 0 (DeepSeekMath eq. 4 uses it)

All three take and return [B, T] (any shape, as long as ``logp`` and ``ref_logp`` match); masking is the caller's.
A configuration selects one by name through :data:`KL_ESTIMATORS` / :func:`kl_penalty`::

    kl = kl_penalty(logp, ref_logp, cfg.kl_estimator)          # "k1" | "k2" | "k3"

Controllers (Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences", §2.2) hold the coefficient β of
the KL penalty in the reward ``R = r - β KL`` and update it once per PPO step. Both share one interface: ``value``,
``update(current_kl, n_steps)``, ``state_dict()`` / ``load_state_dict()``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal

import torch

from align_pipeline.config.guards import check_nonnegative, check_positive

KLEstimator = Literal["k1", "k2", "k3"]


def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k1 = logp - ref_logp = -log r (Schulman 2020). Shapes: [B, T] in, [B, T] out."""
    _check_same_shape(logp, ref_logp)
    return logp - ref_logp  # [B, T]


def kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k2 = ½ (logp - ref_logp)² = ½ (log r)² (Schulman 2020). Shapes: [B, T] in, [B, T] out."""
    _check_same_shape(logp, ref_logp)
    return 0.5 * (logp - ref_logp) ** 2  # [B, T]


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 = (r - 1) - log r with r = exp(ref_logp - logp) (Schulman 2020; DeepSeekMath eq. 4). [B, T] → [B, T].

    Computed as ``expm1(d) - d`` with d = log r, which is exact near d = 0 and ≥ 0 everywhere (e^d ≥ 1 + d).
    No clamping: a large ``ref_logp - logp`` gives a large (possibly inf) value, as the divergence it estimates.
    """
    _check_same_shape(logp, ref_logp)
    log_r = ref_logp - logp  # [B, T]
    return torch.expm1(log_r) - log_r  # [B, T]


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "k1": kl_k1,
    "k2": kl_k2,
    "k3": kl_k3,
}
"""Name → estimator ``fn(logp, ref_logp) -> [B, T]``."""


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: KLEstimator) -> torch.Tensor:
    """Per-token estimate of KL(π ‖ π_ref) by the estimator registered under ``estimator``.

    Args:
      logp: [B, T], log π(y_t | x, y_<t) of the sampled tokens under the policy.
      ref_logp: [B, T], the same tokens under the frozen reference.
      estimator: ``"k1"`` | ``"k2"`` | ``"k3"``; ``ValueError`` listing the known names otherwise.

    Returns [B, T]; positions outside the response are whatever the inputs give there (mask them).
    """
    try:
        fn = KL_ESTIMATORS[estimator]
    except KeyError:
        raise ValueError(f"unknown KL estimator {estimator!r}; known: {sorted(KL_ESTIMATORS)}") from None
    return fn(logp, ref_logp)


# --------------------------------------------------------------------------------------------------------------------
# KL coefficient controllers
# --------------------------------------------------------------------------------------------------------------------


class AdaptiveKLController:
    """Adaptive β (Ziegler et al. 2019, §2.2): a proportional controller driving the KL towards ``target``.

    ::

        e_t     = clip((KL_t - KL_target) / KL_target, -0.2, 0.2)
        β_{t+1} = β_t (1 + K_β e_t),     K_β = n_steps / horizon

    The paper uses K_β = 0.1; its code (lm-human-preferences) writes K_β as ``n_steps / horizon``, n_steps being the
    number of samples (episodes) in this update, so β moves by at most ±0.2·n_steps/horizon per update.

    Args:
      beta: β_0 > 0.
      target: KL_target > 0, in the units of ``current_kl`` (nats per sequence when KL_t is the mean over the batch of
        the per-sequence sum of per-token KL, as in the paper).
      horizon: > 0.

    ``current_kl`` must be the same number on every data-parallel rank (all-reduce it first) so that β stays in sync.
    """

    def __init__(self, beta: float, target: float, horizon: float) -> None:
        check_positive("beta", beta)
        check_positive("target", target)
        check_positive("horizon", horizon)
        self.value = float(beta)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float | torch.Tensor, n_steps: int) -> None:
        """β ← β (1 + clip(KL/KL_target - 1, ±0.2) · n_steps / horizon)."""
        current_kl = float(current_kl)
        if not math.isfinite(current_kl):
            raise ValueError(f"AdaptiveKLController.update: current_kl must be finite, got {current_kl}")
        if n_steps < 0:
            raise ValueError(f"AdaptiveKLController.update: n_steps must be >= 0, got {n_steps}")
        proportional_error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)  # e_t
        self.value *= 1.0 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict[str, Any]:
        """``{"value": β}``; ``target`` / ``horizon`` are configuration, not state, and come from the config on resume."""
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_positive("value", state["value"])
        self.value = float(state["value"])


class FixedKLController:
    """Constant β, with the :class:`AdaptiveKLController` interface (``update`` does nothing)."""

    def __init__(self, beta: float) -> None:
        check_nonnegative("beta", beta)
        self.value = float(beta)

    def update(self, current_kl: float | torch.Tensor, n_steps: int) -> None:
        """No-op."""

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_nonnegative("value", state["value"])
        self.value = float(state["value"])


# --------------------------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------------------------


def _check_same_shape(logp: torch.Tensor, ref_logp: torch.Tensor) -> None:
    if logp.shape != ref_logp.shape:
        raise ValueError(
            f"logp and ref_logp must have the same shape; got {tuple(logp.shape)}, {tuple(ref_logp.shape)}"
        )


