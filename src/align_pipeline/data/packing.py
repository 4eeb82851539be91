"""Sequence packing: several samples in one row of ``seq_length`` tokens, each attending only to itself.

:func:`pack` assigns samples to rows (first fit over a window of open rows, in the given order, so a row's samples
come from nearby in the shuffled stream). :func:`packed_microbatch` lays rows out the way Megatron's packed ("thd")
path takes them: the rows of a micro-batch concatenated into one sequence of ``rows x seq_length`` tokens, with

* ``cu_seqlens`` int32 [segments + 1]: where each sample starts (the padding at the end of a row is its own segment);
* ``position_ids`` [1, T]: restarting at 0 for every sample;
* ``labels`` / ``loss_mask`` [1, T]: shifted *within* each sample; a sample's last token has no label, so no sample
  learns from another's first token.

Megatron applies RoPE per segment (positions restart) and hands ``cu_seqlens`` to the core attention
(:mod:`align_pipeline.model.attention`), which restricts attention to each segment.

    rows = pack(lengths, order, seq_length)                     # [[i, j, ...], ...] sample indices per row
    mb = packed_microbatch([store_rows], rows[:4], seq_length, pad_id)      # pairs: [chosen_rows, rejected_rows]

A preference pair's chosen and rejected sequences share a row (``lengths`` = their sum), so per-sequence sums and
pools (``sequence``) give the same [2k] chosen-then-rejected layout as stacked padded pairs.
"""

from __future__ import annotations

import numpy as np

WINDOW = 64
"""Open rows a sample may go into (first fit); older rows are closed. Larger packs denser, slower."""


def pack(lengths: np.ndarray, order: np.ndarray, seq_length: int, window: int = WINDOW) -> list[list[int]]:
    """Sample indices per row: samples taken in ``order``, each into the first open row with room (of the last
    ``window`` opened), else a new row. Deterministic; every sample appears once."""
    rows: list[list[int]] = []
    room: list[int] = []  # free tokens of each row
    first_open = 0
    for i in order:
        n = int(lengths[i])
        if n > seq_length:
            raise ValueError(f"sample {i} has {n} tokens > seq_length {seq_length}")
        for r in range(first_open, len(rows)):
            if room[r] >= n:
                rows[r].append(int(i))
                room[r] -= n
                break
        else:
            rows.append([int(i)])
            room.append(seq_length - n)
            first_open = max(first_open, len(rows) - window)
    return rows


def packed_microbatch(groups, packs: list[list[int]], seq_length: int, pad_id: int) -> dict[str, np.ndarray]:
    """``packs`` (sample indices per row) -> one packed micro-batch. ``groups``: the
    :class:`~align_pipeline.data.store.Rows` of a sample's sequences: one (SFT, regression) or two (a preference
    pair: chosen, rejected, placed next to each other in the same row).

    Returns ``input_ids``, ``labels``, ``position_ids`` int64 [1, T], ``loss_mask`` float32 [1, T] (T = len(packs) x
    seq_length), ``cu_seqlens`` int32 [segments + 1], ``max_seqlen`` int64 [1], ``num_tokens`` int64 [1] (real,
    non-padding tokens), ``sample_index`` int64 [k] (the k samples, in order), ``num_sequences`` [1] (k x groups) and
    ``sequence`` int64 [1, T]: the
    sequence each token belongs to, -1 on padding; sequence ``g x k + j`` = group g of the micro-batch's j-th sample
    (pairs: chosen 0..k-1, then rejected k..2k-1 – the order of stacked padded pairs)."""
    T = len(packs) * seq_length
    k = sum(len(p) for p in packs)
    input_ids = np.full(T, pad_id, dtype=np.int64)
    labels = np.full(T, pad_id, dtype=np.int64)
    loss_mask = np.zeros(T, dtype=np.float32)
    position_ids = np.zeros(T, dtype=np.int64)
    sequence = np.full(T, -1, dtype=np.int64)
    cu, longest, real, order = [0], 1, 0, []
    for r, samples in enumerate(packs):
        at = r * seq_length
        for i in samples:
            j = len(order)
            order.append(int(i))
            for g, rows in enumerate(groups):
                ids, resp = rows.sample(int(i))
                L = len(ids)
                if at + L > (r + 1) * seq_length:
                    raise ValueError(f"row {r} overflows seq_length {seq_length}: the packs do not fit")
                input_ids[at : at + L] = ids
                labels[at : at + L - 1] = ids[1:]
                loss_mask[at : at + L - 1] = resp[1:]
                position_ids[at : at + L] = np.arange(L)
                sequence[at : at + L] = g * k + j
                at += L
                cu.append(at)
                longest, real = max(longest, L), real + L
        end = (r + 1) * seq_length
        if at < end:  # the row's padding: a segment of its own
            position_ids[at:end] = np.arange(end - at)
            cu.append(end)
            longest = max(longest, end - at)
    return {"input_ids": input_ids[None], "labels": labels[None], "loss_mask": loss_mask[None],
            "position_ids": position_ids[None], "cu_seqlens": np.asarray(cu, dtype=np.int32),
            "max_seqlen": np.array([longest], dtype=np.int64), "num_tokens": np.array([real], dtype=np.int64),
            "sample_index": np.asarray(order, dtype=np.int64), "sequence": sequence[None],
            "num_sequences": np.array([k * len(groups)], dtype=np.int64)}


__all__ = ["WINDOW", "pack", "packed_microbatch"]
