"""Environments in worker processes, with a per-call timeout (``<stage>.env.workers``, ``env.step_timeout_s``).

Each of ``workers`` spawned processes builds the environment once (``Class(**config)``) and serves ``reset`` and
``step`` calls. :meth:`EnvPool.run` hands a batch of calls to the workers and waits at most ``timeout_s`` for each
one's answer: a call that runs over gets ``None`` (its episode ends, scored 0 for that turn, and is counted), the
pool is terminated - which ends the hung call - and the calls not collected yet go to a fresh one (calls are pure:
running one again changes nothing). An exception inside ``reset`` / ``step``, or an answer that breaks the protocol,
comes back as its message and traceback, and :meth:`EnvPool.run` raises :class:`~.base.EnvError` naming the call's
label (the episode and turn).
"""

from __future__ import annotations

import multiprocessing
import traceback
from typing import Any

from align_pipeline.envs.base import EnvError, as_start, as_step, load_environment_class
from align_pipeline.rewards.pool import spawn_pool

_ENV: Any = None
"""This worker's environment."""


def _call(spec: str, config: dict[str, Any], kind: str, args: tuple) -> tuple[str, Any]:
    """In a worker: ``("ok", result)`` of one reset / step (the environment built on the worker's first call), or
    ``("error", message with traceback)``."""
    global _ENV
    try:
        if _ENV is None:
            _ENV = load_environment_class(spec, "env.name")(**config)
        if kind == "reset":
            messages, tools = as_start(_ENV.reset(*args), "reset()")
            return "ok", {"messages": messages, "tools": tools}
        step = as_step(_ENV.step(*args), "step()")
        return "ok", {"messages": step.messages, "reward": step.reward, "done": step.done, "info": step.info}
    except BaseException as exc:  # noqa: BLE001 - handed to the job, which names the episode
        return "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=8)}"


class EnvPool:
    """``workers`` spawned processes running the environment ``spec`` (built with ``config``), each call waited for
    at most ``timeout_s``."""

    def __init__(self, spec: str, config: dict[str, Any], workers: int, timeout_s: float):
        if workers < 1 or timeout_s <= 0:
            raise ValueError(f"EnvPool needs workers >= 1 and timeout_s > 0, got {workers}, {timeout_s}")
        self.spec, self.config, self.workers, self.timeout_s = spec, dict(config), workers, timeout_s
        self._pool = None

    def _get(self):
        if self._pool is None:  # started before any call is timed (rewards.pool.spawn_pool)
            self._pool = spawn_pool(self.workers)
        return self._pool

    def close(self) -> None:
        """End the workers (hung ones too)."""
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None

    def _submit(self, kind: str, args: tuple):
        return self._get().apply_async(_call, (self.spec, self.config, kind, args))

    def run(self, kind: str, calls: list[tuple], labels: list[str]) -> tuple[list[dict[str, Any] | None], int]:
        """(each call's answer in order - None for one that ran over ``timeout_s`` -, how many ran over) of
        ``kind`` (``reset``: args ``(record,)``; ``step``: ``(messages, record)``); ``labels`` name the calls in
        errors."""
        waiting = {i: self._submit(kind, args) for i, args in enumerate(calls)}
        answers: dict[int, dict[str, Any] | None] = {}
        timeouts = 0
        while len(answers) < len(calls):
            late = None
            for i in range(len(calls)):
                if i in answers:
                    continue
                try:
                    status, value = waiting[i].get(timeout=self.timeout_s)
                except multiprocessing.TimeoutError:
                    late = i
                    break
                if status == "error":  # the workers end first: a pool left running would hold up the job's exit
                    self.close()
                    raise EnvError(f"environment {self.spec}: {kind}() of {labels[i]} failed: {value}")
                answers[i] = value
            if late is None:
                break
            answers[late] = None  # ran over: its episode ends there, counted
            timeouts += 1
            self.close()  # ends the hung call; what was not collected yet goes to a fresh pool
            waiting = {i: self._submit(kind, calls[i]) for i in range(len(calls)) if i not in answers}
        return [answers[i] for i in range(len(calls))], timeouts

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001, S110 - interpreter shutdown
            pass


__all__ = ["EnvPool"]
