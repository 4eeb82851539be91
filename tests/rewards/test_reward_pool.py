"""reward.workers: reward functions in spawned worker processes with a per-response timeout - a hung call scores 0,
is counted, and does not hold up the others; without a hang, the values of the serial path."""

from __future__ import annotations

import time

import pytest

from align_pipeline.rewards.pool import RewardPool

SPECS = ["slow_rewards:hangs_on_request", "slow_rewards:length"]


@pytest.fixture
def pool(monkeypatch):
    import pathlib

    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parent))  # spawned workers inherit sys.path
    p = RewardPool(SPECS, workers=2, timeout_s=2.0)
    yield p
    p.close()


def test_a_hung_call_scores_zero_is_counted_and_the_rest_are_scored(pool):
    items = [("p", "ok", {}), ("p", "please hang", {}), ("p", "fine too", {}), ("p", "x", {})]
    t0 = time.monotonic()
    values, timeouts = pool.values(items)
    assert values == [[1.0, 2.0], [0.0, 0.0], [1.0, 8.0], [1.0, 1.0]] and timeouts == 1
    assert time.monotonic() - t0 < 60  # the hour-long call was ended, not waited for
    again, timeouts = pool.values([("p", "ok", {})])  # a fresh pool after the terminated one
    assert again == [[1.0, 2.0]] and timeouts == 0


def test_without_a_hang_the_values_are_the_serial_ones(pool):
    from slow_rewards import hangs_on_request, length

    items = [("p", "a" * n, {}) for n in range(6)]
    values, timeouts = pool.values(items)
    assert timeouts == 0 and values == [[hangs_on_request(*i), length(*i)] for i in items]


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="workers"):
        RewardPool(SPECS, workers=0, timeout_s=1.0)


def test_responses_submitted_as_they_end_are_computed_once(monkeypatch, tmp_path):
    """A rollout hands each response to the pool as generation ends it (submit); values() then collects those and
    computes only what was not submitted, or was submitted with other content."""
    import pathlib

    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parent))
    log = tmp_path / "calls.txt"
    pool = RewardPool(["slow_rewards:logged"], workers=2, timeout_s=30.0)
    try:
        items = [("p", r, {"log": str(log)}) for r in ("one", "three", "fifteen", "x")]
        pool.submit(2, items[2])  # ended first
        pool.submit(0, items[0])
        pool.submit(1, ("p", "stale", {"log": str(log)}))  # not what values() is asked for: computed again
        values, timeouts = pool.values(items)
        assert values == [[3.0], [5.0], [7.0], [1.0]] and timeouts == 0
        assert sorted(log.read_text().split()) == sorted(["one", "three", "fifteen", "x", "stale"])
        pool.values(items)  # nothing carried over from the last collection: all four again
        assert len(log.read_text().split()) == 9
    finally:
        pool.close()


def test_an_exception_in_a_function_is_raised_and_the_workers_end(monkeypatch):
    import pathlib

    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parent))
    pool = RewardPool(["slow_rewards:raises_on_request"], workers=2, timeout_s=30.0)
    try:
        with pytest.raises(ArithmeticError, match="cannot score 'please raise'"):
            pool.values([("p", "ok", {}), ("p", "please raise", {}), ("p", "fine", {})])
        assert pool._pool is None  # terminated: nothing left running to hold up the job's exit
        assert pool.values([("p", "ok", {})]) == ([[1.0]], 0)  # a fresh pool afterwards
    finally:
        pool.close()
