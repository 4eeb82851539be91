"""Direct preference losses (DPO family) on sequence log-probabilities.

Every loss takes a :class:`PreferenceLogps` (one pair per row, shape [B]) and keyword-only hyper-parameters named as
in its paper, and returns ``(loss_sum, count=B, metrics)`` per :mod:`align_pipeline.losses.base`: each metric is a
sum over the B pairs, and the caller divides after reducing over micro-batches and data-parallel ranks.

Notation (all per pair, [B])::

    logπ(y)          sum over the response tokens of the policy's token log-probs (``policy_chosen`` / ``_rejected``)
    logπ_ref(y)      the same under the frozen reference (``ref_chosen`` / ``ref_rejected``)
    h                (logπ(y_c) - logπ_ref(y_c)) - (logπ(y_r) - logπ_ref(y_r))

Metrics common to every loss (sums over B), named as TRL's ``DPOTrainer`` names them: ``<name>_loss`` (= loss_sum),
``rewards/accuracies`` (1 where the chosen implicit reward is strictly greater than the rejected one; ties count 0),
``rewards/chosen`` / ``rewards/rejected`` (the implicit rewards β·(logπ(y) - logπ_ref(y)) of DPO eq. 5, or
β·logπ(y)/|y| for the reference-free SimPO), ``rewards/margins`` (chosen - rejected), ``logps/chosen`` /
``logps/rejected`` (policy sequence log-probs). (TRL also logs mean ``logits/*``; we don't.)

Configuration selects a function by name through :data:`PREFERENCE_LOSSES` / :func:`get_preference_loss`::

    loss_fn = get_preference_loss(cfg.loss.name)             # "dpo" | "ipo" | "rpo" | "simpo" | "hinge"
    out = loss_fn(batch, **cfg.loss.params)                   # e.g. {"beta": 0.1, "label_smoothing": 0.0}
    if cfg.sft_weight > 0:
        out = combine(out, -batch.policy_chosen, batch.chosen_tokens, weight=cfg.sft_weight)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Literal, Protocol

import torch
import torch.nn.functional as F

from align_pipeline.config.dpo import REFERENCE_FREE_LOSSES  # noqa: F401  (re-exported: losses that never read ref_*)
from align_pipeline.config.guards import check_nonnegative, check_positive
from align_pipeline.losses.base import LossOutput


@dataclass(frozen=True)
class PreferenceLogps:
    """One micro-batch of preference pairs, reduced to per-sequence quantities; every tensor is [B].

    Attributes:
      policy_chosen: log π(y_c | x), sum of the policy's log-probs over the chosen response tokens (carries grad).
      policy_rejected: log π(y_r | x), the same for the rejected response.
      ref_chosen: log π_ref(y_c | x) from the frozen reference (no grad); required by DPO, IPO, RPO, hinge.
      ref_rejected: log π_ref(y_r | x).
      chosen_tokens: |y_c|, number of response tokens summed over; required by SimPO and length-normalised IPO.
      rejected_tokens: |y_r|.
      chosen_reward: r*(x, y_c), an external reward (RPO); NaN where the pair has none.
      rejected_reward: r*(x, y_r); NaN where the pair has none.
    """

    policy_chosen: torch.Tensor
    policy_rejected: torch.Tensor
    ref_chosen: torch.Tensor | None = None
    ref_rejected: torch.Tensor | None = None
    chosen_tokens: torch.Tensor | None = None
    rejected_tokens: torch.Tensor | None = None
    chosen_reward: torch.Tensor | None = None
    rejected_reward: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.policy_chosen.dim() != 1:
            raise ValueError(f"PreferenceLogps.policy_chosen must be [B]; got shape {tuple(self.policy_chosen.shape)}")
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and value.shape != self.policy_chosen.shape:
                raise ValueError(
                    f"PreferenceLogps.{f.name} has shape {tuple(value.shape)}, "
                    f"expected {tuple(self.policy_chosen.shape)} like policy_chosen"
                )

    @property
    def batch_size(self) -> int:
        return self.policy_chosen.shape[0]


class PreferenceLoss(Protocol):
    def __call__(self, batch: PreferenceLogps, *, beta: float, **kwargs) -> LossOutput: ...


# --------------------------------------------------------------------------------------------------------------------
# Losses with a reference model
# --------------------------------------------------------------------------------------------------------------------


def dpo_loss(batch: PreferenceLogps, *, beta: float, label_smoothing: float = 0.0) -> LossOutput:
    """Direct Preference Optimization (Rafailov et al. 2023, eq. 7), optionally conservative (cDPO).

    ::

        loss_b = -(1 - ε) · log σ(β h_b) - ε · log σ(-β h_b)

    ``ε = label_smoothing = 0`` is eq. 7; ``ε > 0`` is cDPO (Mitchell 2023, "A note on DPO with noisy preferences"):
    the label is assumed flipped with probability ε. ``ε = 0.5`` makes the loss symmetric in h (no preference).

    Args:
      batch: needs ``policy_*`` and ``ref_*`` ([B] each).
      beta: β > 0, strength of the KL constraint to the reference.
      label_smoothing: ε in [0, 0.5].

    Returns ``(loss_sum, B, metrics)`` with ``dpo_loss`` and the common metrics (see module docstring).
    """
    check_positive("beta", beta)
    if not 0.0 <= label_smoothing <= 0.5:
        raise ValueError(f"dpo_loss: label_smoothing must be in [0, 0.5], got {label_smoothing}")
    _require(batch, "dpo_loss", "ref_chosen", "ref_rejected")
    ratio_c, ratio_r = _log_ratios(batch)  # [B], [B]
    logits = beta * (ratio_c - ratio_r)  # [B]  β h
    losses = -(1.0 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)  # [B]
    return _output("dpo_loss", losses, beta * ratio_c, beta * ratio_r, batch)


def ipo_loss(batch: PreferenceLogps, *, beta: float, length_normalized: bool = True) -> LossOutput:
    """Identity Preference Optimization (Azar et al. 2023, eq. 17).

    ::

        loss_b = (h_b - 1 / (2τ))²,   τ = beta

    τ is the paper's regularisation strength (the coefficient of the KL term), passed as ``beta`` as in TRL and
    NeMo-Aligner: smaller τ → larger target gap 1/(2τ).

    With ``length_normalized=True`` (default) each log-ratio in h is divided by its response length
    (``(logπ(y) - logπ_ref(y)) / |y|``), as TRL's ``loss_type="ipo"`` does (it averages the completion log-probs):
    on summed log-probs the target gap 1/(2τ) is one constant for a 5-token and a 500-token response alike, so its
    meaning, and a good τ, would depend on response length. ``length_normalized=False`` is eq. 17 on summed sequence
    log-probs (NeMo-Aligner's default, ``preference_average_log_probs=False``).
    The reward metrics always use the un-normalised β·(logπ - logπ_ref), for comparability across losses.

    Args:
      batch: needs ``policy_*``, ``ref_*``, and ``chosen_tokens`` / ``rejected_tokens`` if ``length_normalized``.
      beta: τ > 0.
      length_normalized: divide each log-ratio by its response token count.

    Returns ``(loss_sum, B, metrics)`` with ``ipo_loss`` and the common metrics.
    """
    check_positive("beta", beta)
    _require(batch, "ipo_loss", "ref_chosen", "ref_rejected")
    ratio_c, ratio_r = _log_ratios(batch)  # [B], [B]
    if length_normalized:
        _require(batch, "ipo_loss(length_normalized=True)", "chosen_tokens", "rejected_tokens")
        h = ratio_c / _lengths(batch.chosen_tokens) - ratio_r / _lengths(batch.rejected_tokens)  # [B]
    else:
        h = ratio_c - ratio_r  # [B]
    losses = (h - 1.0 / (2.0 * beta)) ** 2  # [B]
    return _output("ipo_loss", losses, beta * ratio_c, beta * ratio_r, batch)


def rpo_loss(
    batch: PreferenceLogps,
    *,
    beta: float,
    eta: float,
    distance: Literal["bwd_kl", "sq"] = "bwd_kl",
) -> LossOutput:
    """Reward-aware Preference Optimization (Adler et al. 2024, Nemotron-4 340B technical report, §3.2.3).

    RPO matches the policy's implicit reward gap to a scaled external reward gap::

        loss_b = D[ β h_b ‖ η (r*(x, y_c) - r*(x, y_r)) ]

    ``distance="bwd_kl"`` (the report's choice; NeMo-Aligner ``rpo_bwd_kl``) is the KL divergence between the two
    Bernoulli preference distributions, from the reward's to the policy's; with a = β h, b = η Δr*::

        D[a ‖ b] = σ(b) · (log σ(b) - log σ(a)) + σ(-b) · (log σ(-b) - log σ(-a))

    It is 0 when a = b and tends to DPO's -log σ(a) as b → +∞. ``distance="sq"`` (NeMo-Aligner ``rpo_sq``) is
    (a - b)².

    Missing rewards: where ``chosen_reward`` or ``rejected_reward`` is NaN, the pair falls back to plain DPO,
    -log σ(β h) (the bwd_kl limit of an infinitely confident label), so a data set may mix rewarded and unrewarded
    pairs. The NaN never reaches the loss or the gradient. Rewards must otherwise be finite.

    Args:
      batch: needs ``policy_*``, ``ref_*``, ``chosen_reward`` and ``rejected_reward`` (NaN for missing).
      beta: β > 0, as in DPO.
      eta: η > 0, scale of the external reward gap.
      distance: ``"bwd_kl"`` or ``"sq"``.

    Returns ``(loss_sum, B, metrics)`` with ``rpo_loss``, the common metrics, and ``reward_pairs`` (1 per pair that
    had both rewards; divided by the count it is the fraction of rewarded pairs).
    """
    check_positive("beta", beta)
    check_positive("eta", eta)
    if distance not in ("bwd_kl", "sq"):
        raise ValueError(f"rpo_loss: distance must be 'bwd_kl' or 'sq', got {distance!r}")
    _require(batch, "rpo_loss", "ref_chosen", "ref_rejected", "chosen_reward", "rejected_reward")
    ratio_c, ratio_r = _log_ratios(batch)  # [B], [B]
    a = beta * (ratio_c - ratio_r)  # [B]  policy's implicit reward gap β h
    gap = batch.chosen_reward.float() - batch.rejected_reward.float()  # [B]  NaN where a reward is missing
    has_reward = ~torch.isnan(gap)  # [B] bool
    # Zero the NaNs before use: torch.where alone would still back-propagate 0·NaN = NaN through the unused branch.
    b = eta * torch.where(has_reward, gap, torch.zeros_like(gap))  # [B]
    if distance == "bwd_kl":
        log_p, log_q = F.logsigmoid(b), F.logsigmoid(-b)  # [B]  reward's Bernoulli (chosen, rejected)
        rpo = log_p.exp() * (log_p - F.logsigmoid(a)) + log_q.exp() * (log_q - F.logsigmoid(-a))  # [B]
    else:
        rpo = (a - b) ** 2  # [B]
    losses = torch.where(has_reward, rpo, -F.logsigmoid(a))  # [B]
    loss_sum, count, metrics = _output("rpo_loss", losses, beta * ratio_c, beta * ratio_r, batch)
    metrics["reward_pairs"] = has_reward.float().sum()
    return loss_sum, count, metrics


def hinge_loss(batch: PreferenceLogps, *, beta: float) -> LossOutput:
    """SLiC-HF rank-calibration hinge (Zhao et al. 2023) on the DPO log-ratio, as in TRL's ``hinge`` loss.

    ::

        loss_b = max(0, 1 - β h_b)

    i.e. SLiC's ``max(0, δ - log P(y_c) + log P(y_r))`` with reference-normalised log-probs, margin δ = 1/β, scaled
    by β. Zero loss (and zero gradient) once β h ≥ 1. SLiC's separate regularisation term is not included; add an
    SFT term with :func:`combine` if wanted.

    Args:
      batch: needs ``policy_*`` and ``ref_*``.
      beta: β > 0, inverse margin.

    Returns ``(loss_sum, B, metrics)`` with ``hinge_loss`` and the common metrics.
    """
    check_positive("beta", beta)
    _require(batch, "hinge_loss", "ref_chosen", "ref_rejected")
    ratio_c, ratio_r = _log_ratios(batch)  # [B], [B]
    losses = torch.relu(1.0 - beta * (ratio_c - ratio_r))  # [B]
    return _output("hinge_loss", losses, beta * ratio_c, beta * ratio_r, batch)


# --------------------------------------------------------------------------------------------------------------------
# Reference-free
# --------------------------------------------------------------------------------------------------------------------


def simpo_loss(batch: PreferenceLogps, *, beta: float, gamma: float) -> LossOutput:
    """Simple Preference Optimization (Meng et al. 2024, eq. 6): reference-free and length-normalised.

    ::

        loss_b = -log σ( β/|y_c| · logπ(y_c) - β/|y_r| · logπ(y_r) - γ )

    The implicit rewards (and the ``rewards/*`` metrics) are SimPO's β·logπ(y)/|y|; the reference
    log-probs, if present, are ignored. A zero token count is treated as 1.

    Args:
      batch: needs ``policy_*``, ``chosen_tokens`` and ``rejected_tokens``.
      beta: β > 0, reward scale.
      gamma: γ, target reward margin (γ ≥ 0 in the paper).

    Returns ``(loss_sum, B, metrics)`` with ``simpo_loss`` and the common metrics.
    """
    check_positive("beta", beta)
    _require(batch, "simpo_loss", "chosen_tokens", "rejected_tokens")
    reward_c = beta * batch.policy_chosen.float() / _lengths(batch.chosen_tokens)  # [B]
    reward_r = beta * batch.policy_rejected.float() / _lengths(batch.rejected_tokens)  # [B]
    losses = -F.logsigmoid(reward_c - reward_r - gamma)  # [B]
    return _output("simpo_loss", losses, reward_c, reward_r, batch)


# --------------------------------------------------------------------------------------------------------------------
# SFT term on the chosen response ("mix", as in RPO / NeMo-Aligner's sft_loss_weight)
# --------------------------------------------------------------------------------------------------------------------


def combine(
    pref: LossOutput,
    chosen_token_nll_sum: torch.Tensor,
    chosen_tokens: torch.Tensor,
    *,
    weight: float,
) -> LossOutput:
    """Add the SFT term to a preference loss as a per-sequence mean NLL, so both share count = B.

    ::

        loss_sum = Σ_b [ pref_b + weight · nll_b / |y_c,b| ],   count = B (the preference loss's count)

    After the caller divides by the reduced count this is ``mean_b pref_b + weight · mean_b (mean-token NLL_b)``,
    the RPO / NeMo-Aligner "preference + sft_loss_weight · SFT" mix with a length-averaged SFT term.

    Args:
      pref: a preference loss's output (count = B pairs).
      chosen_token_nll_sum: [B], summed NLL of the chosen response (``-batch.policy_chosen``).
      chosen_tokens: [B], chosen response token counts (0 is treated as 1).
      weight: ≥ 0.

    Returns ``(loss_sum, B, metrics)``: the preference metrics, plus ``sft_loss`` (Σ_b nll_b/|y_c,b|, unweighted) and
    ``loss`` (the combined loss_sum).
    """
    _check_pair_shapes(chosen_token_nll_sum, chosen_tokens)
    check_nonnegative("weight", weight)
    pref_sum, count, pref_metrics = pref
    per_seq_nll = chosen_token_nll_sum.float() / _lengths(chosen_tokens)  # [B]
    loss_sum = pref_sum + weight * per_seq_nll.sum()  # []
    metrics = dict(pref_metrics)
    metrics["sft_loss"] = per_seq_nll.detach().sum()
    metrics["loss"] = loss_sum.detach()
    return loss_sum, count, metrics


# --------------------------------------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------------------------------------

PREFERENCE_LOSSES: dict[str, Callable[..., LossOutput]] = {
    "dpo": dpo_loss,
    "ipo": ipo_loss,
    "rpo": rpo_loss,
    "simpo": simpo_loss,
    "hinge": hinge_loss,
}
"""Name → loss. Each is called as ``fn(batch: PreferenceLogps, *, beta, **params)``; an unknown param is a TypeError."""



def get_preference_loss(name: str) -> PreferenceLoss:
    """The preference loss registered under ``name``; ``ValueError`` listing the known names otherwise."""
    try:
        return PREFERENCE_LOSSES[name]
    except KeyError:
        raise ValueError(f"unknown preference loss {name!r}; known: {sorted(PREFERENCE_LOSSES)}") from None


# --------------------------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------------------------


def _require(batch: PreferenceLogps, loss_name: str, *names: str) -> None:
    missing = [n for n in names if getattr(batch, n) is None]
    if missing:
        raise ValueError(f"{loss_name} needs PreferenceLogps fields {missing}, which are None")




def _check_pair_shapes(nll: torch.Tensor, tokens: torch.Tensor) -> None:
    if nll.dim() != 1 or nll.shape != tokens.shape:
        raise ValueError(
            f"chosen_token_nll_sum and chosen_tokens must both be [B]; got {tuple(nll.shape)}, {tuple(tokens.shape)}"
        )


def _lengths(tokens: torch.Tensor) -> torch.Tensor:
    return tokens.float().clamp(min=1.0)  # [B]


def _log_ratios(batch: PreferenceLogps) -> tuple[torch.Tensor, torch.Tensor]:
    """(logπ(y_c) - logπ_ref(y_c), logπ(y_r) - logπ_ref(y_r)), float32, [B] each; the reference carries no grad."""
    ratio_c = batch.policy_chosen.float() - batch.ref_chosen.detach().float()
    ratio_r = batch.policy_rejected.float() - batch.ref_rejected.detach().float()
    return ratio_c, ratio_r


def _output(
    loss_name: str,
    losses: torch.Tensor,
    reward_chosen: torch.Tensor,
    reward_rejected: torch.Tensor,
    batch: PreferenceLogps,
) -> LossOutput:
    loss_sum = losses.sum()  # []
    count = torch.tensor(losses.numel(), dtype=torch.int, device=losses.device)
    with torch.no_grad():
        margin = reward_chosen - reward_rejected  # [B]
        metrics = {
            loss_name: loss_sum.detach(),
            "rewards/accuracies": (margin > 0).float().sum(),
            "rewards/chosen": reward_chosen.sum(),
            "rewards/rejected": reward_rejected.sum(),
            "rewards/margins": margin.sum(),
            "logps/chosen": batch.policy_chosen.detach().float().sum(),
            "logps/rejected": batch.policy_rejected.detach().float().sum(),
        }
    return loss_sum, count, metrics
