"""Models a stage trains or only runs: the GPT stage in Megatron DDP with its Megatron optimizer (AdamW) and
warmup + cosine schedule, frozen models, and one optimizer step over a list of micro-batches."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from align_pipeline.config.common import LoRAConfig, OptimizerConfig, ParallelConfig
from align_pipeline.model import kernels, memory
from align_pipeline.model.init import ModelSource, build_model
from align_pipeline.train.core import profiling
from align_pipeline.train.core.distributed import Dist
from align_pipeline.train.core.progress import log
from align_pipeline.train.core.schedule import ForwardLoss, run_microbatches


@dataclasses.dataclass
class Trainable:
    """A model the stage trains, with its optimizer and schedule."""

    source: ModelSource
    """Where its weights came from (architecture, vocab, lineage)."""
    model: Any
    """The GPT stage wrapped in Megatron DDP."""
    optimizer: Any
    """Megatron's optimizer (AdamW; distributed when configured)."""
    scheduler: Any
    """Megatron's LR/WD schedule."""
    head: str = "lm"
    """"lm" (vocab logits) or "value" (reward model, critic)."""
    num_outputs: int = 1
    """Outputs of a value head."""
    lora: LoRAConfig | None = None
    """Its adapters (None or rank 0: full fine-tuning)."""
    router_stats: Any = None
    """An MoE model's :class:`~align_pipeline.model.moe.RouterStats` (None: dense)."""


def build_trainable(source: ModelSource, parallel: ParallelConfig, opt: OptimizerConfig, total_steps: int,
                    dist: Dist, head: str = "lm", num_outputs: int = 1, lora: LoRAConfig | None = None) -> Trainable:
    """The model of ``source`` (weights loaded into the bare model first, so fp32 main weights copy them), wrapped in
    Megatron DDP, with AdamW and a schedule over ``total_steps`` optimizer steps. ``lora`` (rank > 0): adapters on
    its linears and only they train (with a value head: the head too); DDP and the optimizer hold only those."""
    gpt = build_model(source, parallel, dist, head=head, num_outputs=num_outputs, lora=lora)
    if lora is not None and lora.rank:
        from align_pipeline.model.lora import freeze_base

        trainable = freeze_base(gpt, keep=("output_layer.",) if head == "value" else ())
        total = sum(p.numel() for p in gpt.parameters())
        log(dist, f"LoRA rank {lora.rank} on {', '.join(lora.target_modules)}: {trainable:,} of {total:,} "
                  "parameters train on this rank")
    lean = parallel.bf16 and parallel.optimizer_precision == "bf16"
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=not lean,
        overlap_grad_reduce=False,
        use_distributed_optimizer=parallel.use_distributed_optimizer,
    )
    model = DistributedDataParallel(config=gpt.config, ddp_config=ddp_config, module=gpt)
    gpt.config.finalize_model_grads_func = finalize_model_grads
    gpt.config.no_sync_func = model.no_sync
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
            bf16=parallel.bf16 and not lean,  # lean: no fp32 main weights (Megatron's FP32Optimizer over bf16 ones)
            params_dtype=torch.bfloat16 if parallel.bf16 else torch.float32,
            use_distributed_optimizer=parallel.use_distributed_optimizer,
        ),
        [model],
    )
    if lean:
        use_stochastic_rounding_adamw(optimizer)
        log(dist, "optimizer: bf16 weights, gradients and AdamW moments, stochastic rounding (no fp32 copies)")
    elif kernels.active():
        kernels.fuse_adamw(optimizer)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=opt.lr,
        min_lr=opt.min_lr,
        lr_warmup_steps=min(opt.warmup_steps, max(total_steps - 1, 0)),
        lr_decay_steps=total_steps,
        lr_decay_style="cosine",
        start_wd=opt.weight_decay,
        end_wd=opt.weight_decay,
        wd_incr_steps=total_steps,
        wd_incr_style="constant",
    )
    stats = None
    if gpt.config.num_moe_experts:
        from align_pipeline.model.moe import RouterStats

        stats = RouterStats(gpt)
    return Trainable(source, model, optimizer, scheduler, head, num_outputs, lora, stats)


def use_stochastic_rounding_adamw(megatron_optimizer) -> int:
    """Replace the torch ``AdamW`` under each of Megatron's ``FP32Optimizer`` wrappers by
    :class:`~align_pipeline.train.core.bf16_adamw.StochasticRoundingAdamW` over the same param groups (the bf16
    weights themselves: ``parallel.optimizer_precision: bf16``). Returns the number of optimizers replaced."""
    from megatron.core.optimizer import optimizer as megatron_optimizers

    from align_pipeline.train.core.bf16_adamw import StochasticRoundingAdamW, clip_grads_by_total_norm

    # Megatron's clipping asserts fp32 gradients (its main grads); these are bf16
    megatron_optimizers.clip_grad_by_total_norm_fp32 = clip_grads_by_total_norm
    replaced = 0
    for chained in getattr(megatron_optimizer, "chained_optimizers", [megatron_optimizer]):
        inner = getattr(chained, "optimizer", None)
        if inner is None:
            continue
        if type(inner) is not torch.optim.AdamW or inner.state:
            raise RuntimeError(f"optimizer_precision=bf16 expects torch's AdamW before the first step under Megatron's "
                               f"optimizer, found {type(inner).__name__}")
        defaults = inner.defaults
        chained.optimizer = StochasticRoundingAdamW(inner.param_groups, lr=defaults["lr"], betas=defaults["betas"],
                                                    eps=defaults["eps"], weight_decay=defaults["weight_decay"],
                                                    compiled=kernels.active())
        replaced += 1
    return replaced


def build_frozen(source: ModelSource, parallel: ParallelConfig, dist: Dist, head: str = "lm"):
    """A model that is only run (reference, reward model, evaluated policy): eval mode, no gradients."""
    model = build_model(source, parallel, dist, head=head)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def train_step(t: Trainable, microbatches: list[dict[str, torch.Tensor]], forward_loss: ForwardLoss,
               metric_names: list[str], dist: Dist, seq_length: int) -> dict[str, float]:
    """One optimizer step of ``t`` on ``microbatches`` (gradients accumulated over them and reduced over DP).

    Returns the loss metrics (means over the loss's count, over every micro-batch and DP rank) with ``grad_norm``,
    the ``lr`` of the step and ``update_skipped`` (1 when the optimizer skipped it: a non-finite gradient)."""
    with memory.phase("train"), profiling.maybe_profile(dist.rank):
        t.model.zero_grad_buffer()
        t.optimizer.zero_grad()
        if t.router_stats is not None:
            t.router_stats.reset()
        metrics = run_microbatches(t.model, microbatches, forward_loss, metric_names, dist, seq_length,
                                   forward_only=False)
        ok, grad_norm, _ = t.optimizer.step()
    if ok:
        t.scheduler.step(increment=1)
    metrics.pop("count")
    moe = t.router_stats.metrics() if t.router_stats is not None else {}
    return {**metrics, "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
            "lr": float(t.optimizer.param_groups[0]["lr"]), "update_skipped": float(not ok), **moe}


def peak_memory_gib() -> float | None:
    """This rank's peak allocated accelerator memory in GiB over the whole job (None on CPU); per phase (train step,
    validation, checkpoint save): :func:`align_pipeline.model.memory.peaks_gib`."""
    return memory.overall_peak_gib()
