"""Hand-computed checks of the DPO-family losses.

Closed forms used: σ(0) = 1/2, σ(ln 3) = 3/4, σ(-ln 3) = 1/4, hence
-log σ(0) = ln 2, -log σ(ln 3) = ln(4/3), -log σ(-ln 3) = ln 4.
h = (logπ(y_c) - logπ_ref(y_c)) - (logπ(y_r) - logπ_ref(y_r)).
"""

import math

import pytest
import torch

from align_pipeline.losses import (
    PREFERENCE_LOSSES,
    REFERENCE_FREE_LOSSES,
    PreferenceLogps,
    combine,
    dpo_loss,
    get_preference_loss,
    hinge_loss,
    ipo_loss,
    rpo_loss,
    simpo_loss,
)

LN2, LN3 = math.log(2.0), math.log(3.0)
COMMON_METRICS = {"rewards/accuracies", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen",
                  "logps/rejected"}


def approx(x):
    return pytest.approx(x, rel=1e-6, abs=1e-6)


def t(*xs):
    return torch.tensor(xs, dtype=torch.float32)


def pairs(ratio_c, ratio_r, **extra):
    """Batch whose log-ratios are ``ratio_c`` / ``ratio_r``: ref = -5 (chosen) / -7 (rejected), policy = ref + ratio."""
    ratio_c, ratio_r = t(*ratio_c), t(*ratio_r)
    ref_c, ref_r = torch.full_like(ratio_c, -5.0), torch.full_like(ratio_r, -7.0)
    return PreferenceLogps(
        policy_chosen=(ref_c + ratio_c).requires_grad_(),
        policy_rejected=(ref_r + ratio_r).requires_grad_(),
        ref_chosen=ref_c,
        ref_rejected=ref_r,
        **extra,
    )


# ------------------------------------------------------------------------------------------------ DPO


def test_dpo_equal_logps_is_ln2():
    # h = 0 for both pairs: loss = 2 · (-log σ(0)) = 2 ln 2; rewards all 0; accuracy 0 (ties count 0)
    batch = pairs([0.0, 0.0], [0.0, 0.0])
    loss_sum, count, m = dpo_loss(batch, beta=0.1)
    assert loss_sum.item() == approx(2 * LN2)
    assert count.item() == 2 and count.dtype == torch.int
    assert set(m) == COMMON_METRICS | {"dpo_loss"}
    assert m["dpo_loss"].item() == approx(2 * LN2)
    assert m["rewards/accuracies"].item() == 0.0
    assert m["rewards/margins"].item() == 0.0
    # logps metrics are the policy's sums: chosen -5 + -5, rejected -7 + -7
    assert m["logps/chosen"].item() == approx(-10.0) and m["logps/rejected"].item() == approx(-14.0)


def test_dpo_hand_computed():
    # β = 0.5, log-ratios: chosen ln3, rejected -ln3  ->  h = 2 ln3, βh = ln3
    # loss = -log σ(ln3) = ln(4/3); rewards: chosen 0.5 ln3, rejected -0.5 ln3, margin ln3; accuracy 1
    loss_sum, _, m = dpo_loss(pairs([LN3], [-LN3]), beta=0.5)
    assert loss_sum.item() == approx(math.log(4 / 3))
    assert m["rewards/chosen"].item() == approx(0.5 * LN3)
    assert m["rewards/rejected"].item() == approx(-0.5 * LN3)
    assert m["rewards/margins"].item() == approx(LN3)
    assert m["rewards/accuracies"].item() == 1.0


def test_cdpo_label_smoothing():
    # βh = ln3, ε = 0.25: -(0.75) log σ(ln3) - 0.25 log σ(-ln3) = 0.75 ln(4/3) + 0.25 ln 4
    loss, _, _ = dpo_loss(pairs([LN3], [0.0]), beta=1.0, label_smoothing=0.25)
    assert loss.item() == approx(0.75 * math.log(4 / 3) + 0.25 * math.log(4))
    # ε = 0 is plain DPO
    assert dpo_loss(pairs([LN3], [0.0]), beta=1.0, label_smoothing=0.0)[0].item() == approx(math.log(4 / 3))
    # ε = 0.5 is symmetric in h: loss(ln3) = loss(-ln3) = 0.5 (ln(4/3) + ln 4) = 0.5 ln(16/3)
    pos = dpo_loss(pairs([LN3], [0.0]), beta=1.0, label_smoothing=0.5)[0].item()
    neg = dpo_loss(pairs([0.0], [LN3]), beta=1.0, label_smoothing=0.5)[0].item()
    assert pos == approx(neg) and pos == approx(0.5 * math.log(16 / 3))


def test_dpo_gradient_raises_chosen_lowers_rejected():
    # d/dlogπ(y_c) [-log σ(βh)] = -β σ(-βh) = -0.1 · 0.5 = -0.05 at h = 0 ; rejected: +0.05
    # (gradient descent therefore increases logπ(y_c) and decreases logπ(y_r)); the reference gets no gradient
    batch = pairs([0.0], [0.0])
    ref_c = batch.ref_chosen.clone().requires_grad_()
    batch = PreferenceLogps(batch.policy_chosen, batch.policy_rejected, ref_c, batch.ref_rejected)
    dpo_loss(batch, beta=0.1)[0].backward()
    assert batch.policy_chosen.grad.item() == approx(-0.05)
    assert batch.policy_rejected.grad.item() == approx(0.05)
    assert ref_c.grad is None


def test_dpo_validation():
    no_ref = PreferenceLogps(t(-1.0), t(-2.0))
    with pytest.raises(ValueError, match="ref_chosen"):
        dpo_loss(no_ref, beta=0.1)
    with pytest.raises(ValueError, match="label_smoothing"):
        dpo_loss(pairs([0.0], [0.0]), beta=0.1, label_smoothing=0.7)
    with pytest.raises(ValueError, match="beta"):
        dpo_loss(pairs([0.0], [0.0]), beta=0.0)


# ------------------------------------------------------------------------------------------------ IPO


def test_ipo_sequence_level():
    # τ = β = 0.5  ->  target gap 1/(2τ) = 1 ; h = [0, 1, 3]  ->  (h - 1)² = [1, 0, 4], sum 5
    batch = pairs([0.0, 1.0, 3.0], [0.0, 0.0, 0.0])
    loss_sum, count, m = ipo_loss(batch, beta=0.5, length_normalized=False)
    assert loss_sum.item() == approx(5.0) and count.item() == 3
    assert m["ipo_loss"].item() == approx(5.0)
    # gradient of (h - 1)² w.r.t. logπ(y_c) is 2(h - 1) = [-2, 0, 4]: below the target it pushes chosen up, above down
    loss_sum.backward()
    assert batch.policy_chosen.grad.tolist() == pytest.approx([-2.0, 0.0, 4.0])


def test_ipo_length_normalized():
    # log-ratios: chosen 4 over 2 tokens -> 2 ; rejected -3 over 3 tokens -> -1 ; h = 2 - (-1) = 3
    # τ = 0.25 -> target 1/(2·0.25) = 2 ; loss = (3 - 2)² = 1
    # reward metrics stay sequence-level: β·ratio = 0.25·4 = 1 and 0.25·(-3) = -0.75
    batch = pairs([4.0], [-3.0], chosen_tokens=t(2), rejected_tokens=t(3))
    loss_sum, _, m = ipo_loss(batch, beta=0.25)
    assert loss_sum.item() == approx(1.0)
    assert m["rewards/chosen"].item() == approx(1.0)
    assert m["rewards/rejected"].item() == approx(-0.75)
    with pytest.raises(ValueError, match="chosen_tokens"):
        ipo_loss(pairs([0.0], [0.0]), beta=0.1)  # length-normalised by default: needs token counts


# ------------------------------------------------------------------------------------------------ RPO


def rpo_pairs(ratio_c, ratio_r, reward_c, reward_r):
    return pairs(ratio_c, ratio_r, chosen_reward=t(*reward_c), rejected_reward=t(*reward_r))


def test_rpo_bwd_kl_zero_when_matched():
    # β h = 1 · ln3 and η Δr* = 1 · ln3 -> the two Bernoulli distributions coincide -> KL = 0
    loss_sum, count, m = rpo_loss(rpo_pairs([LN3], [0.0], [LN3], [0.0]), beta=1.0, eta=1.0)
    assert loss_sum.item() == approx(0.0) and count.item() == 1
    assert m["reward_pairs"].item() == 1.0


def test_rpo_bwd_kl_hand_computed():
    # a = βh = 0 ; b = η Δr* = 0.5 · 2 ln3 = ln3 ; σ(b) = 3/4, σ(-b) = 1/4, log σ(±a) = -ln 2
    # D = 3/4 (ln 3/4 + ln 2) + 1/4 (ln 1/4 + ln 2) = 3/4 ln(3/2) - 1/4 ln 2
    loss_sum, _, m = rpo_loss(rpo_pairs([0.0], [0.0], [2 * LN3], [0.0]), beta=1.0, eta=0.5)
    assert loss_sum.item() == approx(0.75 * math.log(1.5) - 0.25 * LN2)
    assert m["rpo_loss"].item() == approx(0.75 * math.log(1.5) - 0.25 * LN2)


def test_rpo_bwd_kl_tends_to_dpo_for_confident_rewards():
    # b = η Δr* = 30 -> σ(b) ≈ 1 -> D ≈ -log σ(a) = DPO ; a = ln3 -> ln(4/3)
    loss_sum, _, _ = rpo_loss(rpo_pairs([LN3], [0.0], [30.0], [0.0]), beta=1.0, eta=1.0)
    assert loss_sum.item() == pytest.approx(math.log(4 / 3), abs=1e-5)


def test_rpo_sq():
    # a = βh = 0.5 · 2 = 1 ; b = η Δr* = 2 · (3 - 1) = 4 ; (a - b)² = 9
    loss_sum, _, _ = rpo_loss(rpo_pairs([2.0], [0.0], [3.0], [1.0]), beta=0.5, eta=2.0, distance="sq")
    assert loss_sum.item() == approx(9.0)


def test_rpo_nan_rewards_fall_back_to_dpo():
    # pair 1: chosen reward NaN -> DPO: -log σ(βh) = -log σ(ln3) = ln(4/3)
    # pair 2: a = 0, b = ln3 -> 3/4 ln(3/2) - 1/4 ln 2 (as above)
    # pair 3: rejected reward NaN, h = 0 -> DPO: ln 2
    batch = rpo_pairs([LN3, 0.0, 0.0], [0.0, 0.0, 0.0], [float("nan"), LN3, 1.0], [0.0, 0.0, float("nan")])
    loss_sum, count, m = rpo_loss(batch, beta=1.0, eta=1.0)
    expected = math.log(4 / 3) + (0.75 * math.log(1.5) - 0.25 * LN2) + LN2
    assert loss_sum.item() == approx(expected)
    assert count.item() == 3
    assert m["reward_pairs"].item() == 1.0
    # the NaN reaches neither the loss nor the gradient
    loss_sum.backward()
    assert torch.isfinite(batch.policy_chosen.grad).all() and torch.isfinite(batch.policy_rejected.grad).all()
    # and the NaN pairs' values equal dpo_loss on those pairs
    dpo = dpo_loss(pairs([LN3, 0.0], [0.0, 0.0]), beta=1.0)[0]
    assert dpo.item() == approx(math.log(4 / 3) + LN2)


def test_rpo_validation():
    with pytest.raises(ValueError, match="chosen_reward"):
        rpo_loss(pairs([0.0], [0.0]), beta=1.0, eta=1.0)
    with pytest.raises(ValueError, match="distance"):
        rpo_loss(rpo_pairs([0.0], [0.0], [1.0], [0.0]), beta=1.0, eta=1.0, distance="fwd_kl")
    with pytest.raises(ValueError, match="eta"):
        rpo_loss(rpo_pairs([0.0], [0.0], [1.0], [0.0]), beta=1.0, eta=-1.0)


# ------------------------------------------------------------------------------------------------ SimPO


def test_simpo_hand_computed():
    # β = 2, γ = 3 ; chosen: logπ = -2 over 4 tokens -> β·(-0.5) = -1 ; rejected: -6 over 3 -> β·(-2) = -4
    # logit = -1 - (-4) - 3 = 0 -> loss ln 2 (the chosen already wins, accuracy 1, but not by γ)
    batch = PreferenceLogps(t(-2.0), t(-6.0), chosen_tokens=t(4), rejected_tokens=t(3))  # no reference needed
    loss_sum, count, m = simpo_loss(batch, beta=2.0, gamma=3.0)
    assert loss_sum.item() == approx(LN2) and count.item() == 1
    assert m["rewards/chosen"].item() == approx(-1.0)
    assert m["rewards/rejected"].item() == approx(-4.0)
    assert m["rewards/margins"].item() == approx(3.0)
    assert m["rewards/accuracies"].item() == 1.0
    assert m["simpo_loss"].item() == approx(LN2)


def test_simpo_is_length_normalised():
    # same summed log-prob -6 for both, but chosen has 6 tokens, rejected 2:
    # β = 1, γ = 0: -1 - (-3) = 2 -> -log σ(2) = ln(1 + e^-2)
    batch = PreferenceLogps(t(-6.0), t(-6.0), chosen_tokens=t(6), rejected_tokens=t(2))
    assert simpo_loss(batch, beta=1.0, gamma=0.0)[0].item() == approx(math.log1p(math.exp(-2.0)))


def test_simpo_requires_token_counts():
    with pytest.raises(ValueError, match="chosen_tokens"):
        simpo_loss(pairs([0.0], [0.0]), beta=2.0, gamma=0.5)


# ------------------------------------------------------------------------------------------------ hinge (SLiC-HF)


def test_hinge_at_and_beyond_margin():
    # β = 0.5 ; h = [0, 1, 2, 4] -> 1 - βh = [1, 0.5, 0, -1] -> relu = [1, 0.5, 0, 0], sum 1.5
    batch = pairs([0.0, 1.0, 2.0, 4.0], [0.0, 0.0, 0.0, 0.0])
    loss_sum, count, m = hinge_loss(batch, beta=0.5)
    assert loss_sum.item() == approx(1.5) and count.item() == 4
    assert m["hinge_loss"].item() == approx(1.5)
    # gradient -β on the chosen where βh < 1, zero at and beyond the margin (βh ≥ 1)
    loss_sum.backward()
    assert batch.policy_chosen.grad.tolist() == [-0.5, -0.5, 0.0, 0.0]
    assert batch.policy_rejected.grad.tolist() == [0.5, 0.5, 0.0, 0.0]


# ------------------------------------------------------------------------------------------------ SFT mix


def test_combine_puts_sft_per_sequence():
    # DPO with h = 0 on 2 pairs: 2 ln 2, count 2.
    # SFT: NLL sums [6, 2] over [3, 1] tokens -> per-sequence means [2, 2] -> sum 4 ; weight 0.5 -> + 2
    # loss = Σ_b [pref_b + 0.5 · nll_b/|y_b|] = 2 ln 2 + 2, count stays 2
    batch = pairs([0.0, 0.0], [0.0, 0.0])
    pref = dpo_loss(batch, beta=0.1)
    loss_sum, count, m = combine(pref, t(6.0, 2.0), torch.tensor([3, 1]), weight=0.5)
    assert loss_sum.item() == approx(2 * LN2 + 2.0)
    assert count.item() == 2
    assert m["dpo_loss"].item() == approx(2 * LN2)
    assert m["sft_loss"].item() == approx(4.0)
    assert m["loss"].item() == approx(2 * LN2 + 2.0)


def test_combine_gradient_on_chosen():
    # with nll = -logπ(y_c): d/dlogπ(y_c) = DPO's -β/2 = -0.05 plus SFT's -weight/|y_c| = -1/4
    batch = pairs([0.0], [0.0], chosen_tokens=t(4), rejected_tokens=t(4))
    out = combine(dpo_loss(batch, beta=0.1), -batch.policy_chosen, batch.chosen_tokens, weight=1.0)
    out[0].backward()
    assert batch.policy_chosen.grad.item() == approx(-0.05 - 0.25)


# ------------------------------------------------------------------------------------------------ registry & batch


def full_batch():
    return pairs(
        [LN3, 0.0, -1.0, 2.0],
        [0.0, 0.5, 1.0, -2.0],
        chosen_tokens=t(3, 4, 5, 6),
        rejected_tokens=t(2, 2, 7, 1),
        chosen_reward=t(1.0, float("nan"), 0.5, 2.0),
        rejected_reward=t(0.0, 1.0, 1.5, -1.0),
    )


PARAMS = {
    "dpo": {"beta": 0.1, "label_smoothing": 0.1},
    "ipo": {"beta": 0.1},
    "rpo": {"beta": 0.1, "eta": 1.0},
    "simpo": {"beta": 2.0, "gamma": 0.5},
    "hinge": {"beta": 0.1},
}


def test_registry_selects_function():
    assert get_preference_loss("dpo") is dpo_loss
    assert get_preference_loss("ipo") is ipo_loss
    assert get_preference_loss("rpo") is rpo_loss
    assert get_preference_loss("simpo") is simpo_loss
    assert get_preference_loss("hinge") is hinge_loss
    assert set(PREFERENCE_LOSSES) == set(PARAMS)
    assert REFERENCE_FREE_LOSSES == {"simpo"}


def test_registry_rejects_unknown_name_and_params():
    with pytest.raises(ValueError, match=r"unknown preference loss 'kto'.*dpo"):
        get_preference_loss("kto")
    with pytest.raises(TypeError):
        get_preference_loss("dpo")(full_batch(), beta=0.1, gamma=0.5)  # SimPO's γ is not a DPO parameter


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_every_loss_follows_the_protocol_and_splits_over_micro_batches(name):
    # Uniform call shape; finite values; count = B; metric sums add up over micro-batches like the loss does.
    fn, params, batch = get_preference_loss(name), PARAMS[name], full_batch()
    loss_sum, count, metrics = fn(batch, **params)
    assert torch.isfinite(loss_sum) and count.item() == 4
    assert COMMON_METRICS | {f"{name}_loss"} <= set(metrics)
    loss_sum.backward()
    assert torch.isfinite(batch.policy_chosen.grad).all()

    def half(sl):
        return PreferenceLogps(*(None if v is None else v.detach()[sl] for v in vars(batch).values()))

    parts = [fn(half(slice(0, 2)), **params), fn(half(slice(2, 4)), **params)]
    assert sum(p[0].item() for p in parts) == approx(loss_sum.item())
    assert sum(p[1].item() for p in parts) == 4
    for key, value in metrics.items():
        assert sum(p[2][key].item() for p in parts) == approx(value.item()), key


def test_preference_logps_checks_shapes():
    with pytest.raises(ValueError, match="ref_chosen"):
        PreferenceLogps(t(0.0, 0.0), t(0.0, 0.0), ref_chosen=t(0.0))
    with pytest.raises(ValueError, match=r"\[B\]"):
        PreferenceLogps(torch.zeros(2, 3), torch.zeros(2, 3))
