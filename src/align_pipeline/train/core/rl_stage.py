"""What the RL stages (PPO, REINFORCE) share around their loops, so each loop stays readable in its own file:

* set-up: process groups, tokenizer, the policy's source and the job's layout check (:class:`RLStage`), then - after
  the stage has built what it trains - the reward functions, the frozen judges (KL reference, reward model) and the
  prompts (:meth:`RLStage.load_scoring`), resume and the warm-up of generation (:meth:`RLStage.start`);
* per iteration: 1. the rollout and 2. its scores and per-token log-probs (:meth:`RLStage.rollout_and_score`), and
  5. the tail - metrics, validation, run log, checkpoint (:meth:`RLStage.end_iteration`);
* the end: final validation, checkpoint, export with meta.json (:meth:`RLStage.finish`).

Steps 3 (advantages) and 4 (updates) are each stage's own, in its file.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from align_pipeline.config.base import ConfigError, config_hash, to_dict
from align_pipeline.config.checks import attribute_weights, check_job
from align_pipeline.config.common import ModelConfig, RewardConfig, RLLoopConfig
from align_pipeline.data.formats import load_jsonl
from align_pipeline.data.tokenizer import load_tokenizer
from align_pipeline.model import init
from align_pipeline.model.checkpoint import reward_pooling
from align_pipeline.model.generate import expert_peers_generating
from align_pipeline.model.sequences import rewards_forward
from align_pipeline.rewards.base import RewardFunctions
from align_pipeline.rewards.check import check_records
from align_pipeline.rl.advantages import groups_without_signal
from align_pipeline.tracking.mlflow_logger import RunLogger
from align_pipeline.train.core import rollout
from align_pipeline.train.core.batches import PromptStream, split_rows
from align_pipeline.train.core.distributed import Dist, init_distributed
from align_pipeline.train.core.metrics import Timings, throughput
from align_pipeline.train.core.offload import Offload
from align_pipeline.train.core.optimizer import Trainable, build_frozen, train_step
from align_pipeline.train.core.progress import RunLog, log, log_job_params


class RLStage:
    """One RL job's shared state: ``dist``, ``tok``, ``source`` (the policy's start), ``vocab``, ``seq_length``; after
    :meth:`load_scoring` ``reward_fns``, ``reference``, ``rm``, ``rm_forward``, ``prompts``, ``val_records``."""

    def __init__(self, name: str, job, cfg) -> None:
        self.name, self.job, self.cfg = name, job, cfg
        self.paths, self.run_dir = job.paths, Path(job.paths.run_dir)
        self.rl, self.gen, self.mbs = cfg.rl, cfg.generation, cfg.rl.micro_batch_size
        self.dist = dist = init_distributed(job.parallel, self.rl.seed)
        self.logger = RunLogger(rank=dist.rank)
        self.tok = load_tokenizer(self.paths.tokenizer)
        self.source = init.resolve(self.paths.policy, job.model, self.tok.vocab_size)
        check_job(name, cfg, job.parallel, dist.world_size, self.source.model, self.paths.policy,
                  self.source.parent["kind"])
        log(dist, f"[{name}] {dist.describe()} policy={self.paths.policy} reward_model={self.paths.reward_model}")
        self.vocab, self.seq_length = self.source.vocab_size, self.source.model.seq_length
        self.setup: dict[str, float] = {}
        self.sampling: dict[str, float] = {}  # dynamic sampling's counts of the last rollout

    def load_scoring(self, kl_reference: bool = True, teacher: str | None = None) -> None:
        """The reward functions, the frozen judges and the prompts (after the trained models: their random draws
        do not depend on whether a reference is built). ``kl_reference=False`` (REINFORCE with ``kl.beta`` 0): no
        KL reference at all - no model built, no reference forward, no KL metrics. ``teacher`` (distillation): the
        frozen model in the reference's place is this one (its log-probs are :meth:`rollout_and_score`'s
        ``ref_logp``)."""
        self.kl_reference, self.teacher = kl_reference or teacher is not None, teacher
        where = f"{self.name}.reward"
        self.reward_fns = RewardFunctions.load(self.cfg.reward, where)
        reward, self.reward_pool = self.cfg.reward, None
        if reward.workers and self.reward_fns.terms:  # imported only when used (a stage's reach stays small)
            from align_pipeline.rewards.pool import RewardPool

            self.reward_pool = RewardPool([t.spec for t in self.reward_fns.terms], reward.workers, reward.timeout_s)
        self.env, self.env_pool = self.cfg.env, None
        if self.env.name is not None and self.dist.tp_rank == 0:  # the group's other ranks get its answers
            from align_pipeline.envs.pool import EnvPool

            self.env_pool = EnvPool(self.env.name, self.env.config, self.env.workers, self.env.step_timeout_s)
        self.reference, self.rm, self.rm_forward = load_judges(
            self.paths, self.cfg.reward, self.job.model.attention_backend, self.job.parallel, self.dist, where,
            lora_policy=bool(self.cfg.lora.rank), kl_reference=kl_reference, teacher=teacher, tokens=self.tok.vocab_size)
        self.prompts, self.val_records = load_prompts(self.paths, self.rl, self.dist, self.reward_fns)

    def offload(self, optimizers: list) -> Offload:
        """The ``offload`` options over the frozen judges and ``optimizers``."""
        return Offload(self.cfg.offload, self.dist.device, [self.reference, self.rm], optimizers)

    def start(self, actor: Trainable, ckpts) -> tuple[int, dict[str, Any] | None]:
        """Resume (:func:`start`), then, before iteration 1, the KV cache and CUDA graphs, so its generate time is a
        warm one (the set-up is logged apart, with iteration 1); returns (first iteration, resumed train state)."""
        self.ckpts = ckpts
        iteration, state, self.runlog = start(self.name, self.job, ckpts, self.prompts, self.rl, self.dist,
                                              self.logger)
        self.initial: dict[str, float] = {}
        if iteration == 0 and self.rl.eval_before_training:  # the starting policy, on the validation prompts
            self.initial = self.validation_accuracy(actor)
            self.logger.log_metrics(self.initial, 0)
            log(self.dist, f"[{self.name}] before training: " + ", ".join(f"{k} {v:.4f}"
                                                                          for k, v in self.initial.items()))
        if iteration < self.rl.iterations:
            self.setup = rollout.prepare_rollouts(actor.model, self.prompts, iteration, self.gen, self.tok, self.vocab,
                                                  self.dist, self.seq_length)
        return iteration, state

    def rollout_and_score(self, actor: Trainable, iteration: int, timings: Timings, offload: Offload,
                          also: Callable[[dict], Any] | None = None, old_forward: bool = True):
        """Steps 1-2: this DP rank's rollout (optimizer states offloaded while generating), then its scores and the
        per-token log-probs of the rollout policy and the KL reference [n, s] (+ ``also(rows)``, e.g. the critic's
        values), the frozen models on the device only meanwhile -> (rollout, scores, old_logp, ref_logp, also);
        ref_logp is None without a KL reference (:meth:`load_scoring`).

        ``old_forward=False`` (one optimizer step per rollout: the "old" policy is the one being trained, whose
        log-probs the training step's own forward computes) skips the training forward over the rollout: old_logp
        is then the engine's own log-probs (``rows["rollout_logp"]``), for the metrics that need one."""
        dist, vocab, mbs = self.dist, self.vocab, self.mbs
        offload.optimizers_to("cpu")
        r, scores = self.sample(actor, iteration, timings, offload)
        with timings("timing/score_s"):
            offload.frozen_to(dist.device)
            old_logp = (rollout.token_logprobs(actor.model, r.rows, vocab, mbs, dist) if old_forward  # [n, s]
                        else r.rows["rollout_logp"])
            ref_logp = (rollout.reference_logprobs(self.reference, actor.model, r.rows, vocab, mbs, dist)  # [n, s]
                        if self.kl_reference else None)
            extra = also(r.rows) if also is not None else None
            offload.frozen_to("cpu")
        offload.optimizers_to(dist.device)
        return r, scores, old_logp, ref_logp, extra

    def sample(self, actor: Trainable, iteration: int, timings: Timings, offload: Offload
               ) -> tuple[rollout.Rollout, rollout.Scores]:
        """The rollout of ``iteration`` on this DP rank and its scores (``timing/generate_s``, ``timing/score_s``).

        With ``dynamic_sampling.enabled`` (REINFORCE: DAPO's dynamic sampling), the groups whose scores are all
        equal are dropped and further rounds of as many prompts (:meth:`PromptStream.extra`, their own seeds) are
        generated and scored until this rank has its ``prompts_per_iteration / DP`` groups with signal or
        ``max_rounds`` rounds ran; then dropped groups fill what is missing. The groups keep their order of
        sampling, so the kept groups of the first round are the rollout the stage would have without it. Counts in
        :attr:`sampling` (``rollout/dynamic_sampling/*``). With expert parallelism every rank of an EP group runs
        as many rounds as the one that needs most (each round's forwards exchange tokens across the group); the
        rounds a rank did not need are left out of its rollout and counts, so it samples what it would at EP=1."""
        dist, gen = self.dist, self.gen
        dynamic = getattr(self.cfg, "dynamic_sampling", None)
        rounds = dynamic.max_rounds if dynamic is not None and dynamic.enabled else 1
        want = len(self.prompts.local(iteration))
        kept: list[tuple[int, int]] = []  # (round, group) with signal
        dropped: list[tuple[int, int]] = []
        parts: list[tuple[rollout.Rollout, rollout.Scores]] = []
        needed = None  # the rounds this rank needed for its groups with signal
        for round_ in range(rounds):
            records = self.prompts.local(iteration) if round_ == 0 else self.prompts.extra(iteration, round_)
            offload.frozen_to("cpu")  # (a no-op before the first round)
            seed = rollout.iteration_seed(gen.seed, iteration, dist.dp_rank, round_)
            episodes = None
            with timings("timing/generate_s"):
                if self.env.name is not None:  # multi-turn: the environment's steps are part of the rollout
                    from align_pipeline.train.core.episodes import episodes_rollout, run_episodes

                    episodes = run_episodes(actor.model, records, gen, self.env, self.env_pool, self.tok, self.vocab,
                                            dist, self.seq_length, seed)
                    r = episodes_rollout(episodes, self.tok, dist, self.seq_length)
                else:
                    r = rollout.generate_rollout(actor.model, records, gen, self.tok, self.vocab, dist,
                                                 self.seq_length, seed, pool=self.reward_pool)
            with timings("timing/score_s"):
                offload.frozen_to(dist.device)
                scores = rollout.score(r, self.cfg.reward, self.reward_fns, self.rm, self.rm_forward, self.mbs, dist,
                                       max_tokens=gen.max_new_tokens, pool=self.reward_pool)
                if episodes is not None:
                    from align_pipeline.train.core.episodes import add_returns

                    scores = add_returns(scores, episodes, self.env, dist.device)
            if rounds == 1:
                return r, scores
            parts.append((r, scores))
            flat = groups_without_signal(scores.total.view(-1, gen.samples_per_prompt)).tolist()  # [P]
            kept += [(round_, g) for g, none in enumerate(flat) if not none]
            dropped += [(round_, g) for g, none in enumerate(flat) if none]
            if needed is None and len(kept) >= want:
                needed = round_ + 1
            if not expert_peers_generating(actor.model, needed is None):
                break
        needed = needed or len(parts)
        parts = parts[:needed]
        kept, dropped = [k for k in kept if k[0] < needed], [d for d in dropped if d[0] < needed]
        chosen = sorted(kept[:want] + dropped[: max(0, want - len(kept))])  # sampling order
        n = gen.samples_per_prompt
        picked = [(parts[k][0].take(idx), parts[k][1].take(idx)) for k in range(len(parts))
                  if (idx := [g * n + j for rk, g in chosen if rk == k for j in range(n)])]
        self.sampling = {"rounds": float(len(parts)), "dropped_groups": float(len(dropped)),
                         "padded_groups": float(max(0, want - len(kept)))}
        return rollout.Rollout.join([p[0] for p in picked]), rollout.Scores.join([p[1] for p in picked])

    def minibatch_steps(self, model: Trainable, rows: dict, loss, metric_names: list[str], iteration: int,
                        n: int) -> list[dict[str, float]]:
        """Step 4 of a one-model stage: ``rl.epochs`` passes over this rank's ``n`` rollout rows, each in
        ``rl.minibatches`` optimizer steps of a seeded order (the same on a resumed run); the steps' metrics."""
        rl, steps = self.rl, []
        for epoch in range(rl.epochs):
            order = rollout.minibatch_order(rl.seed, iteration, epoch, n, self.dist.device)
            steps += [train_step(model, split_rows(rows, self.mbs, chunk)[0], loss, metric_names, self.dist,
                                 self.seq_length) for chunk in order.chunk(rl.minibatches)]
        return steps

    def validation_accuracy(self, actor: Trainable) -> dict[str, float]:
        """Greedy and sampled accuracy on the held-out prompts: of responses, or of episodes with an environment."""
        if self.env.name is None:
            return rollout.validation_accuracy(actor.model, self.val_records, self.gen, self.tok, self.vocab,
                                               self.dist, self.seq_length, self.reward_fns)
        from align_pipeline.train.core.episodes import validation_accuracy

        return validation_accuracy(actor.model, self.val_records, self.gen, self.env, self.env_pool, self.tok,
                                   self.vocab, self.dist, self.seq_length, self.reward_fns)

    def train_state(self, iteration: int, **extra: Any) -> dict[str, Any]:
        """What a checkpoint resumes from: the iteration, the prompt cursor, and the stage's own state."""
        return {"iteration": iteration, "consumed_prompts": self.prompts.consumed(iteration), **extra}

    def end_iteration(self, iteration: int, m: dict[str, float], timings: Timings, r, trained_rows: int, t0: float,
                      actor: Trainable, train_state: dict[str, Any]) -> dict | None:
        """Step 5 (``iteration`` counted done): timings, throughput, validation on the interval, the run log, a
        checkpoint on the interval; returns the job's result when it stops here (``stop_after``), else None."""
        rl = self.rl
        m.update(timings)
        m.update(self.setup)  # iteration 1 only
        self.setup = {}
        m.update(throughput(r, timings, trained_rows=trained_rows, seq_length=self.seq_length, dist=self.dist))
        m["timing/iteration_s"] = time.perf_counter() - t0
        if rl.eval_interval and iteration % rl.eval_interval == 0 and iteration < rl.iterations:
            m.update(self.validation_accuracy(actor))
        self.runlog.record(iteration, m, {"iteration": iteration, **m}, force="val/greedy_accuracy" in m)
        if self.ckpts.after_step(iteration, train_state):
            return self.runlog.stopped(iteration, self.run_dir, self.ckpts.started_at)
        return None

    def finish(self, iteration: int, actor: Trainable, train_state: dict[str, Any], m: dict[str, float],
               per_model: dict[str, dict[str, Any]] | None = None) -> dict:
        """Final validation (greedy and sampled accuracy), checkpoint, export of every trained model; the result."""
        final = self.validation_accuracy(actor)
        self.logger.log_metrics(final, iteration)
        for pool in (self.reward_pool, self.env_pool):
            if pool is not None:
                pool.close()
        log(self.dist, f"[{self.name}] done: " + ", ".join(f"{k} {v:.4f}" for k, v in final.items()))
        self.ckpts.save(iteration, train_state)
        meta = export_meta(self.name, self.job, self.tok, final, m, kl_reference=self.kl_reference,
                           teacher=self.teacher)
        dirs = self.ckpts.export(iteration, meta, per_model=per_model)
        return self.runlog.finish(self.run_dir, {**dirs, "step": iteration, "iteration": iteration, **final,
                                                 "final": {**m, **final}, "initial": self.initial,
                                                 "history": self.runlog.history})


def load_judges(paths, reward: RewardConfig, attention_backend: str, parallel, dist: Dist, where: str,
                lora_policy: bool = False, kl_reference: bool = True, teacher: str | None = None, tokens: int = 0):
    """The frozen models of an RL stage: the KL reference (``paths.reference`` or the policy's start; the
    ``teacher`` when given) and, when the reward uses it, the reward model with its scoring forward (its pooling; a
    multi-attribute model's outputs combined by ``reward.reward_model_attribute_weights``, ``where`` naming that
    section); returns (reference, reward model | None, rewards forward | None). ``lora_policy`` (the policy trains
    adapters) with the reference being the policy's start: no reference model (None): the policy with its adapters
    off is the reference (:func:`reference_logprobs`). ``kl_reference=False``: no reference (None) either. A
    reference or teacher with fewer embeddings than the tokenizer's ``tokens``, or no LM head, is refused."""
    run_time = ModelConfig(attention_backend=attention_backend)
    reference = None
    if teacher is not None:
        log(dist, f"[rl] teacher: {teacher}")
        reference = build_frozen(_language_model(init.resolve(teacher, run_time, 0), tokens, "the teacher", teacher),
                                 parallel, dist)
    elif not kl_reference:
        log(dist, "[rl] kl.beta is 0: no KL reference (no reference model, no reference forward, no KL metrics)")
    elif lora_policy and paths.reference in (None, paths.policy):
        log(dist, "[rl] KL reference: the policy with its LoRA adapters off (no second copy of the weights)")
    else:
        path = paths.reference or paths.policy
        reference = build_frozen(_language_model(init.resolve(path, run_time, 0), tokens, "the KL reference", path),
                                 parallel, dist)
    if paths.reward_model is None or not reward.reward_model_weight:
        return reference, None, None
    source = init.resolve(paths.reward_model, run_time, 0)
    weights = attribute_weights(reward.reward_model_attribute_weights, source.num_outputs, where, paths.reward_model)
    rm = build_frozen(source, parallel, dist, head="value")
    return reference, rm, rewards_forward(reward_pooling(paths.reward_model), weights)


def _language_model(source, tokens: int, role: str, path: str):
    """``source``, unless it has no LM head or fewer embeddings than the tokenizer's ``tokens`` (0: not checked):
    its log-probs would not be of this tokenizer's tokens."""
    if source.head != "lm":
        raise ConfigError(f"{role} {path} is a {source.head}-head model; it must be a policy (a language model)")
    if tokens and source.vocab_size < tokens:
        raise ConfigError(f"{role} {path} has {source.vocab_size} embeddings but the tokenizer has {tokens} tokens: "
                          "it must use the policy's tokenizer")
    return source


def load_prompts(paths, rl: RLLoopConfig, dist: Dist, rewards: RewardFunctions
                 ) -> tuple[PromptStream, list[dict]]:
    """The training prompt stream and the held-out prompt records used for validation, every record checked for
    the fields the reward functions need (:func:`align_pipeline.rewards.check_records`)."""
    train = load_jsonl(paths.prompts)
    check_records(train, paths.prompts, rewards)
    val = load_jsonl(paths.val_prompts)[: rl.eval_prompts] if paths.val_prompts else []
    check_records(val, paths.val_prompts, rewards)
    return PromptStream(train, rl.prompts_per_iteration, dist, rl.seed), val


def start(stage: str, job, ckpts, prompts: PromptStream, rl: RLLoopConfig, dist: Dist, logger):
    """Resume every trained model from the newest common checkpoint (checking the prompt cursor), log the job as
    MLflow params, open the run log; returns (first iteration to run, the checkpoint's train state or None, log)."""
    iteration, state = ckpts.resume()
    if state is not None:
        if state["consumed_prompts"] != prompts.consumed(iteration):
            raise RuntimeError(f"prompt cursor {state['consumed_prompts']} does not match iteration {iteration}")
        log(dist, f"[{stage}] resumed at iteration {iteration} from {job.paths.run_dir}")
    log_job_params(logger, job, dist, resumed_from_iteration=iteration)
    return iteration, state, RunLog(stage, dist, logger, rl.iterations, iteration, rl.log_interval, unit="iteration",
                                   metrics_interval=rl.metrics_interval)


def export_meta(stage: str, job, tok, final: dict[str, float], last: dict[str, float],
                kl_reference: bool = True, teacher: str | None = None) -> dict:
    """meta.json fields of an RL stage's exported models: tokenizer, layout, final metrics, lineage (the KL reference
    - None when there was none -, the reward model and a distillation's teacher included)."""
    paths = job.paths
    reference = (paths.reference or paths.policy) if kl_reference and teacher is None else None
    return {"stage": stage, "tokenizer": {"path": str(paths.tokenizer), "fingerprint": tok.fingerprint},
            "saved_with_parallel": to_dict(job.parallel),
            "metrics": {**final, **{k: v for k, v in last.items() if not k.startswith("timing/")}},
            "lineage": {**job.lineage, "reference": reference, "reward_model": paths.reward_model,
                        **({"teacher": teacher} if teacher is not None else {}), "config_hash": config_hash(job)}}
