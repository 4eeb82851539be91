"""Artifact files: atomic writes, sidecars, fingerprints, loaders, Kedro datasets."""

import json
import os

import numpy as np
import pytest

from align_pipeline.data.formats import (
    ArrayBundle,
    Artifact,
    RecordBundle,
    arrays_fingerprint,
    atomic_open,
    check_tokenized_with,
    load_artifact,
    load_jsonl,
    load_npz,
    save_jsonl,
    save_npz,
)


def _arrays(seed=0):
    rng = np.random.default_rng(seed)
    return {"input_ids": rng.integers(0, 50, (4, 8)), "loss_mask": rng.random((4, 8)).astype(np.float32)}


def test_fingerprint_is_stable_and_content_based(tmp_path):
    a = _arrays()
    fp = arrays_fingerprint(a)
    assert len(fp) == 16 and fp == arrays_fingerprint(dict(reversed(list(a.items()))))
    assert fp != arrays_fingerprint(_arrays(1))
    b = dict(a, input_ids=a["input_ids"].astype(np.int32))
    assert fp != arrays_fingerprint(b)  # dtype is part of the content
    art1 = save_npz(tmp_path / "x.npz", a, {"num_samples": 4})
    art2 = save_npz(tmp_path / "y.npz", a, {"num_samples": 4})
    assert art1.fingerprint == art2.fingerprint == fp
    assert load_artifact(tmp_path / "x.npz", verify=True).fingerprint == fp


def test_npz_round_trip_and_sidecar(tmp_path):
    a = _arrays()
    art = save_npz(tmp_path / "d" / "s.npz", a, {"num_samples": 4, "seq_length": 8})
    assert art.path == str(tmp_path / "d" / "s.npz")
    back = load_npz(art.path)
    assert set(back) == set(a) and all(np.array_equal(back[k], a[k]) and back[k].dtype == a[k].dtype for k in a)
    meta = json.loads((tmp_path / "d" / "s.npz.meta.json").read_text())
    assert meta["fingerprint"] == art.fingerprint and meta["num_samples"] == 4 and meta["seq_length"] == 8
    assert meta["arrays"]["loss_mask"] == {"dtype": "float32", "shape": [4, 8]}
    assert sorted(os.listdir(tmp_path / "d")) == ["s.npz", "s.npz.meta.json"]


def test_jsonl_round_trip(tmp_path):
    recs = [{"prompt": "a", "answer": None, "prompt_ids": [1, 5]}]
    art = save_jsonl(tmp_path / "p.jsonl", recs, {"num_samples": 1})
    assert load_jsonl(art.path) == recs
    assert load_artifact(art.path, verify=True).meta["num_samples"] == 1


def test_tampering_and_missing_sidecar_detected(tmp_path):
    save_npz(tmp_path / "s.npz", _arrays())
    np.savez(tmp_path / "s.npz", **_arrays(1))
    with pytest.raises(ValueError, match="does not match its sidecar"):
        load_artifact(tmp_path / "s.npz", verify=True)
    np.savez(tmp_path / "t.npz", **_arrays())
    with pytest.raises(FileNotFoundError, match="meta.json not found"):
        load_artifact(tmp_path / "t.npz")


def test_atomic_open_leaves_nothing_on_error(tmp_path):
    (tmp_path / "f").write_bytes(b"old")
    with pytest.raises(RuntimeError), atomic_open(tmp_path / "f") as f:
        f.write(b"partial")
        raise RuntimeError("boom")
    assert (tmp_path / "f").read_bytes() == b"old" and os.listdir(tmp_path) == ["f"]


def test_kedro_datasets(tmp_path):
    from align_pipeline.data.tokenizer import train_tokenizer
    from align_pipeline.datasets import PromptsJsonlDataset, RawJsonlDataset, TokenizedNpzDataset, TokenizerDirDataset

    raw = tmp_path / "sft.jsonl"
    raw.write_text('{"input": "a", "output": "b"}\n')
    art = RawJsonlDataset(filepath=str(raw), kind="sft").load()
    assert art.path == str(raw) and len(art.meta["sha256"]) == 64 and art.fingerprint == art.meta["sha256"][:16]

    ds = TokenizedNpzDataset(filepath=str(tmp_path / "o" / "x.npz"), verify=True)
    assert not ds.exists()
    ds.save(ArrayBundle(arrays=_arrays(), meta={"num_samples": 4}))
    loaded = ds.load()
    assert ds.exists() and loaded.meta["num_samples"] == 4 and loaded.fingerprint == arrays_fingerprint(_arrays())

    pds = PromptsJsonlDataset(filepath=str(tmp_path / "o" / "p.jsonl"))
    pds.save(RecordBundle(records=[{"prompt": "a", "answer": None, "prompt_ids": [1]}], meta={"num_samples": 1}))
    assert pds.load().meta["num_samples"] == 1

    tds = TokenizerDirDataset(path=str(tmp_path / "tok"))
    tok = train_tokenizer(["abc"])
    tds.save(tok)
    assert tds.exists() and tds.load().fingerprint == tok.fingerprint


def test_check_tokenized_with():
    from align_pipeline.data.schemas import DataValidationError
    from align_pipeline.errors import UserError

    tok = Artifact(path="/p/data/03_primary/tokenizer", fingerprint="aaaa", meta={"fingerprint": "aaaa"})

    def art(name, tok_fp):
        return Artifact(path=f"/p/data/05_model_input/{name}", fingerprint="f", meta={"tokenizer_fingerprint": tok_fp})

    check_tokenized_with(tok, sft_train=art("sft_train.npz", "aaaa"), sft_val=art("sft_val.npz", "aaaa"))
    check_tokenized_with(tok)  # nothing to check

    with pytest.raises(DataValidationError) as excinfo:
        check_tokenized_with(
            tok,
            sft_train=art("sft_train.npz", "aaaa"),
            sft_val=art("sft_val.npz", "bbbb"),
            prompts_val=Artifact(path="/p/data/05_model_input/prompts_val.jsonl", fingerprint="f", meta={}),
        )
    msg = str(excinfo.value)
    assert isinstance(excinfo.value, UserError)
    assert msg.startswith("sft_val, prompts_val were not tokenized with the tokenizer /p/data/03_primary/tokenizer")
    assert "(fingerprint aaaa)" in msg and "sft_val (/p/data/05_model_input/sft_val.npz: tokenizer bbbb)" in msg
    assert "prompts_val (/p/data/05_model_input/prompts_val.jsonl: no tokenizer_fingerprint)" in msg
    assert "sft_train" not in msg and msg.endswith("rerun `kedro run --pipelines data_prep`")

    with pytest.raises(DataValidationError, match=r"^pref_train was not tokenized"):
        check_tokenized_with(tok, pref_train=art("pref_train.npz", "cccc"))
