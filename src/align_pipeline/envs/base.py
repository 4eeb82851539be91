"""What an environment is: the protocol the RL stages' multi-turn rollouts drive (``<stage>.env.name``).

An environment is a class named in the parameters as ``module:Class``. A job builds it once per worker process with
``Class(**env.config)``, then, for every episode (one prompt record x one sample):

* ``reset(record) -> messages``: the conversation the policy answers first (OpenAI chat messages, e.g. a system
  message and the record's question), from the prompt record (every field of its raw line). It may return
  ``{"messages": [...], "tools": [...]}`` instead: ``tools`` (function schemas) then reach the chat template at every
  turn, as ``apply_chat_template(tools=...)`` passes them.
* ``step(messages, record) -> Step | (new_messages, reward, done, info)``: ``messages`` is the conversation so far,
  ending with the policy's turn (``{"role": "assistant", "content": <its text>}``); the environment answers with the
  messages to append (a ``tool`` or ``user`` turn; none when it is done), the reward of this turn, whether the
  episode is over, and an ``info`` dict (JSON values; ``info["correct"]`` on the last step, a bool, is the episode's
  accuracy in the metrics).

The episode ends when the environment says ``done``, after ``env.max_turns`` policy turns, when the policy's turn
ends without a stop token (it ran out of ``generation.max_new_tokens`` or of the episode's ``env.max_tokens``), or
when a step runs over ``env.step_timeout_s`` (scored 0, counted). An environment keeps no state between calls:
everything an episode needs is in its messages and its record (the calls of one episode may run in different
worker processes, and a worker is replaced after a timeout). Exceptions raised by ``reset`` / ``step`` stop the job
with the environment, the episode (prompt record and sample) and the turn named.

Nothing here imports torch, Megatron or Kedro; an environment's module is imported by the Kedro process too (the
parameters are checked before any node runs), so it should not import them either.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from align_pipeline.config.env_spec import load_environment_class

ROLES = ("system", "user", "assistant", "tool")


class EnvError(RuntimeError):
    """An environment failed (raised, returned something else than the protocol says, or cannot be rendered)."""


@dataclass
class Step:
    """One environment step: the messages to append, this turn's reward, whether the episode is over, and info."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


class Environment:
    """Optional base class of an environment (see the module docstring): keeps ``config``."""

    def __init__(self, **config: Any) -> None:
        self.config = config

    def reset(self, record: dict[str, Any]) -> list[dict[str, Any]] | dict[str, Any]:
        raise NotImplementedError

    def step(self, messages: list[dict[str, Any]], record: dict[str, Any]) -> Step | tuple:
        raise NotImplementedError


def check_messages(messages: Any, what: str) -> list[dict[str, Any]]:
    """``messages`` as a list of ``{"role", "content", ...}`` dicts with a known role and string content (or None
    beside ``tool_calls``); else :class:`EnvError` naming ``what``."""
    if not isinstance(messages, list):
        raise EnvError(f"{what}: expected a list of messages, got {type(messages).__name__}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise EnvError(f"{what}: message {i} must be a dict with a role in {ROLES}, got {m!r:.200}")
        content = m.get("content")
        if not isinstance(content, str) and not (content is None and m.get("tool_calls")):
            raise EnvError(f"{what}: message {i} ({m['role']}) has no string content")
    return messages


def as_step(value: Any, what: str) -> Step:
    """What ``step()`` returned as a :class:`Step`, checked (messages, a finite reward, a bool, a dict of info)."""
    if isinstance(value, tuple) and len(value) == 4:
        value = Step(*value)
    if not isinstance(value, Step):
        raise EnvError(f"{what}: step() must return a Step or (new_messages, reward, done, info), got "
                       f"{type(value).__name__}")
    check_messages(value.messages, what)
    if isinstance(value.reward, bool) or not isinstance(value.reward, (int, float)) or not math.isfinite(value.reward):
        raise EnvError(f"{what}: the reward must be a finite number, got {value.reward!r}")
    if not isinstance(value.done, bool):
        raise EnvError(f"{what}: done must be a bool, got {type(value.done).__name__}")
    if not isinstance(value.info, dict):
        raise EnvError(f"{what}: info must be a dict, got {type(value.info).__name__}")
    return Step(list(value.messages), float(value.reward), value.done, dict(value.info))


def as_start(value: Any, what: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """What ``reset()`` returned -> (messages, tools or None), checked."""
    tools = None
    if isinstance(value, dict):
        tools = value.get("tools")
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise EnvError(f"{what}: tools must be a list of function schemas (dicts)")
        value = value.get("messages")
    messages = check_messages(value, what)
    if not messages:
        raise EnvError(f"{what}: reset() returned no messages")
    return messages, tools


__all__ = ["ROLES", "EnvError", "Environment", "Step", "as_start", "as_step", "check_messages",
           "load_environment_class"]
