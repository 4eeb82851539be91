"""The math answer checker: final-answer extraction, reference answers, numeric comparison (hand-made cases)."""

from __future__ import annotations

import pytest

from align_pipeline.rewards import final_answer, math_answer, reference_answer
from align_pipeline.rewards.math_answers import answers_match, last_boxed, parse_number


@pytest.mark.parametrize(("text", "want"), [
    (r"so \boxed{42}.", "42"),
    (r"\boxed{1} then \boxed{2}", "2"),                                    # the last one
    (r"\boxed{\frac{3}{4}}", r"\frac{3}{4}"),                               # nested braces
    (r"\boxed{\text{(A) } \{1, 2\}}", r"\text{(A) } \{1, 2\}"),
    (r"\boxed {7}", "7"),
    (r"\fbox{9}", "9"),
    (r"\boxed{unclosed", None),
    ("no box", None),
])
def test_last_boxed(text, want):
    assert last_boxed(text) == want


@pytest.mark.parametrize(("response", "want"), [
    (r"First 3, then \boxed{72}, and 5 more.", "72"),       # a box beats numbers after it
    ("She has 5 apples.\n#### 72\n", "72"),                 # GSM8K line
    ("#### 1,000 dollars", "1,000"),                        # its leading number
    ("#### $18", "18"),
    ("#### x+1", "x+1"),                                    # no leading number: the line
    ("#### 3\nlater 9", "3"),                               # the marker beats the last number
    ("3 + 4 = 7. So the answer is 7.", "7"),                # last number, sentence full stop dropped
    ("It costs $1,234.50 in total", "1,234.50"),
    ("ratio 3/4", "3/4"),
    ("minus: -5", "-5"),
    ("no numbers here", None),
    (r"\boxed{5}<eos> \boxed{6}", "5"),                     # text after EOS is not the response
    ("", None),
])
def test_final_answer(response, want):
    assert final_answer(response) == want


@pytest.mark.parametrize(("answer", "want"), [
    ("Natalia sold 48/2 = 24 clips in May.\n#### 72", "72"),  # a GSM8K solution
    ("#### 1,080", "1,080"),
    (r"The answer is $\boxed{\dfrac{1}{2}}$.", r"\dfrac{1}{2}"),
    (" 17 ", "17"),
    (72, "72"),
    (0.75, "0.75"),
])
def test_reference_answer(answer, want):
    assert reference_answer(answer) == want


def test_reference_answer_refuses_none_and_other_types():
    with pytest.raises(ValueError, match='no "answer"'):
        reference_answer(None)
    with pytest.raises(TypeError, match="string or a number"):
        reference_answer([1, 2])
    with pytest.raises(TypeError, match="string or a number"):
        reference_answer(True)


@pytest.mark.parametrize(("text", "want"), [
    ("72", 72.0), ("1,000", 1000.0), ("1,234.5", 1234.5), ("$18", 18.0), (r"\$18", 18.0), ("72.", 72.0),
    ("-3", -3.0), ("−3", -3.0), ("3/4", 0.75), ("-3/4", -0.75), (r"\frac{3}{4}", 0.75), (r"\dfrac{-1}{8}", -0.125),
    (r"-\frac{1}{2}", -0.5), ("50%", 50.0), (r"50\%", 50.0), (r"72 \text{ dollars}", 72.0), (r"$\frac{1}{3}$", 1 / 3),
    ("1e3", 1000.0), (".5", 0.5),
    ("1,00", None), ("x+1", None), ("3/0", None), ("", None), ("abc", None), (r"\frac34", None),
])
def test_parse_number(text, want):
    got = parse_number(text)
    assert got == pytest.approx(want) if want is not None else got is None


@pytest.mark.parametrize(("predicted", "reference", "want"), [
    ("3/4", "0.75", True),
    (r"\frac{3}{4}", "0.75", True),
    ("0.333333", "1/3", True),       # |0.333333 - 1/3| = 3.3e-7 <= 1e-6
    ("0.33333", "1/3", False),       # 3.3e-6 > 1e-6
    ("1,000", "1000.0", True),
    ("1000001", "1000000", False),   # a relative tolerance would call these equal; 1e-9 does not
    ("72", "72.", True),
    ("72", "73", False),
    ("x + 1", "x+1", True),          # not numbers: compared as strings without whitespace
    ("x+1", "x+2", False),
    ("7", "x", False),               # a number never equals a non-number
    (None, "7", False),
    ("", "", False),
])
def test_answers_match(predicted, reference, want):
    assert answers_match(predicted, reference) is want


@pytest.mark.parametrize(("response", "answer", "want"), [
    (r"Half of 48 is 24, so 48 + 24 = \boxed{72}.", "Natalia sold 48/2 = 24 clips in May.\n#### 72", 1.0),
    ("48 + 24 = 72 clips.\n#### 72<eos>", "#### 72", 1.0),
    ("48 + 24 = 72, plus 1 is 73", "#### 72", 0.0),          # the last number is 73
    ("so the answer is 72", 72, 1.0),                         # a number answer
    ("The total is $1,080.", "#### 1080", 1.0),
    (r"\boxed{0.75}", r"$\boxed{\frac{3}{4}}$", 1.0),
    (r"\boxed{3/4}", 0.75, 1.0),
    (r"\boxed{\frac{2}{3}}", "0.6667", 0.0),                  # 3.3e-5 apart
    ("I don't know", "#### 72", 0.0),
])
def test_math_answer(response, answer, want):
    got = math_answer("prompt", response, {"prompt": "prompt", "answer": answer, "prompt_ids": [1]})
    assert got == want and isinstance(got, float)
    assert math_answer.required_fields == ("answer",)
