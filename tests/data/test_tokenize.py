"""Tokenized arrays: shifted labels, loss only on response tokens, padding, length limit, split."""

import json

import numpy as np
import pytest

from align_pipeline.data.schemas import DataValidationError, parse_jsonl_bytes, record_texts
from align_pipeline.data.store import as_rows
from align_pipeline.data.tokenize import DataPrepConfig, encode, split_encoded, split_indices
from align_pipeline.data.tokenizer import train_tokenizer


def _raw(kind, records, name=None):
    blob = "".join(json.dumps(r) + "\n" for r in records).encode()
    return parse_jsonl_bytes(blob, kind, name or f"data/01_raw/{kind}.jsonl")

def _rows(enc, tok, seq_length):
    """Every sample padded to seq_length (the rows a batch of them would hold)."""
    return as_rows(enc.arrays, seq_length, tok.pad_id)



@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(["reverse: abcdefghijklmnopqrstuvwxyz\n", "add: 0123456789+\n", "sys!?"])


def test_sft_prompt_tokens_carry_no_loss(tok):
    raw = _raw("sft", [{"input": "add: 23+45\n", "output": "68"}, {"input": "reverse: abc\n", "output": "cba"}])
    S = 24
    a = _rows(encode(raw, tok, S), tok, S)
    assert a["input_ids"].dtype == np.int64 and a["labels"].dtype == np.int64 and a["loss_mask"].dtype == np.float32
    assert a["input_ids"].shape == a["labels"].shape == a["loss_mask"].shape == (2, S)
    for i, (p, r) in enumerate([("add: 23+45\n", "68"), ("reverse: abc\n", "cba")]):
        ids = [tok.bos_id] + tok.encode(p) + tok.encode(r) + [tok.eos_id]
        L, P = len(ids), 1 + len(tok.encode(p))  # P = tokens up to and including the last prompt token
        assert a["input_ids"][i, :L].tolist() == ids and (a["input_ids"][i, L:] == tok.pad_id).all()
        # labels are input_ids shifted left by one, pad past the end
        assert a["labels"][i, : L - 1].tolist() == ids[1:]
        assert (a["labels"][i, L - 1 :] == tok.pad_id).all()
        # loss exactly where the label is a response token or the final <eos>
        mask = a["loss_mask"][i]
        assert (mask[: P - 1] == 0).all(), "a prompt token carries loss"
        assert (mask[P - 1 : L - 1] == 1).all()
        assert (mask[L - 1 :] == 0).all()
        assert mask.sum() == len(tok.encode(r)) + 1
        assert tok.decode(a["labels"][i][mask == 1]) == r and a["labels"][i][mask == 1][-1] == tok.eos_id


def test_chat_loss_only_on_assistant_turns(tok):
    chat = {
        "system": "sys!",
        "conversations": [
            {"from": "User", "value": "add: 1+2\n"},
            {"from": "Assistant", "value": "3"},
            {"from": "User", "value": "add: 3+4\n"},
            {"from": "Assistant", "value": "7"},
        ],
    }
    a = _rows(encode(_raw("sft", [chat]), tok, 48), tok, 48)
    supervised = a["labels"][0][a["loss_mask"][0] == 1].tolist()
    assert supervised == tok.encode("3") + [tok.eos_id] + tok.encode("7") + [tok.eos_id]


def test_preference_arrays_and_rewards(tok):
    recs = [
        {
            "prompt": "add: 1+2\n",
            "chosen_response": "3",
            "rejected_response": "4",
            "chosen_reward": 1,
            "rejected_reward": 0.0,
        },
        {"prompt": "reverse: ab\n", "chosen_response": "ba", "rejected_response": "ab"},
    ]
    a = _rows(encode(_raw("preference", recs), tok, 32), tok, 32)
    assert set(a) == {
        f"{s}_{k}" for s in ("chosen", "rejected") for k in ("input_ids", "labels", "loss_mask", "reward")
    }
    assert a["chosen_reward"].dtype == np.float32 and a["chosen_reward"][0] == 1.0 and np.isnan(a["chosen_reward"][1])
    assert np.isnan(a["rejected_reward"][1]) and a["rejected_reward"][0] == 0.0
    for side, resp in (("chosen", "ba"), ("rejected", "ab")):
        m = a[f"{side}_loss_mask"][1] == 1
        assert tok.decode(a[f"{side}_labels"][1][m]) == resp
        assert a[f"{side}_input_ids"][1, 0] == tok.bos_id


def test_prompts_records(tok):
    enc = encode(_raw("prompts", [{"prompt": "add: 1+2\n", "answer": "3"}, {"prompt": "reverse: ab\n"}]), tok, 32)
    assert enc.records[0] == {
        "prompt": "add: 1+2\n",
        "answer": "3",
        "prompt_ids": [tok.bos_id] + tok.encode("add: 1+2\n"),
    }
    assert enc.records[1]["answer"] is None


@pytest.mark.parametrize(
    "kind, rec, field",
    [
        ("sft", {"input": "add: 1+2\n", "output": "3" * 30}, "output"),
        (
            "sft",
            {"conversations": [{"from": "User", "value": "a" * 20}, {"from": "Assistant", "value": "b" * 20}]},
            "conversations",
        ),
        (
            "preference",
            {"prompt": "add: 1+2\n", "chosen_response": "3", "rejected_response": "4" * 30},
            "rejected_response",
        ),
        ("prompts", {"prompt": "a" * 40}, "prompt"),
        ("prompts", {"prompt": "add: 1+2\n", "answer": "3" * 30}, "answer"),
    ],
)
def test_too_long_sample_names_length_and_limit(tok, kind, rec, field):
    ok = {
        "sft": {"input": "a", "output": "b"},
        "preference": {"prompt": "a", "chosen_response": "b", "rejected_response": "c"},
        "prompts": {"prompt": "a"},
    }[kind]
    with pytest.raises(DataValidationError) as exc:
        encode(_raw(kind, [ok, ok, rec]), tok, 32)
    msg = str(exc.value)
    assert f"data/01_raw/{kind}.jsonl line 3" in msg and f'field "{field}"' in msg, msg
    assert "longer than model.seq_length = 32" in msg and "tokens" in msg


def test_exactly_seq_length_fits(tok):
    p = "add: 1+2\n"
    S = 1 + len(p) + 3 + 1
    a = _rows(encode(_raw("sft", [{"input": p, "output": "333"}]), tok, S), tok, S)
    assert a["labels"][0, S - 2] == tok.eos_id and a["loss_mask"][0, S - 2] == 1 and a["loss_mask"][0, S - 1] == 0


def test_split_is_deterministic_exact_and_order_free():
    keys = [f"k{i}" for i in range(1000)]
    tr, va = split_indices(keys, 0.1, seed=7)
    assert (tr, va) == split_indices(keys, 0.1, seed=7)
    assert len(va) == 100 and sorted(tr + va) == list(range(1000)) and not set(tr) & set(va)
    assert split_indices(keys, 0.1, seed=8)[1] != va
    _rev_tr, rev_va = split_indices(keys[::-1], 0.1, seed=7)
    assert sorted(keys[::-1][i] for i in rev_va) == sorted(keys[i] for i in va)
    assert split_indices(["a", "b"], 0.01, seed=0)[1] != []  # at least one val sample
    assert split_indices(["a", "b"], 0.0, seed=0) == ([0, 1], [])
    assert split_indices(["a"], 0.5, seed=0) == ([0], [])
    dup = ["a", "b", "a", "c", "b", "d"] * 3
    tr, va = split_indices(dup, 0.5, seed=0)
    assert len({dup[i] for i in va}) == 2 and not {dup[i] for i in va} & {dup[i] for i in tr}


def test_split_encoded_meta(tok):
    raw = _raw("sft", [{"input": f"add: {i}+1\n", "output": str(i + 1)} for i in range(20)])
    cfg = DataPrepConfig(val_fraction=0.25, seed=1)
    parts = split_encoded(encode(raw, tok, 24), raw, tok, cfg, 24)
    train, val = (as_rows(parts[s].arrays, 24, tok.pad_id) for s in ("train", "val"))
    assert train["input_ids"].shape == (15, 24) and val["input_ids"].shape == (5, 24)
    m = parts["val"].meta
    assert m["num_samples"] == 5 and m["seq_length"] == 24 and m["tokenizer_fingerprint"] == tok.fingerprint
    assert m["source"] == "data/01_raw/sft.jsonl" and m["source_sha256"] == raw.sha256 and m["split"] == "val"


def test_shipped_data_fits_default_seq_length():
    from pathlib import Path

    from align_pipeline.data.schemas import read_raw_jsonl

    root = Path(__file__).resolve().parents[2] / "data" / "01_raw"
    raws = [read_raw_jsonl(root / f"{k}.jsonl", k) for k in ("sft", "preference", "prompts")]
    tok = train_tokenizer([t for r in raws for rec in r.records for t in record_texts(rec)])
    assert tok.vocab_size <= 64
    assert max(encode(r, tok, 48).max_tokens for r in raws) <= 24


@pytest.mark.parametrize(
    "kind, record",
    [
        ("sft", {"input": "add: 1+2\n", "output": "3"}),
        ("preference", {"prompt": "add: 1+2\n", "chosen_response": "3", "rejected_response": "4"}),
        ("prompts", {"prompt": "add: 1+2\n", "answer": "3"}),
        ("regression", {"prompt": "add: 1+2\n", "response": "3", "labels": {"correct": 1.0}}),
    ],
)
def test_every_kind_records_its_tokenizer(tok, kind, record):
    """Stages compare this key with the tokenizer they are given (formats.check_tokenized_with)."""
    key = "input" if kind == "sft" else "prompt"
    raw = _raw(kind, [record, {**record, key: "add: 2+2\n"}])  # two prompts: one per split
    parts = split_encoded(encode(raw, tok, 24), raw, tok, DataPrepConfig(val_fraction=0.5), 24)
    assert {split: p.meta["tokenizer_fingerprint"] for split, p in parts.items()} == {
        "train": tok.fingerprint,
        "val": tok.fingerprint,
    }
