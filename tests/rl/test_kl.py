"""Hand-computed checks of the KL estimators and the KL-coefficient controllers.

Closed forms: with d = logp - ref_logp and r = exp(-d),
  d = +ln 2 → r = 1/2: k1 = ln 2, k2 = ½ ln²2, k3 = (1/2 - 1) + ln 2 = ln 2 - 1/2 ≈ 0.193147
  d = -ln 2 → r = 2:   k1 = -ln 2, k2 = ½ ln²2, k3 = (2 - 1) - ln 2 = 1 - ln 2 ≈ 0.306853
"""

import json
import math

import pytest
import torch

from align_pipeline.rl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    kl_k1,
    kl_k2,
    kl_k3,
    kl_penalty,
)

LN2 = math.log(2.0)


def approx(x):
    return pytest.approx(x, rel=1e-6, abs=1e-7)


def test_estimators_zero_at_equal_logps():
    logp = torch.tensor([[-1.0, -2.5], [-0.1, -7.0]])  # [B=2, T=2]
    for fn in (kl_k1, kl_k2, kl_k3):
        out = fn(logp, logp.clone())
        assert out.shape == (2, 2)
        assert torch.equal(out, torch.zeros(2, 2))


def test_estimators_at_known_difference():
    ref = torch.tensor([[-1.0, -1.0]])
    logp = ref + torch.tensor([[LN2, -LN2]])  # d = [+ln2, -ln2]
    assert kl_k1(logp, ref).tolist()[0] == [approx(LN2), approx(-LN2)]
    assert kl_k2(logp, ref).tolist()[0] == [approx(0.5 * LN2**2), approx(0.5 * LN2**2)]  # ½ ln²2 ≈ 0.240227
    assert kl_k3(logp, ref).tolist()[0] == [approx(LN2 - 0.5), approx(1.0 - LN2)]  # 0.193147, 0.306853


def test_k3_nonnegative_and_k2_nonnegative():
    g = torch.Generator().manual_seed(0)
    logp, ref = torch.randn(64, 32, generator=g) * 3, torch.randn(64, 32, generator=g) * 3
    assert (kl_k3(logp, ref) >= 0).all()
    assert (kl_k2(logp, ref) >= 0).all()
    assert (kl_k1(logp, ref) < 0).any()  # k1 alone can be negative per token


def test_kl_penalty_selects_by_name():
    logp, ref = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]])
    assert set(KL_ESTIMATORS) == {"k1", "k2", "k3"}
    for name, fn in KL_ESTIMATORS.items():
        assert torch.equal(kl_penalty(logp, ref, name), fn(logp, ref))
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'"):
        kl_penalty(logp, ref, "k4")


def test_shape_mismatch_raises():
    with pytest.raises(ValueError, match="same shape"):
        kl_k3(torch.zeros(2, 3), torch.zeros(2, 4))


# ------------------------------------------------------------------------------------------------ controllers


def test_adaptive_controller_formula():
    # β0 = 0.2, target 6, horizon 10000, n_steps 256  →  K_β = 256/10000 = 0.0256
    # KL = 6.6: e = 6.6/6 - 1 = 0.1 (inside ±0.2) → β = 0.2 · (1 + 0.1·0.0256) = 0.2 · 1.00256 = 0.200512
    c = AdaptiveKLController(beta=0.2, target=6.0, horizon=10000)
    c.update(6.6, n_steps=256)
    assert c.value == approx(0.200512)
    # next step from 0.200512, KL = 5.4: e = -0.1 → β = 0.200512 · (1 - 0.00256) = 0.200512 · 0.99744 = 0.19999869...
    c.update(torch.tensor(5.4), n_steps=256)
    assert c.value == approx(0.200512 * 0.99744)
    # KL = target: e = 0, β unchanged
    before = c.value
    c.update(6.0, n_steps=256)
    assert c.value == approx(before)


def test_adaptive_controller_clips_error_at_0_2():
    # KL = 7.5: e = 7.5/6 - 1 = 0.25 → clipped to 0.2 → β = 0.2 · (1 + 0.2·0.0256) = 0.2 · 1.00512 = 0.201024
    hi = AdaptiveKLController(0.2, 6.0, 10000)
    hi.update(7.5, n_steps=256)
    assert hi.value == approx(0.201024)
    # KL = 60: e = 9 → 0.2, same result
    hi2 = AdaptiveKLController(0.2, 6.0, 10000)
    hi2.update(60.0, n_steps=256)
    assert hi2.value == approx(0.201024)
    # KL = 0: e = -1 → -0.2 → β = 0.2 · (1 - 0.00512) = 0.2 · 0.99488 = 0.198976
    lo = AdaptiveKLController(0.2, 6.0, 10000)
    lo.update(0.0, n_steps=256)
    assert lo.value == approx(0.198976)


def test_adaptive_controller_state_round_trip():
    c = AdaptiveKLController(0.2, 6.0, 10000)
    for kl in (7.5, 3.0, 6.3):
        c.update(kl, n_steps=128)
    state = json.loads(json.dumps(c.state_dict()))  # plain, serialisable
    resumed = AdaptiveKLController(0.2, 6.0, 10000)
    resumed.load_state_dict(state)
    assert resumed.value == c.value
    c.update(9.0, n_steps=128)
    resumed.update(9.0, n_steps=128)
    assert resumed.value == c.value  # resume vs no resume: identical trajectory


def test_adaptive_controller_rejects_bad_input():
    with pytest.raises(ValueError):
        AdaptiveKLController(0.2, 0.0, 10000)
    with pytest.raises(ValueError):
        AdaptiveKLController(0.2, 6.0, 10000).update(float("nan"), n_steps=1)


def test_fixed_controller_same_interface():
    c = FixedKLController(0.05)
    c.update(100.0, n_steps=256)
    assert c.value == 0.05
    other = FixedKLController(0.0)
    other.load_state_dict(c.state_dict())
    assert other.value == 0.05
