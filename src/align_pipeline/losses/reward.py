"""Reward-model losses: pairwise Bradley–Terry and multi-attribute regression (SteerLM / HelpSteer).

Both follow the protocol of :mod:`align_pipeline.losses.base`: ``(loss_sum, count, metrics)`` with every metric a sum
over the same count; the caller divides after reducing over micro-batches and data-parallel ranks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from align_pipeline.losses.base import LossOutput


def bradley_terry_loss(
    chosen_rewards: torch.Tensor,
    rejected_rewards: torch.Tensor,
    margin: torch.Tensor | None = None,
) -> LossOutput:
    """Pairwise Bradley–Terry reward-model loss, summed over pairs.

    InstructGPT (Ouyang et al. 2022, eq. 1), for one pair (K = 2)::

        loss_b = -log σ(r(x, y_c) - r(x, y_r) - m(r))

    with the optional margin ``m(r)`` of Llama 2 (Touvron et al. 2023, eq. 2); ``margin=None`` means ``m = 0``.

    Args:
      chosen_rewards: [B] float, scalar reward ``r(x, y_c)`` of the preferred response.
      rejected_rewards: [B] float, scalar reward ``r(x, y_r)`` of the other response.
      margin: [B] float or None, the required reward gap per pair (a larger gap for a stronger preference).

    Returns ``(loss_sum, B, metrics)``; metrics are sums over the B pairs:
      ``rm_loss`` (= loss_sum), ``accuracy`` (1 where ``r_c > r_r`` strictly, so a tie counts 0),
      ``reward_chosen``, ``reward_rejected``, ``reward_margin`` (``r_c - r_r``, without the margin ``m``).
    """
    _check_pair(chosen_rewards, rejected_rewards, "chosen_rewards", "rejected_rewards")
    r_c = chosen_rewards.float()  # [B]
    r_r = rejected_rewards.float()  # [B]
    delta = r_c - r_r  # [B]
    logits = delta
    if margin is not None:
        if margin.shape != delta.shape:
            raise ValueError(f"margin has shape {tuple(margin.shape)}, expected {tuple(delta.shape)}")
        logits = delta - margin.float()  # [B]
    loss_sum = -F.logsigmoid(logits).sum()  # []
    count = torch.tensor(delta.numel(), dtype=torch.int, device=delta.device)
    with torch.no_grad():
        metrics = {
            "rm_loss": loss_sum.detach(),
            "accuracy": (delta > 0).float().sum(),
            "reward_chosen": r_c.sum(),
            "reward_rejected": r_r.sum(),
            "reward_margin": delta.sum(),
        }
    return loss_sum, count, metrics


def regression_reward_loss(
    predicted: torch.Tensor,
    labels: torch.Tensor,
    label_mask: torch.Tensor,
) -> LossOutput:
    """Multi-attribute regression reward-model loss: squared error on the labels that are present.

    The attribute-prediction model of SteerLM (Dong et al. 2023) as trained with a regression head in NeMo-Aligner /
    HelpSteer (Wang et al. 2023)::

        loss = Σ_{b,a} mask_{b,a} · (ŷ_{b,a} - y_{b,a})²,   count = Σ_{b,a} mask_{b,a}

    so ``loss_sum / count`` is the MSE over present labels. Missing labels (mask 0) add nothing to the loss, the
    count, the metrics or the gradient, whatever their value (NaN or a sentinel such as -100 is fine).

    Args:
      predicted: [B, A] float, the model's predicted attribute values.
      labels: [B, A] float, target attribute values.
      label_mask: [B, A] bool/float, 1 where the label is present, 0 where missing.

    Returns ``(loss_sum, num_present_labels, {"rm_loss", "abs_error"})``, both metrics sums over present labels.
    """
    if not (predicted.shape == labels.shape == label_mask.shape) or predicted.dim() != 2:
        raise ValueError(
            "predicted, labels and label_mask must all be [B, A]; got "
            f"{tuple(predicted.shape)}, {tuple(labels.shape)}, {tuple(label_mask.shape)}"
        )
    present = label_mask.bool()  # [B, A]
    pred = predicted.float()  # [B, A]
    # Replace missing labels *before* the subtraction: NaN·0 is NaN, and would also poison the gradient.
    target = torch.where(present, labels.float(), pred.detach())  # [B, A]
    err = torch.where(present, pred - target, torch.zeros_like(pred))  # [B, A]
    loss_sum = err.pow(2).sum()  # []
    count = present.sum().to(torch.int)  # []
    with torch.no_grad():
        metrics = {"rm_loss": loss_sum.detach(), "abs_error": err.abs().sum()}
    return loss_sum, count, metrics


def _check_pair(a: torch.Tensor, b: torch.Tensor, name_a: str, name_b: str) -> None:
    if a.dim() != 1 or a.shape != b.shape:
        raise ValueError(f"{name_a} and {name_b} must both be [B]; got {tuple(a.shape)} and {tuple(b.shape)}")
