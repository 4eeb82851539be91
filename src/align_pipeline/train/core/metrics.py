"""Metrics of a training iteration: statistics reduced over the data-parallel ranks in one all-reduce, timed phases,
per-step metrics averaged, throughput."""

from __future__ import annotations

import contextlib
import time

import numpy as np
import torch
import torch.distributed as tdist

from align_pipeline.train.core.distributed import Dist


class DPStats:
    """Accumulate sums of (value, count) pairs on each DP rank and reduce them in one all-reduce.

    ``add(name, values, mask)`` records Σ v, Σ v² and the count; :meth:`reduce` returns ``name_mean`` /
    ``name_std`` (or just ``name`` with ``std=False``, or the sum Σ v with ``total=True``) over every DP rank's rows;
    ``add_max`` records a maximum (its own all-reduce). Entries outside ``mask`` never reach the sums (they may be NaN).
    """

    def __init__(self, dist: Dist):
        self.dist = dist
        self._entries: list[tuple[str, str, torch.Tensor]] = []
        self._maxima: list[tuple[str, torch.Tensor]] = []
        self._quantiles: list[tuple[str, torch.Tensor, dict[str, float]]] = []

    def add_quantiles(self, name: str, values: torch.Tensor, quantiles: dict[str, float]) -> None:
        """``<name>/<key>`` = the ``q`` quantile of ``values`` over every DP rank (gathered: for small [n] tensors such
        as response lengths), for each ``key: q`` of ``quantiles``."""
        self._quantiles.append((name, values.detach().double().flatten(), quantiles))

    def add_max(self, name: str, values: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """``name`` = the largest value inside ``mask`` over every DP rank (NaN when there is none)."""
        v = values.detach().double()
        inside = torch.ones_like(v, dtype=torch.bool) if mask is None else mask.detach() != 0
        self._maxima.append((name, torch.where(inside, v, float("-inf")).max() if v.numel() else
                             torch.tensor(float("-inf"), dtype=torch.float64, device=v.device)))

    def add(self, name: str, values: torch.Tensor, mask: torch.Tensor | None = None, std: bool = True,
            total: bool = False) -> None:
        v = values.detach().double()
        m = torch.ones_like(v) if mask is None else mask.detach().double()
        v = torch.where(m != 0, v, 0.0)  # a NaN outside the mask stays out of the sums
        kind = "total" if total else "mean_std" if std else "mean"
        self._entries.append((name, kind, torch.stack([(v * m).sum(), (v * v * m).sum(), m.sum()])))

    def _gathered(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` of every DP rank, concatenated (ranks may hold different counts)."""
        group = self.dist.pgs.dp
        size = tdist.get_world_size(group)
        values = values.to(self.dist.device)
        if size == 1:
            return values
        counts = [torch.zeros(1, dtype=torch.int64, device=self.dist.device) for _ in range(size)]
        tdist.all_gather(counts, torch.tensor([values.numel()], device=self.dist.device), group=group)
        longest = int(max(c.item() for c in counts))
        padded = torch.zeros(longest, dtype=values.dtype, device=self.dist.device)
        padded[: values.numel()] = values
        parts = [torch.empty_like(padded) for _ in range(size)]
        tdist.all_gather(parts, padded, group=group)
        return torch.cat([p[: int(c.item())] for p, c in zip(parts, counts)])

    def reduce(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, values, quantiles in self._quantiles:
            every = self._gathered(values)
            for key, q in quantiles.items():
                out[f"{name}/{key}"] = float(torch.quantile(every, q)) if every.numel() else float("nan")
        if self._maxima:
            maxima = torch.stack([x for _, x in self._maxima]).to(self.dist.device)  # [k]
            tdist.all_reduce(maxima, op=tdist.ReduceOp.MAX, group=self.dist.pgs.dp)
            out.update({name: (x if x != float("-inf") else float("nan"))
                        for (name, _), x in zip(self._maxima, maxima.tolist())})
        if not self._entries:
            return out
        stacked = torch.stack([e[2] for e in self._entries]).to(self.dist.device)  # [k, 3]
        tdist.all_reduce(stacked, group=self.dist.pgs.dp)
        for (name, kind, _), (s, s2, c) in zip(self._entries, stacked.tolist()):
            mean = s / c if c else float("nan")
            if kind == "total":
                out[name] = s
            elif kind == "mean_std":
                out[f"{name}_mean"] = mean
                out[f"{name}_std"] = float(np.sqrt(max(s2 / c - mean * mean, 0.0))) if c else float("nan")
            else:
                out[name] = mean
        return out


class Timings(dict):
    """``with timings("timing/generate_s"): ...`` records the block's wall time (added up over the blocks of one
    key), with a device synchronisation on both sides so GPU work is counted where it happens."""

    @contextlib.contextmanager
    def __call__(self, key: str):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        yield
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self[key] = self.get(key, 0.0) + time.perf_counter() - t0


def mean_metrics(steps: list[dict[str, float]], prefix: str) -> dict[str, float]:
    """Average per-step metrics of one iteration, keys prefixed (``train/policy_loss``, ``critic/grad_norm``)."""
    return {f"{prefix}/{k}": float(np.mean([s[k] for s in steps])) for k in steps[0]}


def throughput(r, timings: dict[str, float], trained_rows: int, seq_length: int, dist: Dist
               ) -> dict[str, float]:
    """Generated tokens/s and trained tokens/s of an iteration, over all DP ranks."""
    generated = torch.tensor([float(r.rows["loss_mask"].sum())], dtype=torch.float64, device=dist.device)
    tdist.all_reduce(generated, group=dist.pgs.dp)
    return {"throughput/generated_tokens_per_s": generated.item() / max(timings["timing/generate_s"], 1e-9),
            "throughput/train_tokens_per_s": trained_rows * dist.dp_size * seq_length
            / max(timings["timing/train_s"], 1e-9)}
