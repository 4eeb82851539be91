"""REINFORCE family: RLOO or GRPO, no critic.

    torchrun --nproc_per_node 2 -m align_pipeline.train.reinforce --config run/config.json

Each iteration, in :func:`main`'s loop: ``generation.samples_per_prompt`` (n >= 2) responses per prompt from the
policy, each scored by the weighted reward functions and/or the reward model (``reward``); the n scores of a prompt
give every sample one advantage, either leave-one-out (RLOO, Ahmadian et al. 2024) or group-normalised (GRPO, Shao et al. 2024),
shared by all its tokens. The policy then takes ``epochs x minibatches`` optimizer steps on
:func:`~align_pipeline.losses.reinforce.reinforce_loss`: plain ``-A log pi`` when the rollout is used for a single
step, PPO's clipped ratio against the rollout policy otherwise, plus ``kl.beta`` x KL to the frozen reference
(reported either way). The n samples of a prompt always sit on one DP rank, so the group baselines need no
communication. Output: ``run_dir/actor/model``.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from align_pipeline.config.checks import check_job
from align_pipeline.config.reinforce import ReinforceConfig, ReinforceJob
from align_pipeline.data.tokenizer import load_tokenizer
from align_pipeline.losses.reinforce import reinforce_loss
from align_pipeline.model import init
from align_pipeline.model.logprobs import token_nll
from align_pipeline.model.sequences import run
from align_pipeline.rewards.base import RewardFunctions
from align_pipeline.rl.advantages import groups_without_signal, grpo_advantages, rloo_advantages
from align_pipeline.rl.kl import kl_penalty
from align_pipeline.tracking.mlflow_logger import RunLogger
from align_pipeline.train.core import rollout
from align_pipeline.train.core.batches import split_rows
from align_pipeline.train.core.checkpointing import Checkpoints
from align_pipeline.train.core.cli import cli
from align_pipeline.train.core.distributed import init_distributed
from align_pipeline.train.core.optimizer import build_trainable, train_step
from align_pipeline.train.core.progress import log


def group_advantages(cfg: ReinforceConfig, scores: torch.Tensor) -> torch.Tensor:
    """Flat prompt-major scores [P*n] -> one advantage per sample [P*n] (0 for a non-finite score, which no baseline
    includes)."""
    groups = scores.view(-1, cfg.generation.samples_per_prompt)  # [P, n]
    if cfg.loss.estimator == "rloo":
        return rloo_advantages(groups).flatten()
    return grpo_advantages(groups, eps=cfg.loss.std_eps, scale=cfg.loss.grpo_scale).flatten()


def policy_loss(cfg: ReinforceConfig, vocab_size: int, tp_rank: int, clipped: bool):
    """(module, rows) -> (logits, loss_fn): the REINFORCE loss (clipped ratio when ``clipped``) + beta x KL."""

    def forward_loss(module, batch):
        logits = run(module, batch["input_ids"])  # [b, s, V/tp]

        def loss_fn(logits):
            logp = -token_nll(logits, batch["labels"], vocab_size, tp_rank)  # [b, s]
            return reinforce_loss(logp, batch["advantages"], batch["loss_mask"], ref_logp=batch["ref_logp"],
                                  beta=cfg.kl.beta, estimator=cfg.kl.estimator,
                                  old_logp=batch["old_logp"] if clipped else None, clip_eps=cfg.loss.clip_eps)

        return logits, loss_fn

    return forward_loss


def main(job: ReinforceJob) -> dict:
    # ---- set-up: process groups, tokenizer, prompts, the policy (trained), reference + reward model (frozen) ----
    cfg, paths, run_dir = job.reinforce, job.paths, Path(job.paths.run_dir)
    rl, gen, mbs = cfg.rl, cfg.generation, cfg.rl.micro_batch_size
    dist = init_distributed(job.parallel, rl.seed)
    logger = RunLogger(rank=dist.rank)
    tok = load_tokenizer(paths.tokenizer)
    source = init.resolve(paths.policy, job.model, tok.vocab_size)
    check_job("reinforce", cfg, job.parallel, dist.world_size, source.model, paths.policy, source.parent["kind"])
    log(dist, f"[reinforce] {dist.describe()} policy={paths.policy} reward_model={paths.reward_model}")
    total_steps = rl.iterations * rl.steps_per_iteration
    actor = build_trainable(source, job.parallel, cfg.optimizer, total_steps, dist, lora=cfg.lora)
    reward_fns = RewardFunctions.load(cfg.reward, "reinforce.reward")
    reference, rm, rm_forward = rollout.load_judges(paths, cfg.reward, job.model.attention_backend, job.parallel, dist,
                                                    "reinforce.reward", lora_policy=bool(cfg.lora.rank))
    prompts, val_records = rollout.load_prompts(paths, rl, dist, reward_fns)
    vocab, seq_length = source.vocab_size, source.model.seq_length
    clipped = rl.steps_per_iteration > 1  # the rollout policy differs from the policy after the first step
    metric_names = ["pg_loss", "kl"] + (["clip_fraction", "ratio"] if clipped else [])
    offload = rollout.Offload(cfg.offload, dist.device, [reference, rm], [actor.optimizer])
    loss = policy_loss(cfg, vocab, dist.tp_rank, clipped)
    ckpts = Checkpoints.for_rl({"actor": (actor, run_dir / "actor")}, rl, job, "reinforce", dist)
    iteration, _, runlog = rollout.start("reinforce", job, ckpts, prompts, rl, dist, logger)

    # KV cache and CUDA graphs before iteration 1, so its generate time is a warm one (the set-up is logged apart)
    setup = (rollout.prepare_rollouts(actor.model, prompts, iteration, gen, tok, vocab, dist, seq_length)
             if iteration < rl.iterations else {})

    # ---- the loop: rollout -> score -> group advantages -> minibatch updates -> log -> checkpoint ----
    m: dict[str, float] = {}
    while iteration < rl.iterations:
        t0, timings = time.perf_counter(), rollout.Timings()
        # 1. rollout
        offload.optimizers_to("cpu")
        with timings("timing/generate_s"):
            r = rollout.generate_rollout(actor.model, prompts.local(iteration), gen, tok, vocab, dist, seq_length,
                                         rollout.iteration_seed(gen.seed, iteration, dist.dp_rank))
        # 2. score, and the per-token log-probs of the rollout policy and the reference
        with timings("timing/score_s"):
            offload.frozen_to(dist.device)
            scores = rollout.score(r, cfg.reward, reward_fns, rm, rm_forward, mbs, dist)
            old_logp = rollout.token_logprobs(actor.model, r.rows, vocab, mbs, dist)  # [n, s]
            ref_logp = rollout.reference_logprobs(reference, actor.model, r.rows, vocab, mbs, dist)  # [n, s]
            offload.frozen_to("cpu")
        offload.optimizers_to(dist.device)
        # 3. one advantage per sample from its group
        mask = r.rows["loss_mask"]
        advantages = group_advantages(cfg, scores.total)  # [n]
        groups = scores.total.view(-1, gen.samples_per_prompt)  # [P, n]
        stats = rollout.rollout_stats(r, scores, reward_fns, dist)
        stats.add("rollout/init_policy_kl", (kl_penalty(old_logp, ref_logp, "k1") * mask).sum(-1), std=False)
        stats.add("rollout/advantages", advantages)
        stats.add("rollout/fraction_of_groups_without_signal", groups_without_signal(groups).double(), std=False)
        m = stats.reduce()
        # 4. epochs x minibatches of policy steps over a seeded order
        rows = {**r.rows, "advantages": advantages, "ref_logp": ref_logp, "old_logp": old_logp}
        steps = []
        with timings("timing/train_s"):
            for epoch in range(rl.epochs):
                order = rollout.minibatch_order(rl.seed, iteration, epoch, r.n, dist.device)
                steps += [train_step(actor, split_rows(rows, mbs, chunk), loss, metric_names, dist, seq_length)
                          for chunk in order.chunk(rl.minibatches)]
        iteration += 1
        # 5. log, validate, checkpoint
        m.update(rollout.mean_metrics(steps, "train"))
        m.update(timings)
        m.update(setup)  # iteration 1 only
        setup = {}
        m.update(rollout.throughput(r, timings, trained_rows=rl.epochs * r.n, seq_length=seq_length, dist=dist))
        m["timing/iteration_s"] = time.perf_counter() - t0
        if rl.eval_interval and iteration % rl.eval_interval == 0 and iteration < rl.iterations:
            m.update(rollout.validation_accuracy(actor.model, val_records, gen, tok, vocab, dist, seq_length,
                                                 reward_fns))
        runlog.record(iteration, m, {"iteration": iteration, **m}, force="val/greedy_accuracy" in m)
        train_state = {"iteration": iteration, "consumed_prompts": prompts.consumed(iteration)}
        if ckpts.after_step(iteration, train_state):
            return runlog.stopped(iteration, run_dir, ckpts.started_at)

    # ---- final validation, checkpoint and export of the policy ----
    final = rollout.validation_accuracy(actor.model, val_records, gen, tok, vocab, dist, seq_length, reward_fns)
    logger.log_metrics(final, iteration)
    log(dist, "[reinforce] done: " + ", ".join(f"{k} {v:.4f}" for k, v in final.items()))
    ckpts.save(iteration, {"iteration": iteration, "consumed_prompts": prompts.consumed(iteration)})
    dirs = ckpts.export(iteration, rollout.export_meta("reinforce", job, tok, final, m))
    return runlog.finish(run_dir, {**dirs, "step": iteration, "iteration": iteration, **final,
                                   "final": {**m, **final}, "history": runlog.history})


if __name__ == "__main__":  # torchrun runs the module; importing it (tests, spawned helpers) runs nothing
    cli(ReinforceJob, main, __doc__)
