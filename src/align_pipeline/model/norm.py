"""PyTorch RMSNorm/LayerNorm for the local (non-TE) layer spec, with sequence-parallel support.

Megatron's ``WrappedTorchNorm`` refuses ``sequence_parallel`` (its fused Apex/TE norms are expected instead). A norm
needs nothing special under sequence parallelism except that its weight gradients, computed on a sequence shard, are
summed across the tensor-parallel group: Megatron's ``finalize_model_grads`` does that for every parameter marked
``sequence_parallel=True``. This builder marks them and is otherwise the same torch module.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from align_pipeline.model import kernels


class TorchNorm:
    """Builds ``torch.nn.RMSNorm`` or ``torch.nn.LayerNorm`` per ``config.normalization`` (spec-compatible)."""

    rms_norm: type[torch.nn.Module] = torch.nn.RMSNorm
    layer_norm: type[torch.nn.Module] = torch.nn.LayerNorm

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_unused):
        if config.normalization == "RMSNorm":
            norm = cls.rms_norm(hidden_size, eps=eps, dtype=config.params_dtype)
        elif config.normalization == "LayerNorm":
            norm = cls.layer_norm(hidden_size, eps=eps, dtype=config.params_dtype)
        else:
            raise ValueError(f"unsupported normalization {config.normalization!r}")
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


class FusedTorchNorm(TorchNorm):
    """:class:`TorchNorm` building the compiled norms of :mod:`align_pipeline.model.kernels` (same state dict)."""

    rms_norm = kernels.FusedRMSNorm
    layer_norm = kernels.FusedLayerNorm
