"""AdamW over bf16 weights and bf16 moments with stochastic rounding: the optimizer of ``parallel.optimizer_precision:
bf16``.

Megatron's mixed-precision optimizer keeps, next to the bf16 weights the model computes with, fp32 main weights, an
fp32 gradient buffer and fp32 AdamW moments: 18 bytes per parameter. HF + Liger users train in pure bf16 (8 bytes:
weights, gradients and the two moments, all bf16) and so fit larger micro-batches. Pure bf16 with round-to-nearest
loses updates: a step whose change is below half a bf16 ulp of the weight (weights of magnitude 1 have an ulp of
2^-7; an update of lr x ~1 at lr 1e-5 is far below it) rounds back to the old value, and so does the second moment's
``beta2 * v`` when 1 - beta2 is smaller than the ulp ratio.

This optimizer stores the same 8 bytes per parameter but computes each step in fp32 and writes the new weight and
moments back with *stochastic rounding*: a value between two bf16 neighbours becomes the upper one with probability
equal to its distance from the lower one over their gap, so every stored tensor equals the fp32 result in
expectation and small updates accumulate instead of vanishing (Zamirai et al., "Revisiting BFloat16 Training",
2020, arXiv:2010.06192).

It is a ``torch.optim.AdamW`` (same hyper-parameters, param groups, state keys ``step`` / ``exp_avg`` /
``exp_avg_sq``), so Megatron's ``FP32Optimizer`` wraps it and the training checkpoint saves and loads its state as
for torch's; only :meth:`step` differs. Large tensors are updated in chunks of :data:`CHUNK` elements so the fp32
temporaries stay small. The random bits come from torch's generator of the parameter's device: runs are
reproducible under a fixed seed.
"""

from __future__ import annotations

import functools

import torch

CHUNK = 1 << 24
"""Elements updated at a time (fp32 temporaries of a few x 64 MiB)."""


def stochastic_round_bf16(x: torch.Tensor, noise: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 ``x`` rounded to bf16 stochastically: the low 16 bits of each float's bit pattern are the fraction of
    the gap to the next bf16 value away from zero; adding a uniform 16-bit integer and truncating the low 16 bits
    rounds up (in magnitude) with exactly that probability. ``noise`` (int32 in [0, 2^16), the shape of ``x``): the
    random integers to use (tests); None = drawn from torch's generator. Non-finite values pass through."""
    bits = x.contiguous().view(torch.int32)
    if noise is None:
        noise = torch.randint_like(bits, 0, 1 << 16)
    rounded = ((bits + noise) & -65536).view(torch.float32)
    return torch.where(torch.isfinite(x), rounded, x).to(torch.bfloat16)


def clip_grads_by_total_norm(parameters, max_norm: float, total_norm: float, use_decoupled_grad: bool = False) -> None:
    """Megatron's ``clip_grad_by_total_norm_fp32`` for gradients of any float dtype (it asserts fp32 ones): scale
    every ``.grad`` by ``max_norm / (total_norm + 1e-6)`` when that is below 1."""
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [g for g in (getattr(p, attr, None) for p in parameters) if g is not None]
    coeff = max_norm / (total_norm + 1.0e-6)
    if grads and coeff < 1.0:
        torch._foreach_mul_(grads, coeff)


def _store(dst: torch.Tensor, value: torch.Tensor) -> None:
    """Write fp32 ``value`` into ``dst``: stochastically rounded into bf16, copied into other dtypes."""
    dst.copy_(stochastic_round_bf16(value) if dst.dtype == torch.bfloat16 else value)


def _adamw_chunk(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, lr: float, beta1: float,
                 beta2: float, eps: float, weight_decay: float, step: int) -> None:
    """One AdamW update of flat views ``p`` (weights), ``m``, ``v`` (moments) from gradient ``g``, in fp32 with the
    results stored back by :func:`_store`."""
    # torch's single-tensor AdamW, operation for operation (fp32 parameters: the same bits as torch.optim.AdamW)
    g32 = g.float()
    p32 = p.float().mul_(1 - lr * weight_decay)
    m32 = m.float().lerp_(g32, 1 - beta1)
    v32 = v.float().mul_(beta2).addcmul_(g32, g32, value=1 - beta2)
    del g32
    bias1, bias2 = 1 - beta1 ** step, 1 - beta2 ** step
    denom = (v32.sqrt() / bias2**0.5).add_(eps)
    p32.addcdiv_(m32, denom, value=-lr / bias1)
    del denom
    _store(m, m32)
    _store(v, v32)
    _store(p, p32)


def _fused_bf16_update(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
                       coeffs: torch.Tensor) -> None:
    """:func:`_adamw_chunk` for bf16 ``p``, ``m``, ``v`` as one generated kernel (``torch.compile``): reads 8 bytes
    and writes 6 per parameter, the fp32 values living in registers only. ``coeffs`` (fp32, on the device):
    1 - lr * wd, 1 - beta1, beta2, 1 - beta2, 1 / sqrt(1 - beta2^step), eps, -lr / (1 - beta1^step) -- tensors, so
    a new learning rate or step does not recompile."""
    decay, one_minus_b1, b2, one_minus_b2, inv_sqrt_bias2, eps, neg_step_size = coeffs.unbind(0)
    g32 = g.float()
    m32 = torch.lerp(m.float(), g32, one_minus_b1)
    v32 = v.float() * b2 + one_minus_b2 * g32 * g32
    p32 = p.float() * decay + neg_step_size * m32 / (v32.sqrt() * inv_sqrt_bias2 + eps)
    m.copy_(stochastic_round_bf16(m32))
    v.copy_(stochastic_round_bf16(v32))
    p.copy_(stochastic_round_bf16(p32))


@functools.cache
def _compiled_update():
    return torch.compile(_fused_bf16_update, dynamic=None)


class StochasticRoundingAdamW(torch.optim.AdamW):
    """Torch's AdamW (decoupled weight decay, bias correction) whose bf16 parameters and moments are updated in fp32
    and stored with :func:`stochastic_round_bf16` (parameters of other dtypes: the same arithmetic, stored as is).
    ``compiled``: bf16 tensors take :func:`_fused_bf16_update`, one generated kernel per chunk (the GPU path, with
    ``parallel.kernels`` fused); otherwise the eager operations of torch's AdamW."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, compiled: bool = False) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False, fused=False)
        self.compiled = compiled

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            coeffs: dict[tuple[torch.device, int], torch.Tensor] = {}  # (device, step) -> the fused kernel's scalars
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("StochasticRoundingAdamW does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                step = int(state["step"].item())  # a CPU tensor: no device synchronisation
                flat = [t.view(-1) for t in (p.data, p.grad, state["exp_avg"], state["exp_avg_sq"])]
                fused = self.compiled and all(t.dtype == torch.bfloat16 for t in flat[:1] + flat[2:])
                if fused and (p.device, step) not in coeffs:
                    lr, bias1, bias2 = group["lr"], 1 - beta1 ** step, 1 - beta2 ** step
                    coeffs[p.device, step] = torch.tensor(
                        [1 - lr * group["weight_decay"], 1 - beta1, beta2, 1 - beta2, 1 / bias2**0.5, group["eps"],
                         -lr / bias1], dtype=torch.float32).to(p.device)
                for start in range(0, p.numel(), CHUNK):
                    chunk = [t[start:start + CHUNK] for t in flat]
                    if fused:
                        _compiled_update()(*chunk, coeffs[p.device, step])
                    else:
                        _adamw_chunk(*chunk, group["lr"], beta1, beta2, group["eps"], group["weight_decay"], step)
        return loss
