"""Tokenizers: trained (char / bpe) round-trips, saved dirs, HF model dirs."""

import json

import pytest

from align_pipeline.data.tokenizer import (
    TextTokenizer,
    TokenizerConfig,
    build_tokenizer,
    load_tokenizer,
    train_tokenizer,
)

TEXTS = ["reverse: abcd\n", "dcba", "add: 23+45\n", "68", "add: 99+99\n", "198"]


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_trained_round_trip_and_specials(tmp_path, kind):
    tok = train_tokenizer(TEXTS, TokenizerConfig(kind=kind, vocab_size=60))
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert tok.vocab_size <= 60
    for text in TEXTS + ["reverse: zyx\n"]:
        ids = tok.encode(text)
        assert tok.bos_id not in ids and tok.eos_id not in ids
        if all(c in "".join(TEXTS) for c in text):
            assert tok.decode(ids) == text
    assert tok.decode([tok.bos_id] + tok.encode("68") + [tok.eos_id]) == "68"
    assert tok.decode([tok.bos_id, *tok.encode("68"), tok.eos_id], skip_special_tokens=False) == "<bos>68<eos>"

    tok.save(tmp_path / "tok")
    meta = json.loads((tmp_path / "tok" / "align_tokenizer.json").read_text())
    assert meta["fingerprint"] == tok.fingerprint and meta["vocab_size"] == tok.vocab_size
    again = load_tokenizer(tmp_path / "tok")
    assert again.fingerprint == tok.fingerprint
    assert again.encode("add: 23+45\n") == tok.encode("add: 23+45\n")
    assert [p.name for p in tmp_path.iterdir()] == ["tok"]  # no temp dirs left behind


def test_char_tokenizer_is_one_token_per_char_and_deterministic():
    a = train_tokenizer(TEXTS)
    assert len(a.encode("reverse: abcd\n")) == len("reverse: abcd\n")
    assert train_tokenizer(list(reversed(TEXTS))).fingerprint == a.fingerprint
    assert (
        train_tokenizer(TEXTS, TokenizerConfig(kind="bpe", vocab_size=60)).fingerprint
        == train_tokenizer(TEXTS, TokenizerConfig(kind="bpe", vocab_size=60)).fingerprint
    )


def test_char_vocab_cap_maps_rare_chars_to_unk():
    tok = train_tokenizer(["aaaa", "bbb", "cc", "d"], TokenizerConfig(vocab_size=6))
    assert tok.vocab_size == 6  # 4 specials + a, b
    assert tok.decode(tok.encode("ab")) == "ab"
    assert tok.encode("d") == [tok.tokenizer.token_to_id("<unk>")]


def test_save_replaces_existing_dir(tmp_path):
    train_tokenizer(["abc"]).save(tmp_path / "tok")
    tok = train_tokenizer(TEXTS)
    tok.save(tmp_path / "tok")
    assert load_tokenizer(tmp_path / "tok").fingerprint == tok.fingerprint
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tok"]


def _make_hf_dir(path, with_pad=True):
    """A tiny HF-style model dir, built locally (no hub): tokenizer.json + tokenizer_config.json + config.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2, "hello": 3, "world": 4, "!": 5}
    if with_pad:
        vocab["<pad>"] = 6
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    kw = {"pad_token": "<pad>"} if with_pad else {}
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>", **kw)
    fast.save_pretrained(str(path))
    (path / "config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": [1], "vocab_size": 8}))
    return fast


@pytest.mark.parametrize("with_pad", [True, False])
def test_hf_model_dir(tmp_path, with_pad):
    fast = _make_hf_dir(tmp_path / "hf", with_pad)
    tok = load_tokenizer(tmp_path / "hf")  # no align_tokenizer.json -> HF rules
    assert (tok.bos_id, tok.eos_id) == (0, 1)
    assert tok.pad_id == (6 if with_pad else 1)  # no pad token -> eos
    assert tok.encode("hello world") == [3, 4] == fast.encode("hello world", add_special_tokens=False)
    assert tok.source.startswith("hf:")

    via_cfg = build_tokenizer(TokenizerConfig(hf_model_dir=str(tmp_path / "hf")), texts=[])
    assert via_cfg.fingerprint == tok.fingerprint
    via_cfg.save(tmp_path / "saved")
    assert (tmp_path / "saved" / "tokenizer_config.json").exists()  # HF files travel with the copy
    again = load_tokenizer(tmp_path / "saved")
    assert again.fingerprint == tok.fingerprint and again.encode("hello !") == [3, 5]


def test_hf_dir_special_ids_from_config_only(tmp_path):
    from tokenizers import Tokenizer, models

    (tmp_path / "m").mkdir()
    Tokenizer(models.WordLevel({"a": 0, "b": 1, "<end>": 2}, unk_token="a")).save(
        str(tmp_path / "m" / "tokenizer.json")
    )
    (tmp_path / "m" / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "bos_token_id": 1}))
    tok = load_tokenizer(tmp_path / "m")
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, 2)


def test_missing_dir_and_no_eos_are_clear(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_tokenizer(tmp_path / "nope")
    from tokenizers import Tokenizer, models

    (tmp_path / "m").mkdir()
    Tokenizer(models.WordLevel({"a": 0}, unk_token="a")).save(str(tmp_path / "m" / "tokenizer.json"))
    with pytest.raises(ValueError, match="no eos token"):
        load_tokenizer(tmp_path / "m")


def test_text_tokenizer_rejects_ids_outside_vocab():
    tok = train_tokenizer(["ab"])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        TextTokenizer(tok.tokenizer, bos_id=1, eos_id=999, pad_id=0, source="x")
