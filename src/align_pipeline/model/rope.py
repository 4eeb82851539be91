"""RoPE inverse frequencies for plain, linearly scaled and Llama-3.1-scaled rotary embeddings.

Megatron's ``RotaryEmbedding`` computes ``inv_freq = 1 / theta^(2i/d)`` and knows Llama 3's scaling only with its
original constants (factor 8, low/high frequency factors 1 and 4, context 8192). :func:`inv_freq` computes the
frequencies for any :class:`~align_pipeline.config.ModelConfig`; :func:`build_gpt` installs them on the model.

llama3 (Llama 3.1 report, §3; ``transformers``' ``_compute_llama3_parameters``), with wavelength
``w = 2π / f``, ``L = original context``:

* ``w < L / high_freq_factor``: ``f`` unchanged (high frequencies: local order);
* ``w > L / low_freq_factor``: ``f / factor`` (low frequencies: stretched to the longer context);
* in between: ``(1 - s) f / factor + s f`` with ``s = (L / w - low_freq_factor) / (high_freq_factor - low_freq_factor)``.

linear: every ``f / factor`` (the same as dividing positions by the factor).
"""

from __future__ import annotations

import math

import torch

from align_pipeline.config.common import ModelConfig


def head_dim(model: ModelConfig) -> int:
    """Width of one attention head."""
    return model.kv_channels or model.hidden_size // model.num_attention_heads


def inv_freq(model: ModelConfig, device: torch.device | str = "cpu") -> torch.Tensor:
    """``[head_dim / 2]`` fp32 inverse frequencies of the model's rotary embedding."""
    dim = head_dim(model)
    base = 1.0 / (model.rotary_base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
    factor = model.rope_scaling_factor
    if model.rope_scaling == "none":
        return base
    if model.rope_scaling == "linear":
        return base / factor
    context = model.rope_original_max_position
    low, high = model.rope_low_freq_factor, model.rope_high_freq_factor
    wavelen = 2 * math.pi / base
    scaled = torch.where(wavelen > context / low, base / factor, base)
    smooth = (context / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= context / high) & (wavelen <= context / low)
    return torch.where(medium, blended, scaled)
