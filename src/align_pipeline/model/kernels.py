"""Fused elementwise kernels for the local (non-Transformer-Engine) layer spec.

Without TE or Apex, a Megatron layer runs its small operations one eager kernel at a time: RoPE (cos, sin, a split,
a concatenation, two products and a sum for the query and again for the key, in every layer, forward and backward),
the SwiGLU gate, the norms. On an H200 these memory-bound kernels took ~40 % of a 1.19B model's step. This module
fuses them, each into one generated kernel per direction, with ``torch.compile`` (Triton on GPU, C++ on CPU):

* RoPE: installed as Megatron's ``fused_apply_rotary_pos_emb`` / ``..._thd`` (the hooks TE fills), switched on by
  ``apply_rope_fusion``. The cos/sin tables are computed once per forward, not per layer and tensor; packed (thd)
  rows get their per-sample positions in one gather instead of Megatron's per-sample Python loop.
* SwiGLU: :class:`FusedSwiGLU`, given to Megatron's MLP as its activation module (a GeLU with a bias: Megatron's own
  fused bias-GeLU).
* RMSNorm / LayerNorm: :class:`FusedRMSNorm` / :class:`FusedLayerNorm`, the torch norms with their functional form
  compiled once for every layer.
* fp32 gradient accumulation (CUDA): the weight-gradient GEMM adds into Megatron's fp32 ``main_grad`` directly
  (``gradient_accumulation_fusion``, Apex's extension replaced by ``addmm`` with ``out_dtype``).
* The LM loss at tensor parallelism 1: log-softmax and the label gather in one kernel (:func:`token_nll`).
* The optimizer step: torch's fused AdamW over the fp32 main weights (:func:`fuse_adamw`), and the gradient norm and
  scaling in foreach kernels without host synchronisations (:func:`install_optimizer_kernels`), where Megatron falls
  back to a Python loop over the parameters without Apex.

Chosen by ``parallel.kernels`` (auto = fused on CUDA, eager on CPU, where compiling costs more than it saves for the
tiny test models); Transformer Engine's spec brings its own fused kernels and is left alone. The eager path is
Megatron's unfused code, the reference the fused path is tested against.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


def use_fused(kernels: str, attention_backend: str) -> bool:
    """Whether the model gets the fused kernels: ``kernels`` (auto | fused | eager) for the resolved attention
    backend (TE's spec has its own)."""
    if attention_backend == "te" or kernels == "eager":
        return False
    if kernels == "fused":
        return True
    return torch.cuda.is_available()


_ACTIVE = False


def active() -> bool:
    """Whether this process builds its models with the fused kernels (a job has one parallel config); the loss
    functions read it to pick their fused form."""
    return _ACTIVE


def config_overrides(fused: bool, swiglu: bool, bias: bool) -> dict:
    """``TransformerConfig`` fields for the choice (installs the RoPE hooks and, on CUDA, the fp32 weight-gradient
    accumulation when fused). Megatron fuses a GeLU only with a bias; SwiGLU with or without."""
    global _ACTIVE
    _ACTIVE = fused
    if not fused:
        return {}
    install_rope()
    install_optimizer_kernels()
    return {"apply_rope_fusion": True, "gradient_accumulation_fusion": install_grad_accumulation(),
            # SwiGLU: FusedSwiGLU, built from the MLP spec (Megatron's hook for a spec-given activation module);
            # a GeLU with a bias: Megatron's own fused bias-GeLU
            "use_te_activation_func": swiglu, "bias_activation_fusion": bias and not swiglu}


@functools.cache
def _compiled(fn):
    # dynamic=None: the first shape compiles static, a second one recompiles with dynamic sizes (validation, rollouts)
    return torch.compile(fn, dynamic=None)


def _rope_math(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Megatron's ``_apply_rotary_pos_emb_bshd`` (non-interleaved): t [..., d], cos/sin [..., rot] in t's dtype."""
    rot = cos.shape[-1]
    x, rest = t[..., :rot], t[..., rot:]
    x1, x2 = x.chunk(2, dim=-1)
    out = x * cos + torch.cat((-x2, x1), dim=-1) * sin
    return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out


class _CosSin:
    """cos/sin of the last frequency tensor seen: every layer's query and key of a forward share one table."""

    def __init__(self):
        self.freqs: torch.Tensor | None = None
        self.version = -1
        self.tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def get(self, freqs: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if freqs is not self.freqs or freqs._version != self.version:
            self.freqs, self.version, self.tables = freqs, freqs._version, {}
        if dtype not in self.tables:
            with torch.no_grad():
                self.tables[dtype] = (torch.cos(freqs).to(dtype), torch.sin(freqs).to(dtype))
        return self.tables[dtype]


_TABLES = _CosSin()


def rope_bshd(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False, **_unused) -> torch.Tensor:
    """Fused RoPE: t [s, b, h, d], freqs [s, 1, 1, rot] (Megatron's layout) -> t rotated, one kernel each way."""
    if interleaved:
        raise NotImplementedError("the fused RoPE covers non-interleaved rotary embeddings (Llama, Qwen, Mistral)")
    if freqs.requires_grad:  # learned frequencies are not a thing here; keep autograd exact if they ever are
        return _rope_math(t, torch.cos(freqs).to(t.dtype), torch.sin(freqs).to(t.dtype))
    cos, sin = _TABLES.get(freqs, t.dtype)
    return _compiled(_rope_math)(t, cos, sin)


def thd_positions(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """[total] each packed token's position within its sample (cu_seqlens [k + 1]: starts, then the end)."""
    starts = cu_seqlens[:-1].long()
    lengths = cu_seqlens[1:].long() - starts
    index = torch.arange(total, device=cu_seqlens.device)
    return index - torch.repeat_interleave(starts, lengths, output_size=total)


def rope_thd(t: torch.Tensor, cu_seqlens: torch.Tensor, freqs: torch.Tensor, cp_size: int = 1, cp_rank: int = 0,
             **_unused) -> torch.Tensor:
    """Fused RoPE of packed samples: t [T, h, d], positions restarting at each ``cu_seqlens`` start. Frequencies as
    Megatron's unfused thd path reads them: by absolute index when ``freqs`` has exactly T rows, else by position
    within the sample."""
    if cp_size != 1:
        raise NotImplementedError("the fused packed RoPE does not split samples over context-parallel ranks")
    total = t.shape[0]
    key = (cu_seqlens, cu_seqlens._version, freqs, freqs._version, total)
    if _PACKED["key"] is None or not all(a is b if isinstance(a, torch.Tensor) else a == b
                                         for a, b in zip(_PACKED["key"], key)):
        # once per forward (every layer's query and key share it): one host sync, one gather
        if freqs.shape[0] == int(cu_seqlens[-1]):
            packed = freqs[:total]
        else:
            packed = freqs[thd_positions(cu_seqlens, total)]  # [T, 1, 1, rot]
        _PACKED.update(key=key, freqs=packed)
    return rope_bshd(t.unsqueeze(1), _PACKED["freqs"]).squeeze(1)


_PACKED: dict = {"key": None, "freqs": None}  # the last packed batch's per-token frequencies


def install_rope() -> None:
    """Fill Megatron's fused-RoPE hooks with ours where Transformer Engine did not."""
    from megatron.core.models.common.embeddings import rope_utils

    if rope_utils.fused_apply_rotary_pos_emb is None:
        rope_utils.fused_apply_rotary_pos_emb = rope_bshd
    if rope_utils.fused_apply_rotary_pos_emb_thd is None:
        rope_utils.fused_apply_rotary_pos_emb_thd = rope_thd


def _swiglu(x: torch.Tensor) -> torch.Tensor:
    gate, linear = torch.chunk(x, 2, dim=-1)
    return F.silu(gate) * linear


class FusedSwiGLU(torch.nn.Module):
    """The gated SiLU of the MLP, ``silu(x[..., :f]) * x[..., f:]``: one generated kernel forward, one backward
    (Megatron's fused SwiGLU has a hand-written backward that upcasts and concatenates: ~1.6x the time on an H200)."""

    def __init__(self, config=None, **_unused):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _compiled(_swiglu)(x)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        return {}  # no parameters (Megatron's distributed checkpoint asks every submodule)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def _layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


class FusedRMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` (same parameters and state dict) whose forward and backward are each one generated
    kernel; the compiled function takes the weight as an argument, so one compilation serves every layer."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _compiled(_rms_norm)(x, self.weight, self.eps)


class FusedLayerNorm(torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` with a compiled forward and backward (see :class:`FusedRMSNorm`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _compiled(_layer_norm)(x, self.weight, self.bias, self.eps)


class _WeightGradAccumulation:
    """Megatron's ``fused_weight_gradient_mlp_cuda`` (an Apex extension) on plain PyTorch: the weight gradient of a
    linear layer is computed by one GEMM that adds its fp32 result into the fp32 ``main_grad`` (``addmm`` with
    ``out_dtype``), instead of a bf16 GEMM, a cast and an add per parameter and micro-batch."""

    @staticmethod
    def wgrad_gemm_accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
        if total_input.dtype == torch.float32:
            main_grad.addmm_(grad_output.t(), total_input)
        else:
            torch.addmm(main_grad, grad_output.t(), total_input, torch.float32, out=main_grad)

    @staticmethod
    def wgrad_gemm_accum_fp16(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
        main_grad.addmm_(grad_output.t(), total_input)


@functools.cache
def _addmm_out_dtype_works() -> bool:
    """bf16 x bf16 -> fp32 ``addmm`` into its own input exists (CUDA, torch >= 2.8) and is right."""
    if not torch.cuda.is_available():
        return False
    try:
        a = torch.randn(64, 32, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(32, 48, device="cuda", dtype=torch.bfloat16)
        acc = torch.ones(64, 48, device="cuda")
        torch.addmm(acc, a, b, torch.float32, out=acc)
        return bool(torch.allclose(acc, 1 + a.float() @ b.float(), atol=1e-2))
    except (RuntimeError, TypeError):
        return False


def install_grad_accumulation() -> bool:
    """Make Megatron's ``gradient_accumulation_fusion`` use :class:`_WeightGradAccumulation` when Apex's extension is
    absent; returns whether the fusion can be switched on."""
    from megatron.core.tensor_parallel import layers

    if layers._grad_accum_fusion_available and getattr(layers, "fused_weight_gradient_mlp_cuda", None) is not None:
        return True  # Apex's own
    if not _addmm_out_dtype_works():
        return False
    layers.fused_weight_gradient_mlp_cuda = _WeightGradAccumulation
    layers._grad_accum_fusion_available = True
    return True


def _token_nll(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """-log softmax(logits)[label] over the first ``vocab_size`` columns, in fp32: [b, s, V] -> [b, s]."""
    z = logits[..., :vocab_size].float()
    return torch.logsumexp(z, dim=-1) - z.gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def token_nll(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Fused cross-entropy of whole-vocabulary logits (tensor parallelism 1): one generated kernel reads the bf16
    logits and writes the per-token NLL (no fp32 copy of the logits), and one computes their gradient."""
    return _compiled(_token_nll)(logits, labels, vocab_size)


def _foreach_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """Apex's ``multi_tensor_l2norm`` with torch's foreach kernels: the L2 norm of a list of tensors as a [1] fp32
    device tensor, with no host synchronisation (Megatron's local fallback copies every tensor's norm to the host)."""
    norms = torch._foreach_norm(tensor_lists[0])
    return torch.linalg.vector_norm(torch.stack([n.float() for n in norms])).reshape(1), None


def _foreach_scale(chunk_size, noop_flag, tensor_lists, scale):
    """Apex's ``multi_tensor_scale`` (dst = src * scale, dtype-converting) in a few foreach kernels instead of one
    multiply and one copy per tensor."""
    src, dst = tensor_lists
    if src is dst or all(s is d for s, d in zip(src, dst)):
        torch._foreach_mul_(dst, scale)
    elif scale == 1.0:
        torch._foreach_copy_(dst, src)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


def install_optimizer_kernels() -> None:
    """Replace Megatron's local (no TE/Apex) gradient-norm and tensor-scale fallbacks with :func:`_foreach_l2_norm`
    and :func:`_foreach_scale`; TE's or Apex's own are left alone."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer

    if clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = _foreach_l2_norm
    for module in (clip_grads, optimizer):
        if module.multi_tensor_scale_impl is utils.local_multi_tensor_scale:
            module.multi_tensor_scale_impl = _foreach_scale


def fuse_adamw(megatron_optimizer) -> int:
    """Switch the torch ``AdamW`` under Megatron's optimizer (its fallback without TE/Apex) to torch's fused
    implementation: one generated kernel per parameter chunk instead of ~a dozen foreach kernels over the fp32 main
    weights. Returns the number of param groups switched (0 when the optimizer is not torch's, e.g. TE's)."""
    switched = 0
    for chained in getattr(megatron_optimizer, "chained_optimizers", [megatron_optimizer]):
        inner = getattr(chained, "optimizer", None)
        if not isinstance(inner, torch.optim.AdamW | torch.optim.Adam):
            continue
        for group in inner.param_groups:
            if all(p.is_floating_point() and p.device.type in ("cuda", "cpu") for p in group["params"]):
                group["fused"], group["foreach"] = True, False
                switched += 1
    return switched
