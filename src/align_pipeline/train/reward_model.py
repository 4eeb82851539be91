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

import numpy as np
import torch

from align_pipeline.config.checks import check_job
from align_pipeline.config.reward_model import RewardModelConfig, RewardModelJob
from align_pipeline.data.tokenizer import load_tokenizer
from align_pipeline.losses.reward import bradley_terry_loss, regression_reward_loss
from align_pipeline.model import init
from align_pipeline.model.sequences import pair_batch, run, sequence_rewards
from align_pipeline.tracking.mlflow_logger import RunLogger
from align_pipeline.train.core import supervised
from align_pipeline.train.core.batches import load_split_batches
from align_pipeline.train.core.checkpointing import Checkpoints
from align_pipeline.train.core.cli import cli
from align_pipeline.train.core.distributed import init_distributed
from align_pipeline.train.core.optimizer import build_trainable, train_step
from align_pipeline.train.core.progress import log
from align_pipeline.train.core.schedule import evaluate_loss

PAIR_METRICS = ["rm_loss", "accuracy", "reward_chosen", "reward_rejected", "reward_margin"]
REGRESSION_METRICS = ["rm_loss", "abs_error"]


def bradley_terry(cfg: RewardModelConfig):
    """(module, pair batch) -> (values, loss_fn): chosen rows over rejected rows [2b, s] -> one reward each."""

    def forward_loss(module, batch):
        ids, _, mask = pair_batch(batch)  # [2b, s] (packed: [1, T])
        values = run(module, ids, batch)  # [2b, s, 1] on the last stage

        def loss_fn(values):
            r_c, r_r = sequence_rewards(values, mask, cfg.pooling, batch).chunk(2)  # [b], [b]
            gap = batch["chosen_reward"] - batch["rejected_reward"]  # [b], NaN where the data has no rewards
            margin = cfg.margin_scale * torch.nan_to_num(gap, nan=0.0) if cfg.margin_scale else None
            return bradley_terry_loss(r_c, r_r, margin)

        return values, loss_fn

    return forward_loss


def regression(cfg: RewardModelConfig):
    """(module, batch) -> (values, loss_fn): one value per attribute [b, s, A], regressed onto the labels present."""

    def forward_loss(module, batch):
        ids, mask = batch["input_ids"], batch["loss_mask"]  # [b, s] (packed: [1, T])
        values = run(module, ids, batch)  # [b, s, A]

        def loss_fn(values):
            per_attr = [sequence_rewards(values[..., a : a + 1], mask, cfg.pooling, batch)
                        for a in range(values.shape[-1])]
            predicted = torch.stack(per_attr, dim=-1)  # [b, A]
            labels = batch["reward_labels"]  # [b, A], NaN = missing
            present = ~torch.isnan(labels)
            return regression_reward_loss(predicted, torch.nan_to_num(labels), present.float())

        return values, loss_fn

    return forward_loss


def main(job: RewardModelJob) -> dict:
    # ---- set-up: process groups, tokenizer, model (value head) + optimizer, data, checkpoints ----
    section, paths = job.reward_model, job.paths
    cfg = section.training
    dist = init_distributed(job.parallel, cfg.seed)
    logger = RunLogger(rank=dist.rank)
    tok = load_tokenizer(paths.tokenizer)
    source = init.resolve(paths.init_from, job.model, tok.vocab_size)
    check_job("reward_model", section, job.parallel, dist.world_size, source.model, paths.init_from,
              source.parent["kind"])
    log(dist, f"[reward_model] {dist.describe()} init={source.parent['kind']}:{paths.init_from} loss={section.loss}")
    if section.loss == "regression":
        num_outputs = np.load(paths.train_data)["reward_labels"].shape[1]
        loss, metric_names = regression(section), REGRESSION_METRICS
    else:
        num_outputs, loss, metric_names = 1, bradley_terry(section), PAIR_METRICS
    model = build_trainable(source, job.parallel, cfg.optimizer, cfg.train_steps, dist, head="value",
                            num_outputs=num_outputs, lora=section.lora)
    train, val = load_split_batches(paths.train_data, paths.val_data, cfg, dist, packing=section.packing)
    seq_length = source.model.seq_length
    ckpts = Checkpoints.for_training({"model": (model, paths.run_dir)}, cfg, job, "reward_model", dist)
    step, runlog, metrics = supervised.start("reward_model", job, ckpts, cfg, dist, logger)

    # ---- the loop: step, validate, log, checkpoint ----
    while step < cfg.train_steps:
        t0 = time.perf_counter()
        m = train_step(model, train.microbatches(step), loss, metric_names, dist, seq_length)
        metrics = supervised.step_metrics(m, "rm_loss", t0, runlog, train.real_tokens(step))
        step += 1
        if supervised.eval_due(step, cfg):
            metrics.update(evaluate_loss(model.model, val, loss, metric_names, "rm_loss", cfg.eval_samples, dist,
                                         seq_length))
        supervised.record(runlog, step, metrics)
        if ckpts.after_step(step, supervised.data_position(step, cfg, metrics)):
            return runlog.stopped(step, paths.run_dir, ckpts.started_at)

    final = evaluate_loss(model.model, val, loss, metric_names, "rm_loss", cfg.eval_samples, dist, seq_length)
    return supervised.finish("reward_model", job, ckpts, runlog, step, cfg, tok, final, metrics, train.real_tokens(step - 1),
                             meta={"reward_head": {"pooling": section.pooling, "loss": section.loss}})


if __name__ == "__main__":  # torchrun runs the module; importing it (tests, spawned helpers) runs nothing
    cli(RewardModelJob, main, __doc__)
