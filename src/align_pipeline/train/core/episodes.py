"""Multi-turn rollouts: episodes of the policy acting in an environment (``<stage>.env``, :mod:`align_pipeline.envs`).

An episode is one prompt record x one sample. Its tokens are built turn by turn, never re-rendered:

* the first prompt: the environment's ``reset(record)`` messages rendered with the generation prompt (the chat
  template with its ``tools``, or the plain layout of a tokenizer without one);
* a policy turn: the tokens the rollout engine sampled (all live episodes in one :func:`generate` call), kept as
  they are, with their log-probs; the loss covers these tokens only;
* an environment turn: the text the chat template adds for the environment's messages and the next generation
  prompt, tokenized (the template's rendering of the conversation with those messages, after the rendering of the
  conversation up to the policy's stop token; with the plain layout, the messages' contents).

A turn's reward sits at its last policy token (``turn_rewards``); REINFORCE optimises the episode's return, their
sum. The environment runs in worker processes (:class:`~align_pipeline.envs.pool.EnvPool`) on each DP group's first
tensor-parallel rank, which hands the answers to the others as JSON.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

import numpy as np
import torch
import torch.distributed as tdist

from align_pipeline.config.common import EnvConfig, GenerationConfig
from align_pipeline.data.chat import ChatTemplateError
from align_pipeline.data.schemas import message_segments
from align_pipeline.envs.base import EnvError
from align_pipeline.model.generate import expert_peers_generating, generate, match_expert_peers
from align_pipeline.train.core.batches import to_rows
from align_pipeline.train.core.distributed import Dist

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Episode:
    """One episode's conversation and tokens."""

    record: dict[str, Any]
    label: str
    """How errors name it: its prompt record and sample."""
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    prompt_ids: list[int]
    tokens: list[int] = dataclasses.field(default_factory=list)
    """Every token after the first prompt: policy and environment turns."""
    policy: list[bool] = dataclasses.field(default_factory=list)
    """Per token of ``tokens``: the policy's (the loss is on these)."""
    logprobs: list[float] = dataclasses.field(default_factory=list)
    """Per token of ``tokens``: the engine's log-prob (0 on environment tokens)."""
    turn_rewards: list[tuple[int, float]] = dataclasses.field(default_factory=list)
    """(index in ``tokens`` of the turn's last policy token, the turn's reward)."""
    turns: int = 0
    done: bool = False
    truncated: bool = False
    """Ended without the environment saying done: a policy turn without a stop token, no room left, the turn limit."""
    timeouts: int = 0
    correct: bool | None = None
    """The last step's ``info["correct"]``, when the environment reports it."""
    last_text: str = ""
    """The text of the last policy turn."""

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.tokens

    @property
    def episode_return(self) -> float:
        return float(sum(r for _, r in self.turn_rewards))

    def add(self, tokens: list[int], policy: bool, logprobs: list[float] | None = None) -> None:
        self.tokens += tokens
        self.policy += [policy] * len(tokens)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(tokens)


class Turns:
    """Renders an episode's messages into tokens: the first prompt and each environment turn (module docstring)."""

    def __init__(self, tok) -> None:
        self.tok, self.template = tok, tok.chat_template

    def first(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, label: str) -> list[int]:
        if self.template is None:
            return self.tok.start_ids() + self.tok.encode(self._plain(messages, tools, label))
        text = self._render(messages, True, tools, label)
        return self.tok.start_ids(text) + self.tok.encode(text)

    def environment(self, ep: Episode, turn_tokens: list[int], new: list[dict[str, Any]]) -> list[int]:
        """The tokens between the policy's last turn (``turn_tokens``, its stop token included; ``ep.messages``
        ending with it) and the next policy turn: the environment's ``new`` messages and the generation prompt."""
        if self.template is None:
            return self.tok.encode(self._plain(new, ep.tools, ep.label))
        before, policy_turn = ep.messages[:-1], ep.messages[-1]
        full = self._render(before + [policy_turn] + new, True, ep.tools, ep.label)
        as_generated = (self._render(before, True, ep.tools, ep.label)
                        + self.tok.decode(turn_tokens, skip_special_tokens=False))
        if full.startswith(as_generated):  # the template's text after the policy's stop token
            return self.tok.encode(full[len(as_generated):])
        rendered = self._render(before + [policy_turn], False, ep.tools, ep.label)
        if not full.startswith(rendered):
            raise EnvError(f"{ep.label}: the chat template does not render this conversation append-only (adding the "
                           "environment's messages changes the text before them), so its turns cannot be appended")
        logger.warning("%s: the chat template renders the policy's turn otherwise than it was generated; the "
                       "environment turn starts after the template's rendering of it", ep.label)
        return self.tok.encode(full[len(rendered):])

    def _render(self, messages, generation_prompt: bool, tools, label: str) -> str:
        try:
            return self.template.render(messages, add_generation_prompt=generation_prompt, tools=tools)
        except ChatTemplateError as exc:
            raise EnvError(f"{label}: {exc}") from None

    @staticmethod
    def _plain(messages, tools, label: str) -> str:
        if tools:
            raise EnvError(f"{label}: the environment gives tools, which need a chat template (the tokenizer has none)")
        try:
            return "".join(text for text, _ in message_segments(messages, responses=False))
        except ChatTemplateError as exc:
            raise EnvError(f"{label}: {exc}") from None


def env_call(dist: Dist, pool, kind: str, calls: list[tuple], labels: list[str]
             ) -> tuple[list[dict[str, Any] | None], int]:
    """``pool.run`` on this DP group's first tensor-parallel rank; its answers (or its error) reach the group's other
    ranks as JSON, so every rank of the group continues the same episodes."""
    if dist.tp_size == 1:
        return pool.run(kind, calls, labels)
    payload = None
    if dist.tp_rank == 0:
        try:
            answers, timeouts = pool.run(kind, calls, labels)
            payload = {"answers": answers, "timeouts": timeouts}
        except EnvError as exc:
            payload = {"error": str(exc)}
    payload = broadcast_json(payload, dist)
    if "error" in payload:
        raise EnvError(payload["error"])
    return payload["answers"], payload["timeouts"]


def broadcast_json(obj: Any, dist: Dist) -> Any:
    """``obj`` (JSON values) of the tensor-parallel group's first rank, on every rank of the group."""
    group = dist.pgs.tp
    src = tdist.get_global_rank(group, 0)
    data = json.dumps(obj).encode() if dist.tp_rank == 0 else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=dist.device)
    tdist.broadcast(size, src, group=group)
    buffer = (torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dist.device) if dist.tp_rank == 0
              else torch.empty(int(size.item()), dtype=torch.uint8, device=dist.device))
    tdist.broadcast(buffer, src, group=group)
    return json.loads(bytes(buffer.cpu().tolist()).decode()) if dist.tp_rank != 0 else obj


def turn_seed(seed: int, turn: int) -> int:
    return (seed + turn * 1_000_033) % 2**62


def run_episodes(policy, records: list[dict[str, Any]], gen: GenerationConfig, env: EnvConfig, pool, tok,
                 vocab_size: int, dist: Dist, seq_length: int, seed: int, greedy: bool = False
                 ) -> list[Episode]:
    """``gen.samples_per_prompt`` episodes per record, played to their ends (module docstring)."""
    stops = set(tok.stop_ids)
    turns = Turns(tok)
    n = gen.samples_per_prompt
    rows = [(r, j) for r in records for j in range(n)]
    labels = [f"episode {i} (prompt {r.get('prompt')!r:.80}, sample {j})" for i, (r, j) in enumerate(rows)]
    starts, _ = env_call(dist, pool, "reset", [(r,) for r, _ in rows], labels)
    episodes = []
    for (record, _), label, start in zip(rows, labels, starts):
        if start is None:  # reset ran over: an empty episode, done at once
            ep = Episode(record, label, [], None, list(record["prompt_ids"]), done=True, truncated=True, timeouts=1)
        else:
            ep = Episode(record, label, start["messages"], start["tools"], [])
            ep.prompt_ids = turns.first(ep.messages, ep.tools, label)
            if len(ep.prompt_ids) >= seq_length:
                raise EnvError(f"{label}: reset()'s conversation is {len(ep.prompt_ids)} tokens, the model's "
                               f"seq_length {seq_length} leaves no room for a turn")
        episodes.append(ep)
    budget = env.max_tokens or seq_length
    for turn in range(env.max_turns):
        caps = {i: min(gen.max_new_tokens, seq_length - len(ep.ids), budget - len(ep.tokens))
                for i, ep in enumerate(episodes) if not ep.done}
        for i, cap in caps.items():
            if cap < 1:
                episodes[i].done = episodes[i].truncated = True
        live = [i for i, cap in caps.items() if cap >= 1]
        if not expert_peers_generating(policy, bool(live)):
            break
        if not live:  # an expert-parallel peer's episodes go on: its forwards need this rank's
            match_expert_peers(policy)
            continue
        g = generate(policy, [episodes[i].ids for i in live], max_new_tokens=max(caps[i] for i in live),
                     eos_id=tok.stop_ids, pad_id=tok.pad_id, vocab_size=vocab_size, temperature=gen.temperature,
                     top_k=gen.top_k, top_p=gen.top_p, greedy=greedy, seed=turn_seed(seed, turn),
                     cuda_graphs=gen.cuda_graphs, tp_group=dist.pgs.tp, prefill_bucket=gen.prefill_bucket,
                     max_rows=gen.batch_size, kv_cache_gib=gen.kv_cache_gib, compile_step=gen.compile_step)
        stepping, turn_tokens = [], {}
        for k, i in enumerate(live):
            ep, cap = episodes[i], caps[i]
            tokens, logprobs = g.tokens[k][:cap], g.logprobs[k][:cap]
            ended = bool(tokens) and tokens[-1] in stops
            ep.add(tokens, True, logprobs)
            ep.turns += 1
            ep.last_text = tok.decode(tokens[:-1] if ended else tokens)
            ep.messages = ep.messages + [{"role": "assistant", "content": ep.last_text}]
            if not ended:  # out of tokens mid-turn: no step on a cut-off turn
                ep.done = ep.truncated = True
                continue
            stepping.append(i)
            turn_tokens[i] = tokens
        answers, _ = env_call(dist, pool, "step", [(episodes[i].messages, episodes[i].record) for i in stepping],
                                     [f"{episodes[i].label}, turn {turn + 1}" for i in stepping])
        for i, answer in zip(stepping, answers):
            ep = episodes[i]
            if answer is None:  # the step ran over: the turn scores 0 and the episode ends
                ep.turn_rewards.append((len(ep.tokens) - 1, 0.0))
                ep.done = ep.truncated = True
                ep.timeouts += 1
                continue
            ep.turn_rewards.append((len(ep.tokens) - 1, answer["reward"]))
            if "correct" in answer["info"]:
                ep.correct = bool(answer["info"]["correct"])
            if answer["done"]:
                ep.done = True
                continue
            if turn + 1 == env.max_turns:
                ep.done = ep.truncated = True
                continue
            delta = turns.environment(ep, turn_tokens[i], answer["messages"])
            if len(ep.ids) + len(delta) >= seq_length or len(ep.tokens) + len(delta) >= budget:
                ep.done = ep.truncated = True  # no room for the environment's turn and another policy turn
                continue
            ep.add(delta, False)
            ep.messages = ep.messages + answer["messages"]
    for ep in episodes:
        ep.done = True
    return episodes


def episodes_rollout(episodes: list[Episode], tok, dist: Dist, seq_length: int):
    """The episodes as a :class:`~align_pipeline.train.core.rollout.Rollout`: one row each, the loss on the policy's
    tokens, the engine's log-probs there, ``turn_rewards`` [n, s] (each turn's reward at its last policy token: PPO's
    per-turn rewards); ``texts`` = each episode's last policy turn (what reward functions score); ``episode_stats`` =
    per-episode numbers for the ``env/*`` metrics."""
    from align_pipeline.train.core.rollout import Rollout

    arrays = to_rows([ep.prompt_ids for ep in episodes], [ep.tokens for ep in episodes], seq_length, tok.pad_id,
                     [ep.logprobs for ep in episodes], masks=[ep.policy for ep in episodes])
    turn_rewards = np.zeros_like(arrays["loss_mask"])  # [n, s] each turn's reward at its last policy token's label
    for i, ep in enumerate(episodes):
        for j, reward in ep.turn_rewards:
            position = len(ep.prompt_ids) - 1 + j  # label t = token t + 1
            if position < seq_length - 1:
                turn_rewards[i, position] += reward
    arrays["turn_rewards"] = turn_rewards
    rows = {k: torch.from_numpy(v).to(dist.device) for k, v in arrays.items()}
    stats = {
        "return": [ep.episode_return for ep in episodes],
        "turns": [float(ep.turns) for ep in episodes],
        "truncated": [float(ep.truncated) for ep in episodes],
        "timeouts": [float(ep.timeouts) for ep in episodes],
        "policy_tokens": [float(sum(ep.policy)) for ep in episodes],
        "env_tokens": [float(len(ep.policy) - sum(ep.policy)) for ep in episodes],
    }
    return Rollout([ep.record for ep in episodes], [list(ep.tokens) for ep in episodes],
                   [not ep.truncated for ep in episodes], rows, [ep.last_text for ep in episodes],
                   episode_stats=stats)


def validation_accuracy(model, records: list[dict[str, Any]], gen: GenerationConfig, env: EnvConfig, pool, tok,
                        vocab_size: int, dist: Dist, seq_length: int, rewards) -> dict[str, float]:
    """:func:`~align_pipeline.train.core.rollout.validation_accuracy` of episodes: one per held-out prompt, correct as
    its last step's ``info["correct"]`` says, else by the accuracy function on its last policy turn."""
    from align_pipeline.train.core.rollout import held_out_accuracy

    if not records:
        return {}

    def correct(greedy: bool, mine: list[dict[str, Any]], one: GenerationConfig, seed: int) -> float:
        episodes = run_episodes(model, mine, one, env, pool, tok, vocab_size, dist, seq_length, seed, greedy=greedy)
        return float(sum(bool(ep.correct) if ep.correct is not None else rewards.accuracy is not None
                         and rewards.correct(rewards.values(ep.record["prompt"], ep.last_text, ep.record))
                         for ep in episodes))

    return held_out_accuracy(records, gen, dist, correct)


def add_returns(scores, episodes: list[Episode], env: EnvConfig, device):
    """The scores of the episodes' last turns (``reward`` section) plus ``env.reward_weight`` x each return;
    accuracy from the environment's ``info["correct"]`` when it reports one."""
    returns = torch.tensor([ep.episode_return for ep in episodes], dtype=scores.total.dtype, device=device)  # [n]
    scores.total = scores.total + env.reward_weight * returns
    if any(ep.correct is not None for ep in episodes):
        scores.correct = torch.tensor([float(bool(ep.correct)) for ep in episodes], device=device)  # [n]
    return scores


__all__ = ["Episode", "Turns", "add_returns", "broadcast_json", "env_call", "episodes_rollout", "run_episodes",
           "validation_accuracy"]
