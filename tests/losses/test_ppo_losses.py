"""Hand-computed checks of the PPO policy / value losses, the entropy bonus and the REINFORCE/GRPO loss.

Ratios are built as exp(logp - old_logp) with old_logp = 0 and logp = ln ρ, ρ ∈ {0.5, 0.75, 1.25, 1.5}, which
round-trip exactly, so "at the clip boundary" (ε = 0.25) is exact.
"""

import math

import pytest
import torch

from align_pipeline.losses.ppo import (
    entropy_bonus,
    entropy_from_logits,
    ppo_policy_loss,
    ppo_value_loss,
)
from align_pipeline.losses.reinforce import reinforce_loss

LN2, LN3 = math.log(2.0), math.log(3.0)
NAN = float("nan")


def approx(x):
    return pytest.approx(x, rel=1e-6, abs=1e-6)


def close(actual, expected, tol=1e-6):
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    assert torch.allclose(actual, expected, atol=tol, rtol=0), f"{actual} != {expected}"


def logps(*ratios):
    """[1, T] log-probs (requires grad) giving these ratios against old_logp = 0; NaN ratio = garbage (masked)."""
    return torch.tensor([[NAN if math.isnan(r) else math.log(r) for r in ratios]], requires_grad=True)


# ------------------------------------------------------------------------------------------------ PPO policy loss


def test_policy_loss_ratio_one_is_vanilla_policy_gradient():
    # ρ = 1 everywhere: loss = -Σ A = -(1 - 2 + 0.5) = 0.5; d loss / d logp_t = -A_t ρ_t = -A_t
    logp = torch.tensor([[-1.3, -0.2, -2.0]], requires_grad=True)
    adv = torch.tensor([[1.0, -2.0, 0.5]])
    loss, count, m = ppo_policy_loss(logp, logp.detach().clone(), adv, torch.ones(1, 3), clip_eps=0.2)
    assert loss.item() == approx(0.5) and count.item() == 3 and count.dtype == torch.int
    assert m["clip_fraction"].item() == 0 and m["ratio"].item() == approx(3.0) and m["approx_kl"].item() == approx(0)
    loss.backward()
    close(logp.grad, [[-1.0, 2.0, -0.5]])


def test_policy_loss_at_the_clip_boundary():
    # ε = 0.25.  t0: ρ = 1.25, A = +2 → -min(2·1.25, 2·1.25) = -2.5
    #            t1: ρ = 0.75, A = -2 → -min(-2·0.75, -2·0.75) = 1.5
    # Both terms equal: not counted as clipped; the token keeps its full gradient -A ρ = [-2.5, 1.5].
    logp = logps(1.25, 0.75)
    loss, count, m = ppo_policy_loss(logp, torch.zeros(1, 2), torch.tensor([[2.0, -2.0]]), torch.ones(1, 2), 0.25)
    assert loss.item() == approx(-1.0) and count.item() == 2
    assert m["policy_loss"].item() == approx(-1.0)
    assert m["clip_fraction"].item() == 0
    assert m["ratio"].item() == approx(2.0)
    loss.backward()
    close(logp.grad, [[-2.5, 1.5]])


def test_policy_loss_beyond_the_clip():
    # ε = 0.25, old_logp = 0:
    #   t0: ρ = 1.5, A = +1: -min(1.5, 1.25)   = -1.25  clipped   → grad 0
    #   t1: ρ = 0.5, A = -1: -min(-0.5, -0.75) =  0.75  clipped   → grad 0
    #   t2: ρ = 1.5, A = -1: -min(-1.5, -1.25) =  1.5   unclipped → grad -A ρ =  1.5
    #   t3: ρ = 0.5, A = +1: -min(0.5, 0.75)   = -0.5   unclipped → grad -A ρ = -0.5
    #   t4: masked; logp NaN and A = 100 must reach neither loss nor grad
    # loss = -1.25 + 0.75 + 1.5 - 0.5 = 0.5; clip_fraction = 2; Σρ = 4
    # approx_kl = Σ (ρ - 1) - ln ρ = 2·(0.5 - ln 1.5) + 2·(-0.5 + ln 2) = 2·0.0945349 + 2·0.1931472 = 0.5753641
    logp = logps(1.5, 0.5, 1.5, 0.5, NAN)
    adv = torch.tensor([[1.0, -1.0, -1.0, 1.0, 100.0]])
    mask = torch.tensor([[1.0, 1, 1, 1, 0]])
    loss, count, m = ppo_policy_loss(logp, torch.zeros(1, 5), adv, mask, clip_eps=0.25)
    assert loss.item() == approx(0.5) and count.item() == 4
    assert m["clip_fraction"].item() == 2
    assert m["ratio"].item() == approx(4.0)
    assert m["approx_kl"].item() == approx(2 * (0.5 - math.log(1.5)) + 2 * (LN2 - 0.5))
    loss.backward()
    close(logp.grad, [[0.0, 0.0, 1.5, -0.5, 0.0]])


def test_policy_loss_rejects_bad_clip_and_shapes():
    x = torch.zeros(1, 3)
    with pytest.raises(ValueError, match="clip_eps"):
        ppo_policy_loss(x, x, x, x, clip_eps=0.0)
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        ppo_policy_loss(x, x, torch.zeros(1), x, clip_eps=0.2)


# ------------------------------------------------------------------------------------------------ PPO value loss


def test_value_loss_clipping():
    # ε = 0.2, R̂ = 1 everywhere, V_old = 0.5:
    #   t0: V = 1.0: V_clip = 0.5 + clip(0.5) = 0.7; (V-R)² = 0, (V_clip-R)² = 0.09 → ½·0.09 = 0.045, clipped, grad 0
    #   t1: V = 0.6: inside the clip; both 0.16 → ½·0.16 = 0.08, not clipped, grad V - R = -0.4
    #   t2: V = 0.0: V_clip = 0.3; 1.0 vs 0.49 → ½·1.0 = 0.5, unclipped larger, grad V - R = -1.0
    #   t3: masked garbage
    # loss = 0.045 + 0.08 + 0.5 = 0.625; value_clip_fraction = 1
    values = torch.tensor([[1.0, 0.6, 0.0, NAN]], requires_grad=True)
    old = torch.tensor([[0.5, 0.5, 0.5, NAN]])
    ret = torch.tensor([[1.0, 1.0, 1.0, 1e9]])
    loss, count, m = ppo_value_loss(values, old, ret, torch.tensor([[1, 1, 1, 0]]), clip_eps=0.2)
    assert loss.item() == approx(0.625) and count.item() == 3
    assert m["value_loss"].item() == approx(0.625)
    assert m["value_clip_fraction"].item() == 1
    loss.backward()
    close(values.grad, [[0.0, -0.4, -1.0, 0.0]])


def test_value_loss_without_clipping():
    # clip_eps None, same tensors: ½·(0 + 0.16 + 1.0) = 0.58; grads V - R̂ = 0, -0.4, -1.0; nothing counts as clipped
    values = torch.tensor([[1.0, 0.6, 0.0, NAN]], requires_grad=True)
    old = torch.tensor([[0.5, 0.5, 0.5, NAN]])
    ret = torch.tensor([[1.0, 1.0, 1.0, 1e9]])
    loss, count, m = ppo_value_loss(values, old, ret, torch.tensor([[1, 1, 1, 0]]), clip_eps=None)
    assert loss.item() == approx(0.58) and count.item() == 3
    assert m["value_clip_fraction"].item() == 0
    loss.backward()
    close(values.grad, [[0.0, -0.4, -1.0, 0.0]])
    with pytest.raises(ValueError, match="clip_eps must be None or a finite number > 0"):
        ppo_value_loss(values, old, ret, torch.tensor([[1, 1, 1, 0]]), clip_eps=0.0)


# ------------------------------------------------------------------------------------------------ entropy


def test_entropy_bonus_from_logits_and_from_entropy():
    # logits [0, 0] → p = [½, ½], H = ln 2 = 0.693147
    # logits [0, ln 3] → p = [¼, ¾], H = ¼ ln 4 + ¾ ln(4/3) = 0.346574 + 0.215762 = 0.562335
    # third token masked
    logits = torch.tensor([[[0.0, 0.0], [0.0, LN3], [50.0, -50.0]]])  # [B=1, T=3, V=2]
    h = entropy_from_logits(logits)
    h_expected = [LN2, 0.25 * math.log(4) + 0.75 * math.log(4 / 3)]
    close(h[:, :2], [h_expected])
    mask = torch.tensor([[1, 1, 0]])
    for x in (logits, h):
        loss, count, m = entropy_bonus(x, mask)
        assert loss.item() == approx(-sum(h_expected)) and count.item() == 2
        assert m["entropy"].item() == approx(sum(h_expected))


# ------------------------------------------------------------------------------------------------ REINFORCE / GRPO


def test_reinforce_on_policy_no_kl():
    # A = [2, -1] per sequence; loss_t = -A logp_t: row 0: -2·(-1) + -2·(-2) = 2 + 4; row 1: 1·(-0.5) = -0.5
    # loss = 5.5 over 3 tokens; d/d logp = -A = [[-2, -2, 0], [1, 0, 0]]
    logp = torch.tensor([[-1.0, -2.0, NAN], [-0.5, NAN, NAN]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    loss, count, m = reinforce_loss(logp, torch.tensor([2.0, -1.0]), mask)
    assert loss.item() == approx(5.5) and count.item() == 3
    assert m["pg_loss"].item() == approx(5.5) and m["kl"].item() == 0
    loss.backward()
    close(logp.grad, [[-2.0, -2.0, 0.0], [1.0, 0.0, 0.0]])


def test_reinforce_with_k3_kl_to_reference():
    # ref = logp + ln 2 on every token → r = π_ref/π = 2 → k3 = (2 - 1) - ln 2 = 0.306853 per token
    # β = 0.1: loss = 5.5 + 0.1 · 3 · 0.306853 = 5.5920558
    # d k3 / d logp = 1 - r = -1 → grad = -A + 0.1·(-1) = [[-2.1, -2.1, 0], [0.9, 0, 0]]
    logp = torch.tensor([[-1.0, -2.0, NAN], [-0.5, NAN, NAN]], requires_grad=True)
    ref = torch.tensor([[-1.0 + LN2, -2.0 + LN2, NAN], [-0.5 + LN2, NAN, NAN]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    loss, _, m = reinforce_loss(logp, torch.tensor([2.0, -1.0]), mask, ref_logp=ref, beta=0.1)
    assert loss.item() == approx(5.5 + 0.3 * (1 - LN2))
    assert m["pg_loss"].item() == approx(5.5) and m["kl"].item() == approx(3 * (1 - LN2))
    loss.backward()
    close(logp.grad, [[-2.1, -2.1, 0.0], [0.9, 0.0, 0.0]], tol=1e-5)
    # k1: kl = logp - ref = -ln 2 per token (reported even with beta = 0, which leaves the loss at 5.5)
    loss1, _, m1 = reinforce_loss(logp, torch.tensor([2.0, -1.0]), mask, ref_logp=ref, estimator="k1")
    assert loss1.item() == approx(5.5) and m1["kl"].item() == approx(-3 * LN2)


def test_reinforce_sequence_and_token_advantages_agree():
    logp = torch.tensor([[-1.0, -2.0, -0.3], [-0.5, -0.1, -4.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    a_seq = reinforce_loss(logp, torch.tensor([2.0, -1.0]), mask)
    a_tok = reinforce_loss(logp, torch.tensor([[2.0, 2.0, 2.0], [-1.0, -1.0, -1.0]]), mask)
    assert a_seq[0].item() == a_tok[0].item() and a_seq[1].item() == a_tok[1].item()


def test_reinforce_clipped_form_matches_ppo_policy_loss():
    # with old_logp the policy-gradient term is PPO eq. 7: same numbers as test_policy_loss_beyond_the_clip
    adv_tok = torch.tensor([[1.0, -1.0, -1.0, 1.0, 100.0]])
    mask = torch.tensor([[1.0, 1, 1, 1, 0]])
    loss, _, m = reinforce_loss(
        logps(1.5, 0.5, 1.5, 0.5, NAN), adv_tok, mask, old_logp=torch.zeros(1, 5), clip_eps=0.25
    )
    ppo, _, pm = ppo_policy_loss(logps(1.5, 0.5, 1.5, 0.5, NAN), torch.zeros(1, 5), adv_tok, mask, 0.25)
    assert loss.item() == approx(0.5) == ppo.item()
    assert m["clip_fraction"].item() == pm["clip_fraction"].item() == 2
    assert m["ratio"].item() == approx(pm["ratio"].item())


def test_reinforce_beta_needs_reference():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="needs ref_logp"):
        reinforce_loss(x, torch.zeros(1), x, beta=0.1)


# ------------------------------------------------------------------------ rollout-training mismatch (TIS / MIS)


def test_rollout_correction_is_the_identity_when_the_engine_agrees_with_the_training_forward():
    """Engine log-probs equal to the training side: every correction gives the plain loss and gradient, weight 1."""
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    adv = torch.tensor([2.0, -1.0])
    for old in (None, torch.tensor([[-1.2, -1.7, NAN], [-0.4, NAN, NAN]])):  # on-policy, and the clipped form
        plain_logp = torch.tensor([[-1.0, -2.0, NAN], [-0.5, NAN, NAN]], requires_grad=True)
        plain, count, _ = reinforce_loss(plain_logp, adv, mask, old_logp=old)
        plain.backward()
        engine = (old if old is not None else plain_logp.detach()).clone()
        for correction in ("none", "tis", "mis"):
            logp = torch.tensor([[-1.0, -2.0, NAN], [-0.5, NAN, NAN]], requires_grad=True)
            loss, _, m = reinforce_loss(logp, adv, mask, old_logp=old, rollout_logp=engine, correction=correction)
            loss.backward()
            assert loss.item() == approx(plain.item()), correction
            close(logp.grad, plain_logp.grad.tolist())
            assert m["is_weight"].item() == count.item() and m["is_dropped"].item() == 0
            assert m["logprob_diff"].item() == 0


def test_truncated_and_masked_importance_sampling_by_hand():
    # on-policy: train side = logp (detached). Tokens: row 0 (A=2): logp -1, -2; row 1 (A=-1): logp -0.5.
    # engine log-probs: -1 - ln 5 (r = 5), -2 + ln 1.5 (r = 1/1.5 = 0.6667), -0.5 - ln 1.5 (r = 1.5)
    logp = torch.tensor([[-1.0, -2.0, NAN], [-0.5, NAN, NAN]], requires_grad=True)
    engine = torch.tensor([[-1.0 - math.log(5.0), -2.0 + math.log(1.5), NAN], [-0.5 - math.log(1.5), NAN, NAN]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    adv = torch.tensor([2.0, -1.0])
    # TIS, C = 2: w = [2, 0.6667, 1.5]; pg_t = -A·logp_t·w_t = [-2·-1·2, -2·-2·(2/3), 1·-0.5·1.5] = [4, 8/3, -0.75]
    loss, _, m = reinforce_loss(logp, adv, mask, rollout_logp=engine, correction="tis", tis_cap=2.0)
    assert loss.item() == approx(4 + 8 / 3 - 0.75)
    assert m["is_weight"].item() == approx(2 + 2 / 3 + 1.5) and m["is_dropped"].item() == 0
    assert m["logprob_diff"].item() == approx(math.log(5.0) + 2 * math.log(1.5))
    loss.backward()
    close(logp.grad, [[-4.0, -4 / 3, 0.0], [1.5, 0.0, 0.0]], tol=1e-5)  # d/dlogp = -A·w
    # MIS, band [0.5, 2]: r = 5 leaves it (dropped, weight 0), 0.6667 and 1.5 stay with their ratio as weight
    logp.grad = None
    loss, _, m = reinforce_loss(logp, adv, mask, rollout_logp=engine, correction="mis", mis_low=0.5, mis_high=2.0)
    assert loss.item() == approx(8 / 3 - 0.75)
    assert m["is_dropped"].item() == 1 and m["is_weight"].item() == approx(2 / 3 + 1.5)
    loss.backward()
    close(logp.grad, [[0.0, -4 / 3, 0.0], [1.5, 0.0, 0.0]], tol=1e-5)
    with pytest.raises(ValueError, match="needs rollout_logp"):
        reinforce_loss(logp, adv, mask, correction="tis")


# ------------------------------------------------------------------ DAPO clip-higher, GSPO sequence ratio, CISPO


def test_dapo_clip_higher_keeps_the_gradient_of_a_ratio_between_the_two_upper_clips():
    # one token, A = 1, ρ = 1.25: with ε = 0.2 on both sides it is clipped (loss -1.2, no gradient); with
    # ε_high = 0.28 it is not (loss -1.25, d/dlogp = -A·ρ = -1.25)
    old = torch.tensor([[0.0]])
    mask = torch.tensor([[1]])
    for high, loss_value, grad, clipped in ((None, -1.2, 0.0, 1.0), (0.28, -1.25, -1.25, 0.0)):
        logp = torch.tensor([[math.log(1.25)]], requires_grad=True)
        loss, _, m = reinforce_loss(logp, torch.tensor([1.0]), mask, old_logp=old, clip_eps=0.2, clip_eps_high=high)
        loss.backward()
        assert loss.item() == approx(loss_value) and m["clip_fraction"].item() == clipped
        close(logp.grad, [[grad]], tol=1e-6)
    # the lower clip stays 1 - ε: A = -1, ρ = 0.7 < 0.8 is clipped either way (loss 0.8, no gradient)
    logp = torch.tensor([[math.log(0.7)]], requires_grad=True)
    loss, _, m = reinforce_loss(logp, torch.tensor([-1.0]), mask, old_logp=old, clip_eps=0.2, clip_eps_high=0.28)
    loss.backward()
    assert loss.item() == approx(0.8) and m["clip_fraction"].item() == 1 and logp.grad.item() == 0


def test_gspo_clips_the_length_normalised_sequence_ratio():
    # row 0 (A = 1): Δ = logp - old = [0.2, -0.1] -> s = exp(0.05) = 1.0512711 on both tokens, inside [0.8, 1.2]:
    #   loss = -2·s, d/dlogp_t = -A·s = -1.0512711 each
    # row 1 (A = 1): Δ = [0.5] -> s = exp(0.5) = 1.6487213 > 1.2: clipped, loss -1.2, no gradient
    # row 2 (A = -1): Δ = [0.5] -> s = 1.6487213, unclipped term the larger loss: loss +s, d/dlogp = -A·s = +s
    old = torch.tensor([[0.0, 0.0], [0.0, 0.0], [0.0, 0.0]])
    logp = torch.tensor([[0.2, -0.1], [0.5, NAN], [0.5, NAN]], requires_grad=True)
    mask = torch.tensor([[1, 1], [1, 0], [1, 0]])
    adv = torch.tensor([1.0, 1.0, -1.0])
    loss, count, m = reinforce_loss(logp, adv, mask, old_logp=old, clip_eps=0.2, ratio_level="sequence")
    s0, s1 = math.exp(0.05), math.exp(0.5)
    assert count.item() == 4 and loss.item() == approx(-2 * s0 - 1.2 + s1)
    assert m["clip_fraction"].item() == 1 and m["ratio"].item() == approx(2 * s0 + 2 * s1)
    loss.backward()
    close(logp.grad, [[-s0, -s0], [0.0, 0.0], [s1, 0.0]], tol=1e-5)
    # per token, row 0's ratios are exp(0.2) = 1.2214 (clipped at 1.2) and exp(-0.1): another loss on the same rows
    token, _, _ = reinforce_loss(logp, adv, mask, old_logp=old, clip_eps=0.2)
    assert token.item() == approx(-(1.2 + math.exp(-0.1)) - 1.2 + s1)


def test_cispo_clips_the_weight_and_keeps_every_gradient():
    # ρ = 1.5, A = 2, ε_high = 0.28: weight sg[clip(1.5, 0.8, 1.28)] = 1.28; loss = -A·1.28·logp = -2·1.28·ln 1.5;
    # d/dlogp = -A·1.28 = -2.56 (PPO's clip would give no gradient here); ρ = 1.1 stays 1.1
    old = torch.tensor([[0.0, 0.0]])
    logp = torch.tensor([[math.log(1.5), math.log(1.1)]], requires_grad=True)
    mask = torch.tensor([[1, 1]])
    loss, _, m = reinforce_loss(logp, torch.tensor([2.0]), mask, old_logp=old, clip_eps=0.2, clip_eps_high=0.28,
                                objective="cispo")
    assert loss.item() == approx(-2 * 1.28 * math.log(1.5) - 2 * 1.1 * math.log(1.1))
    assert m["clip_fraction"].item() == 1 and m["ratio"].item() == approx(2.6)
    loss.backward()
    close(logp.grad, [[-2.56, -2.2]], tol=1e-5)


def test_loss_aggregation_modes_by_hand():
    # A = 1 on both rows, logp = -l: per-token losses l = [1, 3] (row 0) and [5] (row 1); the trainer divides the
    # summed loss by the summed count
    logp = torch.tensor([[-1.0, -3.0], [-5.0, NAN]])
    mask = torch.tensor([[1, 1], [1, 0]])
    adv = torch.tensor([1.0, 1.0])
    expected = {"token_mean": (9.0, 3, 9 / 3),              # (1 + 3 + 5) / 3 tokens
                "seq_mean_token_mean": (7.0, 2, 7 / 2),     # (4/2 + 5/1) / 2 responses
                "seq_mean_token_sum": (9.0, 2, 9 / 2),      # (4 + 5) / 2 responses
                "dr_grpo": (9.0, 8, 9 / 8)}                 # (4 + 5) / (2 responses x 4 max tokens)
    for aggregation, (loss_sum, count, mean) in expected.items():
        loss, n, m = reinforce_loss(logp, adv, mask, aggregation=aggregation, max_tokens=4)
        assert (loss.item(), n.item()) == (approx(loss_sum), count), aggregation
        assert loss.item() / n.item() == approx(mean)
        assert m["pg_loss"].item() == approx(9.0)  # metrics stay per-token sums ...
        assert aggregation == "token_mean" or m["_tokens"].item() == 3  # ... over the tokens the trainer is told
    with pytest.raises(ValueError, match="max_tokens"):
        reinforce_loss(logp, adv, mask, aggregation="dr_grpo")
