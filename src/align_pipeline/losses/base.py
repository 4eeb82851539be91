"""The loss protocol shared by every stage.

A loss takes tensors and returns ``(loss_sum, count, metrics)``:

* ``loss_sum`` – scalar tensor, the *sum* of the per-token (or per-sequence) losses of this micro-batch;
* ``count`` – scalar int tensor, the number of tokens (or sequences) the sum runs over;
* ``metrics`` – dict of scalar tensors, each also a *sum over the same count*.

The caller normalises: Megatron (``calculate_per_token_loss=True``) divides gradients by the count summed over
micro-batches and data-parallel ranks, and the trainer divides reduced metric sums by the reduced count. Losses never
touch ``torch.distributed``.
"""

from __future__ import annotations

import math

import torch

LossOutput = tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]


# Helpers of the token-level losses (losses.ppo, losses.reinforce): masked positions become 0 before any arithmetic.
def clipped_surrogate(
    logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, clip_eps: float, clip_eps_high: float | None = None,
    ratio: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token ``(loss, clipped, ratio)`` of PPO eq. 7 on already-filled [B, T] tensors: the ratio clipped to
    [1 - ``clip_eps``, 1 + ``clip_eps_high``] (``clip_eps_high`` None = ``clip_eps``; DAPO's "clip-higher" decouples
    them). ``ratio``: a ratio computed by the caller (GSPO's sequence-level one), else π/π_old per token."""
    if ratio is None:
        ratio = torch.exp(logp - old_logp)  # [B, T]  ρ
    high = clip_eps if clip_eps_high is None else clip_eps_high
    unclipped = -adv * ratio  # [B, T]
    clipped = -adv * ratio.clamp(1.0 - clip_eps, 1.0 + high)  # [B, T]
    return torch.maximum(unclipped, clipped), (clipped > unclipped).detach(), ratio.detach()


def fill(x: torch.Tensor, m: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x where m, else 0 (before any arithmetic, so masked garbage cannot make NaN gradients)."""
    return torch.where(m, x.to(dtype), 0.0)


def masked_sum(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return torch.where(m, x, 0.0).sum()


def count_tokens(m: torch.Tensor) -> torch.Tensor:
    return m.sum().to(torch.int)


def float_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def check_clip(fn: str, clip_eps: float) -> None:
    if not (math.isfinite(clip_eps) and 0 < clip_eps < 1):
        raise ValueError(f"{fn}: clip_eps must be in (0, 1), got {clip_eps}")


def check_tokens(fn: str, **tensors: torch.Tensor) -> None:
    shapes = {name: tuple(x.shape) for name, x in tensors.items()}
    first = next(iter(shapes.values()))
    if len(first) != 2 or any(s != first for s in shapes.values()):
        raise ValueError(f"{fn}: expected [B, T] tensors of one shape; got {shapes}")
