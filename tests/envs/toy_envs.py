"""Environments of the tests (imported by name in worker processes: ``toy_envs:Class``)."""

from __future__ import annotations

import time
import zlib

from align_pipeline.envs import Environment, Step


class Nudge(Environment):
    """The record's prompt as the user's turn; after each policy turn but the last of ``turns``, a user turn
    ``" more:"`` rewarded 0.25; the last turn ends the episode with 1.0 when the record's answer is in it. ``hang_on``
    / ``raise_on``: the step of that turn (1-based) sleeps an hour / raises (``hang_one_in``: only for prompts whose
    crc32 is a multiple of it). ``turns_mod``: ``turns`` is 1 + the prompt's crc32 modulo it instead (episodes of
    different prompts take different numbers of turns)."""

    def reset(self, record):
        return [{"role": "user", "content": record["prompt"]}]

    def step(self, messages, record):
        turn = sum(m["role"] == "assistant" for m in messages)
        if self.config.get("hang_on") == turn and zlib.crc32(record.get("prompt", "").encode()) % self.config.get(
                "hang_one_in", 1) == 0:
            time.sleep(3600)
        if self.config.get("raise_on") == turn:
            raise ValueError(f"boom on turn {turn}")
        turns = self.config.get("turns", 2)
        if "turns_mod" in self.config:
            turns = 1 + zlib.crc32(record["prompt"].encode()) % self.config["turns_mod"]
        if turn < turns:
            return Step([{"role": "user", "content": " more:"}], 0.25, False, {})
        correct = str(record.get("answer")) in messages[-1]["content"]
        return [], float(correct), True, {"correct": correct}


class BadStep(Environment):
    def reset(self, record):
        return [{"role": "user", "content": "hi"}]

    def step(self, messages, record):
        return "not a step"
