"""Supervised fine-tuning loss: next-token cross-entropy on response tokens only."""

from __future__ import annotations

import torch

from align_pipeline.losses.base import LossOutput


def masked_token_loss(token_losses: torch.Tensor, loss_mask: torch.Tensor) -> LossOutput:
    """Sum of per-token negative log-likelihoods where ``loss_mask`` is 1.

    Args:
      token_losses: [b, s] float, ``-log p(label_t | x_<=t)`` per position (Megatron's vocab-parallel cross-entropy).
      loss_mask: [b, s] float/bool, 1 on response tokens (including EOS), 0 on prompt and padding.

    Returns ``(loss_sum, num_tokens, {"lm_loss": loss_sum})``; mean NLL = loss_sum / num_tokens after reduction.
    """
    mask = loss_mask.to(token_losses.dtype)
    loss_sum = (token_losses.float() * mask.float()).sum()  # []
    num_tokens = mask.sum().to(torch.int)  # []
    return loss_sum, num_tokens, {"lm_loss": loss_sum.detach()}
