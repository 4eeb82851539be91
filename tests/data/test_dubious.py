"""Dubious records: duplicates, empty answers, chosen == rejected; counted, warned about, refused or ignored.

Line numbers are the file's physical lines (blank lines count); every expected value below is worked out by hand
from the records listed.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from align_pipeline.config import ConfigError, from_dict
from align_pipeline.data.dubious import REFUSE_LINES, find_dubious, handle_dubious
from align_pipeline.data.schemas import DataValidationError, parse_jsonl_bytes, read_raw_jsonl
from align_pipeline.data.tokenize import DataPrepConfig

ROOT = Path(__file__).resolve().parents[2]


def _raw(kind: str, lines: list[str]):
    return parse_jsonl_bytes("".join(line + "\n" for line in lines).encode(), kind, f"data/01_raw/{kind}.jsonl")


def _chat(answer: str) -> str:
    return json.dumps(
        {"conversations": [{"from": "User", "value": "add: 1+2\n"}, {"from": "Assistant", "value": answer}]}
    )


SFT_LINES = [
    '{"input": "add: 1+2\\n", "output": "3"}',  # 1
    "",  # 2 (blank)
    '{"output": "3",   "input": "add: 1+2\\n"}',  # 3 duplicate of 1 (key order and spacing differ)
    '{"input": "add: 1+2\\n", "output": "  "}',  # 4 empty answer
    '{"input": "add: 1+2\\n", "output": "3"}',  # 5 duplicate of 1
    _chat(""),  # 6 empty Assistant turn
    _chat(""),  # 7 duplicate of 6, and empty
    '{"input": "add: 1+2\\n", "output": "4"}',  # 8 fine
]

PREFERENCE_LINES = [
    '{"prompt": "q", "chosen_response": "x", "rejected_response": "y"}',  # 1 fine
    '{"prompt": "q", "chosen_response": "x", "rejected_response": "x"}',  # 2 chosen == rejected
    '{"prompt": "q", "chosen_response": "", "rejected_response": ""}',  # 3 chosen == rejected, empty
    '{"prompt": "q", "chosen_response": "x", "rejected_response": "y", "chosen_reward": 1.0}',  # 4 fine (extra key)
    '{"prompt": "q", "chosen_response": "x", "rejected_response": "y"}',  # 5 duplicate of 1
    '{"prompt": "q", "chosen_response": "x ", "rejected_response": "x"}',  # 6 fine: not exactly equal
    '{"prompt": "q", "chosen_response": "\\n", "rejected_response": "y"}',  # 7 empty
]

PROMPT_LINES = [
    '{"prompt": "add: 1+2\\n", "answer": "3"}',  # 1
    '{"prompt": "add: 1+3\\n", "answer": " "}',  # 2 empty answer
    '{"prompt": "add: 1+4\\n", "answer": null}',  # 3 fine: no answer
    '{"prompt": "add: 1+5\\n"}',  # 4 fine: no answer
    '{"prompt": "add: 1+2\\n", "answer": "3"}',  # 5 duplicate of 1
]


def test_sft_counts_and_lines():
    d = find_dubious(_raw("sft", SFT_LINES))
    assert d.lines == {"duplicates": [3, 5, 7], "empty_answers": [4, 6, 7]}
    assert d.duplicate_of == {3: 1, 5: 1, 7: 6}
    assert d.total == 5  # lines 3, 4, 5, 6, 7
    assert d.metrics() == {"sft_dubious_duplicates": 3, "sft_dubious_empty_answers": 3}


def test_preference_counts_and_lines():
    d = find_dubious(_raw("preference", PREFERENCE_LINES))
    assert d.lines == {"duplicates": [5], "empty_answers": [3, 7], "chosen_equals_rejected": [2, 3]}
    assert d.duplicate_of == {5: 1} and d.total == 4
    assert d.metrics() == {
        "preference_dubious_duplicates": 1,
        "preference_dubious_empty_answers": 2,
        "preference_dubious_chosen_equals_rejected": 2,
    }


def test_prompts_counts_and_lines():
    d = find_dubious(_raw("prompts", PROMPT_LINES))
    assert d.lines == {"duplicates": [5], "empty_answers": [2]} and d.duplicate_of == {5: 1}


def test_regression_empty_response():
    lines = [
        '{"prompt": "p", "response": "r", "labels": {"a": 1}}',
        '{"prompt": "p", "response": "\\t", "labels": {"a": 1}}',
    ]
    assert find_dubious(_raw("regression", lines)).lines == {"duplicates": [], "empty_answers": [2]}


def test_clean_file_counts_zero_and_is_silent(caplog):
    d = find_dubious(_raw("sft", ['{"input": "a", "output": "b"}', '{"input": "a", "output": "c"}']))
    assert d.metrics() == {"sft_dubious_duplicates": 0, "sft_dubious_empty_answers": 0} and d.total == 0
    with caplog.at_level(logging.WARNING):
        handle_dubious([d], "warn")
        handle_dubious([d], "refuse")  # nothing to refuse
    assert caplog.records == []


def test_warn_once_per_file_with_counts_and_examples(caplog):
    found = [find_dubious(_raw(k, lines)) for k, lines in (("sft", SFT_LINES), ("preference", PREFERENCE_LINES))]
    with caplog.at_level(logging.WARNING, logger="align_pipeline.data.dubious"):
        handle_dubious(found, "warn")
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2
    assert messages[0].startswith("data/01_raw/sft.jsonl: 5 dubious records – duplicates: 3 (")
    assert "e.g. lines 3 (= line 1), 5 (= line 1), 7 (= line 6))" in messages[0]
    assert "empty_answers: 3 (" in messages[0] and "e.g. lines 4, 6, 7)" in messages[0]
    assert messages[1].startswith("data/01_raw/preference.jsonl: 4 dubious records")
    assert (
        "chosen_equals_rejected: 2 (chosen_response is identical to rejected_response; e.g. lines 2, 3)" in messages[1]
    )
    assert all("data_prep.dubious: warn" in m for m in messages)


def test_warning_shows_a_few_lines_only(caplog):
    lines = ['{"input": "a", "output": "b"}'] * 8
    with caplog.at_level(logging.WARNING, logger="align_pipeline.data.dubious"):
        handle_dubious([find_dubious(_raw("sft", lines))], "warn")
    (message,) = [r.getMessage() for r in caplog.records]
    assert "duplicates: 7 (" in message and "lines 2 (= line 1), 3 (= line 1), 4" in message
    assert "6 (= line 1), ..." in message and "7 (= line 1)" not in message


def test_refuse_names_files_lines_and_reasons():
    found = [
        find_dubious(_raw("sft", SFT_LINES)),
        find_dubious(_raw("preference", PREFERENCE_LINES)),
        find_dubious(_raw("prompts", ['{"prompt": "a"}'])),  # clean: not named
    ]
    with pytest.raises(DataValidationError) as excinfo:
        handle_dubious(found, "refuse")
    msg = str(excinfo.value)
    assert (
        "data/01_raw/sft.jsonl lines 3 (= line 1), 5 (= line 1), 7 (= line 6): exact duplicate of an earlier line"
        in msg
    )
    assert "data/01_raw/sft.jsonl lines 4, 6, 7: empty or whitespace-only answer" in msg
    assert "data/01_raw/preference.jsonl line 5 (= line 1): exact duplicate" in msg
    assert "data/01_raw/preference.jsonl lines 2, 3: chosen_response is identical to rejected_response" in msg
    assert "prompts.jsonl" not in msg and "data_prep.dubious" in msg


def test_refuse_lists_at_most_refuse_lines():
    lines = ['{"input": "a", "output": "b"}'] * (REFUSE_LINES + 6)  # REFUSE_LINES + 5 duplicates
    with pytest.raises(DataValidationError) as excinfo:
        handle_dubious([find_dubious(_raw("sft", lines))], "refuse")
    msg = str(excinfo.value)
    assert f"{REFUSE_LINES + 1} (= line 1) (+5 more)" in msg and f"{REFUSE_LINES + 2} (= line 1)" not in msg


def test_ignore_is_silent(caplog):
    with caplog.at_level(logging.WARNING):
        handle_dubious([find_dubious(_raw("sft", SFT_LINES))], "ignore")
    assert caplog.records == []


def test_parameter_values():
    assert from_dict(DataPrepConfig, {}, "data_prep").dubious == "warn"
    assert from_dict(DataPrepConfig, {"dubious": "refuse"}, "data_prep").dubious == "refuse"
    with pytest.raises(ConfigError, match="data_prep.dubious"):
        from_dict(DataPrepConfig, {"dubious": "drop"}, "data_prep")


def test_shipped_demo_data():
    """The shipped demo data is clean: nothing dubious in any file (the generator leaves out an SFT record that would
    repeat an earlier one; the duplicate count is checked independently with a set of the raw lines)."""
    counts = {}
    for kind in ("sft", "preference", "prompts"):
        path = ROOT / "data" / "01_raw" / f"{kind}.jsonl"
        counts.update(find_dubious(read_raw_jsonl(path, kind)).metrics())
        if kind == "sft":
            raw_lines = [line for line in path.read_text().splitlines() if line.strip()]
            assert len(raw_lines) == len(set(raw_lines)) == 3738
    assert counts == {
        "sft_dubious_duplicates": 0,
        "sft_dubious_empty_answers": 0,
        "preference_dubious_duplicates": 0,
        "preference_dubious_empty_answers": 0,
        "preference_dubious_chosen_equals_rejected": 0,
        "prompts_dubious_duplicates": 0,
        "prompts_dubious_empty_answers": 0,
    }
