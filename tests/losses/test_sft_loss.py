import torch

from align_pipeline.losses.sft import masked_token_loss


def test_masked_token_loss_hand_computed():
    # token NLLs:      [[1.0, 2.0, 3.0],    mask [[0, 1, 1],
    #                   [4.0, 5.0, 6.0]]          [1, 0, 0]]
    # sum over masked = 2 + 3 + 4 = 9, count = 3 -> mean 3.0
    nll = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    loss_sum, count, metrics = masked_token_loss(nll, mask)
    assert loss_sum.item() == 9.0
    assert count.item() == 3 and count.dtype == torch.int
    assert metrics["lm_loss"].item() == 9.0


def test_prompt_tokens_get_no_gradient():
    nll = torch.tensor([[1.0, 2.0, 3.0]], requires_grad=True)
    mask = torch.tensor([[0.0, 0.0, 1.0]])
    loss_sum, _, _ = masked_token_loss(nll, mask)
    loss_sum.backward()
    assert nll.grad.tolist() == [[0.0, 0.0, 1.0]]


def test_all_masked_gives_zero_sum_and_count():
    loss_sum, count, _ = masked_token_loss(torch.ones(2, 4), torch.zeros(2, 4))
    assert loss_sum.item() == 0.0 and count.item() == 0
