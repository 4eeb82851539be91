"""Hand-computed checks of the on-policy distillation loss, and its equivalence to REINFORCE's KL term when the
teacher is the reference."""

import math

import pytest
import torch

from align_pipeline.losses.distill import distill_loss
from align_pipeline.losses.reinforce import reinforce_loss

NAN = float("nan")


def approx(x):
    return pytest.approx(x, rel=1e-6, abs=1e-6)


def test_hand_computed_value_gradient_and_metrics():
    # d = logp - teacher = [0.5, -1.0, 2.0 (masked), 0.25]; kept: 0.5, -1.0, 0.25
    logp = torch.tensor([[-1.0, -2.0, NAN, -0.5]], requires_grad=True)
    teacher = torch.tensor([[-1.5, -1.0, 0.0, -0.75]])
    mask = torch.tensor([[1, 1, 0, 1]])
    loss, count, m = distill_loss(logp, teacher, mask, kl_coef=2.0)
    # 2 x 1/2 (0.25 + 1 + 0.0625) = 1.3125
    assert loss.item() == approx(1.3125) and count.item() == 3 and count.dtype == torch.int
    assert m["distill_loss"].item() == approx(0.65625) and m["reverse_kl"].item() == approx(-0.25)
    assert "pg_loss" not in m
    loss.backward()
    # d loss / d logp_t = kl_coef x d_t; 0 on the masked token (no NaN leaks)
    assert logp.grad.tolist() == [[pytest.approx(1.0), pytest.approx(-2.0), 0.0, pytest.approx(0.5)]]


def test_the_gradient_is_the_per_token_policy_gradient_of_the_reverse_kl():
    """d/dθ of ½ d_t² = d_t ∇logπ_s: REINFORCE with the per-token advantage -d_t (detached), discount 0."""
    logp = torch.tensor([[-0.3, -2.2, -1.1], [-0.7, -0.1, -3.0]], requires_grad=True)
    teacher = torch.tensor([[-0.9, -1.0, -1.1], [-0.2, -0.6, -2.5]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    loss, count, _ = distill_loss(logp, teacher, mask)
    (grad,) = torch.autograd.grad(loss, logp)
    advantage = -(logp - teacher).detach()  # [B, T]
    pg = -(advantage * logp * mask).sum()
    (pg_grad,) = torch.autograd.grad(pg, logp)
    assert torch.allclose(grad, pg_grad) and count.item() == 5


def test_equals_reinforce_kl_term_when_the_teacher_is_the_reference():
    """Teacher = KL reference: the loss is REINFORCE's β x KL term (β = kl_coef, the k2 estimator, no advantage), in
    value and in gradient; the mixed form adds REINFORCE's policy-gradient term."""
    torch.manual_seed(0)
    logp = (torch.rand(3, 5) * -3).requires_grad_()
    reference = torch.rand(3, 5) * -3
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 1, 1, 1, 0]])
    advantages = torch.tensor([0.5, -1.0, 0.25])
    for kl_coef, weight in ((1.0, 0.0), (0.3, 0.0), (0.3, 1.0)):
        ours, ours_count, ours_m = distill_loss(logp, reference, mask, kl_coef=kl_coef, advantages=advantages,
                                                reward_weight=weight)
        theirs, theirs_count, theirs_m = reinforce_loss(logp, advantages * weight, mask, ref_logp=reference,
                                                        beta=kl_coef, estimator="k2")
        (g_ours,) = torch.autograd.grad(ours, logp)
        (g_theirs,) = torch.autograd.grad(theirs, logp)
        assert ours.item() == approx(theirs.item()) and ours_count == theirs_count
        assert torch.allclose(g_ours, g_theirs, atol=1e-7)
        assert ours_m["distill_loss"].item() == approx(theirs_m["kl"].item())
        if weight:
            assert ours_m["pg_loss"].item() == approx(theirs_m["pg_loss"].item())


def test_a_student_equal_to_its_teacher_has_zero_loss_and_gradient():
    logp = torch.tensor([[-0.4, -1.7]], requires_grad=True)
    loss, _, m = distill_loss(logp, logp.detach().clone(), torch.ones(1, 2))
    loss.backward()
    assert loss.item() == 0 and m["reverse_kl"].item() == 0 and logp.grad.abs().max().item() == 0


def test_mixed_with_a_task_reward():
    # one token each: d = [1, -1], A = [2, -1] -> ½ (1 + 1) + 0.5 x (-(2 x -1) - (-1 x -2)) = 1 + 0.5 x 0 = 1
    logp = torch.tensor([[-1.0], [-2.0]], requires_grad=True)
    teacher = torch.tensor([[-2.0], [-1.0]])
    loss, _, m = distill_loss(logp, teacher, torch.ones(2, 1), advantages=torch.tensor([2.0, -1.0]),
                              reward_weight=0.5)
    assert loss.item() == approx(1.0) and m["pg_loss"].item() == approx(0.0)
    loss.backward()
    # d/dlogp = d_t - 0.5 A_t = [1 - 1, -1 + 0.5]
    assert logp.grad.flatten().tolist() == [pytest.approx(0.0), pytest.approx(-0.5)]


@pytest.mark.parametrize("kwargs, message", [
    ({"kl_coef": 0.0}, "kl_coef"), ({"kl_coef": math.inf}, "kl_coef"), ({"reward_weight": -1.0}, "reward_weight"),
    ({"reward_weight": 1.0}, "needs advantages"),
])
def test_bad_arguments_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        distill_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), **kwargs)


def test_shapes_must_agree():
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        distill_loss(torch.zeros(1, 2), torch.zeros(1, 3), torch.ones(1, 2))
