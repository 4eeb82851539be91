"""Raw-data validation: every bad input names the file, the line and the field."""

import json

import pytest

from align_pipeline.data.schemas import DataValidationError, read_raw_jsonl, sft_segments


def _write(path, lines):
    path.write_text("".join((l if isinstance(l, str) else json.dumps(l)) + "\n" for l in lines))
    return path


GOOD_SFT = {"input": "add: 1+2\n", "output": "3"}


@pytest.mark.parametrize(
    "kind, bad_line, field, words",
    [
        ("sft", {"input": "x", "output": 3}, "output", "expected a string, got int"),
        ("sft", {"input": "x"}, "output", "missing"),
        ("sft", {"output": "x"}, "input", "missing"),
        ("sft", {"input": "x", "output": "y", "extra": 1}, "extra", "unknown field"),
        ("sft", {"conversations": [{"from": "Bot", "value": "hi"}]}, "conversations[0].from", "User"),
        ("sft", {"conversations": [{"from": "User", "value": "hi"}]}, "conversations", "no Assistant turn"),
        ("preference", {"prompt": "p", "chosen_response": "a"}, "rejected_response", "missing"),
        (
            "preference",
            {"prompt": "p", "chosen_response": "a", "rejected_response": "b", "chosen_reward": "1"},
            "chosen_reward",
            "expected a number, got string",
        ),
        ("prompts", {"prompt": 5}, "prompt", "expected a string, got int"),
        ("prompts", {"prompt": "p", "answer": "a", "prompt_ids": [3]}, "prompt_ids", "reserved"),
    ],
)
def test_bad_records_name_file_line_field(tmp_path, kind, bad_line, field, words):
    good = {
        "sft": GOOD_SFT,
        "preference": {"prompt": "p", "chosen_response": "a", "rejected_response": "b"},
        "prompts": {"prompt": "p"},
    }[kind]
    path = _write(tmp_path / f"{kind}.jsonl", [good, good, bad_line])
    with pytest.raises(DataValidationError) as exc:
        read_raw_jsonl(path, kind)
    msg = str(exc.value)
    assert f"{kind}.jsonl line 3" in msg and f'field "{field}"' in msg and words in msg, msg


def test_invalid_json_names_line(tmp_path):
    path = _write(tmp_path / "sft.jsonl", [GOOD_SFT, '{"input": "x", "output": }'])
    with pytest.raises(DataValidationError, match=r"sft\.jsonl line 2: invalid JSON"):
        read_raw_jsonl(path, "sft")


def test_not_an_object(tmp_path):
    path = _write(tmp_path / "sft.jsonl", ["[1, 2]"])
    with pytest.raises(DataValidationError, match=r"sft\.jsonl line 1: expected a JSON object, got list"):
        read_raw_jsonl(path, "sft")


def test_empty_file(tmp_path):
    (tmp_path / "prompts.jsonl").write_text("\n  \n")
    with pytest.raises(DataValidationError, match=r"prompts\.jsonl: file is empty"):
        read_raw_jsonl(tmp_path / "prompts.jsonl", "prompts")


def test_blank_lines_skipped_and_line_numbers_physical(tmp_path):
    path = _write(tmp_path / "sft.jsonl", [GOOD_SFT, "", GOOD_SFT, {"input": 1, "output": "x"}])
    with pytest.raises(DataValidationError, match="line 4"):
        read_raw_jsonl(path, "sft")
    data = read_raw_jsonl(_write(tmp_path / "ok.jsonl", [GOOD_SFT, "", GOOD_SFT]), "sft")
    assert data.lines == [1, 3] and len(data) == 2 and len(data.sha256) == 64


def test_chat_records_and_nemo_keys(tmp_path):
    chat = {
        "system": "be brief",
        "mask": "User",
        "type": "VALUE_TO_TEXT",
        "conversations": [
            {"from": "User", "value": "hi\n", "label": None},
            {"from": "Assistant", "value": "yo"},
            {"from": "User", "value": "again\n"},
            {"from": "Assistant", "value": "yo yo"},
        ],
    }
    data = read_raw_jsonl(_write(tmp_path / "chat.jsonl", [chat, GOOD_SFT]), "sft")
    assert sft_segments(data.records[0]) == [
        ("be brief\n", False),
        ("hi\n", False),
        ("yo", True),
        ("again\n", False),
        ("yo yo", True),
    ]
    assert sft_segments(data.records[1]) == [("add: 1+2\n", False), ("3", True)]


def test_shipped_raw_files_are_valid():
    from pathlib import Path

    raw = Path(__file__).resolve().parents[2] / "data" / "01_raw"
    assert len(read_raw_jsonl(raw / "sft.jsonl", "sft")) == 3738  # 4000 drawn, exact repeats left out
    assert len(read_raw_jsonl(raw / "preference.jsonl", "preference")) == 2000
    assert len(read_raw_jsonl(raw / "prompts.jsonl", "prompts")) == 800


@pytest.mark.parametrize(
    "kind, line, field, code",
    [
        ("sft", r'{"input": "a", "output": "x\ud800y"}', "output", "D800"),
        ("sft", r'{"conversations": [{"from": "User", "value": "hi"}, {"from": "Assistant", "value": "\uDC00"}]}',
         "conversations[1].value", "DC00"),
        ("preference", r'{"prompt": "p\udbff", "chosen_response": "a", "rejected_response": "b"}', "prompt", "DBFF"),
        ("prompts", r'{"prompt": "p", "meta": {"tags": ["ok", "\ud800"]}}', "meta.tags[1]", "D800"),
    ],
)
def test_lone_surrogate_is_refused_naming_file_line_and_field(tmp_path, kind, line, field, code):
    """A JSON ``\\ud800`` escape without its pair decodes to a string no UTF-8 text (and no tokenizer) can hold."""
    good = {"sft": GOOD_SFT, "preference": {"prompt": "p", "chosen_response": "a", "rejected_response": "b"},
            "prompts": {"prompt": "p"}}[kind]  # fmt: skip
    path = _write(tmp_path / "x.jsonl", [good, good, line])
    with pytest.raises(DataValidationError) as excinfo:
        read_raw_jsonl(path, kind, source="data/01_raw/x.jsonl")
    assert str(excinfo.value) == f'data/01_raw/x.jsonl line 3: field "{field}": invalid Unicode (lone surrogate U+{code})'


def test_surrogate_pairs_and_escaped_backslashes_are_fine(tmp_path):
    path = _write(tmp_path / "x.jsonl", [r'{"input": "a", "output": "\ud83d\ude00 and \\ud800"}'])
    assert read_raw_jsonl(path, "sft").records[0]["output"] == "\U0001f600 and \\ud800"
