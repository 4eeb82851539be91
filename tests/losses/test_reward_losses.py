"""Hand-computed checks of the reward-model losses.

Closed forms used: -log σ(x) = log(1 + e^-x), so -log σ(0) = ln 2, -log σ(ln 3) = ln(4/3), -log σ(-ln 3) = ln 4.
"""

import math

import pytest
import torch

from align_pipeline.losses.reward import bradley_terry_loss, regression_reward_loss

LN2, LN3 = math.log(2.0), math.log(3.0)


def approx(x):
    return pytest.approx(x, rel=1e-6, abs=1e-6)


# ------------------------------------------------------------------------------------------------ Bradley–Terry


def test_bradley_terry_hand_computed():
    # r_c = [1, ln3, 0], r_r = [1, 0, ln3]  ->  r_c - r_r = [0, ln3, -ln3]
    # per-pair loss -log σ(Δ) = [ln 2, ln(4/3), ln 4]  ->  sum = ln(2 · 4/3 · 4) = ln(32/3)
    # accuracy: Δ > 0 only for pair 2 (the tie, pair 1, counts 0) -> 1
    # reward sums: chosen = 1 + ln3, rejected = 1 + ln3, margin = 0 + ln3 - ln3 = 0
    r_c = torch.tensor([1.0, LN3, 0.0])
    r_r = torch.tensor([1.0, 0.0, LN3])
    loss_sum, count, m = bradley_terry_loss(r_c, r_r)
    assert loss_sum.item() == approx(math.log(32.0 / 3.0))
    assert count.item() == 3 and count.dtype == torch.int
    assert m["rm_loss"].item() == approx(math.log(32.0 / 3.0))
    assert m["accuracy"].item() == 1.0
    assert m["reward_chosen"].item() == approx(1.0 + LN3)
    assert m["reward_rejected"].item() == approx(1.0 + LN3)
    assert m["reward_margin"].item() == approx(0.0)


def test_bradley_terry_tie_is_ln2_and_not_accurate():
    # Δ = 0 for both pairs: loss = 2 ln 2, accuracy 0 (ties count 0)
    loss_sum, count, m = bradley_terry_loss(torch.tensor([0.3, -2.0]), torch.tensor([0.3, -2.0]))
    assert loss_sum.item() == approx(2 * LN2)
    assert count.item() == 2
    assert m["accuracy"].item() == 0.0


def test_bradley_terry_margin_llama2():
    # r_c - r_r = 1 + ln3, margin m = 1  ->  -log σ(1 + ln3 - 1) = -log σ(ln3) = ln(4/3)
    # reward_margin metric is r_c - r_r = 1 + ln3 (the margin is not subtracted)
    loss_sum, _, m = bradley_terry_loss(torch.tensor([1.0 + LN3]), torch.tensor([0.0]), margin=torch.tensor([1.0]))
    assert loss_sum.item() == approx(math.log(4.0 / 3.0))
    assert m["reward_margin"].item() == approx(1.0 + LN3)
    # margin None == margin 0
    a = bradley_terry_loss(torch.tensor([0.5]), torch.tensor([0.2]))[0]
    b = bradley_terry_loss(torch.tensor([0.5]), torch.tensor([0.2]), margin=torch.tensor([0.0]))[0]
    assert a.item() == b.item()


def test_bradley_terry_gradient_pushes_chosen_up():
    # d/dr_c [-log σ(r_c - r_r)] = -σ(-(r_c - r_r)) = -σ(0) = -0.5 ; d/dr_r = +0.5
    r_c = torch.tensor([0.0], requires_grad=True)
    r_r = torch.tensor([0.0], requires_grad=True)
    bradley_terry_loss(r_c, r_r)[0].backward()
    assert r_c.grad.item() == approx(-0.5)
    assert r_r.grad.item() == approx(0.5)


def test_bradley_terry_shape_errors():
    with pytest.raises(ValueError, match="chosen_rewards"):
        bradley_terry_loss(torch.zeros(3), torch.zeros(2))
    with pytest.raises(ValueError, match="margin"):
        bradley_terry_loss(torch.zeros(3), torch.zeros(3), margin=torch.zeros(2))


# ------------------------------------------------------------------------------------------------ regression (SteerLM)


def test_regression_masks_missing_labels():
    # predicted [[1, 2], [3, 4]], labels [[0, NaN], [5, 4]], mask [[1, 0], [1, 1]]
    # present errors ŷ - y: 1 - 0 = 1, 3 - 5 = -2, 4 - 4 = 0   (the NaN slot is missing)
    # loss = 1² + (-2)² + 0² = 5, count = 3, abs_error = 1 + 2 + 0 = 3
    pred = torch.tensor([[1.0, 2.0], [3.0, 4.0]], requires_grad=True)
    labels = torch.tensor([[0.0, float("nan")], [5.0, 4.0]])
    mask = torch.tensor([[1, 0], [1, 1]])
    loss_sum, count, m = regression_reward_loss(pred, labels, mask)
    assert loss_sum.item() == approx(5.0)
    assert count.item() == 3 and count.dtype == torch.int
    assert m["rm_loss"].item() == approx(5.0)
    assert m["abs_error"].item() == approx(3.0)
    # gradient 2(ŷ - y) where present, exactly 0 (not NaN) where missing
    loss_sum.backward()
    assert pred.grad.tolist() == [[2.0, 0.0], [-4.0, 0.0]]


def test_regression_missing_label_value_is_irrelevant():
    pred = torch.tensor([[1.0, 2.0]])
    mask = torch.tensor([[True, False]])
    a = regression_reward_loss(pred, torch.tensor([[3.0, -100.0]]), mask)
    b = regression_reward_loss(pred, torch.tensor([[3.0, 1e6]]), mask)
    assert a[0].item() == b[0].item() == approx(4.0)  # (1 - 3)² = 4
    assert a[1].item() == b[1].item() == 1


def test_regression_all_missing_gives_zero_sum_and_count():
    loss_sum, count, m = regression_reward_loss(torch.ones(2, 3), torch.full((2, 3), float("nan")), torch.zeros(2, 3))
    assert loss_sum.item() == 0.0 and count.item() == 0 and m["abs_error"].item() == 0.0


def test_regression_shape_error():
    with pytest.raises(ValueError, match=r"\[B, A\]"):
        regression_reward_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 2))
