"""DPO family: direct preference optimisation against cached reference log-probs.

    torchrun --nproc_per_node 2 -m align_pipeline.train.dpo --config run/config.json

The policy starts from ``paths.init_from`` (normally ``sft_policy``); the reference log-probs come precomputed from
``align_pipeline.train.reference_logps`` (no reference forward pass here), or, with ``dpo.reference: online``, from
a reference forward per micro-batch: the LoRA policy with its adapters off, or a frozen copy of the reference. The loss is the function ``dpo.loss.name``
names in :data:`align_pipeline.losses.preference.PREFERENCE_LOSSES` (dpo, ipo, rpo, simpo, hinge), optionally mixed
with an SFT term on the chosen response (``sft_weight``).
"""

from __future__ import annotations

import contextlib
import functools
import time
from pathlib import Path

import numpy as np
import torch

from align_pipeline.config.checks import check_job
from align_pipeline.config.common import ModelConfig
from align_pipeline.config.dpo import DPOJob, PreferenceLossConfig
from align_pipeline.data.tokenizer import load_tokenizer
from align_pipeline.losses.preference import PreferenceLogps, combine, get_preference_loss
from align_pipeline.model import init, lora
from align_pipeline.model.sequences import lm_token_nll_forward, pair_batch, per_sequence_sum
from align_pipeline.tracking.mlflow_logger import RunLogger
from align_pipeline.train.core import supervised
from align_pipeline.train.core.batches import load_split_batches
from align_pipeline.train.core.checkpointing import Checkpoints
from align_pipeline.train.core.cli import cli
from align_pipeline.train.core.distributed import init_distributed
from align_pipeline.train.core.optimizer import build_frozen, build_trainable, train_step
from align_pipeline.train.core.progress import log
from align_pipeline.train.core.schedule import evaluate_loss


def with_reference(arrays: dict[str, np.ndarray], ref, split: str) -> dict[str, np.ndarray]:
    """Attach the cached reference log-probs of ``split`` as per-sample arrays (indexed like the pairs)."""
    if ref is None:
        return arrays
    n = len(arrays["chosen_input_ids"])
    extra = {"ref_chosen_logps": ref[f"{split}_chosen_logps"].astype(np.float32),
             "ref_rejected_logps": ref[f"{split}_rejected_logps"].astype(np.float32)}
    for value in extra.values():
        if len(value) != n:
            raise ValueError(f"reference log-probs for {split} have {len(value)} rows, the data has {n}")
    return {**arrays, **extra}


def online_reference(job: DPOJob, source, dist):
    """``dpo.reference: online``: (policy module) -> a context yielding the reference model: the policy itself with
    its LoRA adapters off (:func:`align_pipeline.model.lora.as_reference`; the policy starts from the reference), or
    a frozen copy of the reference; None for cached reference log-probs."""
    if job.dpo.reference != "online":
        return None
    reference = job.paths.reference or job.paths.init_from
    if job.dpo.lora.rank and Path(reference).resolve() == Path(job.paths.init_from).resolve():
        log(dist, "[dpo] reference: the policy with its LoRA adapters off (no second copy of the weights)")
        return lora.as_reference
    log(dist, f"[dpo] reference: a frozen copy of {reference} beside the policy")
    run_time = ModelConfig(attention_backend=job.model.attention_backend)
    frozen = build_frozen(init.resolve(reference, run_time, source.vocab_size), job.parallel, dist)
    return lambda module: contextlib.nullcontext(frozen)


def preference_loss(lc: PreferenceLossConfig, vocab_size: int, tp_rank: int, logits_chunk: int = 0, reference=None):
    """(module, pair batch) -> (output, loss_fn): sequence log-probs of chosen and rejected -> the preference loss
    (``logits_chunk``: ``parallel.logits_chunk_tokens``). ``reference`` (:func:`online_reference`): the reference
    log-probs are computed here, without autograd, instead of read from the batch."""
    loss = functools.partial(get_preference_loss(lc.name), beta=lc.beta, **lc.options)
    nll_forward = lm_token_nll_forward(vocab_size, tp_rank, logits_chunk)

    def reference_logps(module, ids, labels, mask, batch) -> dict[str, torch.Tensor]:
        with torch.no_grad(), reference(module) as model:
            output, nll = nll_forward(model, ids, labels, batch)
            chosen, rejected = (-per_sequence_sum(nll(output) * mask, batch)).chunk(2)
        return {"ref_chosen_logps": chosen, "ref_rejected_logps": rejected}

    def forward_loss(module, batch):
        ids, labels, mask = pair_batch(batch)  # [2b, s] (packed: [1, T])
        if reference is not None:
            batch = {**batch, **reference_logps(module, ids, labels, mask, batch)}
        output, nll = nll_forward(module, ids, labels, batch)  # logits [2b, s, V/tp] or hidden states (chunked)

        def loss_fn(output):
            logps = -per_sequence_sum(nll(output) * mask, batch)  # [2b]
            (pc, pr), (tc, tr) = logps.chunk(2), per_sequence_sum(mask, batch).chunk(2)  # [b] each
            pairs = PreferenceLogps(
                policy_chosen=pc, policy_rejected=pr,
                ref_chosen=batch.get("ref_chosen_logps"), ref_rejected=batch.get("ref_rejected_logps"),
                chosen_tokens=tc, rejected_tokens=tr,
                chosen_reward=batch["chosen_reward"], rejected_reward=batch["rejected_reward"],
            )
            out = loss(pairs)
            return combine(out, -pc, tc, weight=lc.sft_weight) if lc.sft_weight else out

        return output, loss_fn

    return forward_loss


def main(job: DPOJob) -> dict:
    # ---- set-up: process groups, tokenizer, policy + optimizer, data with reference log-probs, checkpoints ----
    lc, cfg, paths = job.dpo.loss, job.dpo.training, job.paths
    dist = init_distributed(job.parallel, cfg.seed)
    logger = RunLogger(rank=dist.rank)
    tok = load_tokenizer(paths.tokenizer)
    source = init.resolve(paths.init_from, job.model, tok.vocab_size)
    check_job("dpo", job.dpo, job.parallel, dist.world_size, source.model, paths.init_from, source.parent["kind"])
    log(dist, f"[dpo] {dist.describe()} init={source.parent['kind']}:{paths.init_from} loss={lc.name}")
    policy = build_trainable(source, job.parallel, cfg.optimizer, cfg.train_steps, dist, lora=job.dpo.lora)
    ref = np.load(paths.reference_logps) if paths.reference_logps else None
    train, val = load_split_batches(paths.train_data, paths.val_data, cfg, dist,
                                    extra=lambda arrays, split: with_reference(arrays, ref, split),
                                    packing=job.dpo.packing)
    loss = preference_loss(lc, source.vocab_size, dist.tp_rank, job.parallel.logits_chunk_tokens,
                           online_reference(job, source, dist))
    seq_length = source.model.seq_length
    loss_name = "loss" if lc.sft_weight else f"{lc.name}_loss"
    metric_names = [f"{lc.name}_loss", "rewards/accuracies", "rewards/chosen", "rewards/rejected", "rewards/margins",
                    "logps/chosen", "logps/rejected"] + (["sft_loss", "loss"] if lc.sft_weight else [])
    ckpts = Checkpoints.for_training({"model": (policy, paths.run_dir)}, cfg, job, "dpo", dist)
    step, runlog, metrics = supervised.start("dpo", job, ckpts, cfg, dist, logger)

    # ---- the loop: step, validate, log, checkpoint ----
    while step < cfg.train_steps:
        t0 = time.perf_counter()
        m = train_step(policy, train.microbatches(step), loss, metric_names, dist, seq_length)
        metrics = supervised.step_metrics(m, loss_name, t0, runlog, train.real_tokens(step))
        step += 1
        if supervised.eval_due(step, cfg):
            metrics.update(evaluate_loss(policy.model, val, loss, metric_names, loss_name, cfg.eval_samples, dist,
                                         seq_length))
        supervised.record(runlog, step, metrics)
        if ckpts.after_step(step, supervised.data_position(step, cfg, metrics)):
            return runlog.stopped(step, paths.run_dir, ckpts.started_at)

    final = evaluate_loss(policy.model, val, loss, metric_names, loss_name, cfg.eval_samples, dist, seq_length)
    return supervised.finish("dpo", job, ckpts, runlog, step, cfg, tok, final, metrics, train.real_tokens(step - 1), meta={
        "preference_loss": {"name": lc.name, "beta": lc.beta, "sft_weight": lc.sft_weight, **lc.options}})


if __name__ == "__main__":  # torchrun runs the module; importing it (tests, spawned helpers) runs nothing
    cli(DPOJob, main, __doc__)
