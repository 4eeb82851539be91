"""Supervised fine-tuning (SFT): next-token cross-entropy on the response tokens only.

    torchrun --nproc_per_node 2 -m align_pipeline.train.sft --config run/config.json     # any world size
    python -m align_pipeline.train.sft --config run/config.json                          # single process

The config is an :class:`align_pipeline.config.SFTJob` as JSON (``params:sft`` + model + parallel + paths). Resumes
from the latest checkpoint in ``paths.run_dir`` when one exists. Writes the final model to ``run_dir/model`` and a
summary to ``run_dir/result.json`` (rank 0).
"""

from __future__ import annotations

import time

from align_pipeline.config.checks import check_job
from align_pipeline.config.sft import SFTJob
from align_pipeline.data.tokenizer import load_tokenizer
from align_pipeline.losses.sft import masked_token_loss
from align_pipeline.model import init
from align_pipeline.model.sequences import lm_token_nll_forward
from align_pipeline.tracking.mlflow_logger import RunLogger
from align_pipeline.train.core import supervised
from align_pipeline.train.core.batches import load_split_batches
from align_pipeline.train.core.checkpointing import Checkpoints
from align_pipeline.train.core.cli import cli
from align_pipeline.train.core.distributed import init_distributed
from align_pipeline.train.core.optimizer import build_trainable, train_step
from align_pipeline.train.core.progress import log
from align_pipeline.train.core.schedule import evaluate_loss

METRICS = ["lm_loss"]


def sft_loss(vocab_size: int, tp_rank: int, logits_chunk: int = 0):
    """(module, batch) -> (output, loss_fn): masked token NLL of input_ids/labels/loss_mask [b, s] (``logits_chunk``:
    ``parallel.logits_chunk_tokens``)."""
    nll_forward = lm_token_nll_forward(vocab_size, tp_rank, logits_chunk)

    def forward_loss(module, batch):
        # the last stage's logits [b, s, V/tp] ([1, T, V/tp] packed), or its hidden states when chunked
        output, nll = nll_forward(module, batch["input_ids"], batch["labels"], batch)

        def loss_fn(output):
            return masked_token_loss(nll(output), batch["loss_mask"])

        return output, loss_fn

    return forward_loss


def main(job: SFTJob) -> dict:
    # ---- set-up: process groups, tokenizer, model + optimizer, data, checkpoints ----
    cfg, paths = job.sft.training, job.paths
    dist = init_distributed(job.parallel, cfg.seed)
    logger = RunLogger(rank=dist.rank)
    tok = load_tokenizer(paths.tokenizer)
    source = init.resolve(paths.init_from, job.model, tok.vocab_size)
    check_job("sft", job.sft, job.parallel, dist.world_size, source.model, paths.init_from, source.parent["kind"])
    log(dist, f"[sft] {dist.describe()} init={source.parent['kind']}:{paths.init_from}")
    policy = build_trainable(source, job.parallel, cfg.optimizer, cfg.train_steps, dist, lora=job.sft.lora)
    train, val = load_split_batches(paths.train_data, paths.val_data, cfg, dist, packing=job.sft.packing)
    loss = sft_loss(source.vocab_size, dist.tp_rank, job.parallel.logits_chunk_tokens)
    seq_length = source.model.seq_length
    ckpts = Checkpoints.for_training({"model": (policy, paths.run_dir)}, cfg, job, "sft", dist)
    step, runlog, metrics = supervised.start("sft", job, ckpts, cfg, dist, logger)

    # ---- the loop: step, validate, log, checkpoint ----
    while step < cfg.train_steps:
        t0 = time.perf_counter()
        m = train_step(policy, train.microbatches(step), loss, METRICS, dist, seq_length)
        metrics = supervised.step_metrics(m, "lm_loss", t0, runlog, train.real_tokens(step))
        step += 1
        if supervised.eval_due(step, cfg):
            metrics.update(evaluate_loss(policy.model, val, loss, METRICS, "lm_loss", cfg.eval_samples, dist,
                                         seq_length))
        supervised.record(runlog, step, metrics)
        if ckpts.after_step(step, supervised.data_position(step, cfg, metrics)):
            return runlog.stopped(step, paths.run_dir, ckpts.started_at)

    final = evaluate_loss(policy.model, val, loss, METRICS, "lm_loss", cfg.eval_samples, dist, seq_length)
    return supervised.finish("sft", job, ckpts, runlog, step, cfg, tok, final, metrics, train.real_tokens(step - 1))


if __name__ == "__main__":  # torchrun runs the module; importing it (tests, spawned helpers) runs nothing
    cli(SFTJob, main, __doc__)
