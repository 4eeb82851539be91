"""The tokenizer: trained on the raw texts (embedded default) or taken from an HF model directory.

A tokenizer directory holds ``tokenizer.json`` (a ``tokenizers`` file) and ``align_tokenizer.json``::

    {"bos_id": 1, "eos_id": 2, "pad_id": 0, "vocab_size": 40, "source": "trained:char",
     "fingerprint": "3f2a...", "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
     "add_bos": true, "stop_ids": [2], "chat_template": false}

and, when it came from an HF model, copies of that model's ``tokenizer_config.json`` / ``special_tokens_map.json`` /
chat template files. :func:`load_tokenizer` reads such a directory, or a plain HF model directory (special tokens
from ``tokenizer_config.json``, then ``config.json``, then ``generation_config.json``). Training entry points import
this module, so it imports neither Kedro nor torch.

Per tokenizer: ``bos_id`` is None when the tokenizer has no BOS token (Qwen), and ``add_bos`` says whether a
sequence starts with it – for an HF tokenizer, exactly when its own post-processor adds it (Llama, Mistral: yes;
Qwen: no); a trained tokenizer always starts with ``<bos>``. EOS is never used as BOS. ``stop_ids`` end a generation:
EOS, the chat template's end-of-turn token (``<|im_end|>``, ``<|eot_id|>``) and ``generation_config.json``'s EOS ids.

    tok = load_tokenizer("data/03_primary/tokenizer")
    ids = tok.start_ids() + tok.encode("add: 23+45\\n")     # encode() adds no special tokens
    tok.decode(ids)                                       # 'add: 23+45\\n' (specials skipped)
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import shutil
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from align_pipeline.config.base import ConfigError

from .chat import ChatTemplate, ChatTemplateError
from .staging import new_write_id, remove_leftovers

TOKENIZER_FILE = "tokenizer.json"
META_FILE = "align_tokenizer.json"
HF_COPY_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "chat_template.json")
CHAT_TEMPLATE_FILE = "chat_template.jinja"
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
    chat_template: str | None = None
    """A Jinja chat template file (HF format) that replaces the tokenizer's own; saved with the tokenizer."""
    use_chat_template: bool = True
    """Render SFT conversations and all prompts with the chat template when the tokenizer has one (loss on the
    assistant turns); False = the plain layout of :mod:`align_pipeline.data.tokenize` (no role markup)."""

    def validate(self, where: str = "tokenizer") -> None:
        if self.vocab_size < len(SPECIAL_TOKENS) + 1:
            raise ConfigError(f"{where}.vocab_size must be > {len(SPECIAL_TOKENS)}, got {self.vocab_size}")
        if self.min_frequency < 1:
            raise ConfigError(f"{where}.min_frequency must be >= 1, got {self.min_frequency}")
        if self.chat_template is not None:
            if not Path(self.chat_template).is_file():
                raise ConfigError(f"{where}.chat_template: {self.chat_template} is not a file")
            try:  # compiled now: a broken template stops the run before any node
                read_chat_template(self.chat_template, f"{where}.chat_template")
            except ChatTemplateError as exc:
                raise ConfigError(str(exc)) from None


class TextTokenizer:
    """A ``tokenizers.Tokenizer`` plus its special ids, BOS rule, stop ids and (optional) chat template."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        bos_id: int | None,
        eos_id: int,
        pad_id: int,
        source: str,
        extra_files: dict[str, bytes] | None = None,
        add_bos: bool | None = None,
        stop_ids: Iterable[int] = (),
        file_paths: dict[str, str] | None = None,
    ):
        """``file_paths``: where each of ``extra_files`` was read from, as messages name it (default: its name)."""
        self.tokenizer = tokenizer
        self.bos_id = None if bos_id is None else int(bos_id)
        self.eos_id = int(eos_id)
        self.pad_id = int(pad_id)
        self.source = source
        self.extra_files = dict(extra_files or {})
        self.file_paths = {n: p for n, p in (file_paths or {}).items() if n in self.extra_files}
        self.add_bos = self.bos_id is not None if add_bos is None else bool(add_bos) and self.bos_id is not None
        self.stop_ids = tuple(dict.fromkeys([self.eos_id, *(int(i) for i in stop_ids)]))  # EOS first, no repeats
        for name, i in (("bos_id", self.bos_id), ("eos_id", self.eos_id), ("pad_id", self.pad_id)):
            if i is not None and not 0 <= i < self.vocab_size:
                raise ValueError(f"{name} {i} is outside the vocabulary (size {self.vocab_size})")
        self.chat_template = _chat_template(self.extra_files, self.special_token_strings(), self.file_paths)

    @property
    def vocab_size(self) -> int:
        """Number of token ids (added/special tokens included)."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """An upper bound on the characters one token covers: the longest vocabulary entry (a byte-level entry has
        one symbol per byte, so it is never shorter than the text it decodes to). A text longer than
        ``n x max_token_chars`` characters has more than n tokens."""
        vocab = self.tokenizer.get_vocab(with_added_tokens=True)
        return max(1, max((len(t) for t in vocab), default=1))

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, without any special tokens."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[int]]:
        """Token ids of ``text`` (no special tokens added; special tokens written in the text are recognised) and
        the character offset where each token starts."""
        enc = self.tokenizer.encode(text, add_special_tokens=False)
        return enc.ids, [start for start, _ in enc.offsets]

    def start_ids(self, text: str = "") -> list[int]:
        """What goes before the tokens of ``text`` when it starts a sequence: ``[bos_id]`` when this tokenizer
        starts sequences with BOS and ``text`` (e.g. a rendered chat template) does not already begin with it."""
        if not self.add_bos:
            return []
        bos = self.id_to_token(self.bos_id)
        return [] if bos and text.startswith(bos) else [self.bos_id]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int | None) -> str | None:
        return None if i is None else self.tokenizer.id_to_token(int(i))

    def special_token_strings(self) -> dict[str, str]:
        """``bos_token``, ``eos_token``, ``pad_token`` (and ``unk_token``) strings: the variables a chat template
        may use. An HF tokenizer's come from its ``tokenizer_config.json`` when it has them."""
        out = {
            "bos_token": self.id_to_token(self.bos_id),
            "eos_token": self.id_to_token(self.eos_id),
            "pad_token": self.id_to_token(self.pad_id),
        }
        config = _json_bytes(self.extra_files.get("tokenizer_config.json"))
        for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
            text = _token_text(config.get(name))
            if text is not None:
                out[name] = text
        return {k: v for k, v in out.items() if v is not None}

    def meta(self) -> dict[str, Any]:
        """The content of ``align_tokenizer.json``."""
        return {
            "bos_id": self.bos_id,
            "eos_id": self.eos_id,
            "pad_id": self.pad_id,
            "bos_token": self.id_to_token(self.bos_id),
            "eos_token": self.id_to_token(self.eos_id),
            "pad_token": self.id_to_token(self.pad_id),
            "add_bos": self.add_bos,
            "stop_ids": list(self.stop_ids),
            "chat_template": self.chat_template is not None,
            "vocab_size": self.vocab_size,
            "source": self.source,
            "fingerprint": self.fingerprint,
        }

    @property
    def fingerprint(self) -> str:
        """Short sha256 of the tokenizer's JSON, its special-token ids, BOS rule, stop ids and chat template."""
        h = hashlib.sha256(self.tokenizer.to_str().encode())
        h.update(json.dumps([self.bos_id, self.eos_id, self.pad_id]).encode())
        if self.bos_id is None or not self.add_bos or self.stop_ids != (self.eos_id,) or self.chat_template:
            h.update(json.dumps([self.add_bos, self.stop_ids]).encode())  # (the trained tokenizers' hash is kept)
        if self.chat_template is not None:
            h.update(self.chat_template.source.encode())
        return h.hexdigest()[:16]

    def save(self, directory: str | os.PathLike) -> None:
        """Write the tokenizer directory atomically: build it in a temp dir next to it (``.<name>.<writer id>.tmp``),
        then rename into place; then remove what killed writers left of it (:mod:`.staging`'s leftovers)."""
        directory = Path(directory)
        directory.parent.mkdir(parents=True, exist_ok=True)
        tmp = directory.parent / f".{directory.name}.{new_write_id()}.tmp"
        tmp.mkdir()
        try:
            for name, blob in self.extra_files.items():
                (tmp / name).write_bytes(blob)
            (tmp / TOKENIZER_FILE).write_text(self.tokenizer.to_str())
            (tmp / META_FILE).write_text(json.dumps(self.meta(), indent=2, sort_keys=True) + "\n")
            _replace_dir(tmp, directory)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        remove_leftovers(directory, backups=True)

    def __repr__(self) -> str:
        return (
            f"TextTokenizer(vocab_size={self.vocab_size}, bos={self.bos_id}, eos={self.eos_id}, "
            f"pad={self.pad_id}, stop={list(self.stop_ids)}, chat_template={self.chat_template is not None}, "
            f"source={self.source!r}, fingerprint={self.fingerprint})"
        )


def _json_bytes(blob: bytes | None) -> dict[str, Any]:
    if not blob:
        return {}
    try:
        value = json.loads(blob)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def _chat_template(
    files: dict[str, bytes], special_tokens: dict[str, str], paths: dict[str, str] | None = None
) -> ChatTemplate | None:
    """The chat template among an HF tokenizer's files: ``chat_template.jinja``, then ``chat_template.json``, then
    ``tokenizer_config.json``'s ``chat_template`` (a string, or a list of named templates: the ``default`` one),
    compiled; its errors name the file (``paths``: file name -> path shown) and the key."""
    paths = paths or {}
    origin = paths.get(CHAT_TEMPLATE_FILE, CHAT_TEMPLATE_FILE)
    source: Any = None
    if CHAT_TEMPLATE_FILE in files:
        try:
            source = files[CHAT_TEMPLATE_FILE].decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ChatTemplateError(f"chat template in {origin}: not valid UTF-8 (at byte {exc.start})") from None
    for name in ("chat_template.json", "tokenizer_config.json"):
        if source is None:
            source = _json_bytes(files.get(name)).get("chat_template")
            origin = f'{paths.get(name, name)} ("chat_template")'
    if isinstance(source, list):
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
        origin = f'{origin[:-1]}, "default")'
    return ChatTemplate(source, special_tokens, origin) if isinstance(source, str) and source.strip() else None


def _shown(path: str | os.PathLike) -> str:
    """``path`` relative to the working directory when it lies inside it (as a user typed it), else absolute."""
    rel = os.path.relpath(os.path.abspath(path))
    return os.path.abspath(path) if rel.startswith("..") else rel


def read_chat_template(path: str | os.PathLike, key: str | None = None) -> ChatTemplate:
    """The compiled chat template of file ``path``; errors name the file (and the parameter ``key`` naming it)."""
    origin = _shown(path) + (f" ({key})" if key else "")
    try:
        source = Path(path).read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ChatTemplateError(f"chat template in {origin}: not valid UTF-8 (at byte {exc.start})") from None
    return ChatTemplate(source, origin=origin)


def _replace_dir(src: Path, dst: Path) -> None:
    """Move directory ``src`` to ``dst``, replacing an existing ``dst`` (the old one is removed afterwards)."""
    old = None
    if dst.exists():
        old = dst.parent / f".{dst.name}.{new_write_id()}.old"
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


def _char_tokenizer(texts: Iterable[str], vocab_size: int, min_frequency: int) -> Tokenizer:
    counts: Counter[str] = Counter()
    for t in texts:
        counts.update(t)
    kept = [c for c, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])) if n >= min_frequency]
    kept = sorted(kept[: vocab_size - len(SPECIAL_TOKENS)])  # most frequent first, then by code point
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + kept)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # one token per character
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return tok


def _bpe_tokenizer(texts: Iterable[str], vocab_size: int, min_frequency: int) -> Tokenizer:
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
    texts = (t for t in texts if t)  # read once: the texts of a large file are never all held
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


def _hf_special_ids(directory: Path, tok: Tokenizer) -> tuple[int | None, int, int]:
    """bos/eos/pad ids of an HF model directory.

    Order: token strings of ``tokenizer_config.json`` (or ``special_tokens_map.json``), then ids of ``config.json``,
    then ``generation_config.json``. A model without a bos token has none (None); without a pad token, eos pads.
    """
    tok_cfg = {**_read_json(directory / "special_tokens_map.json"), **_read_json(directory / "tokenizer_config.json")}
    id_sources = [_read_json(directory / "config.json"), _read_json(directory / "generation_config.json")]

    def lookup(name: str) -> int | None:
        if name == "bos" and "bos_token" in tok_cfg and tok_cfg["bos_token"] is None:
            return None  # said explicitly: no BOS (Qwen's config.json still names one)
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
    return (None if bos == eos else bos), eos, (eos if pad is None else pad)


def _hf_adds_bos(directory: Path, tok: Tokenizer, bos: int | None) -> bool:
    """Whether the HF tokenizer starts a sequence with BOS: ``tokenizer_config.json``'s ``add_bos_token`` when set,
    else whether its own post-processor adds it."""
    if bos is None:
        return False
    flag = _read_json(directory / "tokenizer_config.json").get("add_bos_token")
    if isinstance(flag, bool):
        return flag
    with_specials = tok.encode("a", add_special_tokens=True).ids
    return len(with_specials) > len(tok.encode("a", add_special_tokens=False).ids) and with_specials[0] == bos


def _hf_stop_ids(directory: Path) -> list[int]:
    """``generation_config.json``'s (then ``config.json``'s) ``eos_token_id``, one id or a list."""
    for name in ("generation_config.json", "config.json"):
        value = _read_json(directory / name).get("eos_token_id")
        ids = value if isinstance(value, list) else [value]
        ids = [i for i in ids if isinstance(i, int) and not isinstance(i, bool)]
        if ids:
            return ids
    return []


def _end_of_turn_id(tok: TextTokenizer) -> int | None:
    """The special token that ends an assistant turn in the chat template (``<|im_end|>``, ``<|eot_id|>``)."""
    if tok.chat_template is None:
        return None
    try:
        text = tok.chat_template.end_of_turn()
    except ValueError:
        return None
    ids = tok.encode(text) if text else []
    added = {t.content for t in tok.tokenizer.get_added_tokens_decoder().values()}
    return ids[0] if ids and tok.id_to_token(ids[0]) in added else None


def with_chat_template(tok: TextTokenizer, template_file: str | os.PathLike | None) -> TextTokenizer:
    """``tok`` with the chat template of ``template_file`` (None: unchanged), its end-of-turn token a stop id."""
    if template_file is None:
        return tok
    files = {**tok.extra_files, CHAT_TEMPLATE_FILE: Path(template_file).read_bytes()}
    paths = {**tok.file_paths, CHAT_TEMPLATE_FILE: _shown(template_file)}
    out = TextTokenizer(tok.tokenizer, tok.bos_id, tok.eos_id, tok.pad_id, tok.source, files, tok.add_bos,
                        tok.stop_ids, paths)
    return _add_end_of_turn(out)


def _add_end_of_turn(tok: TextTokenizer) -> TextTokenizer:
    eot = _end_of_turn_id(tok)
    if eot is None or eot in tok.stop_ids:
        return tok
    return TextTokenizer(tok.tokenizer, tok.bos_id, tok.eos_id, tok.pad_id, tok.source, tok.extra_files,
                         tok.add_bos, (*tok.stop_ids, eot), tok.file_paths)


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
    out = TextTokenizer(tok, bos, eos, pad, source=f"hf:{directory.resolve()}", extra_files=extra,
                        add_bos=_hf_adds_bos(directory, tok, bos), stop_ids=_hf_stop_ids(directory),
                        file_paths={n: _shown(directory / n) for n in extra})
    return _add_end_of_turn(out)


def load_tokenizer(directory: str | os.PathLike) -> TextTokenizer:
    """Load a tokenizer directory written by :meth:`TextTokenizer.save`, or a plain HF model directory."""
    directory = Path(directory)
    meta_path = directory / META_FILE
    if not meta_path.exists():
        return load_hf_tokenizer(directory)
    meta = _read_json(meta_path)
    tok = Tokenizer.from_file(str(directory / TOKENIZER_FILE))
    extra = {n: (directory / n).read_bytes() for n in HF_COPY_FILES if (directory / n).exists()}
    out = TextTokenizer(tok, meta["bos_id"], meta["eos_id"], meta["pad_id"], source=meta["source"], extra_files=extra,
                        add_bos=meta.get("add_bos", True), stop_ids=meta.get("stop_ids", ()),
                        file_paths={n: _shown(directory / n) for n in extra})
    if meta.get("fingerprint") not in (None, out.fingerprint):
        raise ValueError(
            f"{directory}: tokenizer fingerprint {out.fingerprint} does not match {META_FILE} ({meta['fingerprint']})"
        )
    return out


def build_tokenizer(config: TokenizerConfig, texts: Iterable[str]) -> TextTokenizer:
    """The tokenizer ``data_prep`` uses: ``config.hf_model_dir``'s, or one trained on ``texts``; with
    ``config.chat_template`` as its chat template when given."""
    tok = load_hf_tokenizer(config.hf_model_dir) if config.hf_model_dir else train_tokenizer(texts, config)
    return with_chat_template(tok, config.chat_template)


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
    "read_chat_template",
    "read_tokenizer_meta",
    "train_tokenizer",
    "with_chat_template",
]
