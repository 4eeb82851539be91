"""Pieces of the training loop shared by the stage scripts (each stage script stays short and readable).

* :class:`ArrayBatches` – deterministic, resumable global batches from the tokenized ``.npz`` arrays, sharded over DP.
* :func:`build_model_and_optimizer` – GPT stage + Megatron DDP + Megatron optimizer (AdamW) + warmup/cosine schedule.
* :func:`run_microbatches` – one forward(/backward) over a list of micro-batches through Megatron's pipeline schedule,
  returning metrics reduced over micro-batches and data-parallel ranks.
* :class:`Progress` – the progress line rank 0 prints (step, loss, lr, tokens/s, ETA).
"""

from __future__ import annotations

import functools
import math
import sys
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as tdist
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func

from align_pipeline.config import ParallelConfig, TrainingConfig
from align_pipeline.losses.base import LossOutput
from align_pipeline.model.init import ModelSource, build_model
from align_pipeline.train.distributed import Dist

COUNT_KEY = "_count"


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
        per_rank = global_batch_size // dist.dp_size
        if global_batch_size % dist.dp_size or per_rank % micro_batch_size:
            raise ValueError(
                f"global_batch_size {global_batch_size} must split into DP={dist.dp_size} ranks x "
                f"micro-batches of {micro_batch_size}"
            )
        self.arrays = arrays
        self.n = sizes.pop()
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.per_rank = per_rank
        self.dist = dist
        self.seed = seed
        self.shuffle = shuffle
        self._perms: dict[int, np.ndarray] = {}

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


def position_ids_like(input_ids: torch.Tensor) -> torch.Tensor:
    """[b, s] positions 0..s-1 (right padding: real tokens always start at 0)."""
    b, s = input_ids.shape
    return torch.arange(s, device=input_ids.device).unsqueeze(0).expand(b, s)


def build_model_and_optimizer(
    source: ModelSource,
    parallel: ParallelConfig,
    training: TrainingConfig,
    dist: Dist,
    head: str = "lm",
    num_outputs: int = 1,
):
    """GPT stage wrapped in Megatron DDP, its Megatron optimizer (AdamW; distributed when configured) and LR schedule.

    The source weights are loaded into the bare model before the optimizer is built, so fp32 main weights copy the
    loaded values (bf16).
    """
    gpt = build_model(source, parallel, dist, head=head, num_outputs=num_outputs)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=parallel.use_distributed_optimizer,
    )
    model = DistributedDataParallel(config=gpt.config, ddp_config=ddp_config, module=gpt)
    gpt.config.finalize_model_grads_func = finalize_model_grads
    gpt.config.no_sync_func = model.no_sync
    opt = training.optimizer
    optimizer = get_megatron_optimizer(
        MegatronOptimizerConfig(
            optimizer="adam",
            lr=opt.lr,
            min_lr=opt.min_lr,
            weight_decay=opt.weight_decay,
            adam_beta1=opt.adam_beta1,
            adam_beta2=opt.adam_beta2,
            adam_eps=opt.adam_eps,
            clip_grad=opt.clip_grad,
            bf16=parallel.bf16,
            params_dtype=torch.bfloat16 if parallel.bf16 else torch.float32,
            use_distributed_optimizer=parallel.use_distributed_optimizer,
        ),
        [model],
    )
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=opt.lr,
        min_lr=opt.min_lr,
        lr_warmup_steps=min(opt.warmup_steps, max(training.train_steps - 1, 0)),
        lr_decay_steps=training.train_steps,
        lr_decay_style="cosine",
        start_wd=opt.weight_decay,
        end_wd=opt.weight_decay,
        wd_incr_steps=training.train_steps,
        wd_incr_style="constant",
    )
    return model, optimizer, scheduler


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
    DP rank, plus ``count`` (the total count); only gradients' normalisation is left to Megatron.
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
    names = list(metric_names) + [COUNT_KEY]
    sums = torch.zeros(len(names), dtype=torch.float64, device=dist.device)
    if dist.is_last_stage and dist.tp_rank == 0:
        for report in store:
            for i, name in enumerate(names):
                sums[i] += report[name].double()
    tdist.all_reduce(sums)
    count = sums[-1].item()
    out = {name: (sums[i].item() / count if count > 0 else float("nan")) for i, name in enumerate(metric_names)}
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


def collect_per_sample(model, microbatches: list[dict[str, torch.Tensor]], forward, dist: Dist) -> torch.Tensor | None:
    """Forward-only pass returning per-sample values.

    ``forward(module, batch)`` returns ``(output, per_sample_fn)`` where ``per_sample_fn(output)`` gives [b, k] on the
    last pipeline stage. Returns the rows of all micro-batches concatenated ([sum b, k]) on the last stage, else None.
    """

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
    return torch.cat([r["v"] for r in store])


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


def optimizer_step(model, optimizer, scheduler) -> tuple[bool, float]:
    """Step the optimizer and the schedule; returns (update applied, grad norm)."""
    ok, grad_norm, _ = optimizer.step()
    if ok:
        scheduler.step(increment=1)
    return bool(ok), float(grad_norm) if grad_norm is not None else float("nan")


def zero_grads(model, optimizer) -> None:
    model.zero_grad_buffer()
    optimizer.zero_grad()


def peak_memory_gib() -> float | None:
    """This rank's peak allocated accelerator memory in GiB (None on CPU)."""
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None


def current_lr(optimizer) -> float:
    return float(optimizer.param_groups[0]["lr"])


class Progress:
    """Rank-0 progress line: ``step 20/300 | loss 1.2340 | lr 1.0e-03 | gnorm 0.52 | 5321 tok/s | eta 0:01:02``."""

    def __init__(self, total_steps: int, start_step: int, enabled: bool):
        self.total = total_steps
        self.start_step = start_step
        self.enabled = enabled
        self.t0 = time.perf_counter()
        self.tokens = 0

    def add_tokens(self, n: int) -> None:
        self.tokens += n

    def tokens_per_s(self) -> float:
        return self.tokens / max(time.perf_counter() - self.t0, 1e-9)

    def eta_s(self, step: int) -> float:
        done = step - self.start_step
        elapsed = time.perf_counter() - self.t0
        return elapsed / max(done, 1) * (self.total - step)

    def line(self, step: int, metrics: dict[str, float]) -> str:
        parts = [f"step {step}/{self.total}"]
        for key, fmt in (("loss", "{:.4f}"), ("val_loss", "{:.4f}"), ("lr", "{:.1e}"), ("grad_norm", "{:.2f}")):
            if key in metrics:
                parts.append(f"{key.replace('grad_norm', 'gnorm')} {fmt.format(metrics[key])}")
        parts.append(f"{self.tokens_per_s():.0f} tok/s")
        eta = int(self.eta_s(step))
        parts.append(f"eta {eta // 3600}:{eta % 3600 // 60:02d}:{eta % 60:02d}")
        return " | ".join(parts)

    def print(self, step: int, metrics: dict[str, float]) -> None:
        if self.enabled:
            print(self.line(step, metrics), flush=True)


def log(dist: Dist, msg: str) -> None:
    """Print on rank 0 only."""
    if dist.is_logging_rank:
        print(msg, file=sys.stdout, flush=True)


def cli(job_cls, main, doc: str | None) -> None:
    """``--config <json>`` -> ``main(from_dict(job_cls, json))``: the command line of every entry point."""
    import argparse
    import json
    from pathlib import Path

    from align_pipeline.config import from_dict

    parser = argparse.ArgumentParser(description=(doc or "").strip().splitlines()[0] if doc else None)
    parser.add_argument("--config", required=True, help=f"{job_cls.__name__} as JSON")
    args = parser.parse_args()
    main(from_dict(job_cls, json.loads(Path(args.config).read_text())))
