"""Reward functions for the reward-pool tests (imported by name in spawned workers)."""

import time


def hangs_on_request(prompt: str, response: str, record: dict) -> float:
    """1.0, except for a response saying "hang": then it never returns (sleeps an hour)."""
    if "hang" in response:
        time.sleep(3600)
    return 1.0


def length(prompt: str, response: str, record: dict) -> float:
    return float(len(response))


def logged(prompt: str, response: str, record: dict) -> float:
    """len(response), each call appended to the file ``record["log"]`` (to count the calls)."""
    with open(record["log"], "a") as f:
        f.write(response + "\n")
    return float(len(response))


def raises_on_request(prompt: str, response: str, record: dict) -> float:
    if "raise" in response:
        raise ArithmeticError(f"cannot score {response!r}")
    return 1.0
