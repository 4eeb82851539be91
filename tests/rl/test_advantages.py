"""Hand-computed checks of per-token rewards, GAE, whitening and the group baselines (RLOO, GRPO)."""

import ast
import math
import pathlib

import pytest
import torch

import align_pipeline
from align_pipeline.rl import (
    gae,
    gae_over_turns,
    grpo_advantages,
    masked_moments,
    moments_to_mean_var,
    rloo_advantages,
    token_rewards,
    whiten_with,
)

NAN = float("nan")


def close(actual, expected, tol=1e-6):
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    assert torch.allclose(actual, expected, atol=tol, rtol=0), f"{actual} != {expected}"


# ------------------------------------------------------------------------------------------------ token rewards


def test_token_rewards_score_on_last_response_token():
    # β = 0.1; rows: right-padded length 3, right-padded length 2, left-padded (prompt first) length 3.
    scores = torch.tensor([1.0, -2.0, 0.5])
    kl = torch.tensor(
        [
            [0.1, 0.2, 0.3, 9.0],  # the 9s are masked and must be ignored
            [0.5, -0.4, 9.0, 9.0],
            [9.0, 0.1, 0.1, 0.1],
        ]
    )
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [0, 1, 1, 1]])
    out = token_rewards(scores, kl, mask, beta=0.1)
    # row 0: -0.1·[0.1, 0.2, 0.3] = [-0.01, -0.02, -0.03], + 1.0 on t=2 → [-0.01, -0.02, 0.97, 0]
    # row 1: -0.1·[0.5, -0.4] = [-0.05, 0.04], - 2.0 on t=1 → [-0.05, -1.96, 0, 0]
    # row 2: -0.1·0.1 = -0.01 on t=1..3, + 0.5 on t=3 → [0, -0.01, -0.01, 0.49]
    close(out, [[-0.01, -0.02, 0.97, 0.0], [-0.05, -1.96, 0.0, 0.0], [0.0, -0.01, -0.01, 0.49]])


def test_token_rewards_needs_a_response_token():
    with pytest.raises(ValueError, match="at least one response token"):
        token_rewards(torch.zeros(2), torch.zeros(2, 3), torch.tensor([[1, 0, 0], [0, 0, 0]]), beta=0.1)


# ------------------------------------------------------------------------------------------------ GAE

# One 3-step trajectory, γ = 0.9, λ = 0.5 (γλ = 0.45), r = [0.1, -0.2, 1.0], V = [0.5, 0.4, 0.3], V(s_3) = 0:
#   δ_2 = 1.0 + 0.9·0   - 0.3 =  0.7
#   δ_1 = -0.2 + 0.9·0.3 - 0.4 = -0.33
#   δ_0 = 0.1 + 0.9·0.4 - 0.5 = -0.04
#   A_2 = 0.7
#   A_1 = -0.33 + 0.45·0.7    = -0.015
#   A_0 = -0.04 + 0.45·(-0.015) = -0.04675
#   R = A + V = [0.45325, 0.385, 1.0]
R3, V3 = [0.1, -0.2, 1.0], [0.5, 0.4, 0.3]
A3, RET3 = [-0.04675, -0.015, 0.7], [0.45325, 0.385, 1.0]


def test_gae_three_steps_by_hand():
    adv, ret = gae(torch.tensor([R3]), torch.tensor([V3]), torch.ones(1, 3), gamma=0.9, lam=0.5)
    close(adv, [A3])
    close(ret, [RET3])


def test_gae_lambda_one_gamma_one_is_monte_carlo():
    # γ = λ = 1: A_t = Σ_{k≥t} r_k - V_t = [0.9 - 0.5, 0.8 - 0.4, 1.0 - 0.3] = [0.4, 0.4, 0.7]; R_t = Σ_{k≥t} r_k
    adv, ret = gae(torch.tensor([R3]), torch.tensor([V3]), torch.ones(1, 3), gamma=1.0, lam=1.0)
    close(adv, [[0.4, 0.4, 0.7]])
    close(ret, [[0.9, 0.8, 1.0]])


def test_gae_different_lengths_and_padding_sides():
    # row 0: the trajectory above with a masked tail holding garbage (NaN value, large reward)
    # (masked values are garbage: a finite one right after row 1's end must not be bootstrapped from)
    # row 1: length 2, γ = 0.9, λ = 0.5, r = [0, 2], V = [1.0, 0.5]:
    #   δ_1 = 2 - 0.5 = 1.5;  δ_0 = 0 + 0.9·0.5 - 1.0 = -0.55
    #   A_1 = 1.5;  A_0 = -0.55 + 0.45·1.5 = 0.125;  R = [1.125, 2.0]
    # row 2: row 0's trajectory left-padded by one prompt position (garbage there): same numbers, shifted
    rewards = torch.tensor([[*R3, 100.0], [0.0, 2.0, 100.0, 100.0], [100.0, *R3]])
    values = torch.tensor([[*V3, NAN], [1.0, 0.5, 5.0, NAN], [NAN, *V3]])  # 5.0: a value past the end
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 1, 0, 0], [0, 1, 1, 1]])
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.5)
    close(adv, [[*A3, 0.0], [0.125, 1.5, 0.0, 0.0], [0.0, *A3]])
    close(ret, [[*RET3, 0.0], [1.125, 2.0, 0.0, 0.0], [0.0, *RET3]])


def test_gae_over_turns_skips_the_environments_tokens():
    # the three-step trajectory above as three policy turns of one token each, with environment tokens between them
    # (garbage rewards / values there) and a prompt position first: the same advantages at the policy's positions,
    # the state after a turn being the next turn's (not the end, as gae would take the gap)
    rewards = torch.tensor([[9.0, R3[0], 100.0, R3[1], 100.0, 100.0, R3[2], 9.0]])
    values = torch.tensor([[NAN, V3[0], NAN, V3[1], 7.0, 7.0, V3[2], NAN]])
    mask = torch.tensor([[0.0, 1, 0, 1, 0, 0, 1, 0]])
    adv, ret = gae_over_turns(rewards, values, mask, gamma=0.9, lam=0.5)
    close(adv, [[0.0, A3[0], 0.0, A3[1], 0.0, 0.0, A3[2], 0.0]])
    close(ret, [[0.0, RET3[0], 0.0, RET3[1], 0.0, 0.0, RET3[2], 0.0]])
    # gae itself ends the episode at each gap: turn 1's advantage is its own delta, not the lambda-return
    assert abs(gae(rewards, values, mask, gamma=0.9, lam=0.5)[0][0, 1].item() - (R3[0] - V3[0])) < 1e-6
    # rows with contiguous response tokens: exactly gae
    g = torch.Generator().manual_seed(0)
    r, v = torch.randn(4, 9, generator=g), torch.randn(4, 9, generator=g)
    m = torch.tensor([[0, 0, 1, 1, 1, 1, 0, 0, 0], [1] * 9, [0, 0, 0, 0, 0, 0, 0, 1, 1], [0, 1, 1, 0, 0, 0, 0, 0, 0]])
    assert all(torch.equal(a, b) for a, b in zip(gae_over_turns(r, v, m, 0.97, 0.9), gae(r, v, m, 0.97, 0.9)))


def test_gae_rejects_bad_params():
    x = torch.zeros(1, 3)
    with pytest.raises(ValueError, match="gamma"):
        gae(x, x, x, gamma=1.5, lam=0.5)
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        gae(x, torch.zeros(1, 4), x, gamma=0.9, lam=0.5)


# ------------------------------------------------------------------------------------------------ whitening

# Masked entries {1, 2, 3, 5}: mean = 11/4 = 2.75; deviations [-1.75, -0.75, 0.25, 2.25];
# population var = (3.0625 + 0.5625 + 0.0625 + 5.0625) / 4 = 8.75 / 4 = 2.1875; std = 1.4790199
X = [[1.0, 2.0, 3.0, 99.0], [5.0, -50.0, 0.0, 7.0]]
M = [[1, 1, 1, 0], [1, 0, 0, 0]]
STD = math.sqrt(2.1875)


def whiten(x, mask, shift_mean=True):
    """Whole-batch whitening, the way the PPO stage composes it (moments, then whiten_with)."""
    return whiten_with(x, mask, *moments_to_mean_var(*masked_moments(x, mask)), shift_mean=shift_mean)


def test_whiten_mean_zero_var_one_over_mask():
    x, mask = torch.tensor(X), torch.tensor(M)
    out = whiten(x, mask)
    expected = [[-1.75 / STD, -0.75 / STD, 0.25 / STD, 0.0], [2.25 / STD, 0.0, 0.0, 0.0]]  # 2.25/1.47902 = 1.52128
    close(out, expected, tol=1e-5)
    sel = out[mask.bool()]
    assert sel.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert sel.var(unbiased=False).item() == pytest.approx(1.0, abs=1e-5)


def test_whiten_ignores_masked_entries():
    x, mask = torch.tensor(X), torch.tensor(M)
    x2 = torch.where(mask.bool(), x, torch.tensor([[NAN, 1e6, -3.0, 8.0]]))  # change only masked entries
    assert torch.equal(whiten(x, mask), whiten(x2, mask))


def test_whiten_without_mean_shift_keeps_mean():
    x, mask = torch.tensor(X), torch.tensor(M)
    sel = whiten(x, mask, shift_mean=False)[mask.bool()]
    assert sel.mean().item() == pytest.approx(2.75, abs=1e-5)
    assert sel.var(unbiased=False).item() == pytest.approx(1.0, abs=1e-5)


def test_whiten_with_reduced_moments_matches_whole_batch():
    # Two "ranks" each hold one row; summing their (Σx, Σx², n) is what an all-reduce does.
    x, mask = torch.tensor(X), torch.tensor(M)
    s0, q0, n0 = masked_moments(x[:1], mask[:1])  # Σx = 6, Σx² = 14, n = 3
    s1, q1, n1 = masked_moments(x[1:], mask[1:])  # Σx = 5, Σx² = 25, n = 1
    assert (s0.item(), q0.item(), n0.item()) == (6.0, 14.0, 3.0)
    mean, var = moments_to_mean_var(s0 + s1, q0 + q1, n0 + n1)  # 11/4, 39/4 - (11/4)² = 9.75 - 7.5625 = 2.1875
    assert (mean.item(), var.item()) == (pytest.approx(2.75), pytest.approx(2.1875))
    out = torch.cat([whiten_with(x[:1], mask[:1], mean, var), whiten_with(x[1:], mask[1:], mean, var)])
    close(out, whiten(x, mask))


# ------------------------------------------------------------------------------------------------ RLOO / GRPO


def test_rloo_group_of_three():
    # [1, 0, 2]: A_0 = 1 - (0+2)/2 = 0; A_1 = 0 - (1+2)/2 = -1.5; A_2 = 2 - (1+0)/2 = 1.5
    # second prompt [3, 1, 2]: A = [3 - 1.5, 1 - 2.5, 2 - 2] = [1.5, -1.5, 0]
    flat = torch.tensor([1.0, 0.0, 2.0, 3.0, 1.0, 2.0])  # prompt-major, n = 3
    adv = rloo_advantages(flat.view(-1, 3))
    close(adv, [[0.0, -1.5, 1.5], [1.5, -1.5, 0.0]])
    close(adv.sum(dim=1), [0.0, 0.0])


def test_grpo_group_of_four():
    # [1, 0, 0, 0]: mean 0.25; dev [0.75, -0.25, -0.25, -0.25];
    #   sample var = (0.5625 + 3·0.0625) / (4-1) = 0.75/3 = 0.25 → std 0.5 → A = [1.5, -0.5, -0.5, -0.5]
    # [2, 4, 6, 8]: mean 5; dev [-3, -1, 1, 3]; sample var = 20/3 → std 2.5819889 → A = [-1.161895, -0.387298, ...]
    scores = torch.tensor([[1.0, 0.0, 0.0, 0.0], [2.0, 4.0, 6.0, 8.0]])
    s = math.sqrt(20 / 3)
    close(grpo_advantages(scores, eps=0.0), [[1.5, -0.5, -0.5, -0.5], [-3 / s, -1 / s, 1 / s, 3 / s]])
    close(
        grpo_advantages(scores),
        [
            [0.75 / 0.500001, -0.25 / 0.500001, -0.25 / 0.500001, -0.25 / 0.500001],
            [-3 / (s + 1e-6), -1 / (s + 1e-6), 1 / (s + 1e-6), 3 / (s + 1e-6)],
        ],
    )
    close(grpo_advantages(scores, scale=False), [[0.75, -0.25, -0.25, -0.25], [-3.0, -1.0, 1.0, 3.0]])


def test_equal_scores_give_exactly_zero_advantages():
    # 0.9 and 0.1 are not exact in float32: for [0.9, 0.9, 0.9], r - mean is 6e-8 (one ulp), and divided by
    # std + 1e-6 it would be 0.056 instead of 0; RLOO's (Σ - r)/(n-1) is off by 7e-9 for [0.1, 0.1, 0.1].
    scores = torch.tensor([[0.9, 0.9, 0.9], [0.1, 0.1, 0.1], [0.7, 0.7, 0.7], [1.0, 0.0, 1.0]])
    for adv in (grpo_advantages(scores), grpo_advantages(scores, scale=False), rloo_advantages(scores)):
        assert torch.equal(adv[:3], torch.zeros(3, 3))
        assert (adv[3] != 0).all()


def test_group_shape_is_checked():
    with pytest.raises(ValueError, match=r"\[P, n\]"):
        rloo_advantages(torch.tensor([1.0, 2.0, 3.0]))
    with pytest.raises(ValueError, match="n >= 2"):
        grpo_advantages(torch.tensor([[1.0], [2.0]]))


# ------------------------------------------------------------------------------------------------ layering


def test_rl_and_ppo_losses_import_no_megatron_or_distributed():
    root = pathlib.Path(align_pipeline.__file__).parent
    for path in [*sorted((root / "rl").glob("*.py")), root / "losses" / "ppo.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            for name in names:
                assert not name.startswith(("megatron", "torch.distributed")), f"{path.name} imports {name}"


def test_dapo_overlong_shaping_by_hand():
    from align_pipeline.rl.advantages import overlong_shaping

    # L_max = 20, L_cache = 4: no penalty up to 16 tokens, then (16 - |y|) / 4: 17 -> -0.25, 18 -> -0.5, 20 -> -1;
    # beyond the budget -1
    lengths = torch.tensor([3, 16, 17, 18, 20, 25])
    assert overlong_shaping(lengths, 20, 4).tolist() == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]
    with pytest.raises(ValueError, match="buffer"):
        overlong_shaping(lengths, 20, 0)
