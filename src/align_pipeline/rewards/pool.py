"""Reward functions in worker processes, with a per-sample timeout (``reward.workers`` > 0).

A slow reward (a math verifier, a code sandbox) computed serially holds up the whole rank; one that hangs stops the
job. :class:`RewardPool` evaluates every response's functions in ``workers`` spawned processes (they import the
functions by name: ``module:function``, as configured), waits at most ``timeout_s`` for each response's values, and
scores a response whose call runs over 0 on every function, counting it (``rollout/reward_timeouts``). The pool is
then terminated - which ends the hung call - and the responses not collected yet go to a fresh one (reward functions
are pure, so computing one again changes nothing). An exception inside a function is raised in the job, as serially.
Responses can be submitted one by one as generation finishes them (:meth:`RewardPool.submit`), so that scoring
overlaps with the rest of the rollout.
"""

from __future__ import annotations

import multiprocessing
import time
from typing import Any

from align_pipeline.rewards.base import call

_LOADED: dict[str, Any] = {}
"""A worker's loaded functions, by spec."""
STARTUP_S = 300.0
"""How long a new pool's workers may take to start (a spawned worker imports the job's main module: torch, Megatron)
before the per-call timeouts apply."""


def _pid(_: int) -> int:
    import os
    import time

    time.sleep(0.05)  # long enough for every worker to take one
    return os.getpid()


def spawn_pool(workers: int, startup_s: float = STARTUP_S):
    """``workers`` spawned processes (a fork of a process with CUDA / OpenMP threads is not safe), returned once
    each has started and answered: the start-up (seconds under load) never counts against a call's timeout."""
    pool = multiprocessing.get_context("spawn").Pool(workers)
    pids: set[int] = set()
    try:
        deadline = time.monotonic() + startup_s
        while len(pids) < workers:
            left = deadline - time.monotonic()
            if left <= 0:
                raise multiprocessing.TimeoutError
            pids.update(pool.map_async(_pid, range(2 * workers), chunksize=1).get(timeout=left))
    except multiprocessing.TimeoutError:
        pool.terminate()
        pool.join()
        raise RuntimeError(f"{workers} worker processes did not start within {startup_s:.0f} s") from None
    return pool


def _values(specs: tuple[str, ...], prompt: str, response: str, record: dict[str, Any]) -> list[float]:
    """In a worker: each function's value for one response (functions loaded once per process)."""
    from align_pipeline.config.reward_spec import load_reward_function

    out = []
    for spec in specs:
        if spec not in _LOADED:
            _LOADED[spec] = load_reward_function(spec, spec)
        out.append(call(_LOADED[spec], spec, prompt, response, record))
    return out


class RewardPool:
    """``workers`` spawned processes evaluating the functions ``specs`` with a per-response timeout."""

    def __init__(self, specs: list[str], workers: int, timeout_s: float):
        if workers < 1 or timeout_s <= 0:
            raise ValueError(f"RewardPool needs workers >= 1 and timeout_s > 0, got {workers}, {timeout_s}")
        self.specs, self.workers, self.timeout_s = tuple(specs), workers, timeout_s
        self._pool = None
        self._items: dict[int, tuple[str, str, dict[str, Any]]] = {}  # submitted, not collected yet
        self._waiting: dict[int, Any] = {}  # their AsyncResults

    def _get(self):
        if self._pool is None:
            self._pool = spawn_pool(self.workers)
        return self._pool

    def close(self) -> None:
        """End the workers (hung ones too)."""
        self._items, self._waiting = {}, {}
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None

    def submit(self, i: int, item: tuple[str, str, dict[str, Any]]) -> None:
        """Start computing response ``i``'s values now (prompt, response, record), e.g. as soon as generation has
        finished it; :meth:`values` collects it."""
        self._items[i] = item
        self._waiting[i] = self._get().apply_async(_values, (self.specs, *item))

    def values(self, items: list[tuple[str, str, dict[str, Any]]]) -> tuple[list[list[float]], int]:
        """(each response's function values, in order; how many timed out and scored 0) for ``items`` =
        (prompt, response, record) per response. Responses :meth:`submit`-ted already (the same item) are not
        computed again; the others start now. Each response gets ``timeout_s`` from when it is waited for."""
        for i, item in enumerate(items):
            if self._items.get(i) != item:
                self.submit(i, item)
        results: dict[int, list[float]] = {}
        timeouts = 0
        try:
            while len(results) < len(items):
                late = None
                for i in range(len(items)):
                    if i in results:
                        continue
                    try:
                        results[i] = self._waiting[i].get(timeout=self.timeout_s)
                    except multiprocessing.TimeoutError:
                        late = i
                        break
                    except Exception:  # the function raised: end the workers first (a pool left running holds up
                        self.close()  # the job's exit), then raise it in the job
                        raise
                if late is None:
                    break
                results[late] = [0.0] * len(self.specs)  # ran over: 0 on every function, counted
                timeouts += 1
                self.close()  # ends the hung call; what was not collected yet goes to a fresh pool
                for i in range(len(items)):
                    if i not in results:
                        self.submit(i, items[i])
        finally:
            self._items, self._waiting = {}, {}
        return [results[i] for i in range(len(items))], timeouts

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001, S110 - interpreter shutdown
            pass


__all__ = ["RewardPool", "spawn_pool"]
