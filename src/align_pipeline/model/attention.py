"""Core attention on ``torch.nn.functional.scaled_dot_product_attention``.

Megatron-core's local layer spec (used when Transformer Engine is absent) computes attention unfused: it materialises
the [b, heads, sq, sk] score matrix with ``baddbmm`` and a separate softmax, which costs about 2x the time and memory
of a fused kernel on an H200. :class:`SDPAttention` keeps Megatron's ``DotProductAttention`` interface (constructor,
sharded state dict, tensor-parallel head split) and replaces only ``forward`` with PyTorch's SDPA, which dispatches to
FlashAttention / memory-efficient kernels on GPU and a fused kernel on CPU.

Packed sequences (Megatron's ``packed_seq_params``, "thd": the samples of a micro-batch concatenated) attend within
their segment only: on a GPU through FlexAttention with a block mask, on CPU through SDPA with the block-diagonal
causal mask. No Transformer Engine needed; with TE's spec, TE's own packed attention does this.
``ALIGN_PACKED_ATTENTION=varlen`` (bf16/fp16 on a GPU, torch >= 2.10) uses PyTorch's variable-length FlashAttention
instead (``torch.nn.attention.varlen``: each segment's causal attention from the ``cu_seqlens`` offsets, no mask);
opt-in until ``benchmarks/packing.py --layouts dense packed packed_varlen`` has measured it against FlexAttention.
"""

from __future__ import annotations

import inspect
import os

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType


class SDPAttention(DotProductAttention):
    """Drop-in core attention for Megatron's local spec, computed with ``scaled_dot_product_attention``.

    Shapes (Megatron convention, per tensor-parallel partition):
      query [sq, b, np, hn], key/value [sk, b, ng, hn] (ng = query groups, GQA when ng < np) -> context [sq, b, np*hn].
    ``attention_mask`` follows Megatron: boolean, True = *masked out*, broadcastable to [b, 1|np, sq, sk].
    Multi-head latent attention passes query/key and value heads of different widths (``k_channels``,
    ``v_channels``: e.g. 192 and 128); the context then has the value width per head.
    """

    def __init__(self, *args, k_channels: int | None = None, v_channels: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        if v_channels is not None:  # the context's width: value heads of this partition
            self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        assert attention_bias is None, "SDPAttention does not support an attention bias."
        if self.softmax_offset is not None:
            raise NotImplementedError("SDPAttention supports softmax_type='vanilla' only")
        if packed_seq_params is not None:
            return self._packed(query, key, value, packed_seq_params)
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        sq, b, np_, _ = query.shape
        sk = key.shape[0]

        # [s, b, h, d] -> [b, h, s, d]
        q = query.permute(1, 2, 0, 3)
        k = key.permute(1, 2, 0, 3)
        v = value.permute(1, 2, 0, 3)
        groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition

        causal = mask_type == AttnMaskType.causal
        sdpa_mask = None
        if attention_mask is not None:
            sdpa_mask = ~attention_mask.bool()  # SDPA: True = attend
            if causal:
                sdpa_mask = sdpa_mask & _causal_keep_mask(sq, sk, q.device)
            causal = False
        elif causal and sq != sk:
            # Decoding with a KV cache: the queries are the *last* sq positions (bottom-right aligned causal mask).
            sdpa_mask = _causal_keep_mask(sq, sk, q.device)
            causal = False

        if sdpa_mask is not None:
            # A query that may attend to nothing (e.g. a left-padding row) would give NaN; let it see every key instead
            # (its output is never used, but NaN would spread through 0 * NaN later).
            sdpa_mask = sdpa_mask | ~sdpa_mask.any(-1, keepdim=True)
        # GQA: the kernels read each key/value head for its group of query heads (enable_gqa) where SDPA takes that
        # with the mask at hand; with an explicit mask the heads are repeated ([b, ng, sk, hn] -> [b, np, sk, hn]),
        # as the memory-efficient kernel that masks need may not take GQA.
        gqa = groups > 1
        if gqa and sdpa_mask is not None:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            gqa = False
        dropout_p = self.attention_dropout.p if self.training else 0.0
        if dropout_p > 0.0 and not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                context = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=sdpa_mask, dropout_p=dropout_p, is_causal=causal, scale=self.softmax_scale,
                    enable_gqa=gqa,
                )
        else:
            context = F.scaled_dot_product_attention(
                q, k, v, attn_mask=sdpa_mask, dropout_p=dropout_p, is_causal=causal, scale=self.softmax_scale,
                enable_gqa=gqa,
            )
        # [b, np, sq, hv] -> [sq, b, np*hv]
        return context.permute(2, 0, 1, 3).reshape(sq, b, np_ * v.shape[-1])


    def _packed(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, params) -> torch.Tensor:
        """Packed ("thd") sequences: query [t, np, hn], key/value [t, ng, hn] -> context [t, np*hn], each segment of
        ``params.cu_seqlens_q`` attending causally to itself only (no dropout)."""
        if params.qkv_format != "thd" or not torch.equal(params.cu_seqlens_q, params.cu_seqlens_kv):
            raise NotImplementedError("SDPAttention packs self-attention in the thd format only")
        t, np_, _ = query.shape
        groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        q, k, v = (x.permute(1, 0, 2).unsqueeze(0) for x in (query, key, value))  # [1, h, t, hn]
        # the variable-length and flex kernels take one head width: multi-head latent attention (value heads
        # narrower than query/key heads) packs through SDPA with the block-diagonal mask
        same_width = value.shape[-1] == query.shape[-1]
        if (same_width and query.is_cuda and query.dtype in (torch.bfloat16, torch.float16)
                and varlen_attention_available()):
            context = _varlen(query, key, value, params.cu_seqlens_q, params.max_seqlen_q, self.softmax_scale, groups)
            return context.reshape(t, np_ * value.shape[-1])  # [t, np*hv]
        segment = segment_ids(params.cu_seqlens_q, t)  # [t]
        if same_width and query.is_cuda and flex_attention_available():
            block_mask = getattr(params, "_align_block_mask", None)  # one per forward, shared by every layer
            if block_mask is None:
                block_mask = _segment_block_mask(segment)
                params._align_block_mask = block_mask
            context = _flex(q, k, v, block_mask=block_mask, scale=self.softmax_scale, enable_gqa=groups > 1)
        else:
            if groups > 1:
                k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            keep = (segment[:, None] == segment[None, :]) & _causal_keep_mask(t, t, q.device)  # [t, t]
            context = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=self.softmax_scale)
        return context.squeeze(0).permute(1, 0, 2).reshape(t, np_ * value.shape[-1])  # [t, np*hv]


def segment_ids(cu_seqlens: torch.Tensor, t: int) -> torch.Tensor:
    """[t] the segment of every token: ``cu_seqlens`` [k + 1] (starts, then t) -> 0..k-1."""
    starts = torch.zeros(t, dtype=torch.int32, device=cu_seqlens.device)
    starts[cu_seqlens[1:-1].long()] = 1
    return starts.cumsum(0)


def flex_attention_available() -> bool:
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def varlen_attention_available(required: bool = False) -> bool:
    """PyTorch's variable-length FlashAttention with a causal window (torch >= 2.10) is there and asked for
    (``ALIGN_PACKED_ATTENTION=varlen``; ``required``: whether it is there)."""
    if not required and os.environ.get("ALIGN_PACKED_ATTENTION", "flex") != "varlen":
        return False
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return False
    return "window_size" in inspect.signature(varlen_attn).parameters


def _varlen(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
            max_seqlen: int | None, scale: float | None, groups: int) -> torch.Tensor:
    """Causal attention within each packed segment: query [t, np, hn], key/value [t, ng, hn] -> [t, np, hn]."""
    from torch.nn.attention.varlen import varlen_attn

    names = inspect.signature(varlen_attn).parameters
    kwargs = {"window_size": (-1, 0), "scale": scale}  # (-1, 0): every earlier key of the segment, none after
    if groups > 1:
        if "enable_gqa" in names:
            kwargs["enable_gqa"] = True
        else:  # torch 2.10-2.11: each key/value head repeated for its query heads
            key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    cu = cu_seqlens.to(torch.int32)
    if max_seqlen is None:
        max_seqlen = int((cu[1:] - cu[:-1]).max())
    query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
    return varlen_attn(query, key, value, cu, cu, int(max_seqlen), int(max_seqlen), **kwargs)


_FLEX = None


def _flex(q, k, v, **kwargs) -> torch.Tensor:
    """FlexAttention, compiled once per shape (blocks the mask leaves empty are skipped)."""
    global _FLEX
    from torch.nn.attention.flex_attention import flex_attention

    if _FLEX is None:
        _FLEX = torch.compile(flex_attention, dynamic=False)
    return _FLEX(q, k, v, **kwargs)


def _segment_block_mask(segment: torch.Tensor):
    """The block mask of causal attention within segments: packed samples cost about what they would alone."""
    from torch.nn.attention.flex_attention import create_block_mask

    def same_segment_causal(b, h, q_idx, kv_idx):
        return (segment[q_idx] == segment[kv_idx]) & (kv_idx <= q_idx)

    t = segment.shape[0]
    return create_block_mask(same_segment_causal, None, None, t, t, device=segment.device)


def _causal_keep_mask(sq: int, sk: int, device: torch.device) -> torch.Tensor:
    """[sq, sk] boolean, True where query i (the i-th of the last sq positions) may attend key j."""
    q_pos = torch.arange(sk - sq, sk, device=device).unsqueeze(1)
    k_pos = torch.arange(sk, device=device).unsqueeze(0)
    return k_pos <= q_pos
