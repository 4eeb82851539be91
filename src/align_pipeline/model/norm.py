"""PyTorch RMSNorm/LayerNorm for the local (non-TE) layer spec, with sequence-parallel support.

Megatron's ``WrappedTorchNorm`` refuses ``sequence_parallel`` (its fused Apex/TE norms are expected instead). A norm
needs nothing special under sequence parallelism except that its weight gradients, computed on a sequence shard, are
summed across the tensor-parallel group: Megatron's ``finalize_model_grads`` does that for every parameter marked
``sequence_parallel=True``. This builder marks them and is otherwise the same torch module.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.transformer_config import TransformerConfig


class TorchNorm:
    """Builds ``torch.nn.RMSNorm`` or ``torch.nn.LayerNorm`` per ``config.normalization`` (spec-compatible)."""

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_unused):
        if config.normalization == "RMSNorm":
            norm = torch.nn.RMSNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        elif config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        else:
            raise ValueError(f"unsupported normalization {config.normalization!r}")
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm
