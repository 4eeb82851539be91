"""Rollouts for the RL stages (PPO, REINFORCE): generation, scoring, statistics over DP, offload, validation.

Every data-parallel rank generates for its own slice of the iteration's prompts and keeps its rows; tensor-parallel
ranks of one DP group hold identical rollouts (same prompts, same seed, tokens broadcast by :func:`generate`).
Nothing here takes an optimizer step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

import numpy as np
import torch
import torch.distributed as tdist

from align_pipeline.config.base import config_hash, to_dict
from align_pipeline.config.checks import attribute_weights
from align_pipeline.config.common import GenerationConfig, ModelConfig, RewardConfig, RLLoopConfig
from align_pipeline.data.formats import load_jsonl
from align_pipeline.model import init, lora
from align_pipeline.model.checkpoint import reward_pooling
from align_pipeline.model.generate import generate, prepare_generation
from align_pipeline.model.sequences import rewards_forward, token_logprobs_forward, token_values_forward
from align_pipeline.rewards.base import RewardFunctions
from align_pipeline.rewards.check import check_records
from align_pipeline.train.core.batches import PromptStream, to_rows
from align_pipeline.train.core.distributed import Dist
from align_pipeline.train.core.optimizer import build_frozen
from align_pipeline.train.core.progress import RunLog, log, log_job_params
from align_pipeline.train.core.schedule import forward_rows


@dataclasses.dataclass
class Rollout:
    """One DP rank's rollout: ``n = prompts x samples`` rows, prompt-major (the samples of a prompt are adjacent)."""

    records: list[dict]
    """The prompt record of each row."""
    tokens: list[list[int]]
    """Generated tokens per row (EOS included when emitted)."""
    ended_with_eos: list[bool]
    rows: dict[str, torch.Tensor]
    """input_ids, labels, loss_mask [n, s] on the device; the stages add per-token tensors."""
    texts: list[str]
    """Decoded responses."""

    @property
    def n(self) -> int:
        return len(self.tokens)


def generate_rollout(policy, records: list[dict], gen: GenerationConfig, tok, vocab_size: int, dist: Dist,
                     seq_length: int, seed: int, greedy: bool = False) -> Rollout:
    """Sample ``gen.samples_per_prompt`` responses per record (KV-cached), in batches of ``gen.batch_size`` rows."""
    prompts = [r["prompt_ids"] for r in records for _ in range(gen.samples_per_prompt)]
    row_records = [r for r in records for _ in range(gen.samples_per_prompt)]
    longest = max(len(p) for p in prompts)
    if longest >= seq_length:
        raise ValueError(f"a prompt has {longest} tokens; the model's seq_length {seq_length} leaves no room")
    max_new = min(gen.max_new_tokens, seq_length - longest)
    tokens, eos = [], []
    for start in range(0, len(prompts), gen.batch_size):
        g = generate(policy, prompts[start : start + gen.batch_size], max_new_tokens=max_new, eos_id=tok.stop_ids,
                     pad_id=tok.pad_id, vocab_size=vocab_size, temperature=gen.temperature, top_k=gen.top_k,
                     top_p=gen.top_p, greedy=greedy, seed=seed + start, cuda_graphs=gen.cuda_graphs,
                     tp_group=dist.pgs.tp)
        tokens += g.tokens
        eos += g.ended_with_eos
    arrays = to_rows(prompts, tokens, seq_length, tok.pad_id)
    rows = {k: torch.from_numpy(v).to(dist.device) for k, v in arrays.items()}
    return Rollout(row_records, tokens, eos, rows, [tok.decode(t) for t in tokens])


def prepare_rollouts(policy, prompts: PromptStream, iteration: int, gen: GenerationConfig, tok, vocab_size: int,
                     dist: Dist, seq_length: int) -> dict[str, float]:
    """Before the first rollout of a job, on a GPU: the KV cache for the rows of one generate call and the longest
    prompt of the data + ``max_new_tokens`` columns, and the CUDA graphs of every batch width
    (:func:`prepare_generation`), so iteration 1's ``timing/generate_s`` is a warm figure ->
    ``{"timing/decode_capture_s", "timing/decode_setup_s"}`` (empty on the CPU)."""
    if dist.device.type != "cuda":
        return {}
    rows = len(prompts.local(iteration)) * gen.samples_per_prompt
    longest = max(len(r["prompt_ids"]) for r in prompts.records)
    t = prepare_generation(policy, batch=min(rows, gen.batch_size), length=min(seq_length, longest + gen.max_new_tokens),
                           prompt_len=longest, vocab_size=vocab_size, pad_id=tok.pad_id, cuda_graphs=gen.cuda_graphs,
                           temperature=gen.temperature, top_k=gen.top_k, top_p=gen.top_p, tp_group=dist.pgs.tp)
    return {"timing/decode_capture_s": t["capture_s"], "timing/decode_setup_s": t["setup_s"]}


def iteration_seed(base: int, iteration: int, dp_rank: int) -> int:
    """Sampling seed of one iteration on one DP rank (distinct streams, reproducible on resume)."""
    return (base * 1_000_003 + iteration * 7919 + dp_rank * 104_729) % 2**62


@dataclasses.dataclass
class Scores:
    total: torch.Tensor
    """[n] the reward the stage optimises."""
    correct: torch.Tensor | None
    """[n] 1.0 where the accuracy function returns >= 1 (None without reward functions)."""
    rm: torch.Tensor | None
    """[n] reward-model scores, attributes combined (None without a reward model)."""
    functions: torch.Tensor | None
    """[n, F] each reward function's value (None without reward functions)."""


def score(rollout: Rollout, cfg: RewardConfig, rewards: RewardFunctions, rm, rm_forward, micro_batch_size: int,
          dist: Dist) -> Scores:
    """``Σ_i functions[i].weight x function_i(prompt, response, record) - missing_eos_penalty x (no EOS)
    + reward_model_weight x RM`` (``rm_forward``: :func:`~align_pipeline.model.sequences.rewards_forward` with the
    reward model's pooling and attribute weights)."""
    device = dist.device
    values = [rewards.values(r["prompt"], t, r) for r, t in zip(rollout.records, rollout.texts)]  # [n][F]
    functions = correct = None
    if rewards.terms:
        functions = torch.tensor(values, device=device)  # [n, F]
        correct = torch.tensor([float(rewards.correct(v)) for v in values], device=device)  # [n]
    no_eos = torch.tensor([0.0 if e else 1.0 for e in rollout.ended_with_eos], device=device)
    total = torch.tensor([rewards.weighted(v) for v in values], device=device) - cfg.missing_eos_penalty * no_eos
    rm_scores = None
    if rm is not None:
        rm_scores = forward_rows(rm, rollout.rows, rm_forward, micro_batch_size, dist)[:, 0]  # [n]
        total = total + cfg.reward_model_weight * rm_scores
    return Scores(total, correct, rm_scores, functions)


# --------------------------------------------------------------------------------------------------------------------
# Statistics over the whole rollout (all DP ranks)
# --------------------------------------------------------------------------------------------------------------------


class DPStats:
    """Accumulate sums of (value, count) pairs on each DP rank and reduce them in one all-reduce.

    ``add(name, values, mask)`` records Σ v, Σ v² and the count; :meth:`reduce` returns ``name_mean`` /
    ``name_std`` (or just ``name`` with ``std=False``, or the sum Σ v with ``total=True``) over every DP rank's rows.
    Entries outside ``mask`` never reach the sums (they may be NaN).
    """

    def __init__(self, dist: Dist):
        self.dist = dist
        self._entries: list[tuple[str, str, torch.Tensor]] = []

    def add(self, name: str, values: torch.Tensor, mask: torch.Tensor | None = None, std: bool = True,
            total: bool = False) -> None:
        v = values.detach().double()
        m = torch.ones_like(v) if mask is None else mask.detach().double()
        v = torch.where(m != 0, v, 0.0)  # a NaN outside the mask stays out of the sums
        kind = "total" if total else "mean_std" if std else "mean"
        self._entries.append((name, kind, torch.stack([(v * m).sum(), (v * v * m).sum(), m.sum()])))

    def reduce(self) -> dict[str, float]:
        if not self._entries:
            return {}
        stacked = torch.stack([e[2] for e in self._entries]).to(self.dist.device)  # [k, 3]
        tdist.all_reduce(stacked, group=self.dist.pgs.dp)
        out = {}
        for (name, kind, _), (s, s2, c) in zip(self._entries, stacked.tolist()):
            mean = s / c if c else float("nan")
            if kind == "total":
                out[name] = s
            elif kind == "mean_std":
                out[f"{name}_mean"] = mean
                out[f"{name}_std"] = float(np.sqrt(max(s2 / c - mean * mean, 0.0))) if c else float("nan")
            else:
                out[name] = mean
        return out


def offload_model(model, device: torch.device | str) -> None:
    """Move a frozen model's parameters and buffers (e.g. to the CPU between the phases that use it)."""
    model.to(device)


def offload_optimizer(optimizer, device: torch.device | str) -> None:
    """Move the Adam moments (and, for bf16 training, the fp32 main weights) of a Megatron optimizer.

    In fp32 training the main weights *are* the model's parameters, which generation needs, so they stay.
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        for state in inner.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and key != "step":
                    state[key] = value.to(device)
        for group in getattr(opt, "shard_fp32_from_float16_groups", []) or []:
            for p in group:
                p.data = p.data.to(device)


def token_logprobs(model, rows: dict, vocab_size: int, micro_batch_size: int, dist: Dist) -> torch.Tensor:
    """log pi(label_t | ids[:t+1]) of this rank's rollout rows: [n, s] fp32 (meaningful where loss_mask is 1)."""
    return forward_rows(model, rows, token_logprobs_forward(vocab_size, dist.tp_rank), micro_batch_size, dist)


def reference_logprobs(reference, policy, rows: dict, vocab_size: int, micro_batch_size: int,
                       dist: Dist) -> torch.Tensor:
    """The KL reference's :func:`token_logprobs`: of the ``reference`` model, or, when it is None (see
    :func:`load_judges`), of the LoRA ``policy`` with its adapters off."""
    if reference is not None:
        return token_logprobs(reference, rows, vocab_size, micro_batch_size, dist)
    with lora.as_reference(policy):
        return token_logprobs(policy, rows, vocab_size, micro_batch_size, dist)


def token_values(model, rows: dict, micro_batch_size: int, dist: Dist) -> torch.Tensor:
    """A value-head model's V(s_t) at every position of this rank's rollout rows: [n, s] fp32."""
    return forward_rows(model, rows, token_values_forward(), micro_batch_size, dist)


def rollout_stats(r: Rollout, scores: Scores, rewards: RewardFunctions, dist: Dist) -> DPStats:
    """The rollout metrics every RL stage reports (a stage adds its own before ``reduce()``): ``rollout/accuracy``
    with an accuracy function, ``rollout/reward_<function>`` per function when there are several, and
    ``rollout/nonfinite_rewards``: how many samples of the rollout (all DP ranks) had a NaN or infinite reward (they
    get advantage 0 and are left out of the baselines and of the reward means)."""
    stats = DPStats(dist)
    finite = torch.isfinite(scores.total)  # [n]
    stats.add("rollout/rewards", scores.total, finite)
    stats.add("rollout/nonfinite_rewards", (~finite).double(), total=True)
    if scores.correct is not None:
        stats.add("rollout/accuracy", scores.correct, std=False)
    if scores.functions is not None and scores.functions.shape[1] > 1:
        for i, term in enumerate(rewards.terms):
            values = scores.functions[:, i]  # [n]
            stats.add(f"rollout/reward_{term.key}", values, torch.isfinite(values), std=False)
    if scores.rm is not None:
        stats.add("rollout/reward_model_score", scores.rm, torch.isfinite(scores.rm), std=False)
    stats.add("rollout/response_lengths", r.rows["loss_mask"].sum(-1), std=False)
    stats.add("rollout/fraction_of_samples_properly_ended",
              torch.tensor(r.ended_with_eos, dtype=torch.float64, device=dist.device), std=False)
    return stats


def minibatch_order(seed: int, iteration: int, epoch: int, n: int, device) -> torch.Tensor:
    """The seeded order of a rollout's n rows in one epoch (a pure function of seed, iteration and epoch)."""
    return torch.from_numpy(np.random.default_rng([seed, iteration, epoch]).permutation(n)).to(device)


def mean_metrics(steps: list[dict[str, float]], prefix: str) -> dict[str, float]:
    """Average per-step metrics of one iteration, keys prefixed (``train/policy_loss``, ``critic/grad_norm``)."""
    return {f"{prefix}/{k}": float(np.mean([s[k] for s in steps])) for k in steps[0]}


def throughput(r: Rollout, timings: dict[str, float], trained_rows: int, seq_length: int, dist: Dist
               ) -> dict[str, float]:
    """Generated tokens/s and trained tokens/s of an iteration, over all DP ranks."""
    generated = torch.tensor([float(r.rows["loss_mask"].sum())], dtype=torch.float64, device=dist.device)
    tdist.all_reduce(generated, group=dist.pgs.dp)
    return {"throughput/generated_tokens_per_s": generated.item() / max(timings["timing/generate_s"], 1e-9),
            "throughput/train_tokens_per_s": trained_rows * dist.dp_size * seq_length
            / max(timings["timing/train_s"], 1e-9)}


class Timings(dict):
    """``with timings("timing/generate_s"): ...`` records the block's wall time, with a device synchronisation on
    both sides so GPU work is counted where it happens."""

    @contextlib.contextmanager
    def __call__(self, key: str):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        yield
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self[key] = time.perf_counter() - t0


class Offload:
    """The ``offload`` options: frozen models on the CPU except while scoring; Adam moments (and bf16 main weights)
    of the trained models on the CPU while generating and scoring. No-ops unless configured."""

    def __init__(self, cfg, device, frozen: list, optimizers: list):
        self.cfg, self.device = cfg, device
        self.frozen = [m for m in frozen if m is not None]
        self.optimizers = optimizers
        self.frozen_to("cpu")

    def frozen_to(self, device) -> None:
        if self.cfg.frozen_models:
            for m in self.frozen:
                offload_model(m, device)

    def optimizers_to(self, device) -> None:
        if self.cfg.optimizer_states:
            for opt in self.optimizers:
                offload_optimizer(opt, device)


def validation_accuracy(model, records: list[dict], gen: GenerationConfig, tok, vocab_size: int, dist: Dist,
                        seq_length: int, rewards: RewardFunctions) -> dict[str, float]:
    """Accuracy (the accuracy function's value >= 1) of ``model`` on held-out prompt records, greedy and sampled (one
    sample per prompt at the rollout temperature); DP ranks split the prompts. Empty without an accuracy function."""
    if not records or rewards.accuracy is None:
        return {}
    mine = records[dist.dp_rank :: dist.dp_size]
    totals = torch.zeros(3, dtype=torch.float64, device=dist.device)
    if mine:
        one = dataclasses.replace(gen, samples_per_prompt=1)
        for i, greedy in enumerate((True, False)):
            r = generate_rollout(model, mine, one, tok, vocab_size, dist, seq_length,
                                 seed=iteration_seed(one.seed, -1, dist.dp_rank), greedy=greedy)
            totals[i] = float(sum(rewards.correct(rewards.values(rec["prompt"], text, rec))
                                  for rec, text in zip(r.records, r.texts)))
        totals[2] = len(mine)
    tdist.all_reduce(totals, group=dist.pgs.dp)
    n = max(totals[2].item(), 1.0)
    return {"val/greedy_accuracy": totals[0].item() / n, "val/accuracy": totals[1].item() / n}


def load_judges(paths, reward: RewardConfig, attention_backend: str, parallel, dist: Dist, where: str,
                lora_policy: bool = False):
    """The frozen models of an RL stage: the KL reference (``paths.reference`` or the policy's start) and, when the
    reward uses it, the reward model with its scoring forward (its pooling; a multi-attribute model's outputs
    combined by ``reward.reward_model_attribute_weights``, ``where`` naming that section); returns (reference,
    reward model | None, rewards forward | None). ``lora_policy`` (the policy trains adapters) with the reference
    being the policy's start: no reference model (None): the policy with its adapters off is the reference
    (:func:`reference_logprobs`)."""
    run_time = ModelConfig(attention_backend=attention_backend)
    reference = None
    if lora_policy and paths.reference in (None, paths.policy):
        log(dist, "[rl] KL reference: the policy with its LoRA adapters off (no second copy of the weights)")
    else:
        reference = build_frozen(init.resolve(paths.reference or paths.policy, run_time, 0), parallel, dist)
    if paths.reward_model is None or not reward.reward_model_weight:
        return reference, None, None
    source = init.resolve(paths.reward_model, run_time, 0)
    weights = attribute_weights(reward.reward_model_attribute_weights, source.num_outputs, where, paths.reward_model)
    rm = build_frozen(source, parallel, dist, head="value")
    return reference, rm, rewards_forward(reward_pooling(paths.reward_model), weights)


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
    return iteration, state, RunLog(stage, dist, logger, rl.iterations, iteration, rl.log_interval, unit="iteration")


def export_meta(stage: str, job, tok, final: dict[str, float], last: dict[str, float]) -> dict:
    """meta.json fields of an RL stage's exported models: tokenizer, layout, final metrics, lineage (the KL reference
    and the reward model included)."""
    paths = job.paths
    return {"stage": stage, "tokenizer": {"path": str(paths.tokenizer), "fingerprint": tok.fingerprint},
            "saved_with_parallel": to_dict(job.parallel),
            "metrics": {**final, **{k: v for k, v in last.items() if not k.startswith("timing/")}},
            "lineage": {**job.lineage, "reference": paths.reference or paths.policy,
                        "reward_model": paths.reward_model, "config_hash": config_hash(job)}}
