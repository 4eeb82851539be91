"""The tokenizer: trained on the raw texts (embedded default) or taken from an HF model directory.

A tokenizer directory holds ``tokenizer.json`` (a ``tokenizers`` file) and ``align_tokenizer.json``::

    {"bos_id": 1, "eos_id": 2, "pad_id": 0, "vocab_size": 40, "source": "trained:char",
     "fingerprint": "3f2a...", "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"}

and, when it came from an HF model, copies of that model's ``tokenizer_config.json`` / ``special_tokens_map.json``.
:func:`load_tokenizer` reads such a directory, or a plain HF model directory (special tokens from
``tokenizer_config.json``, then ``config.json``, then ``generation_config.json``). Training entry points import this
module, so it imports neither Kedro nor torch.

    tok = load_tokenizer("data/03_primary/tokenizer")
    ids = [tok.bos_id] + tok.encode("add: 23+45\\n")     # encode() adds no special tokens
    tok.decode(ids)                                      # 'add: 23+45\\n' (specials skipped)
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from align_pipeline.config.base import ConfigError

TOKENIZER_FILE = "tokenizer.json"
META_FILE = "align_tokenizer.json"
HF_COPY_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK]  # ids 0..3 in a trained tokenizer


@dataclass
class TokenizerConfig:
    """How ``data_prep`` gets its tokenizer."""

    hf_model_dir: str | None = None
    """An HF model directory whose tokenizer to use; None = train one on the raw data."""
    kind: Literal["char", "bpe"] = "char"
    """Trained tokenizer: one token per character (best for the demo task), or BPE merges on top of characters."""
    vocab_size: int = 128
    """Largest vocabulary of a trained tokenizer, special tokens included (rarest characters become <unk>)."""
    min_frequency: int = 1
    """A character (or BPE merge) must occur this often to get a token."""

    def validate(self) -> None:
        if self.vocab_size < len(SPECIAL_TOKENS) + 1:
            raise ConfigError(f"tokenizer.vocab_size must be > {len(SPECIAL_TOKENS)}, got {self.vocab_size}")
        if self.min_frequency < 1:
            raise ConfigError(f"tokenizer.min_frequency must be >= 1, got {self.min_frequency}")


class TextTokenizer:
    """A ``tokenizers.Tokenizer`` plus the ids of ``<bos>``, ``<eos>`` and ``<pad>``."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        bos_id: int,
        eos_id: int,
        pad_id: int,
        source: str,
        extra_files: dict[str, bytes] | None = None,
    ):
        self.tokenizer = tokenizer
        self.bos_id = int(bos_id)
        self.eos_id = int(eos_id)
        self.pad_id = int(pad_id)
        self.source = source
        self.extra_files = dict(extra_files or {})
        for name, i in (("bos_id", self.bos_id), ("eos_id", self.eos_id), ("pad_id", self.pad_id)):
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"{name} {i} is outside the vocabulary (size {self.vocab_size})")

    @property
    def vocab_size(self) -> int:
        """Number of token ids (added/special tokens included)."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, without any special tokens."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str | None:
        return self.tokenizer.id_to_token(int(i))

    def meta(self) -> dict[str, Any]:
        """The content of ``align_tokenizer.json``."""
        return {
            "bos_id": self.bos_id,
            "eos_id": self.eos_id,
            "pad_id": self.pad_id,
            "bos_token": self.id_to_token(self.bos_id),
            "eos_token": self.id_to_token(self.eos_id),
            "pad_token": self.id_to_token(self.pad_id),
            "vocab_size": self.vocab_size,
            "source": self.source,
            "fingerprint": self.fingerprint,
        }

    @property
    def fingerprint(self) -> str:
        """Short sha256 of the tokenizer's JSON and its special-token ids."""
        h = hashlib.sha256(self.tokenizer.to_str().encode())
        h.update(json.dumps([self.bos_id, self.eos_id, self.pad_id]).encode())
        return h.hexdigest()[:16]

    def save(self, directory: str | os.PathLike) -> None:
        """Write the tokenizer directory atomically: build it in a temp dir next to it, then rename into place."""
        directory = Path(directory)
        directory.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", suffix=".tmp", dir=directory.parent))
        try:
            for name, blob in self.extra_files.items():
                (tmp / name).write_bytes(blob)
            (tmp / TOKENIZER_FILE).write_text(self.tokenizer.to_str())
            (tmp / META_FILE).write_text(json.dumps(self.meta(), indent=2, sort_keys=True) + "\n")
            _replace_dir(tmp, directory)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def __repr__(self) -> str:
        return (
            f"TextTokenizer(vocab_size={self.vocab_size}, bos={self.bos_id}, eos={self.eos_id}, "
            f"pad={self.pad_id}, source={self.source!r}, fingerprint={self.fingerprint})"
        )


def _replace_dir(src: Path, dst: Path) -> None:
    """Move directory ``src`` to ``dst``, replacing an existing ``dst`` (the old one is removed afterwards)."""
    old = None
    if dst.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=".old", dir=dst.parent))
        os.rmdir(old)
        os.replace(dst, old)
    try:
        os.replace(src, dst)
    except BaseException:
        if old is not None:
            os.replace(old, dst)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------------------------


def _char_tokenizer(texts: list[str], vocab_size: int, min_frequency: int) -> Tokenizer:
    counts = Counter(ch for t in texts for ch in t)
    kept = [c for c, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])) if n >= min_frequency]
    kept = sorted(kept[: vocab_size - len(SPECIAL_TOKENS)])  # most frequent first, then by code point
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + kept)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # one token per character
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return tok


def _bpe_tokenizer(texts: list[str], vocab_size: int, min_frequency: int) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=UNK))
    # Digits stay single tokens (arithmetic); whitespace is its own token; merges happen inside the rest.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.Split(Regex(r"\s"), behavior="isolated")]
    )
    tok.decoder = decoders.Fuse()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=SPECIAL_TOKENS, show_progress=False
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def train_tokenizer(texts: Iterable[str], config: TokenizerConfig | None = None) -> TextTokenizer:
    """Train a small tokenizer on ``texts`` (deterministic) with ``<pad>``=0, ``<bos>``=1, ``<eos>``=2, ``<unk>``=3."""
    config = config or TokenizerConfig()
    texts = [t for t in texts if t]
    if config.kind == "char":
        tok = _char_tokenizer(texts, config.vocab_size, config.min_frequency)
    elif config.kind == "bpe":
        tok = _bpe_tokenizer(texts, config.vocab_size, config.min_frequency)
    else:
        raise ValueError(f"unknown tokenizer kind {config.kind!r}; expected 'char' or 'bpe'")
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    return TextTokenizer(tok, ids[BOS], ids[EOS], ids[PAD], source=f"trained:{config.kind}")


# ---------------------------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: cannot read ({exc})") from None


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", "lstrip": false, ...}
        value = value.get("content")
    return value if isinstance(value, str) else None


def _first_id(value: Any) -> int | None:
    if isinstance(value, list):
        value = value[0] if value else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _hf_special_ids(directory: Path, tok: Tokenizer) -> tuple[int, int, int]:
    """bos/eos/pad ids of an HF model directory.

    Order: token strings of ``tokenizer_config.json`` (or ``special_tokens_map.json``), then ids of ``config.json``,
    then ``generation_config.json``. A model without a bos token uses eos as bos; without a pad token, eos as pad.
    """
    tok_cfg = {**_read_json(directory / "special_tokens_map.json"), **_read_json(directory / "tokenizer_config.json")}
    id_sources = [_read_json(directory / "config.json"), _read_json(directory / "generation_config.json")]

    def lookup(name: str) -> int | None:
        text = _token_text(tok_cfg.get(f"{name}_token"))
        if text is not None:
            i = tok.token_to_id(text)
            if i is not None:
                return i
        for src in id_sources:
            i = _first_id(src.get(f"{name}_token_id"))
            if i is not None:
                return i
        return None

    eos = lookup("eos")
    if eos is None:
        raise ValueError(
            f"{directory}: no eos token found in tokenizer_config.json, special_tokens_map.json, config.json or "
            "generation_config.json"
        )
    bos = lookup("bos")
    pad = lookup("pad")
    return (eos if bos is None else bos), eos, (eos if pad is None else pad)


def _load_backend(directory: Path) -> Tokenizer:
    path = directory / TOKENIZER_FILE
    if path.exists():
        return Tokenizer.from_file(str(path))
    try:  # a slow (e.g. sentencepiece) tokenizer: let transformers convert it, from local files only
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(directory), local_files_only=True, use_fast=True).backend_tokenizer
    except Exception as exc:  # noqa: BLE001 - any failure here means "no usable tokenizer"
        raise ValueError(f"{directory}: no {TOKENIZER_FILE} and transformers could not load one ({exc})") from None


def load_hf_tokenizer(directory: str | os.PathLike) -> TextTokenizer:
    """The tokenizer of an HF model directory (no network)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ValueError(f"tokenizer directory {directory} does not exist")
    tok = _load_backend(directory)
    bos, eos, pad = _hf_special_ids(directory, tok)
    extra = {n: (directory / n).read_bytes() for n in HF_COPY_FILES if (directory / n).exists()}
    return TextTokenizer(tok, bos, eos, pad, source=f"hf:{directory.resolve()}", extra_files=extra)


def load_tokenizer(directory: str | os.PathLike) -> TextTokenizer:
    """Load a tokenizer directory written by :meth:`TextTokenizer.save`, or a plain HF model directory."""
    directory = Path(directory)
    meta_path = directory / META_FILE
    if not meta_path.exists():
        return load_hf_tokenizer(directory)
    meta = _read_json(meta_path)
    tok = Tokenizer.from_file(str(directory / TOKENIZER_FILE))
    extra = {n: (directory / n).read_bytes() for n in HF_COPY_FILES if (directory / n).exists()}
    out = TextTokenizer(tok, meta["bos_id"], meta["eos_id"], meta["pad_id"], source=meta["source"], extra_files=extra)
    if meta.get("fingerprint") not in (None, out.fingerprint):
        raise ValueError(
            f"{directory}: tokenizer fingerprint {out.fingerprint} does not match {META_FILE} ({meta['fingerprint']})"
        )
    return out


def build_tokenizer(config: TokenizerConfig, texts: Iterable[str]) -> TextTokenizer:
    """The tokenizer ``data_prep`` uses: ``config.hf_model_dir``'s, or one trained on ``texts``."""
    if config.hf_model_dir:
        return load_hf_tokenizer(config.hf_model_dir)
    return train_tokenizer(texts, config)


def read_tokenizer_meta(directory: str | os.PathLike) -> dict[str, Any]:
    """``align_tokenizer.json`` of a saved tokenizer directory."""
    with contextlib.suppress(FileNotFoundError):
        return json.loads((Path(directory) / META_FILE).read_text())
    raise FileNotFoundError(f"{Path(directory) / META_FILE} not found: not a data_prep tokenizer directory")


__all__ = [
    "BOS",
    "EOS",
    "PAD",
    "SPECIAL_TOKENS",
    "TextTokenizer",
    "TokenizerConfig",
    "build_tokenizer",
    "load_hf_tokenizer",
    "load_tokenizer",
    "read_tokenizer_meta",
    "train_tokenizer",
]
