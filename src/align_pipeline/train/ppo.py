"""PPO: actor, critic, frozen reference and frozen reward model colocated in one job.

    torchrun --nproc_per_node 2 -m align_pipeline.train.ppo --config run/config.json

Each iteration (Ouyang et al. 2022 / Ziegler et al. 2019, as NeMo-Aligner and TRL run it), in :func:`main`'s loop:

1. **Rollout.** This DP rank's prompts of the iteration (:class:`~align_pipeline.train.core.batches.PromptStream`)
   are continued by the actor with the KV-cached generator (``generation``: temperature, max new tokens, ...).
2. **Score.** Sequence score = ``reward_model_weight`` x reward model (a multi-attribute model's outputs combined by
   ``reward_model_attribute_weights``) + Σ weight x reward function (``reward.functions``, :mod:`align_pipeline.rewards`)
   (- ``missing_eos_penalty``). Forward passes give the actor's (old) and the reference's per-token log-probs and the
   critic's values.
3. **Advantages.** Per-token KL penalty against the reference (``kl.estimator``, coefficient ``kl.beta`` from the
   fixed or adaptive controller) + the score on the last token (:func:`~align_pipeline.rl.token_rewards`), GAE
   (gamma, lambda), advantages whitened over the whole rollout (moments all-reduced over DP). The KL controller then
   updates with the mean per-sequence KL. With an environment (``env``, multi-turn episodes), each turn's reward sits
   at the turn's last token and GAE runs over the policy's tokens, the environment's turns skipped.
4. **Update.** ``epochs`` passes over the rollout in a seeded order, ``minibatches`` optimizer steps each: the actor
   on the clipped policy loss (+ entropy bonus), then the critic on the (clipped) value loss. For the first
   ``critic_warmup_iterations`` only the critic trains.
5. **Log and checkpoint.** Per-iteration metrics to MLflow; checkpoints hold actor and critic with their optimizers,
   the KL controller and the prompt cursor (= the iteration) and RNG.

Memory options (``offload``): the reference and reward model can live on the CPU except while scoring, the Adam
moments (and bf16 main weights) on the CPU while generating. Outputs: ``run_dir/actor/model`` (policy) and
``run_dir/critic/model``.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as tdist

from align_pipeline.config.ppo import PPOConfig, PPOJob
from align_pipeline.losses.ppo import entropy_bonus, ppo_policy_loss, ppo_value_loss
from align_pipeline.model import init
from align_pipeline.model.checkpoint import reward_pooling
from align_pipeline.model.logprobs import token_entropy, token_nll
from align_pipeline.model.sequences import run
from align_pipeline.rl.advantages import (
    gae,
    gae_over_turns,
    masked_moments,
    moments_to_mean_var,
    token_rewards,
    whiten_with,
)
from align_pipeline.rl.kl import AdaptiveKLController, FixedKLController, kl_penalty
from align_pipeline.train.core import rollout
from align_pipeline.train.core.batches import split_rows
from align_pipeline.train.core.checkpointing import Checkpoints
from align_pipeline.train.core.cli import cli
from align_pipeline.train.core.metrics import Timings, mean_metrics
from align_pipeline.train.core.optimizer import build_trainable, train_step
from align_pipeline.train.core.rl_stage import RLStage

POLICY_METRICS = ["policy_loss", "clip_fraction", "approx_kl", "ratio", "entropy"]
VALUE_METRICS = ["value_loss", "value_clip_fraction"]


def actor_loss(cfg: PPOConfig, vocab_size: int, dist):
    """(module, rows) -> (logits, loss_fn): PPO's clipped policy loss (+ entropy bonus) on the response tokens."""
    coef = cfg.loss.entropy_coef

    def forward_loss(module, batch):
        logits = run(module, batch["input_ids"])  # [b, s, V/tp]

        def loss_fn(logits):
            mask = batch["loss_mask"]  # [b, s]
            logp = -token_nll(logits, batch["labels"], vocab_size, dist.tp_rank)  # [b, s]
            loss, count, metrics = ppo_policy_loss(logp, batch["old_logp"], batch["advantages"], mask,
                                                   cfg.loss.clip_eps)
            with contextlib.nullcontext() if coef else torch.no_grad():
                entropy = token_entropy(logits, vocab_size, dist.tp_rank, dist.pgs.tp)  # [b, s]
                bonus, _, entropy_metrics = entropy_bonus(entropy, mask)
            if coef:
                loss = loss + coef * bonus
            return loss, count, {**metrics, **entropy_metrics}

        return logits, loss_fn

    return forward_loss


def critic_loss(cfg: PPOConfig):
    """(module, rows) -> (values, loss_fn): PPO's clipped value loss on the response tokens."""

    def forward_loss(module, batch):
        values = run(module, batch["input_ids"])  # [b, s, 1]

        def loss_fn(values):
            return ppo_value_loss(values[..., 0].float(), batch["old_values"], batch["returns"], batch["loss_mask"],
                                  cfg.loss.value_clip_eps)

        return values, loss_fn

    return forward_loss


def advantages_and_returns(cfg: PPOConfig, scores: torch.Tensor, old_logp: torch.Tensor, ref_logp: torch.Tensor,
                           values: torch.Tensor, mask: torch.Tensor, beta: float, dist,
                           turn_rewards: torch.Tensor | None = None):
    """Per-token KL [n, s], GAE advantages (whitened over every DP rank when configured) and returns [n, s], and the
    raw advantages [n, s] for the metrics. A sample whose score is not finite (NaN, inf) gets advantage 0 and its own
    values as returns (no signal for actor or critic), and is left out of the whitening statistics.

    ``turn_rewards`` [n, s] (multi-turn episodes, ``ppo.env``): each turn's reward, x ``env.reward_weight``, at its
    last policy token; the rest of the score (the reward section's terms) at the last one; GAE over the policy's
    tokens with the environment's turns skipped (:func:`~align_pipeline.rl.advantages.gae_over_turns`)."""
    finite = torch.isfinite(scores)  # [n]
    scored = mask.bool() & finite[:, None]  # [n, s]  the response tokens of samples with a finite score
    kl = kl_penalty(old_logp, ref_logp, cfg.kl.estimator) * mask  # [n, s]
    if turn_rewards is None:
        rewards = token_rewards(torch.where(finite, scores, 0.0), kl, mask, beta)  # [n, s]: -beta * KL, + score
        raw, returns = gae(rewards, values, mask, cfg.loss.gamma, cfg.loss.lam)  # [n, s]
    else:
        turns = torch.where(finite[:, None], cfg.env.reward_weight * turn_rewards, 0.0)  # [n, s]
        rest = torch.where(finite, scores - turns.sum(-1), 0.0)  # [n]
        empty = ~mask.bool().any(-1)  # [n] an episode that ended before its first turn (a reset that ran over)
        placed = mask.clone()
        placed[empty, 0] = 1.0  # token_rewards needs a token per row; that row's rewards are 0 there
        rewards = token_rewards(torch.where(empty, 0.0, rest), kl, placed, beta) * mask + turns  # [n, s]
        raw, returns = gae_over_turns(rewards, values, mask, cfg.loss.gamma, cfg.loss.lam)  # [n, s]
    raw = torch.where(scored, raw, 0.0)  # [n, s]
    returns = torch.where(scored | ~mask.bool(), returns, values)  # [n, s]
    advantages = raw
    if cfg.loss.whiten_advantages:
        moments = torch.stack(masked_moments(raw, scored))
        tdist.all_reduce(moments, group=dist.pgs.dp)
        advantages = whiten_with(raw, scored, *moments_to_mean_var(*moments))
    return kl, advantages, returns, raw


def main(job: PPOJob) -> dict:
    # ---- set-up: process groups, tokenizer, actor + critic (trained), reward functions, reference + reward model
    #      (frozen), prompts ----
    cfg, paths = job.ppo, job.paths
    stage = RLStage("ppo", job, cfg)
    rl, gen, mbs, dist = stage.rl, stage.gen, stage.mbs, stage.dist
    total_steps = rl.iterations * rl.steps_per_iteration
    warmup = cfg.critic_warmup_iterations  # the actor waits while the critic learns this reward's returns
    actor = build_trainable(stage.source, job.parallel, cfg.optimizer, (rl.iterations - warmup) * rl.steps_per_iteration,
                            dist, lora=cfg.lora)
    # the critic before the frozen models: its adapters' initial draws do not depend on whether a reference is built
    critic_source = init.resolve(paths.critic or paths.reward_model, job.model, stage.tok.vocab_size)
    critic = build_trainable(critic_source, job.parallel, cfg.critic_optimizer, total_steps, dist, head="value",
                             lora=cfg.critic_lora)
    stage.load_scoring()
    kl_ctl = (AdaptiveKLController(cfg.kl.beta, cfg.kl.target, cfg.kl.horizon) if cfg.kl.adaptive
              else FixedKLController(cfg.kl.beta))
    offload = stage.offload([actor.optimizer, critic.optimizer])
    policy_loss, value_loss = actor_loss(cfg, stage.vocab, dist), critic_loss(cfg)
    ckpts = Checkpoints.for_rl({"actor": (actor, stage.run_dir / "actor"), "critic": (critic, stage.run_dir / "critic")},
                               rl, job, "ppo", dist)
    iteration, state = stage.start(actor, ckpts)
    if state is not None:
        kl_ctl.load_state_dict(state["kl_controller"])

    # ---- the loop: rollout -> score -> KL + advantages -> minibatch updates -> log -> checkpoint ----
    m: dict[str, float] = {}
    while iteration < rl.iterations:
        t0, timings = time.perf_counter(), Timings()
        # 1-2. rollout; its scores and the per-token forward passes of actor, reference and critic
        r, scores, old_logp, ref_logp, values = stage.rollout_and_score(
            actor, iteration, timings, offload, also=lambda rows: rollout.token_values(critic.model, rows, mbs, dist))
        # 3. KL penalty, GAE, whitening; the KL controller moves with the rollout's KL
        mask, beta = r.rows["loss_mask"], kl_ctl.value
        kl, advantages, returns, raw = advantages_and_returns(cfg, scores.total, old_logp, ref_logp, values, mask,
                                                              beta, dist, r.rows.get("turn_rewards"))
        seq_kl = kl.sum(-1)  # [n]
        stats = rollout.rollout_stats(r, scores, stage.reward_fns, dist)
        stats.add("rollout/rewards_with_kl", scores.total - beta * seq_kl, torch.isfinite(scores.total), std=False)
        stats.add("rollout/init_policy_kl", seq_kl, std=False)
        stats.add("rollout/advantages", raw, mask)
        stats.add("rollout/returns", returns, mask)
        stats.add("rollout/values", values, mask)
        rollout.mismatch_stats(stats, r.rows, old_logp)  # the training forward vs the engine's log-probs
        m = {**stats.reduce(), "rollout/kl_beta": beta}
        kl_ctl.update(m["rollout/init_policy_kl"], n_steps=rl.prompts_per_iteration * gen.samples_per_prompt)
        # 4. epochs x minibatches: the actor's steps (after the critic's warm-up), then the critic's, over the same
        #    seeded order
        rows = {**r.rows, "old_logp": old_logp, "advantages": advantages, "old_values": values, "returns": returns}
        actor_steps, critic_steps = [], []
        train_actor = iteration >= warmup
        with timings("timing/train_s"):
            for epoch in range(rl.epochs):
                order = rollout.minibatch_order(rl.seed, iteration, epoch, r.n, dist.device)
                if train_actor:
                    actor_steps += [train_step(actor, split_rows(rows, mbs, chunk)[0], policy_loss, POLICY_METRICS,
                                               dist, stage.seq_length) for chunk in order.chunk(rl.minibatches)]
                critic_steps += [train_step(critic, split_rows(rows, mbs, chunk)[0], value_loss, VALUE_METRICS, dist,
                                            stage.seq_length) for chunk in order.chunk(rl.minibatches)]
        iteration += 1
        # 5. log, validate, checkpoint
        if actor_steps:
            m.update(mean_metrics(actor_steps, "train"))
        m.update(mean_metrics(critic_steps, "critic"))
        trained_rows = (2 if train_actor else 1) * rl.epochs * r.n  # actor + critic rows
        stopped = stage.end_iteration(iteration, m, timings, r, trained_rows, t0, actor,
                                      stage.train_state(iteration, kl_controller=kl_ctl.state_dict()))
        if stopped is not None:
            return stopped

    # ---- final validation, checkpoint and export of actor and critic ----
    critic_meta = {"reward_head": {"pooling": reward_pooling(critic_source.parent["path"])}} \
        if critic_source.head == "value" else {}
    return stage.finish(iteration, actor, stage.train_state(iteration, kl_controller=kl_ctl.state_dict()), m,
                        per_model={"critic": critic_meta})


if __name__ == "__main__":  # torchrun runs the module; importing it (tests, spawned helpers) runs nothing
    cli(PPOJob, main, __doc__)
