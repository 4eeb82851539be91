"""PPO entry point: actor, critic, frozen reference and frozen reward model colocated in one job.

    torchrun --nproc_per_node 2 -m align_pipeline.train.ppo --config run/config.json

Each iteration (Ouyang et al. 2022 / Ziegler et al. 2019, as NeMo-Aligner and TRL run it):

1. **Rollout.** This DP rank's prompts of the iteration (:class:`~align_pipeline.train.rollout.PromptStream`) are
   continued by the actor with the KV-cached generator (``generation``: temperature, max new tokens, ...).
2. **Score.** Sequence score = ``reward_model_weight`` x reward model + ``checker_weight`` x verifiable checker
   (- ``missing_eos_penalty``). Forward passes give the actor's (old) and the reference's per-token log-probs and the
   critic's values.
3. **Advantages.** Per-token KL penalty against the reference (``kl.estimator``, coefficient from the fixed or
   adaptive controller) + the score on the last token (:func:`~align_pipeline.rl.token_rewards`), GAE (gamma,
   lambda), advantages whitened over the whole rollout (moments all-reduced over DP). The KL controller then updates
   with the mean per-sequence KL.
4. **Update.** ``epochs`` passes over the rollout in a seeded order, ``minibatches`` optimizer steps each: the actor
   on the clipped policy loss (+ entropy bonus), the critic on the clipped value loss.

Memory options (``offload``): the reference and reward model can live on the CPU except while scoring, the Adam
moments (and bf16 main weights) on the CPU while generating. Checkpoints hold actor and critic with their optimizers,
the KL controller, the prompt cursor and RNG; outputs: ``run_dir/actor/model`` (policy) and ``run_dir/critic/model``.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
import torch.distributed as tdist

from align_pipeline.config import PPOJobConfig
from align_pipeline.losses.ppo import entropy_bonus, ppo_policy_loss, ppo_value_loss
from align_pipeline.model import init
from align_pipeline.model.logprobs import token_entropy, token_nll
from align_pipeline.rl import (
    AdaptiveKLController,
    FixedKLController,
    gae,
    kl_penalty,
    masked_moments,
    moments_to_mean_var,
    token_rewards,
    whiten_with,
)
from align_pipeline.train import loop, rl_trainer, rollout
from align_pipeline.train.rl_trainer import RLContext

POLICY_METRICS = ["policy_loss", "clip_fraction", "approx_kl", "ratio", "entropy"]
VALUE_METRICS = ["value_loss", "value_clip_fraction"]


def kl_controller(job: PPOJobConfig):
    k = job.kl
    return AdaptiveKLController(k.coef, k.target, k.horizon) if k.adaptive else FixedKLController(k.coef)


def actor_forward_loss(job: PPOJobConfig, vocab_size: int, dist):
    coef = job.ppo.entropy_coef

    def forward_loss(module, batch):
        logits = module(batch["input_ids"], loop.position_ids_like(batch["input_ids"]), None)  # [b, s, V/tp]

        def loss_fn(logits):
            mask = batch["loss_mask"]
            logp = -token_nll(logits, batch["labels"], vocab_size, dist.tp_rank)  # [b, s]
            loss, count, metrics = ppo_policy_loss(logp, batch["old_logp"], batch["advantages"], mask,
                                                   job.ppo.clip_eps)
            with contextlib.nullcontext() if coef else torch.no_grad():
                entropy = token_entropy(logits, vocab_size, dist.tp_rank, dist.pgs.tp)  # [b, s]
                bonus, _, entropy_metrics = entropy_bonus(entropy, mask)
            if coef:
                loss = loss + coef * bonus
            return loss, count, {**metrics, **entropy_metrics}

        return logits, loss_fn

    return forward_loss


def critic_forward_loss(job: PPOJobConfig):
    def forward_loss(module, batch):
        values = module(batch["input_ids"], loop.position_ids_like(batch["input_ids"]), None)  # [b, s, 1]

        def loss_fn(values):
            return ppo_value_loss(values[..., 0].float(), batch["old_values"], batch["returns"], batch["loss_mask"],
                                  job.ppo.value_clip_eps)

        return values, loss_fn

    return forward_loss


def make_iterate(job: PPOJobConfig, ctx: RLContext, critic: rl_trainer.Trainable, kl_ctl):
    dist, rl, actor = ctx.dist, job.rl, ctx.actor
    actor_loss, critic_loss = actor_forward_loss(job, ctx.vocab_size, dist), critic_forward_loss(job)
    offload = rl_trainer.Offload(ctx, [actor, critic])

    def iterate(it: int) -> dict[str, float]:
        exp = rl_trainer.collect(ctx, it, offload, critic)
        mask, scores = exp.rollout.rows["loss_mask"], exp.scores
        beta = kl_ctl.value
        kl = kl_penalty(exp.old_logp, exp.ref_logp, job.kl.estimator) * mask  # [n, s]
        rewards = token_rewards(scores.total, kl, mask, beta)  # [n, s]
        advantages, returns = gae(rewards, exp.values, mask, job.ppo.gamma, job.ppo.lam)  # [n, s]
        raw_advantages = advantages
        if job.ppo.whiten_advantages:
            moments = torch.stack(masked_moments(advantages, mask))
            tdist.all_reduce(moments, group=dist.pgs.dp)
            advantages = whiten_with(advantages, mask, *moments_to_mean_var(*moments))
        seq_kl = kl.sum(-1)  # [n]

        stats = rl_trainer.rollout_stats(ctx, exp)
        stats.add("rollout/rewards_with_kl", scores.total - beta * seq_kl, std=False)
        stats.add("rollout/init_policy_kl", seq_kl, std=False)
        stats.add("rollout/advantages", raw_advantages, mask)
        stats.add("rollout/returns", returns, mask)
        stats.add("rollout/values", exp.values, mask)
        m = stats.reduce()
        m["rollout/kl_coef"] = beta
        kl_ctl.update(m["rollout/init_policy_kl"], n_steps=rl.prompts_per_iteration * job.generation.samples_per_prompt)

        rows = {**exp.rollout.rows, "old_logp": exp.old_logp, "advantages": advantages, "old_values": exp.values,
                "returns": returns}
        n = exp.rollout.n

        def train():
            actor_steps, critic_steps = [], []
            for epoch in range(rl.epochs):
                order = torch.from_numpy(np.random.default_rng([rl.seed, it, epoch]).permutation(n)).to(dist.device)
                actor_steps += rl_trainer.update(actor, rows, order, rl.minibatches, rl.micro_batch_size, actor_loss,
                                                 POLICY_METRICS, ctx)
                critic_steps += rl_trainer.update(critic, rows, order, rl.minibatches, rl.micro_batch_size,
                                                  critic_loss, VALUE_METRICS, ctx)
            return actor_steps, critic_steps

        (actor_steps, critic_steps), t_train = rollout.timed(train)
        m.update(rl_trainer.mean_metrics(actor_steps, "train"))
        m.update(rl_trainer.mean_metrics(critic_steps, "critic"))
        m.update(rl_trainer.timing_metrics(ctx, exp, t_train, trained_rows=2 * rl.epochs * n))  # actor + critic
        return m

    return iterate


def main(job: PPOJobConfig) -> dict:
    ctx = rl_trainer.setup(job, "ppo")
    critic_src = init.resolve(job.critic_init or job.reward_model, job.model, ctx.tokenizer.vocab_size)
    critic = rl_trainer.build_trainable("critic", critic_src, job, ctx.dist, job.critic_optimizer,
                                        job.rl.iterations * ctx.steps_per_iteration, head="value")
    kl_ctl = kl_controller(job)
    iterate = make_iterate(job, ctx, critic, kl_ctl)
    return rl_trainer.fit(ctx, "ppo", [ctx.actor, critic], iterate, (kl_ctl.state_dict, kl_ctl.load_state_dict),
                          extra_meta={"critic": {"reward": {"pooling": ctx.rm_pooling or "mean"}}})


if __name__ == "__main__":  # the torch_dist checkpoint saver spawns processes: the guard is required
    loop.cli(PPOJobConfig, main, __doc__)
