"""The bf16 optimizer of ``parallel.optimizer_precision: bf16``: stochastic rounding by hand, AdamW's arithmetic
against torch's, and small updates that survive in bf16 where round-to-nearest drops them."""

from __future__ import annotations

import pytest
import torch

from align_pipeline.train.core import bf16_adamw
from align_pipeline.train.core.bf16_adamw import StochasticRoundingAdamW, stochastic_round_bf16


def test_stochastic_rounding_by_hand():
    # 1 + 2^-9 lies a quarter of the way from bf16's 1.0 to its next value 1 + 2^-7: the low 16 bits of its fp32
    # pattern are 0.25 * 2^16 = 16384, so noise below 49152 keeps 1.0 and noise from 49152 up rounds up
    x = torch.tensor([1 + 2**-9, -(1 + 2**-9), 1 + 2**-9, -(1 + 2**-9)])
    noise = torch.tensor([49151, 49151, 49152, 49152], dtype=torch.int32)
    out = stochastic_round_bf16(x, noise)
    assert out.dtype == torch.bfloat16
    assert out.float().tolist() == [1.0, -1.0, 1 + 2**-7, -(1 + 2**-7)]  # the negative side rounds in magnitude


def test_stochastic_rounding_leaves_bf16_values_and_non_finite_alone():
    x = torch.tensor([1.0, -3.5, 2**-100, 0.0, float("inf"), float("-inf"), float("nan"), 3.3895313892515355e38])
    out = stochastic_round_bf16(x, torch.full(x.shape, 65535, dtype=torch.int32)).float()
    assert out[:4].tolist() == [1.0, -3.5, 2**-100, 0.0]
    assert out[4] == float("inf") and out[5] == float("-inf") and torch.isnan(out[6])
    assert out[7] == 3.3895313892515355e38  # bf16's largest finite value stays finite


def test_stochastic_rounding_is_unbiased():
    torch.manual_seed(0)
    x = torch.full((200_000,), 1 + 2**-9)  # expected value: 0.75 * 1.0 + 0.25 * (1 + 2^-7) = 1 + 2^-9
    out = stochastic_round_bf16(x).float()
    assert set(out.unique().tolist()) == {1.0, 1 + 2**-7}
    assert abs((out == 1 + 2**-7).float().mean().item() - 0.25) < 0.005  # 200k draws: std ~0.001
    assert abs(out.mean().item() - x[0].item()) < 2**-7 * 0.005


def _params(dtype: torch.dtype, seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=g).to(dtype)) for shape in ((7, 5), (5,), (3, 4, 2))]


def _run(opt_cls, params, steps: int, seed: int = 1, **kw) -> None:
    opt = opt_cls(params, lr=kw.get("lr", 1e-2), betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
        opt.step()


def test_fp32_parameters_take_torch_adamw_bit_for_bit():
    ours, theirs = _params(torch.float32), _params(torch.float32)
    _run(StochasticRoundingAdamW, ours, steps=5)
    _run(lambda ps, **kw: torch.optim.AdamW(ps, foreach=False, **kw), theirs, steps=5)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)


def test_chunks_give_the_same_update(monkeypatch):
    whole = _params(torch.bfloat16)
    torch.manual_seed(3)
    _run(StochasticRoundingAdamW, whole, steps=3)
    chunked = _params(torch.bfloat16)
    monkeypatch.setattr(bf16_adamw, "CHUNK", 4)  # every tensor in several pieces, the last one shorter
    torch.manual_seed(3)
    _run(StochasticRoundingAdamW, chunked, steps=3)
    # the random bits are drawn per chunk, so the rounding differs; each value is within one bf16 gap of the other
    for a, b in zip(whole, chunked, strict=True):
        assert (a.float() - b.float()).abs().max() <= 2 * 2**-7 * a.float().abs().max()


def test_bf16_step_stores_a_neighbour_of_the_fp32_result():
    params = _params(torch.bfloat16)
    start = [p.detach().clone() for p in params]
    opt = StochasticRoundingAdamW(params, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    grads = [torch.randn(p.shape, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
             for i, p in enumerate(params)]
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    opt.step()
    for p, p0, g in zip(params, start, grads, strict=True):
        # the fp32 AdamW step from the bf16 start (step 1: m = 0.1 g, v = 0.05 g^2, bias-corrected: g / (|g| + eps))
        g32 = g.float()
        exact = p0.float() * (1 - 1e-2 * 0.1) - 1e-2 * g32 / (g32.abs() + 1e-8 / 1.0)
        gap = exact.abs() * 2**-7  # bf16's spacing near |exact| is at most this
        assert ((p.float() - exact).abs() <= gap).all()
        state = opt.state[p]
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
        assert state["step"].item() == 1.0


def test_small_updates_accumulate_where_round_to_nearest_drops_them():
    """Weights at 1.0 (bf16 gap 2^-7), a constant gradient: AdamW moves each by lr = 1e-4 per step, a 78th of the
    gap. Round-to-nearest (torch's AdamW on bf16 tensors) never moves them; stochastic rounding moves them by the
    right amount on average: 100 steps -> 1 - 0.01."""
    torch.manual_seed(0)
    ours = [torch.nn.Parameter(torch.ones(20_000, dtype=torch.bfloat16))]
    rtn = [torch.nn.Parameter(torch.ones(20_000, dtype=torch.bfloat16))]
    opts = [StochasticRoundingAdamW(ours, lr=1e-4, weight_decay=0.0),
            torch.optim.AdamW(rtn, lr=1e-4, weight_decay=0.0, foreach=False)]
    for _ in range(100):
        for opt, (p,) in zip(opts, (ours, rtn), strict=True):
            p.grad = torch.ones_like(p)
            opt.step()
    assert torch.equal(rtn[0], torch.ones_like(rtn[0]))
    assert ours[0].float().mean().item() == pytest.approx(0.99, abs=2e-4)


def test_compiled_update_matches_the_eager_one_to_rounding():
    """The GPU path (one generated kernel per chunk) against the eager operations: each stored weight and moment
    within one bf16 gap of the other after a step (they draw different random bits), bf16 throughout."""
    eager, fused = _params(torch.bfloat16), _params(torch.bfloat16)
    opts = [StochasticRoundingAdamW(eager, lr=1e-2, weight_decay=0.1),
            StochasticRoundingAdamW(fused, lr=1e-2, weight_decay=0.1, compiled=True)]
    for opt, params in zip(opts, (eager, fused), strict=True):
        for i, p in enumerate(params):
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
        opt.step()
    for a, b in zip(eager, fused, strict=True):
        assert ((a.float() - b.float()).abs() <= a.float().abs() * 2**-7 + 1e-30).all()
        sa, sb = opts[0].state[a], opts[1].state[b]
        for key in ("exp_avg", "exp_avg_sq"):
            assert sb[key].dtype == torch.bfloat16
            assert ((sa[key].float() - sb[key].float()).abs() <= sa[key].float().abs() * 2**-7 + 1e-30).all()
