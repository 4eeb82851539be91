"""``data_prep.overlong`` (error / truncate / drop, counted), O(characters) length checks, and NeMo-Aligner's
``{"text"}`` reward-model and PPO-prompt files."""

import json

import numpy as np
import pytest
from chat_tokenizers import make_chat_tokenizer_dir

from align_pipeline.config import from_dict
from align_pipeline.config.base import ConfigError
from align_pipeline.data.schemas import DataValidationError, parse_jsonl_bytes
from align_pipeline.data.store import as_rows
from align_pipeline.data.tokenize import DataPrepConfig, OverlongConfig, encode, key_digest
from align_pipeline.data.tokenizer import load_tokenizer, train_tokenizer


def _raw(kind, records):
    blob = "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records).encode()
    return parse_jsonl_bytes(blob, kind, f"data/01_raw/{kind}.jsonl")


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(["abcdefghijklmnopqrstuvwxyz 0123456789+:\n"])


def _config(**policies):
    return DataPrepConfig(overlong=OverlongConfig(**policies))


SFT = [{"input": "add: 1+2\n", "output": "3"}, {"input": "q: ", "output": "x" * 40}, {"input": "a" * 30, "output": "b"}]

def _rows(enc, tok, seq_length):
    """Every sample padded to seq_length (the rows a batch of them would hold)."""
    return as_rows(enc.arrays, seq_length, tok.pad_id)



def test_error_names_file_line_and_the_setting(tok):
    with pytest.raises(DataValidationError) as exc:
        encode(_raw("sft", SFT), tok, 20)
    msg = str(exc.value)
    assert "sft.jsonl line 2" in msg and "45 tokens" in msg and "model.seq_length = 20" in msg
    assert "data_prep.overlong.sft" in msg


def test_truncate_cuts_at_seq_length_and_keeps_the_loss_that_fits(tok):
    enc = encode(_raw("sft", SFT), tok, 20, _config(sft="truncate"))
    a = _rows(enc, tok, 20)
    # line 2 is cut: 1 bos + 3 prompt chars + 16 response chars; line 3's prompt alone fills 20 tokens -> dropped
    assert enc.overlong == {"sft_truncated": 1, "sft_dropped": 1}
    assert len(a["input_ids"]) == 2  # split keys: the untruncated prompts
    assert enc.keys == [key_digest("add: 1+2\n", DataPrepConfig().seed), key_digest("q: ", DataPrepConfig().seed)]
    assert (a["input_ids"][1] != tok.pad_id).all()  # full row, no padding
    assert tok.decode(a["input_ids"][1]) == "q: " + "x" * 16
    assert a["loss_mask"][1].sum() == 16  # labels 3..18 = tokens 4..19, the 16 x's; position 19 has no label
    assert not np.isin(a["labels"][1], [tok.eos_id]).any()  # a cut response has no EOS


def test_drop_leaves_out_and_counts(tok):
    enc = encode(_raw("sft", SFT), tok, 20, _config(sft="drop"))
    assert enc.overlong == {"sft_truncated": 0, "sft_dropped": 2}
    assert enc.keys == [key_digest("add: 1+2\n", DataPrepConfig().seed)]
    pairs = [{"prompt": "p", "chosen_response": "ok", "rejected_response": "z" * 30},
             {"prompt": "p2", "chosen_response": "a", "rejected_response": "b"}]
    enc = encode(_raw("preference", pairs), tok, 20, _config(preference="drop"))
    assert enc.overlong == {"preference_truncated": 0, "preference_dropped": 1}
    assert len(enc.arrays["chosen_offsets"]) - 1 == len(enc.arrays["chosen_reward"]) == 1
    enc = encode(_raw("preference", pairs), tok, 20, _config(preference="truncate"))
    assert enc.overlong == {"preference_truncated": 1, "preference_dropped": 0}
    prompts = [{"prompt": "add: 1+2\n", "answer": "3"}, {"prompt": "add: 1+2\n", "answer": "9" * 30}]
    enc = encode(_raw("prompts", prompts), tok, 20, _config(prompts="drop"))
    assert [r["answer"] for r in enc.records] == ["3"] and enc.overlong["prompts_dropped"] == 1


def test_all_dropped_and_truncated_prompts_are_refused(tok):
    with pytest.raises(DataValidationError, match="every sample is longer"):
        encode(_raw("sft", SFT[1:]), tok, 10, _config(sft="drop"))
    with pytest.raises(ConfigError, match="overlong"):
        from_dict(DataPrepConfig, {"overlong": {"prompts": "truncate"}}, "data_prep")


def test_length_check_costs_characters_not_tokens(tok, monkeypatch):
    huge = {"input": "q: ", "output": "x" * 2_000_000}
    longest = []
    encode_text = type(tok).encode
    monkeypatch.setattr(type(tok), "encode", lambda self, text: longest.append(len(text)) or encode_text(self, text))
    with pytest.raises(DataValidationError, match=r"line 2: .*2000003 characters \(more than 100, so more than 20 tokens\)"):
        encode(_raw("sft", [SFT[0], huge]), tok, 20)
    assert max(longest) < 100  # the 2M-character line was never tokenized
    longest.clear()
    enc = encode(_raw("sft", [SFT[0], huge]), tok, 20, _config(sft="truncate"))
    assert enc.overlong["sft_truncated"] == 1 and max(longest) <= 105  # tokenized from a prefix only
    assert tok.decode(_rows(enc, tok, 20)["input_ids"][1]) == "q: " + "x" * 16


def test_nemo_reward_model_pairs(tok, tmp_path):
    lines = [{"text": "User: add 1+2\nAssistant: 3"}, {"text": "User: add 1+2\nAssistant: 4"},
             {"text": "User: reverse ab\nAssistant: ba"}, {"text": "User: reverse ab\nAssistant: ab ab"}]
    raw = _raw("preference", lines)
    assert raw.templated and len(raw) == 2 and raw.lines == [1, 3]
    assert raw.records[0] == {"prompt": "User: add 1+2\nAssistant: ", "chosen_response": "3", "rejected_response": "4"}
    assert raw.records[1]["prompt"] == "User: reverse ab\nAssistant: "
    with pytest.raises(DataValidationError, match=r"line 3: field \"text\": chosen text without its rejected line"):
        _raw("preference", lines[:3])
    with pytest.raises(DataValidationError, match=r"line 2: mixes layouts"):
        _raw("preference", [lines[0], {"prompt": "p", "chosen_response": "a", "rejected_response": "b"}])
    # already-templated text is never passed through a chat template
    hf = load_tokenizer(make_chat_tokenizer_dir(tmp_path / "chatml", "chatml"))
    a = _rows(encode(raw, hf, 64), hf, 64)
    n = int((a["chosen_loss_mask"][0] != 0).sum())
    row = a["chosen_input_ids"][0][: n + len(hf.encode(raw.records[0]["prompt"]))]
    assert hf.decode(row, skip_special_tokens=False) == lines[0]["text"] + "<|im_end|>"  # + EOS, no markup


def test_nemo_ppo_prompts_are_used_verbatim_with_their_fields(tmp_path):
    hf = load_tokenizer(make_chat_tokenizer_dir(tmp_path / "chatml", "chatml"))
    text = "<|im_start|>user\nWhat is 12 + 30?<|im_end|>\n<|im_start|>assistant\n"
    raw = _raw("prompts", [{"text": text, "answer": "42", "source": "gsm8k"}])
    (rec,) = encode(raw, hf, 64).records
    assert rec["prompt"] == text and rec["source"] == "gsm8k" and rec["answer"] == "42"
    assert rec["prompt_ids"] == hf.encode(text)
