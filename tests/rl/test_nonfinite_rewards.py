"""A NaN / inf reward (a reward function or reward model that failed on one sample) stays out of the group baselines:
that sample gets advantage 0, the rest of its group is scored against the finite others, and no NaN reaches the loss
or its gradient (which would make the optimizer skip the whole step). Hand-computed values."""

from __future__ import annotations

import math

import torch

from align_pipeline.losses.reinforce import reinforce_loss
from align_pipeline.rl import groups_without_signal, grpo_advantages, rloo_advantages

NAN, INF = math.nan, math.inf


def close(actual: torch.Tensor, expected, tol: float = 1e-6) -> None:
    assert torch.allclose(actual, torch.tensor(expected, dtype=actual.dtype), atol=tol, rtol=0), actual


def test_rloo_leaves_a_nan_out_of_the_leave_one_out_baselines():
    scores = torch.tensor([
        [1.0, NAN, 0.0, 2.0],  # finite: 1, 0, 2 (k = 3, sum 3): baselines (3-1)/2 = 1, (3-0)/2 = 1.5, (3-2)/2 = 0.5
        [1.0, 0.0, 0.0, 0.0],  # untouched: 1 - 0, 0 - 1/3
        [INF, 2.0, -INF, 2.0],  # finite 2, 2: no signal
        [NAN, 3.0, NAN, NAN],  # one finite score: no baseline
    ])
    adv = rloo_advantages(scores)
    close(adv, [[0.0, 0.0, -1.5, 1.5],
                [1.0, -1 / 3, -1 / 3, -1 / 3],
                [0.0, 0.0, 0.0, 0.0],
                [0.0, 0.0, 0.0, 0.0]])
    assert torch.isfinite(adv).all()
    assert adv[0].sum().item() == 0.0  # still sums to 0 over the finite samples


def test_grpo_leaves_a_nan_out_of_mean_and_std():
    scores = torch.tensor([[1.0, NAN, 0.0, 2.0], [1.0, 0.0, 0.0, 0.0]])
    # group 0: finite mean (1 + 0 + 2) / 3 = 1; sample std sqrt((0 + 1 + 1) / 2) = 1
    # group 1: mean 0.25; sample std sqrt((0.5625 + 3 x 0.0625) / 3) = 0.5
    close(grpo_advantages(scores, eps=0.0), [[0.0, 0.0, -1.0, 1.0], [1.5, -0.5, -0.5, -0.5]])
    close(grpo_advantages(scores, eps=1.0), [[0.0, 0.0, -0.5, 0.5], [0.5, -1 / 6, -1 / 6, -1 / 6]])
    close(grpo_advantages(scores, scale=False), [[0.0, 0.0, -1.0, 1.0], [0.75, -0.25, -0.25, -0.25]])
    close(grpo_advantages(torch.tensor([[NAN, 5.0, INF, 5.0], [NAN, NAN, NAN, NAN]])), [[0.0] * 4, [0.0] * 4])


def test_all_finite_groups_keep_their_exact_numbers():
    """The masked formulas give bit-identical advantages when every score is finite (the default run's numbers)."""
    g = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 3, (64, 4), generator=g).float() + 0.1 * torch.randn(64, 4, generator=g)
    r = scores.double().float()
    n = r.shape[1]
    old_rloo = r - (r.sum(dim=1, keepdim=True) - r) / (n - 1)
    constant = (r == r[:, :1]).all(dim=1, keepdim=True)
    assert torch.equal(rloo_advantages(scores), torch.where(constant, 0.0, old_rloo))
    old_grpo = (r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True) + 1e-6)
    assert torch.equal(grpo_advantages(scores), torch.where(constant, 0.0, old_grpo))
    assert torch.equal(groups_without_signal(scores), constant[:, 0])


def test_groups_without_signal_ignore_nonfinite_scores():
    scores = torch.tensor([[1.0, NAN, 1.0, 1.0], [1.0, NAN, 0.0, 1.0], [NAN, 2.0, NAN, NAN], [0.0, 0.0, 0.0, 0.0]])
    assert groups_without_signal(scores).tolist() == [True, False, True, True]


def test_a_nan_reward_leaves_the_reinforce_loss_and_its_gradient_finite():
    """Without the exclusion the NaN advantage of one sample makes the loss and every gradient NaN (the optimizer
    then skips the step)."""
    scores = torch.tensor([1.0, NAN, 0.0, 2.0])  # one prompt, 4 samples
    for adv in (rloo_advantages(scores.view(1, 4)).flatten(), grpo_advantages(scores.view(1, 4)).flatten()):
        logp = torch.full((4, 3), -1.0, requires_grad=True)
        mask = torch.ones(4, 3)
        loss, count, _metrics = reinforce_loss(logp, adv, mask, ref_logp=torch.full((4, 3), -1.2), beta=0.1)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(logp.grad).all() and int(count) == 12
        # the NaN sample's tokens feel only the KL term: d(0.1 x k3)/d logp = 0.1 x (1 - exp(-0.2))
        close(logp.grad[1], [0.1 * (1 - math.exp(-0.2))] * 3, tol=1e-6)
