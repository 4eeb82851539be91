"""What a stage feeds its model: global batches of tokenized arrays, the RL prompt stream, rollout rows.

* :class:`ArrayBatches` – deterministic, resumable global batches from the tokenized ``.npz`` arrays, sharded over DP.
* :class:`PromptStream` – the prompts of each RL iteration (a pure function of the iteration: the resume cursor).
* :func:`to_rows` / :func:`split_rows` – prompt + response tokens -> padded rows with the loss mask; rows ->
  micro-batches.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from align_pipeline.config.base import ConfigError
from align_pipeline.config.checks import check_batch_split
from align_pipeline.config.common import TrainingConfig
from align_pipeline.data.packing import pack, packed_microbatch
from align_pipeline.data.store import Rows, RowView, load_sequences
from align_pipeline.train.core.distributed import Dist


class ArrayBatches:
    """Global batches over a dict of arrays with equal first dimension.

    Sample ``i`` of the run (``i = step * global_batch_size + j``) is ``perm(epoch)[i % N]`` with ``epoch = i // N``
    and a permutation seeded by ``(seed, epoch)``, so the batch of any step is a pure function of the step: resuming at
    step k replays exactly the data an uninterrupted run would see. Each DP rank takes its contiguous slice of the
    global batch and splits it into micro-batches.
    """

    def __init__(
        self,
        arrays: dict[str, np.ndarray],
        global_batch_size: int,
        micro_batch_size: int,
        dist: Dist,
        seed: int,
        shuffle: bool = True,
    ):
        sizes = {len(v) for v in arrays.values()}
        if len(sizes) != 1:
            raise ValueError(f"arrays have different lengths: { {k: len(v) for k, v in arrays.items()} }")
        check_batch_split(global_batch_size, micro_batch_size, dist.dp_size)
        per_rank = global_batch_size // dist.dp_size
        self.arrays = arrays
        self.n = sizes.pop()
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.per_rank = per_rank
        self.dist = dist
        self.seed = seed
        self.shuffle = shuffle
        self._perms: dict[int, np.ndarray] = {}

    def real_tokens(self, step: int) -> int:
        """Non-padding tokens of global batch ``step`` (all ranks; every sequence of a preference pair); for arrays
        without sample lengths (already padded), the padded count."""
        groups = sequence_groups(self.arrays)
        if not groups:  # the padded layout: every row is seq_length tokens
            ids = self.arrays.get("input_ids", self.arrays.get("chosen_input_ids"))
            return self.global_batch_size * self.rows_per_sample * (ids.shape[1] if ids is not None else 1)
        idx = self.global_indices(step)
        return int(sum(rows.lengths[idx].sum() for rows in groups.values()))

    @property
    def rows_per_sample(self) -> int:
        """Sequences per sample (2 for preference pairs: chosen + rejected)."""
        return 2 if "chosen_input_ids" in self.arrays else 1

    @property
    def num_microbatches(self) -> int:
        return self.per_rank // self.micro_batch_size

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if self.shuffle:
                self._perms[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.n)
            else:
                self._perms[epoch] = np.arange(self.n)
        return self._perms[epoch]

    def global_indices(self, step: int) -> np.ndarray:
        first = step * self.global_batch_size
        idx = np.arange(first, first + self.global_batch_size)
        return np.array([self._perm(int(i // self.n))[i % self.n] for i in idx])

    def microbatches(self, step: int) -> list[dict[str, torch.Tensor]]:
        """This rank's micro-batches of global batch ``step``."""
        idx = self.global_indices(step)
        mine = idx[self.dist.dp_rank * self.per_rank : (self.dist.dp_rank + 1) * self.per_rank]
        return [self._take(mine[i : i + self.micro_batch_size]) for i in range(0, self.per_rank, self.micro_batch_size)]

    def eval_microbatches(self, limit: int | None = None, with_index: bool = False) -> list[dict[str, torch.Tensor]]:
        """The first ``limit`` samples (all by default) in order, split over DP ranks; padded rows get no loss.

        ``with_index`` adds ``index`` [b]: each row's sample index (-1 for padding rows), for per-sample outputs.
        """
        n = min(self.n, limit or self.n)
        chunk = self.dist.dp_size * self.micro_batch_size
        total = int(math.ceil(n / chunk) * chunk)
        idx = np.arange(total)
        valid = idx < n
        idx = np.where(valid, idx, 0)
        per_rank = total // self.dist.dp_size
        sl = slice(self.dist.dp_rank * per_rank, (self.dist.dp_rank + 1) * per_rank)
        mine, mine_valid = idx[sl], valid[sl]
        out = []
        for i in range(0, per_rank, self.micro_batch_size):
            mb = self._take(mine[i : i + self.micro_batch_size])
            keep = torch.from_numpy(mine_valid[i : i + self.micro_batch_size]).to(self.dist.device)
            for k, v in mb.items():
                if k.endswith("loss_mask"):
                    mb[k] = v * keep.unsqueeze(-1).to(v.dtype)
            mb["valid"] = keep
            if with_index:
                idx_mb = torch.from_numpy(mine[i : i + self.micro_batch_size]).to(self.dist.device)
                mb["index"] = torch.where(keep, idx_mb, torch.full_like(idx_mb, -1))
            out.append(mb)
        return out

    def _take(self, idx: np.ndarray) -> dict[str, torch.Tensor]:
        return {k: torch.from_numpy(np.ascontiguousarray(v[idx])).to(self.dist.device) for k, v in self.arrays.items()}


def sequence_groups(arrays) -> dict[str, Rows]:
    """The ragged groups behind an arrays dict's padded views (``{"": rows}`` or ``{"chosen_": .., "rejected_": ..}``),
    found through the views themselves, so a dict that added per-sample arrays (DPO's reference log-probs) keeps them."""
    return {key[: -len("input_ids")]: view.rows for key, view in arrays.items()
            if isinstance(view, RowView) and key.endswith("input_ids")}


class PackedBatches:
    """Global batches of packed rows (:mod:`align_pipeline.data.packing`): each row holds as many samples as fit in
    ``seq_length`` tokens, each sequence attending only to itself; a preference pair's chosen and rejected sequences
    share a row. ``global_batch_size`` / ``micro_batch_size`` count rows.

    Per epoch the samples are shuffled (seeded by ``(seed, epoch)``) and packed in that order, so the rows of any step
    are a pure function of the step (resume replays them). A micro-batch is one packed sequence of
    ``micro_batch_size x seq_length`` tokens with ``cu_seqlens`` / ``position_ids`` (the thd layout), ``sequence``
    (which sequence each token is in) and the micro-batch's samples' per-sample arrays (rewards, labels, reference
    log-probs) in sample order.
    """

    def __init__(self, arrays, global_batch_size: int, micro_batch_size: int, dist: Dist, seed: int):
        groups = sequence_groups(arrays)
        if set(groups) not in ({""}, {"chosen_", "rejected_"}):
            raise ValueError(f"packing needs ragged sequences (one group, or chosen/rejected pairs), got {set(groups)}")
        check_batch_split(global_batch_size, micro_batch_size, dist.dp_size)
        self.groups = [groups[p] for p in sorted(groups)]  # "" | chosen_, rejected_
        self.per_sample = {k: v for k, v in arrays.items() if not isinstance(v, RowView)}
        first = self.groups[0]
        self.seq_length, self.pad_id = first.seq_length, first.pad_id
        self.global_batch_size, self.micro_batch_size, self.dist, self.seed = (global_batch_size, micro_batch_size,
                                                                              dist, seed)
        self.per_rank = global_batch_size // dist.dp_size
        self.rows_per_sample = len(self.groups)
        self._lengths = sum(g.lengths for g in self.groups)  # [N] tokens a sample takes in a row
        self._packs: list[list[int]] = []  # every epoch's rows so far, one after another
        self._epoch_ends: list[int] = []

    def _row(self, k: int) -> list[int]:
        """Row ``k`` of the run (epochs are packed one after another, as they are reached)."""
        while k >= len(self._packs):
            epoch = len(self._epoch_ends)
            order = np.random.default_rng([self.seed, epoch]).permutation(len(self._lengths))
            self._packs += pack(self._lengths, order, self.seq_length)
            self._epoch_ends.append(len(self._packs))
        return self._packs[k]

    def _step_rows(self, step: int) -> list[list[int]]:
        first = step * self.global_batch_size
        return [self._row(k) for k in range(first, first + self.global_batch_size)]

    def microbatches(self, step: int) -> list[dict[str, torch.Tensor]]:
        """This rank's micro-batches of global batch ``step``: each one packed sequence [1, mbs x seq_length]."""
        rows = self._step_rows(step)
        mine = rows[self.dist.dp_rank * self.per_rank : (self.dist.dp_rank + 1) * self.per_rank]
        return [self._microbatch(mine[i : i + self.micro_batch_size]) for i in range(0, self.per_rank,
                                                                                  self.micro_batch_size)]

    def _microbatch(self, packs: list[list[int]]) -> dict[str, torch.Tensor]:
        mb = packed_microbatch(self.groups, packs, self.seq_length, self.pad_id)
        idx = mb["sample_index"]
        mb.update({k: np.ascontiguousarray(np.asarray(v)[idx]) for k, v in self.per_sample.items()})
        return {k: torch.from_numpy(v).to(self.dist.device) for k, v in mb.items()}

    def real_tokens(self, step: int) -> int:
        """Non-padding tokens of global batch ``step`` (all ranks)."""
        return int(sum(self._lengths[i] for row in self._step_rows(step) for i in row))


def load_split_batches(train_path: str, val_path: str, cfg: TrainingConfig, dist: Dist,
                       extra=None, packing: bool = False) -> tuple[ArrayBatches | PackedBatches, ArrayBatches]:
    """Train (shuffled) and validation (in order) batches of two tokenized .npz files (memory-mapped, see
    :mod:`align_pipeline.data.store`), sized by ``cfg``.

    ``extra(arrays, split)`` may add per-sample arrays (e.g. the cached reference log-probs of DPO). ``packing``: the
    train batches are packed rows (:class:`PackedBatches`); validation stays padded (same loss, see the tests)."""
    out = []
    for split, path in (("train", train_path), ("val", val_path)):
        arrays = load_sequences(path)  # memory-mapped; rows are padded (or packed) per batch
        if extra is not None:
            arrays = extra(arrays, split)
        if packing and split == "train":
            if dist.pp_size > 1:
                raise ConfigError("packing needs pipeline_model_parallel_size 1 (packed rows are not pipelined)")
            out.append(PackedBatches(arrays, cfg.global_batch_size, cfg.micro_batch_size, dist, seed=cfg.seed))
        else:
            out.append(ArrayBatches(arrays, cfg.global_batch_size, cfg.micro_batch_size, dist, seed=cfg.seed,
                                    shuffle=split == "train"))
    return out[0], out[1]


class PromptStream:
    """``per_iteration`` prompts per iteration over all DP ranks, in a seeded order that reshuffles every epoch.

    The prompts of iteration ``i`` are a pure function of ``i`` (the same scheme as :class:`ArrayBatches`), so the
    prompt cursor of a resumed run is just its iteration number.
    """

    def __init__(self, records: list[dict], per_iteration: int, dist: Dist, seed: int):
        if not records:
            raise ValueError("no prompts")
        if per_iteration % dist.dp_size:
            raise ValueError(f"prompts_per_iteration {per_iteration} must split over DP={dist.dp_size} ranks")
        self.records = records
        self.per_iteration = per_iteration
        self.seed, self.dp_rank, self.dp_size = seed, dist.dp_rank, dist.dp_size
        self._batches = ArrayBatches({"index": np.arange(len(records))}, per_iteration, per_iteration // dist.dp_size,
                                     dist, seed=seed, shuffle=True)

    def local(self, iteration: int) -> list[dict]:
        """This DP rank's prompt records of ``iteration``."""
        (mb,) = self._batches.microbatches(iteration)
        return [self.records[i] for i in mb["index"].tolist()]

    def consumed(self, iteration: int) -> int:
        """Prompts drawn before ``iteration`` (the cursor)."""
        return iteration * self.per_iteration

    def extra(self, iteration: int, round_: int) -> list[dict]:
        """This DP rank's prompt records of round ``round_`` >= 1 of ``iteration`` (dynamic sampling: as many as
        :meth:`local`, drawn without replacement from all the prompts by a seeded draw of (seed, iteration, round),
        outside the epoch order: the cursor does not move)."""
        local = self.per_iteration // self.dp_size
        order = np.random.default_rng([self.seed, iteration, round_, 1]).permutation(len(self.records))
        if len(order) < self.per_iteration:  # fewer prompts than one iteration takes: some come twice
            order = np.resize(order, self.per_iteration)
        return [self.records[i] for i in order[self.dp_rank * local : (self.dp_rank + 1) * local].tolist()]


def to_rows(prompt_ids: list[list[int]], responses: list[list[int]], seq_length: int, pad_id: int,
            logprobs: list[list[float]] | None = None, masks: list[list[bool]] | None = None) -> dict:
    """prompt + response token lists -> right-padded input_ids/labels/loss_mask [n, s] numpy arrays (+ with
    ``logprobs``, one per response token, ``rollout_logp`` [n, s] float32 at the same positions, 0 elsewhere).

    ``loss_mask[i, t] = 1`` when label t (= token t+1) is a response token, so per-token tensors of the RL math
    ([n, s], position t = the action y_{t+1} taken in state ids[:t+1]) line up with the model's outputs at input
    position t. ``masks`` (one flag per response token): which response tokens are the policy's (a multi-turn
    episode's environment turns are not); all of them when None.
    """
    n = len(prompt_ids)
    ids = np.full((n, seq_length), pad_id, dtype=np.int64)
    mask = np.zeros((n, seq_length), dtype=np.float32)
    engine = np.zeros((n, seq_length), dtype=np.float32) if logprobs is not None else None
    for i, (p, r) in enumerate(zip(prompt_ids, responses)):
        seq = (p + r)[:seq_length]
        ids[i, : len(seq)] = seq
        mask[i, len(p) - 1 : len(seq) - 1] = 1.0 if masks is None else masks[i][: len(seq) - len(p)]  # label t = token t+1
        if engine is not None:
            kept = len(seq) - len(p)  # response tokens that fit
            engine[i, len(p) - 1 : len(seq) - 1] = logprobs[i][:kept]
    labels = np.full_like(ids, pad_id)
    labels[:, :-1] = ids[:, 1:]
    rows = {"input_ids": ids, "labels": labels, "loss_mask": mask}
    if engine is not None:
        rows["rollout_logp"] = engine
    return rows


TRIM_MULTIPLE = 128
"""A micro-batch of rollout rows is cut to the columns its rows use, rounded up to a multiple of this (few distinct
shapes for the attention and GEMM kernels)."""


def row_ends(rows: dict[str, torch.Tensor]) -> torch.Tensor:
    """[n] the columns each rollout row uses: through its last response token (``loss_mask``), or all of them for a
    row without one."""
    mask = rows["loss_mask"] != 0  # [n, S]
    width = mask.shape[1]
    columns = torch.arange(width, device=mask.device)
    return torch.where(mask.any(-1), (columns * mask).amax(-1) + 2, width).clamp(max=width)


def split_rows(rows: dict[str, torch.Tensor], micro_batch_size: int, order: torch.Tensor | None = None
               ) -> tuple[list[dict], torch.Tensor]:
    """Rollout row dict [n, ...] -> (micro-batches of ``micro_batch_size`` rows, the row order they hold).

    The rows are ``order`` (default: all, in order); when the rows are at least :data:`TRIM_MULTIPLE` columns wide,
    they are sorted by the columns they use first (stable), so that rows of like lengths share a micro-batch. Each
    micro-batch is cut to the columns its rows use: right padding past its longest row, rounded up to a multiple of
    :data:`TRIM_MULTIPLE`, is dropped from every per-token tensor ([n, S]). Causal attention makes the kept columns'
    outputs those of the full row; long rollouts of varied lengths no longer pay the forward and backward of every
    row's padding up to ``seq_length``. The micro-batches of one optimizer step hold the same rows whatever their
    grouping (the gradient is their sum)."""
    first = rows["input_ids"]
    n, width = first.shape
    idx = order if order is not None else torch.arange(n, device=first.device)
    ends = row_ends(rows)  # [n]
    if width >= TRIM_MULTIPLE:
        idx = idx[torch.argsort(ends[idx], stable=True)]
    ends_host, idx_host = ends.tolist(), idx.tolist()  # (one wait for the device)
    out = []
    for i in range(0, len(idx), micro_batch_size):
        part = idx[i : i + micro_batch_size]
        used = max(ends_host[j] for j in idx_host[i : i + micro_batch_size])
        keep = min(width, -(-used // TRIM_MULTIPLE) * TRIM_MULTIPLE)
        out.append({k: (v[part, :keep] if v.dim() >= 2 and v.shape[1] == width else v[part]) for k, v in rows.items()})
    return out, idx
