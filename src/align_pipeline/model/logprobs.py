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
