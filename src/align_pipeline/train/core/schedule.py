"""Megatron's pipeline schedule, called the way every stage needs it.

* :func:`run_microbatches` – forward(/backward) over micro-batches, metrics reduced over micro-batches and DP ranks.
* :func:`forward_rows` / :func:`per_sample` – forward-only passes returning per-row values (log-probs, values,
  rewards) for this rank's rows, or for a whole array split over DP and gathered back in order.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as tdist
import torch.nn.functional as F
from megatron.core.pipeline_parallel import get_forward_backward_func

from align_pipeline.losses.base import LossOutput
from align_pipeline.model import memory
from align_pipeline.train.core.batches import ArrayBatches, split_rows
from align_pipeline.train.core.distributed import Dist

COUNT_KEY = "_count"
TOKENS_KEY = "_tokens"
"""A loss may report the count its *metrics* are sums over (``metrics["_tokens"]``) when its gradient's count is
another one (a sequence-level loss aggregation: count = sequences, metrics per token); absent, it is the count."""

ForwardLoss = Callable[[torch.nn.Module, dict[str, torch.Tensor]], tuple[torch.Tensor, Callable[[torch.Tensor], LossOutput]]]


def run_microbatches(
    model,
    microbatches: list[dict[str, torch.Tensor]],
    forward_loss: ForwardLoss,
    metric_names: list[str],
    dist: Dist,
    seq_length: int,
    forward_only: bool,
) -> dict[str, float]:
    """Forward (and backward unless ``forward_only``) over ``microbatches`` via Megatron's schedule.

    ``forward_loss(module, batch)`` returns ``(output_tensor, loss_fn)`` where ``loss_fn(output_tensor)`` is a loss
    from ``align_pipeline.losses`` (sum, count, metric sums). Returns ``{name: sum/count}`` over every micro-batch and
    DP rank (over the metrics' own count, :data:`TOKENS_KEY`, where the loss gives one), plus ``count`` (the total
    count); only gradients' normalisation (by the total count) is left to Megatron.
    """

    def forward_step(data_iterator, module):
        batch = next(data_iterator)
        output, loss_fn = forward_loss(module, batch)
        return output, functools.partial(_with_count, loss_fn)

    _, rows = model_input_shape(microbatches[0])
    store = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(microbatches),
        model=[model],
        num_microbatches=len(microbatches),
        seq_length=seq_length,
        micro_batch_size=rows,
        forward_only=forward_only,
    )
    names = list(metric_names) + [COUNT_KEY, TOKENS_KEY]
    sums = torch.zeros(len(names), dtype=torch.float64, device=dist.device)
    if dist.is_last_stage and dist.tp_rank == 0:
        for report in store:
            for i, name in enumerate(names):
                value = report.get(TOKENS_KEY, report[COUNT_KEY]) if name == TOKENS_KEY else report[name]
                sums[i] += value.double()
    tdist.all_reduce(sums)
    count, tokens = sums[-2].item(), sums[-1].item()
    out = {name: (sums[i].item() / tokens if tokens > 0 else float("nan")) for i, name in enumerate(metric_names)}
    out["count"] = count
    return out


def model_input_shape(batch: dict[str, torch.Tensor]) -> tuple[int, int]:
    """(sequence length, rows) of what the model sees for a micro-batch: preference pairs are stacked chosen over
    rejected, so a micro-batch of b pairs is 2b rows (the pipeline schedule sizes its p2p buffers from this)."""
    if "chosen_input_ids" in batch:
        b, s = batch["chosen_input_ids"].shape
        return s, 2 * b
    b, s = batch["input_ids"].shape
    return s, b


def collect_per_sample(model, microbatches: list[dict[str, torch.Tensor]], forward, dist: Dist,
                       width: int | None = None) -> torch.Tensor | None:
    """Forward-only pass returning per-sample values.

    ``forward(module, batch)`` returns ``(output, per_sample_fn)`` where ``per_sample_fn(output)`` gives [b, k] on the
    last pipeline stage. Returns the rows of all micro-batches concatenated ([sum b, k]) on the last stage, else None.
    ``width``: per-token values of micro-batches cut to fewer columns (:func:`split_rows`) are padded with zeros
    back to ``width`` columns where ``k`` is the micro-batch's column count."""

    def forward_step(data_iterator, module):
        batch = next(data_iterator)
        output, per_sample_fn = forward(module, batch)

        def loss_fn(output_tensor):
            values = per_sample_fn(output_tensor).detach()
            return output_tensor.sum() * 0.0, torch.tensor(1, dtype=torch.int, device=values.device), {"v": values}

        return output, loss_fn

    seq_length, rows = model_input_shape(microbatches[0])
    store = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(microbatches), model=[model],
        num_microbatches=len(microbatches), seq_length=seq_length, micro_batch_size=rows, forward_only=True,
    )
    if not dist.is_last_stage:
        return None
    values = [r["v"] for r in store]
    if width is not None:
        columns = [model_input_shape(mb)[0] for mb in microbatches]
        values = [F.pad(v, (0, width - c)) if v.dim() == 2 and v.shape[1] == c < width else v
                  for v, c in zip(values, columns)]
    return torch.cat(values)


def gather_by_index(values: torch.Tensor | None, microbatches: list[dict[str, torch.Tensor]], n: int,
                    dist: Dist) -> torch.Tensor:
    """Scatter per-sample rows to their sample index and sum over all ranks: [n, k] on every rank.

    Only tensor-parallel rank 0 of the last stage contributes (the values are replicated across TP).
    """
    index = torch.cat([mb["index"] for mb in microbatches])  # [rows]
    k = values.shape[-1] if values is not None else 0
    k_t = torch.tensor([k], device=dist.device)
    tdist.all_reduce(k_t, op=tdist.ReduceOp.MAX)
    out = torch.zeros(n, int(k_t.item()), dtype=torch.float64, device=dist.device)
    if values is not None and dist.tp_rank == 0:
        keep = index >= 0
        out[index[keep]] = values[keep].double()
    tdist.all_reduce(out)
    return out


def _with_count(loss_fn, output_tensor):
    loss_sum, count, metrics = loss_fn(output_tensor)
    report = {k: v.detach().float() for k, v in metrics.items()}
    report[COUNT_KEY] = count.detach().float()
    return loss_sum, count, report


def forward_rows(model, rows: dict[str, torch.Tensor], forward, micro_batch_size: int, dist: Dist) -> torch.Tensor:
    """Forward-only over this rank's ``rows`` (no pipeline parallelism): ``forward`` from
    :mod:`align_pipeline.model.sequences`; returns the per-row values [n, ...] in row order."""
    microbatches, order = split_rows(rows, micro_batch_size)
    with torch.no_grad():
        values = collect_per_sample(model, microbatches, forward, dist, width=rows["input_ids"].shape[1])
    if values is None:
        raise RuntimeError("forward_rows needs pipeline_model_parallel_size 1")
    out = torch.empty_like(values)
    out[order] = values  # back to row order (split_rows may group rows by length)
    return out


def per_sample(model, arrays: dict, forward, micro_batch_size: int, dist: Dist) -> np.ndarray:
    """Per-sample values [n, k] of ``arrays`` (every rank holds all of them; DP ranks split the work), on every
    rank, in sample order."""
    n = len(next(iter(arrays.values())))
    batches = ArrayBatches(arrays, micro_batch_size * dist.dp_size, micro_batch_size, dist, seed=0,
                           shuffle=False).eval_microbatches(with_index=True)
    with torch.no_grad():
        values = collect_per_sample(model, batches, forward, dist)
    return gather_by_index(values, batches, n, dist).cpu().numpy()


def evaluate_loss(model, val: ArrayBatches, forward_loss: ForwardLoss, metric_names: list[str], loss_metric: str,
                  limit: int | None, dist: Dist, seq_length: int) -> dict[str, float]:
    """A validation pass over the first ``limit`` samples of ``val``: ``val_loss`` (= ``loss_metric``) and
    ``val_<metric>`` for the others. Without autograd: Megatron's forward-only schedule does not turn it off, and the
    graph it would record held 1.5x a training step's activation memory (1.19B model on an H200: 56 vs 39 GiB)."""
    model.eval()
    with memory.phase("eval"), torch.no_grad():
        m = run_microbatches(model, val.eval_microbatches(limit), forward_loss, metric_names, dist, seq_length,
                             forward_only=True)
    model.train()
    return {"val_loss": m[loss_metric], **{f"val_{k}": v for k, v in m.items() if k not in (loss_metric, "count")}}
