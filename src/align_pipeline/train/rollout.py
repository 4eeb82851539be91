"""Rollouts for the RL stages (PPO, REINFORCE): the prompt stream, generation, scoring and per-token forward passes.

Every data-parallel rank generates for its own slice of the iteration's prompts and keeps its rows; tensor-parallel
ranks of one DP group hold identical rollouts (same prompts, same seed, tokens broadcast by :func:`generate`).
Nothing here takes an optimizer step.
"""

from __future__ import annotations

import dataclasses
import importlib
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as tdist

from align_pipeline.config import GenerationConfig, RewardConfig
from align_pipeline.model.generate import generate
from align_pipeline.model.logprobs import token_nll
from align_pipeline.train import loop
from align_pipeline.train.distributed import Dist
from align_pipeline.train.reward_model import sequence_rewards


def load_checker(spec: str):
    """``"module:function"`` -> the function ``(prompt, response, answer) -> bool``."""
    module, name = spec.split(":")
    return getattr(importlib.import_module(module), name)


def to_rows(prompt_ids: list[list[int]], responses: list[list[int]], seq_length: int, pad_id: int) -> dict:
    """prompt + response token lists -> right-padded input_ids/labels/loss_mask [n, s] (loss on response tokens).

    ``loss_mask[i, t] = 1`` when label t (= token t+1) is a response token, so per-token tensors of the RL math
    ([n, s], position t = the action y_{t+1} taken in state ids[:t+1]) line up with the model's outputs at input
    position t.
    """
    n = len(prompt_ids)
    ids = np.full((n, seq_length), pad_id, dtype=np.int64)
    mask = np.zeros((n, seq_length), dtype=np.float32)
    for i, (p, r) in enumerate(zip(prompt_ids, responses)):
        seq = (p + r)[:seq_length]
        ids[i, : len(seq)] = seq
        mask[i, len(p) - 1 : len(seq) - 1] = 1.0  # label t = token t+1 is a response token
    labels = np.full_like(ids, pad_id)
    labels[:, :-1] = ids[:, 1:]
    return {"input_ids": ids, "labels": labels, "loss_mask": mask}


class PromptStream:
    """``per_iteration`` prompts per iteration over all DP ranks, in a seeded order that reshuffles every epoch.

    The prompts of iteration ``i`` are a pure function of ``i`` (the same scheme as :class:`loop.ArrayBatches`), so the
    prompt cursor of a resumed run is just its iteration number.
    """

    def __init__(self, records: list[dict], per_iteration: int, dist: Dist, seed: int):
        if per_iteration % dist.dp_size:
            raise ValueError(f"prompts_per_iteration {per_iteration} must split over DP={dist.dp_size} ranks")
        self.records = records
        self.per_iteration = per_iteration
        self._batches = loop.ArrayBatches({"index": np.arange(len(records))}, per_iteration,
                                          per_iteration // dist.dp_size, dist, seed=seed, shuffle=True)

    def local(self, iteration: int) -> list[dict]:
        """This DP rank's prompt records of ``iteration``."""
        (mb,) = self._batches.microbatches(iteration)
        return [self.records[i] for i in mb["index"].tolist()]

    def consumed(self, iteration: int) -> int:
        """Prompts drawn before ``iteration`` (the cursor)."""
        return iteration * self.per_iteration


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
        g = generate(policy, prompts[start : start + gen.batch_size], max_new_tokens=max_new, eos_id=tok.eos_id,
                     pad_id=tok.pad_id, vocab_size=vocab_size, temperature=gen.temperature, top_k=gen.top_k,
                     top_p=gen.top_p, greedy=greedy, seed=seed + start, tp_group=dist.pgs.tp)
        tokens += g.tokens
        eos += g.ended_with_eos
    arrays = to_rows(prompts, tokens, seq_length, tok.pad_id)
    rows = {k: torch.from_numpy(v).to(dist.device) for k, v in arrays.items()}
    return Rollout(row_records, tokens, eos, rows, [tok.decode(t) for t in tokens])


def iteration_seed(base: int, iteration: int, dp_rank: int) -> int:
    """Sampling seed of one iteration on one DP rank (distinct streams, reproducible on resume)."""
    return (base * 1_000_003 + iteration * 7919 + dp_rank * 104_729) % 2**62


def split(rows: dict[str, torch.Tensor], micro_batch_size: int, order: torch.Tensor | None = None) -> list[dict]:
    """Row dict [n, ...] -> micro-batches of ``micro_batch_size`` rows (optionally in ``order``)."""
    first = next(iter(rows.values()))
    idx = order if order is not None else torch.arange(len(first), device=first.device)
    return [{k: v[idx[i : i + micro_batch_size]] for k, v in rows.items()} for i in range(0, len(idx), micro_batch_size)]


def _per_row(model, rows: dict, fn, micro_batch_size: int, dist: Dist) -> torch.Tensor:
    """Forward-only over this rank's rows; ``fn(module, batch) -> (output, per_row_fn)``; returns [n, k]."""
    with torch.no_grad():
        out = loop.collect_per_sample(model, split(rows, micro_batch_size), fn, dist)
    assert out is not None, "RL stages run with pipeline_model_parallel_size 1"
    return out


def token_logprobs(model, rows: dict, vocab_size: int, micro_batch_size: int, dist: Dist) -> torch.Tensor:
    """log pi(label_t | ids[:t+1]) for every position: [n, s] float32 (meaningful where loss_mask is 1)."""

    def fn(module, batch):
        logits = module(batch["input_ids"], loop.position_ids_like(batch["input_ids"]), None)
        return logits, lambda out: -token_nll(out, batch["labels"], vocab_size, dist.tp_rank)

    return _per_row(model, rows, fn, micro_batch_size, dist)


def token_values(model, rows: dict, micro_batch_size: int, dist: Dist) -> torch.Tensor:
    """A value-head model's output at every input position: [n, s] float32 (V(s_t) for the action at label t)."""

    def fn(module, batch):
        values = module(batch["input_ids"], loop.position_ids_like(batch["input_ids"]), None)
        return values, lambda out: out[..., 0].float()

    return _per_row(model, rows, fn, micro_batch_size, dist)


def reward_model_scores(rm, rows: dict, pooling: str, micro_batch_size: int, dist: Dist) -> torch.Tensor:
    """Sequence rewards [n] from a frozen reward model (the pooling it was trained with)."""

    def fn(module, batch):
        values = module(batch["input_ids"], loop.position_ids_like(batch["input_ids"]), None)
        return values, lambda out: sequence_rewards(out, batch["loss_mask"], pooling).unsqueeze(-1)

    return _per_row(rm, rows, fn, micro_batch_size, dist)[:, 0]


@dataclasses.dataclass
class Scores:
    total: torch.Tensor
    """[n] the reward the stage optimises."""
    correct: torch.Tensor
    """[n] 1.0 where the checker accepts the response."""
    rm: torch.Tensor | None
    """[n] reward-model scores (None without a reward model)."""


def score(rollout: Rollout, cfg: RewardConfig, checker, rm, rm_pooling: str | None, micro_batch_size: int,
          dist: Dist) -> Scores:
    """``reward_model_weight * RM + checker_weight * correct - missing_eos_penalty * (no EOS)``."""
    device = dist.device
    correct = torch.tensor([float(bool(checker(r["prompt"], t, r.get("answer"))))
                            for r, t in zip(rollout.records, rollout.texts)], device=device)
    no_eos = torch.tensor([0.0 if e else 1.0 for e in rollout.ended_with_eos], device=device)
    total = cfg.checker_weight * correct - cfg.missing_eos_penalty * no_eos
    rm_scores = None
    if rm is not None:
        rm_scores = reward_model_scores(rm, rollout.rows, rm_pooling, micro_batch_size, dist)
        total = total + cfg.reward_model_weight * rm_scores
    return Scores(total, correct, rm_scores)


# --------------------------------------------------------------------------------------------------------------------
# Statistics over the whole rollout (all DP ranks)
# --------------------------------------------------------------------------------------------------------------------


class DPStats:
    """Accumulate sums of (value, count) pairs on each DP rank and reduce them in one all-reduce.

    ``add(name, values, mask)`` records Σ v, Σ v² and the count; :meth:`reduce` returns ``name_mean`` /
    ``name_std`` (or just ``name`` with ``std=False``) over every DP rank's rows.
    """

    def __init__(self, dist: Dist):
        self.dist = dist
        self._entries: list[tuple[str, bool, torch.Tensor]] = []

    def add(self, name: str, values: torch.Tensor, mask: torch.Tensor | None = None, std: bool = True) -> None:
        v = values.detach().double()
        m = torch.ones_like(v) if mask is None else mask.detach().double()
        self._entries.append((name, std, torch.stack([(v * m).sum(), (v * v * m).sum(), m.sum()])))

    def reduce(self) -> dict[str, float]:
        if not self._entries:
            return {}
        stacked = torch.stack([e[2] for e in self._entries]).to(self.dist.device)  # [k, 3]
        tdist.all_reduce(stacked, group=self.dist.pgs.dp)
        out = {}
        for (name, std, _), (s, s2, c) in zip(self._entries, stacked.tolist()):
            mean = s / c if c else float("nan")
            if std:
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


def timed(fn, *args, **kwargs) -> tuple[Any, float]:
    """(fn(...), seconds), with a device synchronisation so GPU work is counted where it happens."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0
