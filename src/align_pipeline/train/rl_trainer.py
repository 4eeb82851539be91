"""The iteration loop the RL stages share (PPO, REINFORCE): set-up, resume, rollout + update iterations, validation,
checkpoints and the exported models. A stage provides one ``iterate(iteration) -> metrics`` function and the state it
must carry across a resume (the KL controller); everything else is here.

Checkpoint layout: each trained model has its own training checkpoints (``run_dir/<name>/checkpoints/iter_<k>``:
weights, optimizer, schedule, RNG, and the stage's ``train_state`` with the iteration = prompt cursor and the KL
controller). A resume starts from the newest iteration *every* model has completely written.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as tdist

from align_pipeline.config import ModelConfig, OptimizerConfig, RLJobConfig, TrainingConfig, config_hash, to_dict
from align_pipeline.data.formats import load_jsonl
from align_pipeline.data.tokenizer import load_tokenizer
from align_pipeline.model import checkpoint, init
from align_pipeline.model.init import ModelSource
from align_pipeline.tracking import RunLogger
from align_pipeline.train import loop, rollout
from align_pipeline.train.distributed import Dist, init_distributed
from align_pipeline.train.trainer import finish


@dataclasses.dataclass
class Trainable:
    """A model the stage trains, with its optimizer and schedule."""

    name: str
    """"actor" or "critic": the checkpoint sub-directory and the metric prefix."""
    source: ModelSource
    model: Any
    optimizer: Any
    scheduler: Any
    head: str = "lm"


@dataclasses.dataclass
class RLContext:
    """What every RL stage sets up before its loop."""

    job: RLJobConfig
    dist: Dist
    tokenizer: Any
    logger: RunLogger
    seq_length: int
    vocab_size: int
    prompts: rollout.PromptStream
    val_records: list[dict]
    checker: Callable[[str, str, str | None], bool]
    actor: Trainable
    reference: Any
    reward_model: Any | None
    rm_pooling: str | None
    steps_per_iteration: int
    """Optimizer steps per iteration: epochs x minibatches."""


def setup(job: RLJobConfig, stage: str) -> RLContext:
    """Process groups, tokenizer, prompts, the actor (trainable), the frozen reference and reward model."""
    rl = job.rl
    dist = init_distributed(job.parallel, rl.seed)
    tok = load_tokenizer(job.tokenizer)
    source = init.resolve(job.init_from, job.model, tok.vocab_size)
    steps = rl.epochs * rl.minibatches
    rows = rl.prompts_per_iteration // dist.dp_size * job.generation.samples_per_prompt
    if rl.prompts_per_iteration % dist.dp_size or rows % (rl.minibatches * rl.micro_batch_size):
        raise ValueError(
            f"[{stage}] a rollout of {rl.prompts_per_iteration} prompts x {job.generation.samples_per_prompt} samples "
            f"must split over DP={dist.dp_size} ranks into {rl.minibatches} minibatches of micro-batches of "
            f"{rl.micro_batch_size} rows")
    loop.log(dist, f"[{stage}] world={dist.world_size} tp={dist.tp_size} dp={dist.dp_size} backend={dist.backend} "
                   f"policy={job.init_from} reward_model={job.reward_model}")
    actor = build_trainable("actor", source, job, dist, job.optimizer, rl.iterations * steps)
    reference = build_frozen(job.reference or job.init_from, job, dist, "lm")
    rm = pooling = None
    if job.reward_model is not None and job.reward.reward_model_weight:
        rm = build_frozen(job.reward_model, job, dist, "value")
        pooling = checkpoint.read_meta(job.reward_model).get("reward", {}).get("pooling", "last")
    records = load_jsonl(job.prompts)
    if not records:
        raise ValueError(f"{job.prompts} has no prompts")
    return RLContext(
        job=job, dist=dist, tokenizer=tok, logger=RunLogger(rank=dist.rank), seq_length=source.model.seq_length,
        vocab_size=source.vocab_size, prompts=rollout.PromptStream(records, rl.prompts_per_iteration, dist, rl.seed),
        val_records=load_jsonl(job.val_prompts)[: rl.eval_prompts] if job.val_prompts else [],
        checker=rollout.load_checker(job.reward.checker), actor=actor, reference=reference, reward_model=rm,
        rm_pooling=pooling, steps_per_iteration=steps,
    )


def build_trainable(name: str, source: ModelSource, job: RLJobConfig, dist: Dist, optimizer: OptimizerConfig,
                    total_steps: int, head: str = "lm") -> Trainable:
    training = TrainingConfig(seed=job.rl.seed, train_steps=total_steps, global_batch_size=1, micro_batch_size=1,
                              optimizer=optimizer)
    model, opt, sched = loop.build_model_and_optimizer(source, job.parallel, training, dist, head=head)
    return Trainable(name, source, model, opt, sched, head)


def build_frozen(path: str, job: RLJobConfig, dist: Dist, head: str):
    """A frozen model (reference, reward model): eval mode, no gradients (bf16 weights when training is bf16)."""
    source = init.resolve(path, ModelConfig(attention_backend=job.model.attention_backend), 0)
    model = init.build_model(source, job.parallel, dist, head=head)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def update(t: Trainable, rows: dict[str, torch.Tensor], order: torch.Tensor, minibatches: int, micro_batch_size: int,
           forward_loss: loop.ForwardLoss, metrics: list[str], ctx: RLContext) -> list[dict[str, float]]:
    """One pass over ``rows`` in ``order``: ``minibatches`` optimizer steps of ``t``; per-step metrics."""
    out = []
    for chunk in order.chunk(minibatches):
        loop.zero_grads(t.model, t.optimizer)
        m = loop.run_microbatches(t.model, rollout.split(rows, micro_batch_size, chunk), forward_loss, metrics,
                                  ctx.dist, ctx.seq_length, forward_only=False)
        ok, grad_norm = loop.optimizer_step(t.model, t.optimizer, t.scheduler)
        m.pop("count", None)
        out.append({**m, "grad_norm": grad_norm, "lr": loop.current_lr(t.optimizer), "update_skipped": float(not ok)})
    return out


class Offload:
    """The ``offload`` options: frozen models on the CPU except while scoring; Adam moments (and bf16 main weights) of
    the trained models on the CPU while generating and scoring. No-ops unless configured."""

    def __init__(self, ctx: RLContext, trainables: list[Trainable]):
        self.cfg, self.device = ctx.job.offload, ctx.dist.device
        self.frozen = [m for m in (ctx.reference, ctx.reward_model) if m is not None]
        self.trainables = trainables
        self.frozen_to("cpu")

    def frozen_to(self, device) -> None:
        if self.cfg.frozen_models:
            for m in self.frozen:
                rollout.offload_model(m, device)

    def optimizers_to(self, device) -> None:
        if self.cfg.optimizer_states:
            for t in self.trainables:
                rollout.offload_optimizer(t.optimizer, device)


@dataclasses.dataclass
class Experience:
    """One iteration's scored rollout on this DP rank."""

    rollout: rollout.Rollout
    scores: rollout.Scores
    old_logp: torch.Tensor
    """[n, s] log-probs of the rollout policy (the actor before this iteration's updates)."""
    ref_logp: torch.Tensor
    """[n, s] log-probs of the frozen reference."""
    values: torch.Tensor | None
    """[n, s] critic values (PPO), else None."""
    generate_s: float
    score_s: float


def collect(ctx: RLContext, iteration: int, offload: Offload, critic: Trainable | None = None) -> Experience:
    """Generate this DP rank's rollout of ``iteration`` with the actor, then score it and run the forward passes
    (actor, reference, critic when given)."""
    job, dist, mbs = ctx.job, ctx.dist, ctx.job.rl.micro_batch_size
    offload.optimizers_to("cpu")
    r, t_gen = rollout.timed(rollout.generate_rollout, ctx.actor.model, ctx.prompts.local(iteration), job.generation,
                             ctx.tokenizer, ctx.vocab_size, dist, ctx.seq_length,
                             rollout.iteration_seed(job.generation.seed, iteration, dist.dp_rank))

    def score_all():
        offload.frozen_to(dist.device)
        scores = rollout.score(r, job.reward, ctx.checker, ctx.reward_model, ctx.rm_pooling, mbs, dist)
        old_logp = rollout.token_logprobs(ctx.actor.model, r.rows, ctx.vocab_size, mbs, dist)
        ref_logp = rollout.token_logprobs(ctx.reference, r.rows, ctx.vocab_size, mbs, dist)
        values = rollout.token_values(critic.model, r.rows, mbs, dist) if critic is not None else None
        offload.frozen_to("cpu")
        return scores, old_logp, ref_logp, values

    (scores, old_logp, ref_logp, values), t_score = rollout.timed(score_all)
    offload.optimizers_to(dist.device)
    return Experience(r, scores, old_logp, ref_logp, values, t_gen, t_score)


def rollout_stats(ctx: RLContext, exp: Experience) -> rollout.DPStats:
    """The rollout metrics both stages report (a stage adds its own before ``reduce()``)."""
    mask = exp.rollout.rows["loss_mask"]
    stats = rollout.DPStats(ctx.dist)
    stats.add("rollout/rewards", exp.scores.total)
    stats.add("rollout/accuracy", exp.scores.correct, std=False)
    if exp.scores.rm is not None:
        stats.add("rollout/reward_model_score", exp.scores.rm, std=False)
    stats.add("rollout/response_lengths", mask.sum(-1), std=False)
    stats.add("rollout/fraction_of_samples_properly_ended",
              torch.tensor(exp.rollout.ended_with_eos, dtype=torch.float64, device=ctx.dist.device), std=False)
    return stats


def timing_metrics(ctx: RLContext, exp: Experience, train_s: float, trained_rows: int) -> dict[str, float]:
    """Generation vs scoring vs training time of the iteration, and tokens/s of each (over all DP ranks)."""
    generated = torch.tensor([float(exp.rollout.rows["loss_mask"].sum())], dtype=torch.float64,
                             device=ctx.dist.device)
    tdist.all_reduce(generated, group=ctx.dist.pgs.dp)
    return {
        "timing/generate_s": exp.generate_s, "timing/score_s": exp.score_s, "timing/train_s": train_s,
        "throughput/generated_tokens_per_s": generated.item() / max(exp.generate_s, 1e-9),
        "throughput/train_tokens_per_s": trained_rows * ctx.dist.dp_size * ctx.seq_length / max(train_s, 1e-9),
    }


def mean_metrics(steps: list[dict[str, float]], prefix: str) -> dict[str, float]:
    """Average per-step metrics of one iteration, keys prefixed (``train/policy_loss``, ``critic/grad_norm``)."""
    return {f"{prefix}/{k}": float(np.mean([s[k] for s in steps])) for k in steps[0]}


def validate(ctx: RLContext) -> dict[str, float]:
    """Accuracy of the actor on the held-out prompts, greedy and sampled (one sample per prompt at the rollout
    temperature); DP ranks split the prompts."""
    if not ctx.val_records:
        return {}
    mine = ctx.val_records[ctx.dist.dp_rank :: ctx.dist.dp_size]
    totals = torch.zeros(3, dtype=torch.float64, device=ctx.dist.device)
    if mine:
        one = dataclasses.replace(ctx.job.generation, samples_per_prompt=1)
        for i, greedy in enumerate((True, False)):
            r = rollout.generate_rollout(ctx.actor.model, mine, one, ctx.tokenizer, ctx.vocab_size, ctx.dist,
                                         ctx.seq_length, seed=rollout.iteration_seed(one.seed, -1, ctx.dist.dp_rank),
                                         greedy=greedy)
            totals[i] = float(sum(ctx.checker(rec["prompt"], text, rec.get("answer"))
                                  for rec, text in zip(r.records, r.texts)))
        totals[2] = len(mine)
    tdist.all_reduce(totals, group=ctx.dist.pgs.dp)
    n = max(totals[2].item(), 1.0)
    return {"val/greedy_accuracy": totals[0].item() / n, "val/accuracy": totals[1].item() / n}


def fit(ctx: RLContext, stage: str, trainables: list[Trainable], iterate: Callable[[int], dict[str, float]],
        state: tuple[Callable[[], dict], Callable[[dict], None]], extra_meta: dict[str, Any] | None = None) -> dict:
    """Run the iterations (resuming when a checkpoint exists); export every trainable; write result.json.

    ``state``: (get, set) of the stage's own resumable state (e.g. the KL controller).
    """
    job, dist, logger, rl = ctx.job, ctx.dist, ctx.logger, ctx.job.rl
    run_dir = Path(job.run_dir)
    get_state, set_state = state
    iteration = 0
    resume_from = _common_checkpoint(run_dir, trainables) if rl.resume else None
    if resume_from is not None:
        for t in trainables:
            saved = checkpoint.load_training(checkpoint.iteration_dir(run_dir / t.name, resume_from), t.model,
                                             t.optimizer, t.scheduler)
        iteration = int(saved["iteration"])
        if saved["consumed_prompts"] != ctx.prompts.consumed(iteration):
            raise RuntimeError(f"prompt cursor {saved['consumed_prompts']} does not match iteration {iteration}")
        set_state(saved["stage_state"])
        loop.log(dist, f"[{stage}] resumed at iteration {iteration} from {run_dir}")
    logger.log_params({"job": to_dict(job), "world_size": dist.world_size, "resumed_from_iteration": iteration})

    def save(at: int) -> None:
        train_state = {"iteration": at, "consumed_prompts": ctx.prompts.consumed(at), "stage_state": get_state()}
        for t in trainables:
            checkpoint.save_training(run_dir / t.name, at, t.model, t.optimizer, t.scheduler, train_state,
                                     {"stage": stage, "model": t.name, "config_hash": config_hash(job)})
            if dist.is_logging_rank and rl.keep_checkpoints > 0:
                found = checkpoint.complete_checkpoints(run_dir / t.name)
                for old in sorted(found)[: -rl.keep_checkpoints]:
                    shutil.rmtree(found[old], ignore_errors=True)

    history: list[dict[str, float]] = []
    last: dict[str, float] = {}
    start, t_start = iteration, time.perf_counter()
    while iteration < rl.iterations:
        t0 = time.perf_counter()
        metrics = iterate(iteration)
        iteration += 1
        metrics["timing/iteration_s"] = time.perf_counter() - t0
        if rl.eval_interval and iteration % rl.eval_interval == 0 and iteration < rl.iterations:
            metrics.update(validate(ctx))
        last = metrics
        history.append({"iteration": iteration, **metrics})
        if iteration % rl.log_interval == 0 or iteration == rl.iterations or "val/greedy_accuracy" in metrics:
            eta = (time.perf_counter() - t_start) / (iteration - start) * (rl.iterations - iteration)
            _print_progress(dist, stage, iteration, rl.iterations, metrics, eta)
            logger.log_metrics(metrics, iteration)
            logger.log_system_metrics(iteration)
        if rl.save_interval and iteration % rl.save_interval == 0 and iteration < rl.iterations:
            save(iteration)
        if (job.stop_after_iterations is not None and iteration - start >= job.stop_after_iterations
                and iteration < rl.iterations):
            save(iteration)
            loop.log(dist, f"[{stage}] stopping after {iteration - start} iterations (stop_after_iterations); "
                           f"a rerun resumes at iteration {iteration}")
            return finish(dist, logger, run_dir, {"stopped_at_iteration": iteration, "history": history})

    final = validate(ctx)
    logger.log_metrics(final, iteration)
    loop.log(dist, f"[{stage}] done: " + ", ".join(f"{k} {v:.4f}" for k, v in final.items()))
    save(iteration)
    outputs = {}
    for t in trainables:
        meta = {
            "stage": stage,
            "step": iteration,
            "model": to_dict(t.source.model),
            "head": t.head,
            "num_outputs": 1,
            "vocab_size": t.source.vocab_size,
            "tokenizer": {"path": str(job.tokenizer), "fingerprint": ctx.tokenizer.fingerprint},
            "saved_with_parallel": to_dict(job.parallel),
            "metrics": {**final, **{k: v for k, v in last.items() if not k.startswith("timing/")}},
            "lineage": {**job.lineage, "parent": t.source.parent, "reference": job.reference or job.init_from,
                        "reward_model": job.reward_model, "config_hash": config_hash(job),
                        "mlflow_run_id": os.environ.get("MLFLOW_RUN_ID")},
            **(extra_meta or {}).get(t.name, {}),
        }
        outputs[f"{t.name}_dir"] = str(checkpoint.save_model(run_dir / t.name / "model", t.model, meta))
    result = {**outputs, "step": iteration, "iteration": iteration, **final, "final": {**last, **final},
              "history": history}
    return finish(dist, logger, run_dir, result)


def _common_checkpoint(run_dir: Path, trainables: list[Trainable]) -> int | None:
    """The newest iteration for which every trainable has a complete checkpoint."""
    common = None
    for t in trainables:
        steps = set(checkpoint.complete_checkpoints(run_dir / t.name))
        common = steps if common is None else common & steps
    return max(common) if common else None


def _print_progress(dist: Dist, stage: str, it: int, total: int, m: dict[str, float], eta: float) -> None:
    parts = [f"[{stage}] iter {it}/{total}"]
    for key, label, fmt in (("rollout/rewards_mean", "reward", "{:.3f}"), ("rollout/accuracy", "acc", "{:.3f}"),
                            ("rollout/init_policy_kl", "kl", "{:.4f}"), ("train/policy_loss", "pg", "{:.4f}"),
                            ("train/pg_loss", "pg", "{:.4f}"), ("critic/value_loss", "vf", "{:.4f}"),
                            ("val/greedy_accuracy", "val_greedy_acc", "{:.3f}"),
                            ("timing/generate_s", "gen", "{:.2f}s"), ("timing/train_s", "train", "{:.2f}s")):
        if key in m:
            parts.append(f"{label} {fmt.format(m[key])}")
    parts.append(f"eta {int(eta) // 60}:{int(eta) % 60:02d}")
    loop.log(dist, " | ".join(parts))

