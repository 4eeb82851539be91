"""Per-token negative log-likelihoods over the *real* vocabulary.

Embedding rows are padded (``gpt.padded_vocab_size``) for even tensor-parallel sharding; the padded output columns
are not tokens. Megatron's built-in loss (``forward(labels=...)``) normalises over them too, which makes an imported HF
model's log-probs differ from HF's and lets a randomly initialised model leak probability there. Here the padded
columns are set to -inf on the rank that holds them before Megatron's vocab-parallel cross-entropy.
"""

from __future__ import annotations

import torch
from megatron.core import tensor_parallel


def token_nll(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, tp_rank: int) -> torch.Tensor:
    """logits [b, s, V_padded/tp] (this rank's vocab shard), labels [b, s] -> -log p(label) [b, s] (fp32)."""
    logits = logits.float()
    shard = logits.shape[-1]
    first = tp_rank * shard  # global id of this shard's first column
    if first + shard > vocab_size:
        cut = max(vocab_size - first, 0)
        logits = logits.clone()
        logits[..., cut:] = float("-inf")
    # vocab_parallel_cross_entropy works on [s, b, v]-like inputs with any leading dims.
    return tensor_parallel.vocab_parallel_cross_entropy(logits.transpose(0, 1).contiguous(),
                                                        labels.transpose(0, 1).contiguous()).transpose(0, 1)


def token_entropy(logits: torch.Tensor, vocab_size: int, tp_rank: int, tp_group=None) -> torch.Tensor:
    """Entropy of the next-token distribution over the real vocabulary, from vocab-sharded logits.

    logits [b, s, V_padded/tp] (this rank's shard) -> H [b, s] (fp32), the same on every TP rank::

        H = log Z - Σ_v p_v z_v,   Z = Σ_v exp(z_v - m),  with the max m and both sums reduced over TP ranks

    Differentiable: the sums go through Megatron's ``reduce_from_tensor_model_parallel_region`` (all-reduce forward,
    identity backward, right since every TP rank computes the same function of the sums). ``tp_group`` None = no
    reduction (TP = 1, or logits gathered over the whole vocabulary).
    """
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    z = logits.float()  # [b, s, v]
    shard = z.shape[-1]
    first = tp_rank * shard
    valid = (torch.arange(shard, device=z.device) + first) < vocab_size  # [v] real-token columns of this shard
    z = torch.where(valid, z, torch.zeros((), device=z.device))  # padded columns: excluded below, kept finite
    m = torch.where(valid, z, float("-inf")).amax(dim=-1, keepdim=True).detach()  # [b, s, 1]
    reduce = tp_group is not None and tp_group.size() > 1
    if reduce:
        torch.distributed.all_reduce(m, op=torch.distributed.ReduceOp.MAX, group=tp_group)
    e = torch.where(valid, torch.exp(z - m), torch.zeros((), device=z.device))  # [b, s, v]
    sums = torch.stack([e.sum(-1), (e * (z - m)).sum(-1)], dim=-1)  # [b, s, 2]: Z, Σ e (z - m)
    if reduce:
        sums = reduce_from_tensor_model_parallel_region(sums, group=tp_group)
    total, weighted = sums.unbind(-1)
    return torch.log(total) - weighted / total  # H = log Z - E[z - m]
