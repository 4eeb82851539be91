"""Raw data as TRL / OpenAI / veRL users hold it (data/layouts.py) and where it is stored (data/sources.py): chat
messages with tools through the template (the loss exactly on the assistant turns), TRL preference pairs (explicit and
implicit prompt, messages and strings), prompts as messages and veRL rows; jsonl, parquet, a save_to_disk directory
and catalog tables give the same records; every bad input names its file, line or row, and field."""

import json

import numpy as np
import pytest
from chat_tokenizers import make_chat_tokenizer_dir

from align_pipeline.data.schemas import DataValidationError, parse_jsonl_bytes
from align_pipeline.data.sources import read_raw, read_raw_path
from align_pipeline.data.store import as_rows
from align_pipeline.data.tokenize import encode
from align_pipeline.data.tokenizer import load_tokenizer

TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "evaluates arithmetic",
                                           "parameters": {"type": "object",
                                                          "properties": {"expression": {"type": "string"}}}}}]
TOOL_CHAT = {
    "messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is 12 + 30?"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"type": "function", "id": "c1",
                         "function": {"name": "calculator", "arguments": '{"expression": "12 + 30"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
        {"role": "assistant", "content": "The answer is 42."},
    ],
    "tools": TOOLS,
}


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("layouts")
    return {s: load_tokenizer(make_chat_tokenizer_dir(root / s, s)) for s in ("chatml_tools", "mistral")} | {
        "chatml_tools_dir": root / "chatml_tools"}


def _raw(kind, records, layout="auto"):
    blob = "".join(json.dumps(r) + "\n" for r in records).encode()
    return parse_jsonl_bytes(blob, kind, f"data/01_raw/{kind}.jsonl", layout)


def _error(kind, records, layout="auto"):
    with pytest.raises(DataValidationError) as exc:
        _raw(kind, records, layout)
    return str(exc.value)


def _supervised(arrays, tok, prefix="", row=0):
    labels, mask = arrays[f"{prefix}labels"][row], arrays[f"{prefix}loss_mask"][row]
    return tok.decode(labels[mask == 1], skip_special_tokens=False)


def test_sft_messages_with_tools_render_like_transformers_and_train_on_assistant_turns(tokenizers):
    from transformers import AutoTokenizer

    tok = tokenizers["chatml_tools"]
    raw = _raw("sft", [TOOL_CHAT])
    assert raw.layout == "messages"
    arrays = as_rows(encode(raw, tok, 256).arrays, 256, tok.pad_id)
    hf = AutoTokenizer.from_pretrained(str(tokenizers["chatml_tools_dir"]))
    messages = json.loads(json.dumps(TOOL_CHAT["messages"]))
    messages[2]["tool_calls"][0]["function"]["arguments"] = {"expression": "12 + 30"}  # as chat templates take them
    text = hf.apply_chat_template(messages, tools=TOOLS, tokenize=False)
    expected = hf(text, add_special_tokens=False)["input_ids"]
    assert arrays["input_ids"][0][: len(expected)].tolist() == expected
    assert "# Tools" in text and '<tool_call>{"name": "calculator"' in text
    # the loss: the tool call turn and the final answer, each with its end-of-turn marker; never the tool's answer
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "12 + 30"}}</tool_call>'
    assert _supervised(arrays, tok) == f"{call}<|im_end|>The answer is 42.<|im_end|>"


def test_messages_without_a_template_use_the_plain_layout_and_tool_calls_need_one(tokenizers):
    from align_pipeline.data.tokenize import DataPrepConfig

    tok = tokenizers["chatml_tools"]
    config = DataPrepConfig()
    config.tokenizer.use_chat_template = False
    plain = {"messages": [{"role": "user", "content": "What is 12 + 30?"},
                          {"role": "assistant", "content": "42"}]}
    arrays = as_rows(encode(_raw("sft", [plain]), tok, 64, config).arrays, 64, tok.pad_id)
    assert _supervised(arrays, tok) == "42" + tok.id_to_token(tok.eos_id)
    with pytest.raises(DataValidationError) as exc:
        encode(_raw("sft", [TOOL_CHAT]), tok, 256, config)
    assert 'sft.jsonl line 1: field "messages"' in str(exc.value) and "need a chat template" in str(exc.value)


PROMPT = [{"role": "user", "content": "What is 12 + 30?"}]
GOOD, BAD = [{"role": "assistant", "content": "The answer is 42."}], [{"role": "assistant", "content": "41"}]


@pytest.mark.parametrize("layout,record", [
    ("trl_explicit", {"prompt": PROMPT, "chosen": GOOD, "rejected": BAD, "score_chosen": 9.0, "score_rejected": 2}),
    ("trl_implicit", {"chosen": PROMPT + GOOD, "rejected": PROMPT + BAD, "prompt_id": "x1"}),
])
def test_trl_preference_messages_equal_the_nemo_pair(tokenizers, layout, record):
    """The same pair in NeMo's layout and in TRL's (explicit or implicit prompt) gives the same arrays; the loss is
    on the completion only."""
    tok = tokenizers["chatml_tools"]
    raw = _raw("preference", [record])
    assert raw.layout == layout and not raw.templated
    nemo = {"prompt": PROMPT[0]["content"], "chosen_response": GOOD[0]["content"],
            "rejected_response": BAD[0]["content"]}
    ours, theirs = encode(raw, tok, 64).arrays, encode(_raw("preference", [nemo]), tok, 64).arrays
    for key in ("chosen_tokens", "chosen_response", "rejected_tokens", "rejected_response"):
        assert np.array_equal(ours[key], theirs[key]), key
    if layout == "trl_explicit":
        assert ours["chosen_reward"].tolist() == [9.0] and ours["rejected_reward"].tolist() == [2.0]
    rows = as_rows(ours, 64, tok.pad_id)
    assert _supervised(rows, tok, "chosen_") == "The answer is 42.<|im_end|>"


def test_multi_turn_preference_prompt_keeps_its_assistant_turns_out_of_the_loss(tokenizers):
    tok = tokenizers["chatml_tools"]
    history = PROMPT + [{"role": "assistant", "content": "12 + 30 = 42"}, {"role": "user", "content": "Sure?"}]
    raw = _raw("preference", [{"chosen": history + GOOD, "rejected": history + BAD}])
    assert raw.records[0]["prompt"] == history
    rows = as_rows(encode(raw, tok, 96).arrays, 96, tok.pad_id)
    assert _supervised(rows, tok, "rejected_") == "41<|im_end|>"


def test_trl_string_pairs_are_tokenized_verbatim(tokenizers):
    """As in TRL, string prompts and completions are the model's text: no chat template."""
    tok = tokenizers["chatml_tools"]
    for record in ({"prompt": "What is 12 + 30? ", "chosen": "42", "rejected": "41"},
                   {"chosen": "What is 12 + 30? 42", "rejected": "What is 12 + 30? 41"}):
        raw = _raw("preference", [record])
        assert raw.templated and raw.records[0]["prompt"] == "What is 12 + 30? "
        rows = as_rows(encode(raw, tok, 64).arrays, 64, tok.pad_id)
        ids = rows["chosen_input_ids"][0]
        text = tok.decode(ids[ids != tok.pad_id], skip_special_tokens=False)
        assert "<|im_start|>" not in text and text.startswith("What is 12 + 30? 42")
        assert _supervised(rows, tok, "chosen_") == "42" + tok.id_to_token(tok.eos_id)


def test_prompt_messages_and_verl_rows(tokenizers):
    from transformers import AutoTokenizer

    tok = tokenizers["chatml_tools"]
    hf = AutoTokenizer.from_pretrained(str(tokenizers["chatml_tools_dir"]))
    verl = {"data_source": "openai/gsm8k", "prompt": [{"role": "system", "content": "Think."}] + PROMPT,
            "ability": "math", "reward_model": {"style": "rule", "ground_truth": "42"},
            "extra_info": {"split": "train", "index": 7}}
    for record, layout in ((verl, "verl"), ({"prompt": PROMPT, "ground_truth": 42, "level": 1}, "prompt_messages")):
        raw = _raw("prompts", [record])
        assert raw.layout == layout
        (out,) = encode(raw, tok, 64).records
        text = hf.apply_chat_template(record["prompt"], tokenize=False, add_generation_prompt=True)
        assert out["prompt_ids"] == hf(text, add_special_tokens=False)["input_ids"]
        assert out["prompt"] == record["prompt"]  # reward functions get the messages
        assert out["answer"] == (42 if layout == "prompt_messages" else "42")
        assert all(out[k] == v for k, v in record.items())  # every field reaches the reward functions


@pytest.mark.parametrize("kind,records,where,words", [
    ("sft", [{"messages": [{"role": "human", "content": "hi"}, {"role": "assistant", "content": "yo"}]}],
     "messages[0].role", "expected one of system, user, assistant, tool, got 'human'"),
    ("sft", [{"messages": [{"role": "user"}, {"role": "assistant", "content": "yo"}]}],
     "messages[0].content", "missing (required)"),
    ("sft", [{"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "yo"}]}],
     "messages[0].content", "expected a string, got int"),
    ("sft", [{"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "42"}]}],
     "messages[1].role", "none is open"),
    ("sft", [{"messages": [{"role": "user", "content": "hi"}]}], "messages", "no assistant message"),
    ("sft", [{"messages": [{"role": "user", "content": "hi"}, {"role": "system", "content": "x"},
                           {"role": "assistant", "content": "yo"}]}], "messages[1].role", "comes first"),
    ("sft", [{"messages": [{"role": "user", "contnet": "hi"}, {"role": "assistant", "content": "yo"}]}],
     "messages[0].contnet", "unknown message field"),
    ("sft", [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None,
                                                            "tool_calls": [{"function": {"name": "f",
                                                                                         "arguments": "{x"}}]}]}],
     "messages[1].tool_calls[0].function.arguments", "not valid JSON"),
    ("preference", [{"prompt": PROMPT, "chosen": "42", "rejected": BAD}], "chosen", "give all three"),
    ("preference", [{"chosen": PROMPT + GOOD, "rejected": PROMPT}], "rejected", "no assistant message"),
    ("prompts", [{"prompt": PROMPT + GOOD}], "prompt[1].role", "nothing is left for the policy to answer"),
    ("prompts", [{"prompt": PROMPT, "reward_model": {"style": "rule"}}], "reward_model.ground_truth", "missing"),
    ("prompts", [{"prompt": PROMPT, "prompt_ids": [1]}], "prompt_ids", "reserved"),
])
def test_bad_records_name_line_and_field(kind, records, where, words):
    msg = _error(kind, [*records])
    assert f"{kind}.jsonl line 1: field \"{where}\"" in msg and words in msg, msg


def test_non_alternating_turns_are_refused_where_the_template_needs_them(tokenizers):
    tok = tokenizers["mistral"]
    record = {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
                           {"role": "assistant", "content": "c"}]}
    with pytest.raises(DataValidationError) as exc:
        encode(_raw("sft", [record]), tok, 64)
    assert 'sft.jsonl line 1: field "messages": chat template' in str(exc.value)
    assert "roles must alternate" in str(exc.value)


@pytest.mark.parametrize("kind,first,second,words", [
    ("sft", {"input": "a", "output": "b"}, {"messages": PROMPT + GOOD}, "in the messages layout"),
    ("preference", {"prompt": "a", "chosen_response": "b", "rejected_response": "c"},
     {"prompt": "a", "chosen": "b", "rejected": "c"}, "in the trl_explicit layout"),
    ("preference", {"prompt": "a", "chosen": "b", "rejected": "c"},
     {"prompt": PROMPT, "chosen": GOOD, "rejected": BAD}, "chat messages and plain strings"),
    ("prompts", {"prompt": "What is 1 + 1?"}, {"prompt": PROMPT}, "in the prompt_messages layout"),
])
def test_a_file_that_mixes_layouts_is_refused_at_the_first_line_that_differs(kind, first, second, words):
    msg = _error(kind, [first, first, second, first])
    assert f"{kind}.jsonl line 3: " in msg and "mixes layouts" in msg and words in msg, msg


def test_a_forced_layout_refuses_other_records():
    msg = _error("sft", [{"input": "a", "output": "b"}], layout="messages")
    assert "line 1: is in the nemo layout, but data_prep.layouts.sft is messages" in msg
    msg = _error("prompts", [{"prompt": "a"}], layout="chat")
    assert "data_prep.layouts.prompts = 'chat' is not a prompts layout" in msg


# ---- storage: jsonl, parquet, save_to_disk, catalog tables -----------------------------------------------------

VERL_ROWS = [
    {"data_source": "gsm8k", "prompt": [{"role": "user", "content": f"What is {i} + {i}?"}], "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": str(2 * i)}, "extra_info": {"index": i, "split": "train"}}
    for i in range(5)
]


def _write_all(tmp_path, rows):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    parquet = tmp_path / "p.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet, row_group_size=2)
    hf = tmp_path / "hf"
    datasets.Dataset.from_list(rows).save_to_disk(str(hf))
    return jsonl, parquet, hf


def test_jsonl_parquet_save_to_disk_and_tables_give_the_same_records(tmp_path, monkeypatch):
    import pandas as pd

    from align_pipeline.data import sources

    monkeypatch.setattr(sources, "BATCH", 2)  # several batches
    jsonl, parquet, hf = _write_all(tmp_path, VERL_ROWS)
    expected = read_raw_path(jsonl, "prompts").records
    assert [r["answer"] for r in expected] == ["0", "2", "4", "6", "8"]
    for path in (parquet, hf):
        raw = read_raw_path(path, "prompts")
        assert raw.records == expected and raw.unit == "row" and raw.layout == "verl", path
    table = read_raw(pd.read_parquet(parquet), "prompts", name="raw_prompts")
    assert table.records == expected and table.source == "raw_prompts (pandas.DataFrame)"
    import datasets

    assert read_raw(datasets.load_from_disk(str(hf)), "prompts").records == expected
    import polars as pl

    frame, lazy = pl.read_parquet(parquet), pl.scan_parquet(parquet)
    assert read_raw(frame, "prompts", name="raw_prompts").records == expected
    lazy_raw = read_raw(lazy, "prompts", name="raw_prompts")
    assert lazy_raw.records == expected and lazy_raw.source == "raw_prompts (polars.LazyFrame)"


def test_bad_storage_names_file_row_and_field(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"input": "a", "output": "b"}, {"input": "c", "output": "d"}]
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([{"input": "a", "output": 1}, {"input": "c", "output": 2}]), bad)
    with pytest.raises(DataValidationError, match=r'bad.parquet row 1: field "output": expected a string, got int'):
        read_raw_path(bad, "sft")
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    with pytest.raises(DataValidationError, match="empty directory: expected one written by datasets"):
        read_raw_path(empty_dir, "sft")
    splits = tmp_path / "splits"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(splits))
    with pytest.raises(DataValidationError, match="holds the splits train: name one as `split:`"):
        read_raw_path(splits, "sft")
    assert len(read_raw_path(splits, "sft", split="train")) == 2
    none = tmp_path / "none.parquet"
    pq.write_table(pa.Table.from_pylist(rows).slice(0, 0), none)
    with pytest.raises(DataValidationError, match="none.parquet: no rows"):
        read_raw_path(none, "sft")
    text = tmp_path / "x.parquet"
    text.write_text("not parquet")
    with pytest.raises(DataValidationError, match="not a readable parquet file"):
        read_raw_path(text, "sft")


def test_hostile_and_table_shaped_records(tmp_path):
    """What the review of these layouts found: null optional fields a table gives every message are left out; a
    saved numpy format is undone; a NeMo prompt with a string reward_model stays a NeMo prompt; pairs must share a
    prompt; joined prompt + completion rules hold; nesting too deep is an error, not a crash."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [TOOL_CHAT | {"tools": None}, {"messages": [{"role": "user", "content": "hey"},
                                                      {"role": "assistant", "content": "yo"}], "tools": None}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "t.parquet")
    raw = read_raw_path(tmp_path / "t.parquet", "sft")
    assert raw.records[1]["messages"][0] == {"role": "user", "content": "hey"}  # no tool_calls: None
    assert "tools" not in raw.records[1]
    datasets.Dataset.from_list(rows[1:]).with_format("numpy").save_to_disk(str(tmp_path / "np"))
    assert read_raw_path(tmp_path / "np", "sft").records[0]["messages"][1]["content"] == "yo"
    nemo_prompt = _raw("prompts", [{"prompt": "2+2?", "answer": "4", "reward_model": "math"}])
    assert nemo_prompt.layout == "prompt" and nemo_prompt.records[0]["reward_model"] == "math"
    msg = _error("preference", [{"chosen": PROMPT + GOOD, "rejected": [{"role": "user", "content": "other"}] + BAD}])
    assert 'field "rejected[0]": the two conversations share no prompt' in msg
    msg = _error("preference", [{"prompt": PROMPT, "chosen": [{"role": "system", "content": "x"}] + GOOD,
                                 "rejected": BAD}])
    assert 'field "chosen[0].role": a system message comes first' in msg
    deep = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [
        {"function": {"name": "f", "arguments": "[" * 100000}}]}]}
    assert "nested too deeply" in _error("sft", [deep])
