"""Reward functions for the tests: a plain one, a non-callable, a wrong signature, a bad required_fields."""

from __future__ import annotations


def length_bonus(prompt, response, record):
    """min(len(response) / 10, 1): a non-binary reward."""
    return min(len(response) / 10, 1.0)


def category_is_math(prompt, response, record):
    return record["category"] == "math"


category_is_math.required_fields = ("category", "answer")

NOT_A_FUNCTION = 3


def two_args(prompt, response):
    return 1.0


def bad_fields(prompt, response, record):
    return 1.0


bad_fields.required_fields = "answer"  # a string, not a tuple


def returns_text(prompt, response, record):
    return "yes"


class Namespace:
    @staticmethod
    def nested(prompt, response, record):
        return 0.5
