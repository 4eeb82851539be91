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

from typing import Protocol

import torch

LossOutput = tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]


class Loss(Protocol):
    def __call__(self, *args: torch.Tensor, **kwargs) -> LossOutput: ...

