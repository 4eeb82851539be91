"""Reward functions with known groups without signal, for the dynamic-sampling tests: a response's score is a hash of
its text (the samples of a prompt score differently), except that every response to a prompt whose CRC-32 is even
scores 0 (``half_without_signal``: those groups have no signal); ``no_signal``: 0 everywhere."""

from __future__ import annotations

import zlib


def every_group_with_signal(prompt: str, response: str, record: dict) -> float:
    return zlib.crc32(response.encode()) % 997 / 997


def half_without_signal(prompt: str, response: str, record: dict) -> float:
    return 0.0 if zlib.crc32(prompt.encode()) % 2 == 0 else every_group_with_signal(prompt, response, record)


def no_signal(prompt: str, response: str, record: dict) -> float:
    return 0.0
