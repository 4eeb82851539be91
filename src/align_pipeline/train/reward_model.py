"""Reward model: a Bradley-Terry reward model on preference pairs (or a SteerLM-style regression reward model).

    torchrun --nproc_per_node 2 -m align_pipeline.train.reward_model --config run/config.json

Starts from ``paths.init_from`` (normally ``sft_policy``) with the LM head replaced by a value head; the reward of a
sequence is the value at its last response token or the mean over its response tokens (``pooling``). Loss:
``-log sigma(r_c - r_r - margin)`` (:func:`align_pipeline.losses.reward.bradley_terry_loss`); with ``loss:
regression`` one value per attribute regressed onto the labels present
(:func:`~align_pipeline.losses.reward.regression_reward_loss`). Output: ``run_dir/model`` (head "value", with
``reward_head`` {pooling, loss} in its meta.json for every later user of the model).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from align_pipeline.config import RewardModelConfig, RewardModelJob, config_hash, to_dict
from align_pipeline.data.tokenizer import load_tokenizer
from align_pipeline.losses.reward import bradley_terry_loss, regression_reward_loss
from align_pipeline.model import init
from align_pipeline.model.sequences import pair_batch, run, sequence_rewards
from align_pipeline.tracking import RunLogger
from align_pipeline.train.core.batches import load_split_batches
from align_pipeline.train.core.checkpointing import Checkpoints
from align_pipeline.train.core.cli import cli
from align_pipeline.train.core.distributed import init_distributed
from align_pipeline.train.core.optimizer import build_trainable, peak_memory_gib, train_step
from align_pipeline.train.core.progress import Progress, RunLog, finish, log
from align_pipeline.train.core.schedule import evaluate_loss

PAIR_METRICS = ["rm_loss", "accuracy", "reward_chosen", "reward_rejected", "reward_margin"]
REGRESSION_METRICS = ["rm_loss", "abs_error"]


def bradley_terry(cfg: RewardModelConfig):
    """(module, pair batch) -> (values, loss_fn): chosen rows over rejected rows [2b, s] -> one reward each."""

    def forward_loss(module, batch):
        ids, _, mask = pair_batch(batch)  # [2b, s]
        values = run(module, ids)  # [2b, s, 1] on the last stage

        def loss_fn(values):
            r_c, r_r = sequence_rewards(values, mask, cfg.pooling).chunk(2)  # [b], [b]
            gap = batch["chosen_reward"] - batch["rejected_reward"]  # [b], NaN where the data has no rewards
            margin = cfg.margin_scale * torch.nan_to_num(gap, nan=0.0) if cfg.margin_scale else None
            return bradley_terry_loss(r_c, r_r, margin)

        return values, loss_fn

    return forward_loss


def regression(cfg: RewardModelConfig):
    """(module, batch) -> (values, loss_fn): one value per attribute [b, s, A], regressed onto the labels present."""

    def forward_loss(module, batch):
        ids, mask = batch["input_ids"], batch["loss_mask"]  # [b, s]
        values = run(module, ids)  # [b, s, A]

        def loss_fn(values):
            per_attr = [sequence_rewards(values[..., a : a + 1], mask, cfg.pooling) for a in range(values.shape[-1])]
            predicted = torch.stack(per_attr, dim=-1)  # [b, A]
            labels = batch["reward_labels"]  # [b, A], NaN = missing
            present = ~torch.isnan(labels)
            return regression_reward_loss(predicted, torch.nan_to_num(labels), present.float())

        return values, loss_fn

    return forward_loss


def main(job: RewardModelJob) -> dict:
    # ---- set-up: process groups, tokenizer, model (value head) + optimizer, data, checkpoints ----
    cfg_rm, paths, run_dir = job.reward_model, job.paths, Path(job.paths.run_dir)
    cfg = cfg_rm.training
    dist = init_distributed(job.parallel, cfg.seed)
    logger = RunLogger(rank=dist.rank)
    tok = load_tokenizer(paths.tokenizer)
    source = init.resolve(paths.init_from, job.model, tok.vocab_size)
    log(dist, f"[reward_model] world={dist.world_size} tp={dist.tp_size} pp={dist.pp_size} dp={dist.dp_size} "
              f"backend={dist.backend} init={source.parent['kind']}:{paths.init_from} loss={cfg_rm.loss}")
    if cfg_rm.loss == "regression":
        num_outputs = np.load(paths.train_data)["reward_labels"].shape[1]
        loss, metrics_names = regression(cfg_rm), REGRESSION_METRICS
    else:
        num_outputs, loss, metrics_names = 1, bradley_terry(cfg_rm), PAIR_METRICS
    model = build_trainable(source, job.parallel, cfg.optimizer, cfg.train_steps, dist, head="value",
                            num_outputs=num_outputs)
    train, val = load_split_batches(paths.train_data, paths.val_data, cfg.global_batch_size, cfg.micro_batch_size,
                                    dist, cfg.seed)
    seq_length = source.model.seq_length
    ckpts = Checkpoints({"model": (model, run_dir)}, dist, total=cfg.train_steps, interval=cfg.save_interval,
                        keep=cfg.keep_checkpoints, resume=cfg.resume, stop_after=job.stop_after,
                        meta={"stage": "reward_model", "config_hash": config_hash(job)})
    step, state = ckpts.resume()
    if state is not None:
        assert state["consumed_samples"] == step * cfg.global_batch_size, "data position does not match the step"
        log(dist, f"[reward_model] resumed at step {step} from {run_dir}")
    logger.log_params({"job": to_dict(job), "world_size": dist.world_size, "resumed_from_step": step})
    progress = Progress(cfg.train_steps, step, dist)
    runlog = RunLog(dist, logger, progress, cfg.log_interval)
    tokens_per_step = cfg.global_batch_size * seq_length * train.rows_per_sample

    # ---- the loop: step, validate, log, checkpoint ----
    metrics: dict[str, float] = {}
    while step < cfg.train_steps:
        t0 = time.perf_counter()
        m = train_step(model, train.microbatches(step), loss, metrics_names, dist, seq_length)
        step += 1
        progress.add_tokens(tokens_per_step)
        metrics = {"loss": m.pop("rm_loss"), **m, "step_time_s": time.perf_counter() - t0,
                   "tokens_per_s": progress.tokens_per_s()}
        shown = dict(metrics)
        if cfg.eval_interval and step % cfg.eval_interval == 0 and step < cfg.train_steps:
            shown.update(evaluate_loss(model.model, val, loss, metrics_names, "rm_loss", cfg.eval_samples, dist,
                                       seq_length))
        runlog.record(step, shown, {"step": step, "loss": metrics["loss"], "step_time_s": metrics["step_time_s"]},
                      force="val_loss" in shown)
        if ckpts.after_step(step, {"step": step, "consumed_samples": step * cfg.global_batch_size}):
            log(dist, f"[reward_model] stopping after {step - ckpts.started_at} steps (stop_after); a rerun resumes at {step}")
            return finish(dist, logger, run_dir, {"stopped_at_step": step})

    # ---- final validation, checkpoint and export ----
    final = evaluate_loss(model.model, val, loss, metrics_names, "rm_loss", cfg.eval_samples, dist, seq_length)
    progress.print(step, {**metrics, **final})
    logger.log_metrics(final, step)
    ckpts.save(step, {"step": step, "consumed_samples": step * cfg.global_batch_size})
    dirs = ckpts.export(step, {
        "stage": "reward_model", "tokenizer": {"path": str(paths.tokenizer), "fingerprint": tok.fingerprint},
        "saved_with_parallel": to_dict(job.parallel), "metrics": {**final, "train_loss": metrics.get("loss")},
        "lineage": {**job.lineage, "config_hash": config_hash(job)}},
        per_model={"model": {"reward_head": {"pooling": cfg_rm.pooling, "loss": cfg_rm.loss}}})
    return finish(dist, logger, run_dir, {
        **dirs, "step": step, **final, "train_loss": metrics.get("loss"), "train_metrics": metrics,
        "tokens_per_s": metrics.get("tokens_per_s"), "tokens_per_step": tokens_per_step,
        "peak_memory_gib": peak_memory_gib(), "history": runlog.history})



if __name__ == "__main__":  # the torch_dist checkpoint saver spawns processes: the guard is required
    cli(RewardModelJob, main, __doc__)
