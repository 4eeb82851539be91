"""Per-token negative log-likelihoods over the *real* vocabulary.

Embedding rows are padded (``gpt.padded_vocab_size``) for even tensor-parallel sharding; the padded output columns
are not tokens. Megatron's built-in loss (``forward(labels=...)``) normalises over them too, which makes an imported HF
model's log-probs differ from HF's and lets a randomly initialised model leak probability there. Here the padded
columns are set to -inf on the rank that holds them before Megatron's vocab-parallel cross-entropy.
"""

from __future__ import annotations

import torch
import torch.distributed as tdist
from megatron.core import parallel_state, tensor_parallel

from align_pipeline.model import kernels


def token_nll(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, tp_rank: int) -> torch.Tensor:
    """logits [b, s, V_padded/tp] (this rank's vocab shard), labels [b, s] -> -log p(label) [b, s] (fp32).

    With the fused kernels (``parallel.kernels``) and the whole vocabulary on this rank, one compiled kernel each way
    (:func:`align_pipeline.model.kernels.token_nll`); else Megatron's vocab-parallel cross-entropy."""
    if kernels.active() and tp_rank == 0 and parallel_state.get_tensor_model_parallel_world_size() == 1:
        return kernels.token_nll(logits, labels, vocab_size)
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


def sum_grad_over_group(x: torch.Tensor, group) -> torch.Tensor:
    """Identity forward; backward: the gradient summed over ``group`` (every rank holds a partial one). Megatron's
    ``copy_to_tensor_model_parallel_region`` does the same only for a contiguous gradient (it reduces a contiguous
    copy of a non-contiguous one and returns the original)."""
    return _SumGradOverGroup.apply(x, group)


class _SumGradOverGroup(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        tdist.all_reduce(grad, group=ctx.group)
        return grad, None


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, cut: int) -> torch.Tensor:
    """fp32 logits [c, V/tp] of hidden rows ``h`` [c, h]; the shard's padded columns (from ``cut`` on) -inf."""
    z = (h @ weight.t()).float()
    if cut < weight.shape[0]:
        z[:, cut:] = float("-inf")
    return z


def _label_columns(labels: torch.Tensor, first: int, cut: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(each label's column in this shard, whether this shard holds it) for labels [c]."""
    local = labels - first
    return local, (local >= 0) & (local < cut)


class _ChunkedLinearNLL(torch.autograd.Function):
    """-log p(label) from hidden states and this rank's vocab shard of the output weight, ``chunk`` tokens at a time:
    a chunk's logits [chunk, V/tp] exist only while its row of the loss (forward) or of the gradients (backward,
    recomputed) is made. Tensor-parallel reductions as in Megatron's vocab-parallel cross-entropy; the hidden
    gradient returned is this rank's partial sum (the caller's TP region reduces it)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, vocab_size, chunk, tp_group):
        shard = weight.shape[0]
        rank = tdist.get_rank(tp_group) if tp_group is not None else 0
        first = rank * shard
        reduce = tp_group is not None and tp_group.size() > 1
        cut = min(max(vocab_size - first, 0), shard)  # real-token columns of this shard: [0, cut)
        nll = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(nll)
        for start in range(0, hidden.shape[0], chunk):
            z = _chunk_logits(hidden[start:start + chunk], weight, cut)  # [c, V/tp]
            local, owned = _label_columns(labels[start:start + chunk], first, cut)
            target = torch.where(owned, z.gather(1, local.clamp(0, shard - 1).unsqueeze(1)).squeeze(1), 0.0)
            m = z.amax(-1)
            if reduce:
                tdist.all_reduce(m, op=tdist.ReduceOp.MAX, group=tp_group)
            sums = torch.stack([torch.exp(z - m.unsqueeze(1)).sum(-1), target])  # [2, c]
            if reduce:
                tdist.all_reduce(sums, group=tp_group)
            lse[start:start + chunk] = m + torch.log(sums[0])
            nll[start:start + chunk] = lse[start:start + chunk] - sums[1]
        ctx.save_for_backward(hidden, weight, labels, lse)
        ctx.chunk, ctx.first, ctx.cut = chunk, first, cut
        return nll

    @staticmethod
    def backward(ctx, grad_nll):
        hidden, weight, labels, lse = ctx.saved_tensors
        chunk, first, cut = ctx.chunk, ctx.first, ctx.cut
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for start in range(0, hidden.shape[0], chunk):
            h = hidden[start:start + chunk]
            # softmax over the whole vocabulary (exp(-inf - lse) = 0 in the padded columns)
            p = torch.exp(_chunk_logits(h, weight, cut) - lse[start:start + chunk].unsqueeze(1))
            local, owned = _label_columns(labels[start:start + chunk], first, cut)
            rows = torch.nonzero(owned).squeeze(1)
            p[rows, local[rows]] -= 1.0  # d nll / d z = softmax - onehot(label)
            g = (p * grad_nll[start:start + chunk].unsqueeze(1)).to(hidden.dtype)  # [c, V/tp]
            grad_hidden[start:start + chunk] = g @ weight
            grad_weight += (g.t() @ h).float()
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None, None


def chunked_token_nll(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, vocab_size: int, chunk: int,
                      sequence_parallel: bool = False) -> torch.Tensor:
    """The LM loss without whole-vocabulary logits: hidden [b, s, h] (the GPT's final-norm output; [b, s/tp, h] with
    sequence parallelism), ``weight`` this rank's [V_padded/tp, h] output weight, labels [b, s] -> -log p(label)
    [b, s] (fp32), equal to :func:`token_nll` of the logits; at most ``chunk`` tokens' logits exist at a time."""
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    group = parallel_state.get_tensor_model_parallel_group() if parallel_state.model_parallel_is_initialized() \
        else None
    h = hidden.transpose(0, 1)  # [s', b, h]: Megatron's sequence-first layout
    if group is not None and group.size() > 1:
        h = gather_from_sequence_parallel_region(h, group=group) if sequence_parallel \
            else sum_grad_over_group(h, group)
    b, s = labels.shape
    flat = h.transpose(0, 1).reshape(b * s, -1)  # [b*s, h], row-major over (row, position) like labels
    nll = _ChunkedLinearNLL.apply(flat, weight, labels.reshape(-1), vocab_size, chunk, group)
    return nll.view(b, s)
