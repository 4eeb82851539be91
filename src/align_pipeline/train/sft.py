"""Supervised fine-tuning (SFT): next-token cross-entropy on the response tokens only.

    torchrun --nproc_per_node 2 -m align_pipeline.train.sft --config run/config.json     # any world size
    python -m align_pipeline.train.sft --config run/config.json                          # single process

The config is an :class:`align_pipeline.config.SFTJob` as JSON (``params:sft`` + model + parallel + paths). Resumes
from the latest checkpoint in ``paths.run_dir`` when one exists. Writes the final model to ``run_dir/model`` and a
summary to ``run_dir/result.json`` (rank 0).
"""

from __future__ import annotations

import time
from pathlib import Path

from align_pipeline.config import SFTJob, config_hash, to_dict
from align_pipeline.data.tokenizer import load_tokenizer
from align_pipeline.losses.sft import masked_token_loss
from align_pipeline.model import init
from align_pipeline.model.logprobs import token_nll
from align_pipeline.model.sequences import run
from align_pipeline.tracking import RunLogger
from align_pipeline.train.core.batches import load_split_batches
from align_pipeline.train.core.checkpointing import Checkpoints
from align_pipeline.train.core.cli import cli
from align_pipeline.train.core.distributed import init_distributed
from align_pipeline.train.core.optimizer import build_trainable, peak_memory_gib, train_step
from align_pipeline.train.core.progress import Progress, RunLog, finish, log
from align_pipeline.train.core.schedule import evaluate_loss

METRICS = ["lm_loss"]


def sft_loss(vocab_size: int, tp_rank: int):
    """(module, batch) -> (logits, loss_fn): masked token NLL of input_ids/labels/loss_mask [b, s]."""

    def forward_loss(module, batch):
        logits = run(module, batch["input_ids"])  # [b, s, V/tp] on the last stage

        def loss_fn(logits):
            return masked_token_loss(token_nll(logits, batch["labels"], vocab_size, tp_rank), batch["loss_mask"])

        return logits, loss_fn

    return forward_loss


def main(job: SFTJob) -> dict:
    # ---- set-up: process groups, tokenizer, model + optimizer, data, checkpoints ----
    cfg, paths, run_dir = job.sft.training, job.paths, Path(job.paths.run_dir)
    dist = init_distributed(job.parallel, cfg.seed)
    logger = RunLogger(rank=dist.rank)
    tok = load_tokenizer(paths.tokenizer)
    source = init.resolve(paths.init_from, job.model, tok.vocab_size)
    log(dist, f"[sft] world={dist.world_size} tp={dist.tp_size} pp={dist.pp_size} dp={dist.dp_size} "
              f"backend={dist.backend} init={source.parent['kind']}:{paths.init_from}")
    policy = build_trainable(source, job.parallel, cfg.optimizer, cfg.train_steps, dist)
    train, val = load_split_batches(paths.train_data, paths.val_data, cfg.global_batch_size, cfg.micro_batch_size,
                                    dist, cfg.seed)
    loss, seq_length = sft_loss(source.vocab_size, dist.tp_rank), source.model.seq_length
    ckpts = Checkpoints({"model": (policy, run_dir)}, dist, total=cfg.train_steps, interval=cfg.save_interval,
                        keep=cfg.keep_checkpoints, resume=cfg.resume, stop_after=job.stop_after,
                        meta={"stage": "sft", "config_hash": config_hash(job)})
    step, state = ckpts.resume()
    if state is not None:
        assert state["consumed_samples"] == step * cfg.global_batch_size, "data position does not match the step"
        log(dist, f"[sft] resumed at step {step} from {run_dir}")
    logger.log_params({"job": to_dict(job), "world_size": dist.world_size, "resumed_from_step": step})
    progress = Progress(cfg.train_steps, step, dist)
    runlog = RunLog(dist, logger, progress, cfg.log_interval)
    tokens_per_step = cfg.global_batch_size * seq_length * train.rows_per_sample

    # ---- the loop: step, validate, log, checkpoint ----
    metrics: dict[str, float] = {}
    while step < cfg.train_steps:
        t0 = time.perf_counter()
        m = train_step(policy, train.microbatches(step), loss, METRICS, dist, seq_length)
        step += 1
        progress.add_tokens(tokens_per_step)
        metrics = {"loss": m.pop("lm_loss"), **m, "step_time_s": time.perf_counter() - t0,
                   "tokens_per_s": progress.tokens_per_s()}
        shown = dict(metrics)
        if cfg.eval_interval and step % cfg.eval_interval == 0 and step < cfg.train_steps:
            shown.update(evaluate_loss(policy.model, val, loss, METRICS, "lm_loss", cfg.eval_samples, dist,
                                       seq_length))
        runlog.record(step, shown, {"step": step, "loss": metrics["loss"], "step_time_s": metrics["step_time_s"]},
                      force="val_loss" in shown)
        if ckpts.after_step(step, {"step": step, "consumed_samples": step * cfg.global_batch_size}):
            log(dist, f"[sft] stopping after {step - ckpts.started_at} steps (stop_after); a rerun resumes at {step}")
            return finish(dist, logger, run_dir, {"stopped_at_step": step})

    # ---- final validation, checkpoint and export ----
    final = evaluate_loss(policy.model, val, loss, METRICS, "lm_loss", cfg.eval_samples, dist, seq_length)
    progress.print(step, {**metrics, **final})
    logger.log_metrics(final, step)
    ckpts.save(step, {"step": step, "consumed_samples": step * cfg.global_batch_size})
    dirs = ckpts.export(step, {
        "stage": "sft", "tokenizer": {"path": str(paths.tokenizer), "fingerprint": tok.fingerprint},
        "saved_with_parallel": to_dict(job.parallel), "metrics": {**final, "train_loss": metrics.get("loss")},
        "lineage": {**job.lineage, "config_hash": config_hash(job)}})
    return finish(dist, logger, run_dir, {
        **dirs, "step": step, **final, "train_loss": metrics.get("loss"), "train_metrics": metrics,
        "tokens_per_s": metrics.get("tokens_per_s"), "tokens_per_step": tokens_per_step,
        "peak_memory_gib": peak_memory_gib(), "history": runlog.history})


if __name__ == "__main__":  # the torch_dist checkpoint saver spawns processes: the guard is required
    cli(SFTJob, main, __doc__)
