"""Our REINFORCE-family loss against TRL 1.16's ``GRPOTrainer`` loss, on one batch of one tiny HF model.

A real ``GRPOTrainer`` (CPU, fp32) is built on a tiny random-init Llama directory; its ``_compute_loss`` runs over a batch of
prompt + completion ids (completions of different lengths, right-padded) with given advantages, "old" and reference
log-probs. Our :func:`~align_pipeline.losses.reinforce.reinforce_loss` gets the same model's log-probs of the same
tokens (computed here from its logits) and the same inputs. Both losses are differentiated with respect to every
parameter of the model: the gradients must agree (and the loss values, where the two write the same expression -
TRL's on-policy form is ``-A · exp(logp - sg(logp))``, whose value is ``-A`` and whose gradient is ours).

Mapping (TRL ``loss_type`` -> ours): ``grpo`` -> ``aggregation: seq_mean_token_mean``; ``bnpo`` and ``dapo`` (one
micro-batch holding the whole generation batch) -> ``token_mean``; ``dr_grpo`` -> ``dr_grpo`` with ``max_tokens`` =
``max_completion_length``; ``importance_sampling_level: sequence`` -> ``ratio_level: sequence`` (GSPO);
``epsilon`` / ``epsilon_high`` -> ``clip_eps`` / ``clip_eps_high`` (DAPO's clip-higher); ``cispo`` (TRL caps the
detached ratio at ``epsilon_high`` only) -> ``objective: cispo`` with ``clip_eps_high = epsilon_high - 1`` and a lower
bound the test's ratios never reach. The KL term is DeepSeekMath's k3 on both sides: TRL 1.16 by default multiplies
it by the importance ratio (``use_bias_correction_kl``, DeepSeek-V3.2), which ours does not; the test turns that off.
TRL's truncated IS exists only with vLLM generation and is not compared here
(hand-computed tests: tests/losses/test_ppo_losses.py).
"""

from __future__ import annotations

import pytest
import torch

from align_pipeline.losses.reinforce import reinforce_loss

B, P, T, VOCAB = 4, 3, 6, 64
LENGTHS = [6, 4, 5, 2]  # completion tokens per row (the rest is padding)

CASES = {
    # name: (TRL GRPOConfig overrides, our reinforce_loss keywords, old log-probs given, values comparable)
    "on_policy_dapo_kl": ({"loss_type": "dapo", "beta": 0.04}, {"aggregation": "token_mean", "beta": 0.04}, False,
                          False),
    "grpo_clip_higher": ({"loss_type": "grpo", "beta": 0.04, "epsilon": 0.2, "epsilon_high": 0.28},
                         {"aggregation": "seq_mean_token_mean", "beta": 0.04, "clip_eps": 0.2, "clip_eps_high": 0.28},
                         True, True),
    "bnpo": ({"loss_type": "bnpo", "beta": 0.0, "epsilon": 0.1}, {"aggregation": "token_mean", "clip_eps": 0.1},
             True, True),
    "dapo": ({"loss_type": "dapo", "beta": 0.0, "epsilon": 0.1, "epsilon_high": 0.2},
             {"aggregation": "token_mean", "clip_eps": 0.1, "clip_eps_high": 0.2}, True, True),
    "dr_grpo": ({"loss_type": "dr_grpo", "beta": 0.02, "epsilon": 0.15},
                {"aggregation": "dr_grpo", "max_tokens": T, "beta": 0.02, "clip_eps": 0.15}, True, True),
    "gspo": ({"loss_type": "grpo", "beta": 0.0, "epsilon": 0.05, "importance_sampling_level": "sequence"},
             {"aggregation": "seq_mean_token_mean", "clip_eps": 0.05, "ratio_level": "sequence"}, True, True),
    "cispo": ({"loss_type": "cispo", "beta": 0.0, "epsilon_high": 1.1},
              {"aggregation": "token_mean", "objective": "cispo", "clip_eps": 0.9, "clip_eps_high": 0.1}, True, True),
}


@pytest.fixture(scope="module")
def model_and_tokenizer(tmp_path_factory):
    from chat_tokenizers import make_chat_tokenizer_dir
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    path = make_chat_tokenizer_dir(tmp_path_factory.mktemp("tok"), "chatml")
    tok = AutoTokenizer.from_pretrained(str(path))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    LlamaForCausalLM(config).float().save_pretrained(str(path))  # TRL loads it (and its reference) from there
    return str(path), tok


def _trainer(model, tok, tmp_path, overrides: dict):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=B, num_generations=B,
                      max_completion_length=T, report_to="none", use_cpu=True, bf16=False, logging_steps=1,
                      use_bias_correction_kl=False, **overrides)
    return GRPOTrainer(model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=args,
                       train_dataset=Dataset.from_dict({"prompt": ["a"] * B}), processing_class=tok)


def _batch(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(B, T)
    for i, n in enumerate(LENGTHS):
        mask[i, :n] = 1
    return {"prompt_ids": torch.randint(5, VOCAB, (B, P), generator=g), "prompt_mask": torch.ones(B, P, dtype=torch.long),
            "completion_ids": torch.randint(5, VOCAB, (B, T), generator=g), "completion_mask": mask.long(),
            "advantages": torch.randn(B, generator=g)}


def _our_logp(model, batch) -> torch.Tensor:
    """log π(completion_t | prefix) [B, T] from the model's logits (position P - 1 + t predicts completion token t)."""
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    logits = model(input_ids=ids, attention_mask=attention).logits[:, P - 1 : P - 1 + T].float()  # [B, T, V]
    return torch.log_softmax(logits, -1).gather(-1, batch["completion_ids"][..., None])[..., 0]


@pytest.mark.parametrize("case", list(CASES))
def test_reinforce_loss_equals_trl_grpo_trainer(model_and_tokenizer, tmp_path, case):
    trl_args, ours_kw, with_old, values = CASES[case]
    model, tok = model_and_tokenizer
    trainer = _trainer(model, tok, tmp_path, trl_args)
    trainer.model.eval()  # no dropout either way; "eval" mode: TRL's loss is not divided by accumulation steps
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    batch = _batch()
    mask = batch["completion_mask"].float()
    with torch.no_grad():
        current = _our_logp(trainer.model, batch)
    g = torch.Generator().manual_seed(1)
    old = (current + 0.08 * torch.randn(B, T, generator=g)) * mask  # ratios around 1: some clipped, none beyond CISPO's low
    ref = (current + 0.3 * torch.randn(B, T, generator=g)) * mask
    inputs = {**batch, "ref_per_token_logps": ref, "num_items_in_batch": mask.sum()}
    if with_old:
        inputs["old_per_token_logps"] = old

    trl_loss = trainer._compute_loss(trainer.model, inputs)
    trl_grads = torch.autograd.grad(trl_loss, params)

    logp = _our_logp(trainer.model, batch)
    loss_sum, count, _ = reinforce_loss(logp, batch["advantages"], mask, ref_logp=ref,
                                        old_logp=old if with_old else None, estimator="k3", **ours_kw)
    ours = loss_sum / count
    our_grads = torch.autograd.grad(ours, params)

    if values:
        assert ours.item() == pytest.approx(trl_loss.item(), rel=1e-5, abs=1e-7)
    scale = max(g.abs().max().item() for g in trl_grads)
    assert scale > 1e-4  # the batch moves the model
    for (name, _), a, b in zip(trainer.model.named_parameters(), trl_grads, our_grads):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6 * scale), (case, name, (a - b).abs().max().item())
