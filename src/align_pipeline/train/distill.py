"""On-policy distillation: the student samples, the teacher grades every token.

    torchrun --nproc_per_node 2 -m align_pipeline.train.distill --config run/config.json

Each iteration, in :func:`main`'s loop: the student (the policy, from ``paths.policy``) samples
``generation.samples_per_prompt`` responses per prompt; the frozen teacher (``paths.teacher``: any policy checkpoint
or HF directory, loaded into this job's TP layout, offloaded with ``offload.frozen_models``) scores each sampled
token's log-prob; the student then takes ``epochs x minibatches`` optimizer steps on
:func:`~align_pipeline.losses.distill.distill_loss`, the per-token reverse KL to the teacher on its own samples
(Agarwal et al. 2024, GKD with the reverse KL on student samples), plus, with ``loss.reward_weight`` > 0, the task
reward's policy gradient with RLOO advantages. The reward functions are always evaluated: ``rollout/accuracy`` and
the validation accuracy show what the student has learnt. With several steps per rollout, the later steps use the
iteration's samples as they are (no importance weights: the student moves little within one iteration). Output:
``run_dir/actor/model``, whose lineage names the teacher.
"""

from __future__ import annotations

import time

import torch

from align_pipeline.config.distill import DistillConfig, DistillJob
from align_pipeline.losses.distill import distill_loss
from align_pipeline.model.logprobs import token_nll
from align_pipeline.model.sequences import run
from align_pipeline.rl.advantages import rloo_advantages
from align_pipeline.train.core import rollout
from align_pipeline.train.core.checkpointing import Checkpoints
from align_pipeline.train.core.cli import cli
from align_pipeline.train.core.metrics import Timings, mean_metrics
from align_pipeline.train.core.optimizer import build_trainable
from align_pipeline.train.core.rl_stage import RLStage


def student_loss(cfg: DistillConfig, vocab_size: int, tp_rank: int):
    """(module, rows) -> (logits, loss_fn): the reverse KL to the teacher's log-probs (+ the task reward's term)."""

    def forward_loss(module, batch):
        logits = run(module, batch["input_ids"])  # [b, s, V/tp]

        def loss_fn(logits):
            logp = -token_nll(logits, batch["labels"], vocab_size, tp_rank)  # [b, s]
            return distill_loss(logp, batch["teacher_logp"], batch["loss_mask"], kl_coef=cfg.loss.kl_coef,
                                advantages=batch["advantages"], reward_weight=cfg.loss.reward_weight)

        return logits, loss_fn

    return forward_loss


def main(job: DistillJob) -> dict:
    # ---- set-up: process groups, tokenizer, the student (trained), reward functions, the teacher (frozen), prompts
    cfg = job.distill
    stage = RLStage("distill", job, cfg)
    rl, gen, dist = stage.rl, stage.gen, stage.dist
    student = build_trainable(stage.source, job.parallel, cfg.optimizer, rl.iterations * rl.steps_per_iteration,
                              dist, lora=cfg.lora)
    stage.load_scoring(kl_reference=False, teacher=job.paths.teacher)
    metric_names = ["distill_loss", "reverse_kl"] + (["pg_loss"] if cfg.loss.reward_weight else [])
    offload = stage.offload([student.optimizer])
    loss = student_loss(cfg, stage.vocab, dist.tp_rank)
    ckpts = Checkpoints.for_rl({"actor": (student, stage.run_dir / "actor")}, rl, job, "distill", dist)
    iteration, _ = stage.start(student, ckpts)

    # ---- the loop: the student samples -> the teacher's log-probs -> updates -> log -> checkpoint ----
    m: dict[str, float] = {}
    while iteration < rl.iterations:
        t0, timings = time.perf_counter(), Timings()
        # 1-2. the student's samples, their scores, and the teacher's log-probs of every sampled token [n, s]
        r, scores, student_logp, teacher_logp, _ = stage.rollout_and_score(student, iteration, timings, offload,
                                                                           old_forward=False)
        mask = r.rows["loss_mask"]
        # 3. the task reward's advantages (RLOO within a prompt's samples), when it is part of the loss
        advantages = (rloo_advantages(scores.total.view(-1, gen.samples_per_prompt)).flatten()  # [n]
                      if cfg.loss.reward_weight else torch.zeros_like(scores.total))
        stats = rollout.rollout_stats(r, scores, stage.reward_fns, dist)
        # the rollout's reverse KL to the teacher per response (k1 summed over its tokens: nats per sequence)
        stats.add("rollout/teacher_kl", torch.where(mask != 0, student_logp - teacher_logp, 0.0).sum(-1), std=False)
        m = stats.reduce()
        # 4. epochs x minibatches of student steps over a seeded order
        rows = {**r.rows, "advantages": advantages, "teacher_logp": teacher_logp}
        with timings("timing/train_s"):
            steps = stage.minibatch_steps(student, rows, loss, metric_names, iteration, r.n)
        iteration += 1
        # 5. log, validate, checkpoint
        m.update(mean_metrics(steps, "train"))
        stopped = stage.end_iteration(iteration, m, timings, r, rl.epochs * r.n, t0, student,
                                      stage.train_state(iteration))
        if stopped is not None:
            return stopped

    # ---- final validation, checkpoint and export of the student (its lineage names the teacher) ----
    return stage.finish(iteration, student, stage.train_state(iteration), m)


if __name__ == "__main__":  # torchrun runs the module; importing it (tests, spawned helpers) runs nothing
    cli(DistillJob, main, __doc__)
