"""REINFORCE family: RLOO or GRPO, no critic.

    torchrun --nproc_per_node 2 -m align_pipeline.train.reinforce --config run/config.json

Each iteration, in :func:`main`'s loop: ``generation.samples_per_prompt`` (n >= 2) responses per prompt from the
policy, each scored by the weighted reward functions and/or the reward model (``reward``); the n scores of a prompt
give every sample one advantage, either leave-one-out (RLOO, Ahmadian et al. 2024) or group-normalised (GRPO, Shao et al. 2024),
shared by all its tokens. The policy then takes ``epochs x minibatches`` optimizer steps on
:func:`~align_pipeline.losses.reinforce.reinforce_loss`: plain ``-A log pi`` when the rollout is used for a single
step, PPO's clipped ratio against the rollout policy otherwise, plus ``kl.beta`` x KL to the frozen reference
(reported when beta > 0; with beta 0 no reference model is built and no reference forward runs). The n samples
of a prompt always sit on one DP rank, so the group baselines need no
communication. Output: ``run_dir/actor/model``.
"""

from __future__ import annotations

import time

import torch

from align_pipeline.config.reinforce import ReinforceConfig, ReinforceJob
from align_pipeline.losses.reinforce import reinforce_loss
from align_pipeline.model.logprobs import token_nll
from align_pipeline.model.sequences import run
from align_pipeline.rl.advantages import groups_without_signal, grpo_advantages, rloo_advantages
from align_pipeline.rl.kl import kl_penalty
from align_pipeline.train.core import rollout
from align_pipeline.train.core.checkpointing import Checkpoints
from align_pipeline.train.core.cli import cli
from align_pipeline.train.core.metrics import Timings, mean_metrics
from align_pipeline.train.core.optimizer import build_trainable
from align_pipeline.train.core.rl_stage import RLStage


def group_advantages(cfg: ReinforceConfig, scores: torch.Tensor) -> torch.Tensor:
    """Flat prompt-major scores [P*n] -> one advantage per sample [P*n] (0 for a non-finite score, which no baseline
    includes)."""
    groups = scores.view(-1, cfg.generation.samples_per_prompt)  # [P, n]
    if cfg.loss.estimator == "rloo":
        return rloo_advantages(groups).flatten()
    return grpo_advantages(groups, eps=cfg.loss.std_eps, scale=cfg.loss.grpo_scale).flatten()


def policy_loss(cfg: ReinforceConfig, vocab_size: int, tp_rank: int, clipped: bool):
    """(module, rows) -> (logits, loss_fn): the REINFORCE loss (clipped ratio when ``clipped``) + beta x KL, with the
    rollout engine's log-probs for the mismatch metrics and ``loss.rollout_correction``."""

    def forward_loss(module, batch):
        logits = run(module, batch["input_ids"])  # [b, s, V/tp]

        def loss_fn(logits):
            logp = -token_nll(logits, batch["labels"], vocab_size, tp_rank)  # [b, s]
            return reinforce_loss(logp, batch["advantages"], batch["loss_mask"], ref_logp=batch.get("ref_logp"),
                                  beta=cfg.kl.beta, estimator=cfg.kl.estimator,
                                  old_logp=batch["old_logp"] if clipped else None, clip_eps=cfg.loss.clip_eps,
                                  clip_eps_high=cfg.loss.clip_eps_high, objective=cfg.loss.objective,
                                  ratio_level=cfg.loss.ratio_level, aggregation=cfg.loss.aggregation,
                                  max_tokens=cfg.generation.max_new_tokens,
                                  rollout_logp=batch["rollout_logp"], correction=cfg.loss.rollout_correction,
                                  tis_cap=cfg.loss.tis_cap, mis_low=cfg.loss.mis_low, mis_high=cfg.loss.mis_high)

        return logits, loss_fn

    return forward_loss


def main(job: ReinforceJob) -> dict:
    # ---- set-up: process groups, tokenizer, the policy (trained), reward functions, reference + reward model
    #      (frozen), prompts ----
    cfg = job.reinforce
    stage = RLStage("reinforce", job, cfg)
    rl, gen, dist = stage.rl, stage.gen, stage.dist
    actor = build_trainable(stage.source, job.parallel, cfg.optimizer, rl.iterations * rl.steps_per_iteration, dist,
                            lora=cfg.lora)
    stage.load_scoring(kl_reference=cfg.kl.beta > 0)  # beta 0: no reference model, no KL (as TRL, veRL)
    clipped = rl.steps_per_iteration > 1  # the rollout policy differs from the policy after the first step
    metric_names = ["pg_loss"] + (["kl"] if stage.kl_reference else []) + [
        "logprob_diff", "is_weight", "is_dropped"] + (["clip_fraction", "ratio"] if clipped else [])
    offload = stage.offload([actor.optimizer])
    loss = policy_loss(cfg, stage.vocab, dist.tp_rank, clipped)
    ckpts = Checkpoints.for_rl({"actor": (actor, stage.run_dir / "actor")}, rl, job, "reinforce", dist)
    iteration, _ = stage.start(actor, ckpts)

    # ---- the loop: rollout -> score -> group advantages -> minibatch updates -> log -> checkpoint ----
    m: dict[str, float] = {}
    while iteration < rl.iterations:
        t0, timings = time.perf_counter(), Timings()
        # 1-2. rollout; its scores and the per-token log-probs of the rollout policy and the reference
        # (on-policy, old_logp is the engine's: the training step's forward is the only other one)
        r, scores, old_logp, ref_logp, _ = stage.rollout_and_score(actor, iteration, timings, offload,
                                                                   old_forward=clipped)
        # 3. one advantage per sample from its group
        mask = r.rows["loss_mask"]
        advantages = group_advantages(cfg, scores.total)  # [n]
        groups = scores.total.view(-1, gen.samples_per_prompt)  # [P, n]
        stats = rollout.rollout_stats(r, scores, stage.reward_fns, dist)
        if ref_logp is not None:
            stats.add("rollout/init_policy_kl", (kl_penalty(old_logp, ref_logp, "k1") * mask).sum(-1), std=False)
        stats.add("rollout/advantages", advantages)
        stats.add("rollout/fraction_of_groups_without_signal", groups_without_signal(groups).double(), std=False)
        for key, value in stage.sampling.items():  # dynamic sampling: rounds (mean over DP), groups (total)
            stats.add(f"rollout/dynamic_sampling/{key}", torch.tensor([value], device=dist.device),
                      total=key != "rounds", std=False)
        if clipped:  # the training forward ran over the rollout: its mismatch with the engine
            rollout.mismatch_stats(stats, r.rows, old_logp)
        m = stats.reduce()
        # 4. epochs x minibatches of policy steps over a seeded order
        rows = {**r.rows, "advantages": advantages, "old_logp": old_logp,
                **({"ref_logp": ref_logp} if ref_logp is not None else {})}
        with timings("timing/train_s"):
            steps = stage.minibatch_steps(actor, rows, loss, metric_names, iteration, r.n)
        iteration += 1
        # 5. log, validate, checkpoint
        m.update(mean_metrics(steps, "train"))
        stopped = stage.end_iteration(iteration, m, timings, r, rl.epochs * r.n, t0, actor,
                                      stage.train_state(iteration))
        if stopped is not None:
            return stopped

    # ---- final validation, checkpoint and export of the policy ----
    return stage.finish(iteration, actor, stage.train_state(iteration), m)


if __name__ == "__main__":  # torchrun runs the module; importing it (tests, spawned helpers) runs nothing
    cli(ReinforceJob, main, __doc__)
