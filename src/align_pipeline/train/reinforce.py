"""REINFORCE-family entry point: RLOO or GRPO, no critic.

    torchrun --nproc_per_node 2 -m align_pipeline.train.reinforce --config run/config.json

Each iteration: ``generation.samples_per_prompt`` (n >= 2) responses per prompt from the policy, each scored by the
verifiable checker and/or the reward model (``reward``); the n scores of a prompt give every sample one advantage,
either leave-one-out (RLOO, Ahmadian et al. 2024) or group-normalised (GRPO, Shao et al. 2024), shared by all its
tokens. The policy then takes ``epochs x minibatches`` optimizer steps on :func:`~align_pipeline.losses.ppo.
reinforce_loss`: plain ``-A log pi`` when the rollout is used for a single step, PPO's clipped ratio against the
rollout policy otherwise, plus ``loss.kl_coef`` x KL to the frozen reference (reported either way). The n samples of a
prompt always sit on one DP rank, so the group baselines need no communication. Output: ``run_dir/actor/model``.
"""

from __future__ import annotations

import numpy as np
import torch

from align_pipeline.config import ReinforceJobConfig
from align_pipeline.losses.ppo import reinforce_loss
from align_pipeline.model.logprobs import token_nll
from align_pipeline.rl import grpo_advantages, kl_penalty, rloo_advantages
from align_pipeline.train import loop, rl_trainer, rollout
from align_pipeline.train.rl_trainer import RLContext


def group_advantages(job: ReinforceJobConfig, scores: torch.Tensor) -> torch.Tensor:
    """Flat prompt-major scores [P*n] -> one advantage per sample [P*n]."""
    groups = scores.view(-1, job.generation.samples_per_prompt)  # [P, n]
    if job.loss.estimator == "rloo":
        return rloo_advantages(groups).flatten()
    return grpo_advantages(groups, scale=job.loss.grpo_scale).flatten()


def policy_forward_loss(job: ReinforceJobConfig, vocab_size: int, dist, clipped: bool):
    cfg = job.loss

    def forward_loss(module, batch):
        logits = module(batch["input_ids"], loop.position_ids_like(batch["input_ids"]), None)

        def loss_fn(logits):
            logp = -token_nll(logits, batch["labels"], vocab_size, dist.tp_rank)  # [b, s]
            return reinforce_loss(logp, batch["advantages"], batch["loss_mask"], ref_logp=batch["ref_logp"],
                                  kl_coef=cfg.kl_coef, estimator=cfg.kl_estimator,
                                  old_logp=batch["old_logp"] if clipped else None, clip_eps=cfg.clip_eps)

        return logits, loss_fn

    return forward_loss


def make_iterate(job: ReinforceJobConfig, ctx: RLContext):
    dist, rl, actor = ctx.dist, job.rl, ctx.actor
    clipped = ctx.steps_per_iteration > 1  # the rollout policy differs from the policy after the first step
    metrics = ["pg_loss", "kl"] + (["clip_fraction", "ratio"] if clipped else [])
    loss = policy_forward_loss(job, ctx.vocab_size, dist, clipped)
    offload = rl_trainer.Offload(ctx, [actor])

    def iterate(it: int) -> dict[str, float]:
        exp = rl_trainer.collect(ctx, it, offload)
        mask, scores = exp.rollout.rows["loss_mask"], exp.scores
        advantages = group_advantages(job, scores.total)  # [n]
        groups = scores.total.view(-1, job.generation.samples_per_prompt)  # [P, n]

        stats = rl_trainer.rollout_stats(ctx, exp)
        stats.add("rollout/init_policy_kl", (kl_penalty(exp.old_logp, exp.ref_logp, "k1") * mask).sum(-1), std=False)
        stats.add("rollout/advantages", advantages)
        stats.add("rollout/fraction_of_groups_without_signal", (groups == groups[:, :1]).all(dim=1).double(),
                  std=False)
        m = stats.reduce()

        rows = {**exp.rollout.rows, "advantages": advantages, "ref_logp": exp.ref_logp, "old_logp": exp.old_logp}
        n = exp.rollout.n

        def train():
            steps = []
            for epoch in range(rl.epochs):
                order = torch.from_numpy(np.random.default_rng([rl.seed, it, epoch]).permutation(n)).to(dist.device)
                steps += rl_trainer.update(actor, rows, order, rl.minibatches, rl.micro_batch_size, loss, metrics, ctx)
            return steps

        steps, t_train = rollout.timed(train)
        m.update(rl_trainer.mean_metrics(steps, "train"))
        m.update(rl_trainer.timing_metrics(ctx, exp, t_train, trained_rows=rl.epochs * n))
        return m

    return iterate


def main(job: ReinforceJobConfig) -> dict:
    ctx = rl_trainer.setup(job, "reinforce")
    iterate = make_iterate(job, ctx)
    return rl_trainer.fit(ctx, "reinforce", [ctx.actor], iterate, (dict, lambda state: None))


if __name__ == "__main__":  # the torch_dist checkpoint saver spawns processes: the guard is required
    loop.cli(ReinforceJobConfig, main, __doc__)
