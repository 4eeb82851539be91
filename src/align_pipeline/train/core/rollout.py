"""Rollouts for the RL stages (PPO, REINFORCE): generation, scoring, per-token forward passes, the rollout's
statistics over DP, validation accuracy.

Every data-parallel rank generates for its own slice of the iteration's prompts and keeps its rows; tensor-parallel
ranks of one DP group hold identical rollouts (same prompts, same seed, tokens broadcast by :func:`generate`).
Nothing here takes an optimizer step.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
import torch.distributed as tdist

from align_pipeline.config.common import GenerationConfig, RewardConfig
from align_pipeline.model import lora
from align_pipeline.model.generate import decode_slots, generate, prepare_generation
from align_pipeline.model.sequences import token_logprobs_forward, token_values_forward
from align_pipeline.rewards.base import RewardFunctions
from align_pipeline.rl.advantages import overlong_shaping
from align_pipeline.train.core.batches import PromptStream, to_rows
from align_pipeline.train.core.distributed import Dist
from align_pipeline.train.core.metrics import DPStats
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
    slots: int = 0
    """Rows the generation decoded at once."""
    refills: int = 0
    """Times free rows were given pending samples (continuous batching)."""
    episode_stats: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    """Multi-turn episodes (:mod:`.episodes`): per-row numbers of the ``env/*`` metrics."""

    @property
    def n(self) -> int:
        return len(self.tokens)

    def take(self, idx: list[int]) -> Rollout:
        """The rows ``idx``, in that order."""
        rows_idx = torch.tensor(idx, dtype=torch.long, device=next(iter(self.rows.values())).device)
        return Rollout([self.records[i] for i in idx], [self.tokens[i] for i in idx],
                       [self.ended_with_eos[i] for i in idx], {k: v[rows_idx] for k, v in self.rows.items()},
                       [self.texts[i] for i in idx], self.slots, self.refills,
                       {k: [v[i] for i in idx] for k, v in self.episode_stats.items()})

    @staticmethod
    def join(parts: list[Rollout]) -> Rollout:
        """The rows of ``parts`` one after the other (several generate calls: the widest ``slots``, all refills)."""
        return Rollout([x for p in parts for x in p.records], [x for p in parts for x in p.tokens],
                       [x for p in parts for x in p.ended_with_eos],
                       {k: torch.cat([p.rows[k] for p in parts]) for k in parts[0].rows},
                       [x for p in parts for x in p.texts], max(p.slots for p in parts),
                       sum(p.refills for p in parts),
                       {k: [x for p in parts for x in p.episode_stats[k]] for k in parts[0].episode_stats})


def generate_rollout(policy, records: list[dict], gen: GenerationConfig, tok, vocab_size: int, dist: Dist,
                     seq_length: int, seed: int, greedy: bool = False, pool=None) -> Rollout:
    """Sample ``gen.samples_per_prompt`` responses per record (KV-cached, continuous batching over at most
    ``gen.batch_size`` rows at once, fewer under ``gen.kv_cache_gib``). With ``pool`` (a
    :class:`~align_pipeline.rewards.pool.RewardPool`), each response is handed to it as soon as it has ended, so
    that the reward functions run while the rest of the rollout is generated."""
    prompts = [r["prompt_ids"] for r in records for _ in range(gen.samples_per_prompt)]
    row_records = [r for r in records for _ in range(gen.samples_per_prompt)]
    longest = max(len(p) for p in prompts)
    if longest >= seq_length:
        raise ValueError(f"a prompt has {longest} tokens; the model's seq_length {seq_length} leaves no room")
    max_new = min(gen.max_new_tokens, seq_length - longest)

    def score_early(i: int, tokens: list[int], _eos: bool) -> None:
        pool.submit(i, (row_records[i]["prompt"], tok.decode(tokens), row_records[i]))

    g = generate(policy, prompts, max_new_tokens=max_new, eos_id=tok.stop_ids, pad_id=tok.pad_id,
                 vocab_size=vocab_size, temperature=gen.temperature, top_k=gen.top_k, top_p=gen.top_p, greedy=greedy,
                 seed=seed, cuda_graphs=gen.cuda_graphs, tp_group=dist.pgs.tp, prefill_bucket=gen.prefill_bucket,
                 max_rows=gen.batch_size, kv_cache_gib=gen.kv_cache_gib, compile_step=gen.compile_step,
                 on_finished=score_early if pool is not None else None)
    arrays = to_rows(prompts, g.tokens, seq_length, tok.pad_id, g.logprobs)
    rows = {k: torch.from_numpy(v).to(dist.device) for k, v in arrays.items()}
    return Rollout(row_records, g.tokens, g.ended_with_eos, rows, [tok.decode(t) for t in g.tokens],
                   slots=g.slots, refills=g.admissions)


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
    bucketed = -(-longest // gen.prefill_bucket) * gen.prefill_bucket  # the prefill width rollouts will have
    length = max(min(seq_length, longest + gen.max_new_tokens), bucketed + 9)
    t = prepare_generation(policy, batch=decode_slots(policy, min(rows, gen.batch_size), length, gen.kv_cache_gib),
                           length=length,
                           prompt_len=bucketed, vocab_size=vocab_size, pad_id=tok.pad_id, cuda_graphs=gen.cuda_graphs,
                           temperature=gen.temperature, top_k=gen.top_k, top_p=gen.top_p, tp_group=dist.pgs.tp,
                           compile_step=gen.compile_step)
    return {"timing/decode_capture_s": t["capture_s"], "timing/decode_setup_s": t["setup_s"]}


def iteration_seed(base: int, iteration: int, dp_rank: int, round_: int = 0) -> int:
    """Sampling seed of one iteration on one DP rank (distinct streams, reproducible on resume); ``round_`` > 0: the
    extra generation rounds of dynamic sampling."""
    return (base * 1_000_003 + iteration * 7919 + dp_rank * 104_729 + round_ * 15_485_863) % 2**62


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
    overlong: torch.Tensor | None = None
    """[n] DAPO's overlong punishment R_length in [-1, 0], before its scale (None when off)."""
    timeouts: int = 0
    """Responses whose reward functions ran over ``reward.timeout_s`` (scored 0)."""

    def take(self, idx: list[int]) -> Scores:
        """The scores of rows ``idx``, in that order."""
        t = torch.tensor(idx, dtype=torch.long, device=self.total.device)
        pick = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "timeouts"}
        return Scores(**{k: v[t] if v is not None else None for k, v in pick.items()}, timeouts=self.timeouts)

    @staticmethod
    def join(parts: list[Scores]) -> Scores:
        """The scores of ``parts`` one after the other (timeouts summed)."""
        names = [f.name for f in dataclasses.fields(Scores) if f.name != "timeouts"]
        fields = {k: torch.cat([getattr(p, k) for p in parts]) if getattr(parts[0], k) is not None else None
                  for k in names}
        return Scores(**fields, timeouts=sum(p.timeouts for p in parts))


def score(rollout: Rollout, cfg: RewardConfig, rewards: RewardFunctions, rm, rm_forward, micro_batch_size: int,
          dist: Dist, max_tokens: int | None = None, pool=None) -> Scores:
    """``Σ_i functions[i].weight x function_i(prompt, response, record) - missing_eos_penalty x (no EOS)
    + reward_model_weight x RM + overlong_penalty x R_length`` (``rm_forward``:
    :func:`~align_pipeline.model.sequences.rewards_forward` with the reward model's pooling and attribute weights;
    R_length: DAPO's soft overlong punishment over the budget ``max_tokens``, with ``cfg.overlong_buffer`` > 0). The
    functions run in ``pool`` (a :class:`~align_pipeline.rewards.pool.RewardPool`: ``reward.workers`` > 0, worker
    processes, a per-response timeout) when given."""
    device = dist.device
    timeouts = 0
    if pool is not None and rewards.terms:
        values, timeouts = pool.values([(r["prompt"], t, r) for r, t in zip(rollout.records, rollout.texts)])
    else:
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
    shaping = None
    if cfg.overlong_buffer > 0 and max_tokens:
        lengths = torch.tensor([len(t) for t in rollout.tokens], device=device)  # [n]
        shaping = overlong_shaping(lengths, max_tokens, min(cfg.overlong_buffer, max_tokens)).to(total.dtype)
        total = total + cfg.overlong_penalty * shaping
    return Scores(total, correct, rm_scores, functions, shaping, timeouts)


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


def mismatch_stats(stats: DPStats, rows: dict, train_logp: torch.Tensor) -> None:
    """The rollout-training mismatch of one rollout: ``rollout/logprob_diff/{mean,max}`` (|training forward − engine|
    log-prob per response token) and ``rollout/seq_ratio/{mean,max}`` (π_train / π_rollout of each whole response,
    exp of the summed difference, its exponent clamped to ±20)."""
    mask = rows["loss_mask"]
    diff = torch.where(mask != 0, train_logp - rows["rollout_logp"], 0.0)  # [n, s]
    stats.add("rollout/logprob_diff/mean", diff.abs(), mask, std=False)
    stats.add_max("rollout/logprob_diff/max", diff.abs(), mask)
    seq_ratio = torch.exp(diff.double().sum(-1).clamp(-20.0, 20.0))  # [n]
    stats.add("rollout/seq_ratio/mean", seq_ratio, std=False)
    stats.add_max("rollout/seq_ratio/max", seq_ratio)


def rollout_stats(r: Rollout, scores: Scores, rewards: RewardFunctions, dist: Dist) -> DPStats:
    """The rollout metrics every RL stage reports (a stage adds its own before ``reduce()``): ``rollout/accuracy``
    with an accuracy function, ``rollout/reward_<function>`` per function when there are several, and
    ``rollout/nonfinite_rewards``: how many samples of the rollout (all DP ranks) had a NaN or infinite reward (they
    get advantage 0 and are left out of the baselines and of the reward means), and the response length distribution
    ``rollout/response_length/{mean,p50,p90,max,clip_fraction}`` (tokens; clip_fraction: the share cut off at the
    generation limit, without a stop id)."""
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
    lengths = r.rows["loss_mask"].sum(-1)  # [n]
    ended = torch.tensor(r.ended_with_eos, dtype=torch.float64, device=dist.device)  # [n]
    stats.add("rollout/response_lengths", lengths, std=False)
    if scores.overlong is not None:
        stats.add("rollout/overlong_shaping", scores.overlong, std=False)
    stats.add("rollout/reward_timeouts", torch.tensor([float(scores.timeouts)], device=dist.device), total=True)
    stats.add("rollout/fraction_of_samples_properly_ended", ended, std=False)
    stats.add("rollout/response_length/mean", lengths, std=False)
    stats.add_quantiles("rollout/response_length", lengths, {"p50": 0.5, "p90": 0.9, "max": 1.0})
    stats.add("rollout/response_length/clip_fraction", 1.0 - ended, std=False)
    stats.add("rollout/decode_slots", torch.tensor([float(r.slots)], device=dist.device), std=False)
    stats.add("rollout/decode_refills", torch.tensor([float(r.refills)], device=dist.device), std=False)
    for key, values in r.episode_stats.items():  # multi-turn episodes: env/return, env/turns, env/timeouts, ...
        stats.add(f"env/{key}", torch.tensor(values, dtype=torch.float64, device=dist.device),
                  total=key == "timeouts", std=key == "return")
    return stats


def minibatch_order(seed: int, iteration: int, epoch: int, n: int, device) -> torch.Tensor:
    """The seeded order of a rollout's n rows in one epoch (a pure function of seed, iteration and epoch)."""
    return torch.from_numpy(np.random.default_rng([seed, iteration, epoch]).permutation(n)).to(device)


def validation_accuracy(model, records: list[dict], gen: GenerationConfig, tok, vocab_size: int, dist: Dist,
                        seq_length: int, rewards: RewardFunctions) -> dict[str, float]:
    """Accuracy (the accuracy function's value >= 1) of ``model`` on held-out prompt records, greedy and sampled (one
    sample per prompt at the rollout temperature); DP ranks split the prompts. Empty without an accuracy function."""
    if not records or rewards.accuracy is None:
        return {}

    def correct(greedy: bool, mine: list[dict], one: GenerationConfig, seed: int) -> float:
        r = generate_rollout(model, mine, one, tok, vocab_size, dist, seq_length, seed=seed, greedy=greedy)
        return float(sum(rewards.correct(rewards.values(rec["prompt"], text, rec))
                         for rec, text in zip(r.records, r.texts)))

    return held_out_accuracy(records, gen, dist, correct)


def held_out_accuracy(records: list[dict], gen: GenerationConfig, dist: Dist, correct) -> dict[str, float]:
    """``val/greedy_accuracy`` and ``val/accuracy`` over DP ranks: ``correct(greedy, my_records, generation with one
    sample, seed)`` counts this rank's correct responses."""
    mine = records[dist.dp_rank :: dist.dp_size]
    totals = torch.zeros(3, dtype=torch.float64, device=dist.device)
    # A rank without records still generates (one record, not counted) when its expert-parallel peers do: an MoE
    # model's forwards exchange tokens between them.
    stand_in = not mine and dist.ep_size > 1
    if mine or stand_in:
        one = dataclasses.replace(gen, samples_per_prompt=1)
        for i, greedy in enumerate((True, False)):
            right = correct(greedy, mine or records[:1], one, iteration_seed(one.seed, -1, dist.dp_rank))
            totals[i] = right if mine else 0.0
        totals[2] = len(mine)
    tdist.all_reduce(totals, group=dist.pgs.dp)
    n = max(totals[2].item(), 1.0)
    return {"val/greedy_accuracy": totals[0].item() / n, "val/accuracy": totals[1].item() / n}
