"""Sequence-level views of a model's outputs: preference pairs, per-token log-probs and values, sequence rewards.

Each ``*_forward`` returns a ``forward(module, batch) -> (output, per_row_fn)`` for the forward-only helpers of
:mod:`align_pipeline.train.core.schedule` (``per_row_fn(output)`` gives [b] or [b, k] on the last pipeline stage).
Batches are right-padded: ``input_ids``/``labels``/``loss_mask`` [b, s], where ``loss_mask[:, t] = 1`` marks label t
(= input token t+1) as a response token. Preference batches hold ``chosen_*`` and ``rejected_*`` of the same shape.
"""

from __future__ import annotations

import torch

from align_pipeline.model.gpt import unwrap
from align_pipeline.model.logprobs import chunked_token_nll, token_nll


def position_ids(input_ids: torch.Tensor) -> torch.Tensor:
    """[b, s] positions 0..s-1 (right padding: real tokens always start at 0)."""
    b, s = input_ids.shape
    return torch.arange(s, device=input_ids.device).unsqueeze(0).expand(b, s)


def run(module, input_ids: torch.Tensor, batch: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """The model's output for [b, s] token ids: this rank's vocab shard of the logits [b, s, V/tp] (LM head) or the
    values [b, s, k] (value head); only meaningful on the last pipeline stage.

    A packed micro-batch (``batch`` from :func:`align_pipeline.data.packing.packed_microbatch`: [1, T] ids with
    ``cu_seqlens``, ``position_ids``) goes through Megatron's thd path: RoPE restarts at every sample and attention
    stays within each sample."""
    if batch is not None and "cu_seqlens" in batch:
        from megatron.core.packed_seq_params import PackedSeqParams

        cu, longest = batch["cu_seqlens"], int(batch["max_seqlen"][0])
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                                 max_seqlen_kv=longest)
        return module(input_ids, batch["position_ids"], None, packed_seq_params=params)
    return module(input_ids, position_ids(input_ids), None)


def run_lm_hidden(module, input_ids: torch.Tensor, batch: dict[str, torch.Tensor] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
    """:func:`run` with the LM head left out on the last stage: (final hidden states [b, s, h] ([b, s/tp, h] with
    sequence parallelism), this rank's output weight [V/tp, h], whether the hidden states are sequence shards), for
    :func:`~align_pipeline.model.logprobs.chunked_token_nll`. Other pipeline stages: (their output, None, False)."""
    gpt = unwrap(module)
    head = getattr(gpt, "output_layer", None) if getattr(gpt, "post_process", False) else None
    if head is None:
        return run(module, input_ids, batch), None, False
    weight = gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights else head.weight
    head.forward = lambda hidden, weight=None, runtime_gather_output=None: (hidden, None)  # this call only
    try:
        out = run(module, input_ids, batch)
    finally:
        del head.forward
    return out, weight, bool(head.sequence_parallel)


def lm_token_nll_forward(vocab_size: int, tp_rank: int, chunk: int = 0):
    """(module, input_ids, labels, batch) -> (output, nll_fn): the model's output for the micro-batch and a function of
    it giving -log p(label) [b, s] (fp32). ``chunk`` 0: whole logits (:func:`token_nll`); > 0: from the hidden states,
    ``chunk`` tokens' logits at a time (:func:`chunked_token_nll`)."""
    def forward(module, input_ids, labels, batch=None):
        if not chunk:
            return run(module, input_ids, batch), lambda logits: token_nll(logits, labels, vocab_size, tp_rank)
        hidden, weight, sp = run_lm_hidden(module, input_ids, batch)
        return hidden, lambda h: chunked_token_nll(h, weight, labels, vocab_size, chunk, sp)

    return forward


def pair_batch(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stack chosen over rejected: input_ids/labels/loss_mask [2b, s] (rows 0..b-1 chosen, b..2b-1 rejected). A
    packed batch is already one [1, T] sequence whose ``sequence`` numbering has that order."""
    if "sequence" in batch:
        return batch["input_ids"], batch["labels"], batch["loss_mask"]

    def cat(key: str) -> torch.Tensor:
        return torch.cat([batch[f"chosen_{key}"], batch[f"rejected_{key}"]])

    return cat("input_ids"), cat("labels"), cat("loss_mask")


def per_sequence_sum(x: torch.Tensor, batch: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """[rows, s] -> [n]: the sum over each sequence – a padded row is one sequence; in a packed batch ([1, T]) the
    tokens of sequence i (``batch["sequence"] == i``) make sequence i (n = the micro-batch's sequences)."""
    if batch is None or "sequence" not in batch:
        return x.sum(-1)
    seq = batch["sequence"][0]  # [T], -1 = padding
    n = int(batch["num_sequences"][0])
    keep = seq >= 0
    return torch.zeros(n, dtype=x.dtype, device=x.device).index_add(0, seq[keep], x[0][keep])


def sequence_rewards(values: torch.Tensor, loss_mask: torch.Tensor, pooling: str,
                     batch: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """values [n, s, 1] at each *input* position -> rewards [n] (a packed ``batch``: [1, T, 1] -> one per sequence).

    The response occupies input positions t+1 for every t with ``loss_mask[:, t] = 1``; "last" reads the value at the
    final one (the EOS token, which has seen the whole sequence), "mean" averages over all of them. (In a packed row a
    sequence's last token has no loss, so no response spills into the next sequence.)
    """
    values = values[..., 0].float()  # [n, s]
    response = torch.zeros_like(loss_mask, dtype=torch.bool)  # [n, s] response tokens as inputs
    response[:, 1:] = loss_mask[:, :-1] > 0
    if pooling == "mean":
        return per_sequence_sum(values * response, batch) / per_sequence_sum(response.float(), batch).clamp(min=1)
    if pooling != "last":
        raise ValueError(f"pooling must be 'last' or 'mean', got {pooling!r}")
    positions = torch.arange(values.shape[1], device=values.device).expand_as(values)  # [n, s]
    marked = torch.where(response, positions, torch.zeros_like(positions))  # [n, s]
    if batch is not None and "sequence" in batch:
        seq = batch["sequence"][0]
        n = int(batch["num_sequences"][0])
        last = torch.zeros(n, dtype=positions.dtype, device=values.device).scatter_reduce(
            0, seq.clamp(min=0), torch.where(seq >= 0, marked[0], 0), reduce="amax")  # [n] position in the row
        return values[0][last]
    last = marked.max(-1).values  # [n]
    return values.gather(1, last.unsqueeze(1)).squeeze(1)


def token_logprobs_forward(vocab_size: int, tp_rank: int):
    """log pi(label_t | ids[:t+1]) at every position: [b, s] fp32 (meaningful where loss_mask is 1)."""

    def forward(module, batch):
        logits = run(module, batch["input_ids"])  # [b, s, V/tp]
        return logits, lambda out: -token_nll(out, batch["labels"], vocab_size, tp_rank)

    return forward


def token_values_forward():
    """A value-head model's output at every input position: [b, s] fp32 (V(s_t) for the action at label t)."""

    def forward(module, batch):
        values = run(module, batch["input_ids"])  # [b, s, 1]
        return values, lambda out: out[..., 0].float()

    return forward


def nll_forward(vocab_size: int, tp_rank: int):
    """Per row: [Σ response-token NLL, response tokens] -> [b, 2] (perplexity = exp(Σ col 0 / Σ col 1))."""

    def forward(module, batch):
        logits = run(module, batch["input_ids"])

        def stats(logits):
            nll = token_nll(logits, batch["labels"], vocab_size, tp_rank) * batch["loss_mask"]  # [b, s]
            return torch.stack([nll.sum(-1), batch["loss_mask"].sum(-1)], dim=-1)  # [b, 2]

        return logits, stats

    return forward


def pair_logps_forward(vocab_size: int, tp_rank: int):
    """Per preference pair: [log pi(y_c|x), log pi(y_r|x), |y_c|, |y_r|] -> [b, 4] (sums over response tokens)."""

    def forward(module, batch):
        ids, labels, mask = pair_batch(batch)  # [2b, s]
        logits = run(module, ids)  # [2b, s, V/tp]

        def per_pair(logits):
            logp = -(token_nll(logits, labels, vocab_size, tp_rank) * mask).sum(-1)  # [2b]
            chosen, rejected = logp.chunk(2)
            tc, tr = mask.sum(-1).chunk(2)
            return torch.stack([chosen, rejected, tc, tr], dim=-1)  # [b, 4]

        return logits, per_pair

    return forward


def attribute_rewards(values: torch.Tensor, loss_mask: torch.Tensor, pooling: str,
                      weights: list[float] | None) -> torch.Tensor:
    """values [n, s, A] -> rewards [n]: output 0's sequence reward (``weights`` None: a one-output model), or
    Σ_a w_a x r_a over the A outputs of a multi-attribute model (one weight per output)."""
    if weights is None:
        return sequence_rewards(values, loss_mask, pooling)
    if len(weights) != values.shape[-1]:
        raise ValueError(f"{len(weights)} attribute weights for a reward model with {values.shape[-1]} outputs")
    per_attr = torch.stack([sequence_rewards(values[..., a : a + 1], loss_mask, pooling)
                            for a in range(values.shape[-1])], dim=-1)  # [n, A]
    return (per_attr * torch.tensor(weights, dtype=per_attr.dtype, device=per_attr.device)).sum(-1)  # [n]


def rewards_forward(pooling: str, attribute_weights: list[float] | None = None):
    """Sequence rewards of a value-head model: [b, 1] for rows, [b, 2] (chosen, rejected) for preference pairs; a
    multi-attribute model's outputs combined with ``attribute_weights`` (:func:`attribute_rewards`)."""

    def forward(module, batch):
        pairs = "chosen_input_ids" in batch
        if pairs:
            ids, _, mask = pair_batch(batch)  # [2b, s]
        else:
            ids, mask = batch["input_ids"], batch["loss_mask"]  # [b, s]
        values = run(module, ids)  # [rows, s, A]

        def stats(values):
            r = attribute_rewards(values, mask, pooling, attribute_weights)  # [rows]
            return torch.stack(r.chunk(2), dim=-1) if pairs else r.unsqueeze(-1)

        return values, stats

    return forward
