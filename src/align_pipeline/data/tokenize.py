"""Tokenize, mask, pad and split validated raw data into the arrays the trainers read.

Sequence conventions (S = ``model.seq_length``; right-padded with ``pad_id``):

* Plain layout (a trained tokenizer, or no chat template): a sample = ``start`` + prompt + response + ``<eos>``,
  ``start`` = ``<bos>`` when the tokenizer starts sequences with it. Chat: the turns' texts in order, ``<eos>`` after
  each Assistant turn.
* Chat-template layout (an HF tokenizer with a chat template, :mod:`.chat`): the rendered conversation; the response
  tokens are the assistant turns, each with its end-of-turn marker. Prompts are rendered with the generation prompt.
* A sample longer than S is refused, truncated or dropped per ``data_prep.overlong`` (:class:`Overlong`).

Sequence arrays are stored ragged, without padding (:mod:`.store`: ``{p}tokens``, ``{p}response``, ``{p}offsets``)
and read back as padded rows per batch, or packed:

* ``input_ids``  int64   [N, S]  the sample's tokens, then ``pad_id``.
* ``labels``     int64   [N, S]  ``labels[:, t] = input_ids[:, t + 1]`` (already shifted); ``pad_id`` past the end.
* ``loss_mask``  float32 [N, S]  1 exactly where ``labels[:, t]`` is a response token (or the ``<eos>`` / end-of-turn
  ending a response); 0 on prompt tokens and padding.

Artifacts (see :mod:`.formats` for the sidecar, which also records ``seq_length`` and ``pad_id``):

* SFT ``.npz``: one ragged group (prefix ``""``).
* Regression ``.npz``: one ragged group + ``reward_labels`` float32 [N, A] (NaN = missing), attribute names in the
  sidecar.
* Preference ``.npz``: groups ``chosen_`` and ``rejected_``, ``chosen_reward``, ``rejected_reward`` float32 [N]
  (NaN where the raw line has none).
* Prompts ``.jsonl``: every field of the raw record, ``"answer"`` (null when absent) and ``"prompt_ids": [int]``:
  the prompt's tokens (``start`` + prompt, or its chat rendering with the generation prompt), unpadded. A prompt must
  leave room for at least one generated token, and, when its answer is a string, prompt + answer + EOS must fit.

Train/val split: the distinct prompt texts are hashed with the seed and the ``round(K * val_fraction)`` lowest of the
K hashes go to val (at least one each side when K >= 2 and val_fraction > 0), with every sample of those prompts; both
splits keep file order. The result depends only on the data and the seed, not on file order, and no prompt is in
both splits.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from align_pipeline.config.base import ConfigError

from .chat import ChatTemplate, ChatTemplateError, completion_messages, prompt_messages, sft_messages
from .formats import ArrayBundle, RecordBundle
from .layouts import key_text, texts_of, with_texts
from .schemas import RawData, message_segments, sft_prompt_text, sft_segments
from .store import RaggedBuilder, SpilledRecords, select
from .tokenizer import TextTokenizer, TokenizerConfig

SPLITS = ("train", "val")


OverlongPolicy = Literal["error", "truncate", "drop"]


@dataclass
class OverlongConfig:
    """``data_prep.overlong``: per data kind, what happens to a sample longer than ``model.seq_length``.

    ``error`` stops data_prep with the file, line and length; ``truncate`` cuts the sample at seq_length (a sample
    with no response token left is dropped instead); ``drop`` leaves it out. Truncated and dropped samples are
    counted in data_prep's metrics (``<kind>_truncated``, ``<kind>_dropped``) and a warning."""

    sft: OverlongPolicy = "error"
    preference: OverlongPolicy = "error"
    """A pair is truncated or dropped as a whole (both sides cut at seq_length)."""
    prompts: Literal["error", "drop"] = "error"
    """A prompt is never cut (its question would be lost); too long = no room for a response, or for its answer."""
    regression: OverlongPolicy = "error"


@dataclass
class LayoutsConfig:
    """``data_prep.layouts``: the layout of each raw file (:mod:`align_pipeline.data.layouts`), or ``auto``: its
    first record's keys decide (a file never mixes layouts)."""

    sft: Literal["auto", "nemo", "messages"] = "auto"
    preference: Literal["auto", "nemo", "nemo_text", "trl_explicit", "trl_implicit"] = "auto"
    prompts: Literal["auto", "prompt", "prompt_messages", "nemo_text", "verl"] = "auto"
    regression: Literal["auto", "regression"] = "auto"


@dataclass
class DataPrepConfig:
    """Parameters of the ``data_prep`` pipeline (``params:data_prep``)."""

    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    """Where the tokenizer comes from (trained on the raw data, or an HF model directory)."""
    val_fraction: float = 0.1
    """Share of the SFT and preference samples held out for validation (sft_val, pref_val)."""
    prompts_val_fraction: float | None = None
    """Share of the prompts held out (prompts_val: the evaluation set); None = val_fraction."""
    seed: int = 1234
    """Seed of the train/val split."""
    dubious: Literal["warn", "refuse", "ignore"] = "warn"
    """What to do with dubious records – exact duplicate lines, empty/whitespace answers (SFT output or Assistant
    turn, chosen/rejected response, prompt answer), preference pairs with chosen == rejected
    (:mod:`align_pipeline.data.dubious`): ``warn`` keeps them and logs one warning per file with counts and example
    lines; ``refuse`` fails with a ``DataValidationError`` naming file, lines and reason, before anything is written;
    ``ignore`` keeps them silently. Their counts are in data_prep's metrics (``<kind>_dubious_<reason>``) either
    way."""

    overlong: OverlongConfig = field(default_factory=lambda: OverlongConfig())
    """What to do with a sample longer than ``model.seq_length``, per data kind."""
    layouts: LayoutsConfig = field(default_factory=lambda: LayoutsConfig())
    """The layout of each raw file, or ``auto`` (detected from its first record)."""

    def validate(self) -> None:
        for name in ("val_fraction", "prompts_val_fraction"):
            value = getattr(self, name)
            if value is not None and not 0.0 <= value < 1.0:
                raise ConfigError(f"data_prep.{name} must be in [0, 1), got {value}")

    def val_fraction_for(self, kind: str) -> float:
        """The held-out share of a raw file of ``kind``."""
        if kind == "prompts" and self.prompts_val_fraction is not None:
            return self.prompts_val_fraction
        return self.val_fraction


# ---------------------------------------------------------------------------------------------------------------
# One sample
# ---------------------------------------------------------------------------------------------------------------

Sample = tuple[list[int], list[bool]]
"""A sample's token ids and, per token, whether it is a response token (the loss is on those)."""


@dataclass
class Renderer:
    """Turns records into token ids: through the tokenizer's chat template, or the plain layout.

    Plain: ``start`` + each segment's tokens, ``<eos>`` after each response (``start`` = ``[bos_id]`` when the
    tokenizer starts sequences with BOS). Template: the whole rendered conversation tokenized once; response = the
    tokens starting inside an assistant turn, its end-of-turn marker included (:mod:`.chat`); a prompt is rendered
    with the generation prompt appended, exactly as a response to it is generated.
    """

    tok: TextTokenizer
    template: ChatTemplate | None = None
    """None = plain layout (no chat template, or ``tokenizer.use_chat_template: false``, or pre-templated text)."""

    def segments(self, segments: list[tuple[str, bool]]) -> Sample:
        ids, is_response = list(self.tok.start_ids()), [False] * len(self.tok.start_ids())
        for text, response in segments:
            t = self.tok.encode(text)
            ids += t
            is_response += [response] * len(t)
            if response:
                ids.append(self.tok.eos_id)
                is_response.append(True)
        return ids, is_response

    def messages(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                 train_from: int = 0) -> Sample:
        assert self.template is not None
        text, spans = self.template.render_with_spans(messages, tools=tools, train_from=train_from)
        start = self.tok.start_ids(text)
        ids, offsets = self.tok.encode_with_offsets(text)
        is_response, k = [], 0
        for o in offsets:  # spans are sorted and disjoint; offsets ascend
            while k < len(spans) and o >= spans[k][1]:
                k += 1
            is_response.append(k < len(spans) and o >= spans[k][0])
        return start + ids, [False] * len(start) + is_response

    def sft(self, record: dict[str, Any]) -> Sample:
        if self.template is None:
            return self.segments(sft_segments(record))
        return self.messages(sft_messages(record), tools=record.get("tools"))

    def prompt_response(self, prompt: str | list[dict[str, Any]], response: str | list[dict[str, Any]]) -> Sample:
        """A prompt and its response (each a string or chat messages); the loss on the response's tokens (its
        assistant turns, under a template)."""
        if self.template is None:
            return self.segments(self._plain(prompt, False) + self._plain(response, True))
        context = prompt_messages(prompt)
        return self.messages(context + completion_messages(response), train_from=len(context))

    def prompt(self, prompt: str | list[dict[str, Any]]) -> list[int]:
        """The ids a response to ``prompt`` is generated after (the same prefix :meth:`prompt_response` trains)."""
        if self.template is None:
            return self.tok.start_ids() + [t for text, _ in self._plain(prompt, False) for t in self.tok.encode(text)]
        text = self.template.render(prompt_messages(prompt), add_generation_prompt=True)
        return self.tok.start_ids(text) + self.tok.encode(text)

    @staticmethod
    def _plain(value: str | list[dict[str, Any]], response: bool) -> list[tuple[str, bool]]:
        """A string or messages as plain-layout segments (a prompt's messages are all context)."""
        return [(value, response)] if isinstance(value, str) else message_segments(value, responses=response)

    def for_file(self, raw: RawData) -> Renderer:
        """This renderer, or the plain layout for a file whose texts already carry their markup (NeMo ``text``)."""
        return Renderer(self.tok, None) if raw.templated else self


def renderer_for(tok: TextTokenizer, use_chat_template: bool = True) -> Renderer:
    """The tokenizer's chat template when it has one (and it is wanted), else the plain layout."""
    return Renderer(tok, tok.chat_template if use_chat_template else None)


# ---------------------------------------------------------------------------------------------------------------
# Samples longer than seq_length
# ---------------------------------------------------------------------------------------------------------------


class Overlong:
    """Applies ``data_prep.overlong`` to one file's samples and counts what it did.

    Length checks cost O(characters): a text of more than ``seq_length x (longest token in characters)`` characters
    cannot fit, so it is refused or dropped without being tokenized, and a truncated one is tokenized from a prefix
    of ``(seq_length + 1) x that`` characters only.
    """

    def __init__(self, raw: RawData, tok: TextTokenizer, seq_length: int, policy: str):
        self.raw, self.seq_length, self.policy = raw, seq_length, policy
        self.char_budget = seq_length * tok.max_token_chars
        self.truncated: list[int] = []
        self.dropped: list[int] = []
        self._chars = 0

    def too_many_chars(self, texts: list[str]) -> int:
        """The texts' characters when they are more than any sample of seq_length tokens can hold, else 0."""
        n = sum(len(t) for t in texts)
        self._chars = n
        return n if n > self.char_budget else 0

    def clip(self, texts: list[str]) -> list[str]:
        """The texts cut to ``(seq_length + 1) x longest-token`` characters in all (enough for any cut at
        seq_length)."""
        left, out = self.char_budget + self.char_budget // self.seq_length, []
        for t in texts:
            out.append(t[: max(left, 0)])
            left -= len(t)
        return out

    def fit(self, i: int, sample: Sample | None, field: str, what: str, n: int | None = None) -> Sample | None:
        """Sample ``i`` as it enters the data (truncated when the policy says so), or None when it is dropped.

        ``sample`` None = known to be too long from its characters alone (``n`` then unknown)."""
        if sample is not None and len(sample[0]) <= self.seq_length:
            return sample
        if self.policy == "error":
            size = (f"{len(sample[0])} tokens" if sample is not None else
                    f"{self._chars} characters (more than {self.char_budget}, so more than {self.seq_length} tokens)")
            raise self.raw.error(
                i, field, f"{what} is {size}, longer than model.seq_length = {self.seq_length} "
                f"(data_prep.overlong.{self.raw.kind}: truncate or drop to keep going)"
            )
        if self.policy == "truncate" and sample is not None:
            ids, is_response = sample[0][: self.seq_length], sample[1][: self.seq_length]
            if any(is_response[1:]):  # some response token is still a label
                self.truncated.append(i)
                return ids, is_response
        self.dropped.append(i)
        return None

    def metrics(self) -> dict[str, int]:
        return {f"{self.raw.kind}_truncated": len(self.truncated), f"{self.raw.kind}_dropped": len(self.dropped)}


# ---------------------------------------------------------------------------------------------------------------
# Split
# ---------------------------------------------------------------------------------------------------------------


def key_digest(key: str, seed: int) -> bytes:
    """The 32 bytes the split sorts a prompt by (sha256 of the seed and the prompt's key text)."""
    return hashlib.sha256(f"{seed}\x00{key}".encode()).digest()


def split_digests(digests: Sequence[bytes], val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic (train, val) indices into per-sample key digests (:func:`key_digest`): the
    ``round(K * val_fraction)`` lowest of the K distinct digests go to val (see the module docstring)."""
    d = np.frombuffer(b"".join(digests), dtype=np.uint8).reshape(len(digests), 32)  # [N, 32]
    order = np.lexsort(d.T[::-1])  # byte-wise order of the digests, first byte most significant
    ranked = d[order]
    distinct = np.ones(len(d), dtype=bool)
    distinct[1:] = np.any(ranked[1:] != ranked[:-1], axis=1)
    n = int(distinct.sum())
    n_val = round(n * val_fraction)
    if val_fraction > 0 and n >= 2:
        n_val = min(max(n_val, 1), n - 1)
    group = np.cumsum(distinct) - 1  # rank of each sample's digest among the distinct ones
    in_val = np.zeros(len(d), dtype=bool)  # [N]
    in_val[order] = group < n_val
    return np.nonzero(~in_val)[0], np.nonzero(in_val)[0]


def split_indices(keys: list[str], val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Deterministic (train, val) indices into ``keys``; see the module docstring."""
    train, val = split_digests([key_digest(k, seed) for k in keys], val_fraction)
    return train.tolist(), val.tolist()


# ---------------------------------------------------------------------------------------------------------------
# Whole files
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Encoded:
    """One tokenized file before splitting: per-sample split keys, the arrays or records, the longest sample."""

    keys: list[bytes]
    """Per kept sample, its prompt's :func:`key_digest` (the train/val split's key)."""
    arrays: dict[str, Any] | None = None
    """The ragged groups (long arrays spilled to disk, :class:`.store.DiskArray`) and per-sample arrays."""
    records: SpilledRecords | None = None
    max_tokens: int = 0
    attributes: list[str] | None = None
    """Regression data: the label names, in the column order of ``reward_labels``."""
    overlong: dict[str, int] = field(default_factory=dict)
    """``<kind>_truncated`` / ``<kind>_dropped``: samples longer than seq_length that were cut / left out."""


def _sft_texts(record: dict[str, Any]) -> list[str]:
    if "messages" in record:
        return texts_of(record["messages"])
    if "conversations" not in record:
        return [record["input"], record["output"]]
    return [record.get("system") or ""] + [t.get("label") or "" for t in record["conversations"]] + [
        t["value"] for t in record["conversations"]]


def _clip_sft(record: dict[str, Any], over: Overlong) -> dict[str, Any]:
    """The record with its texts cut (in reading order) to the characters a truncation at seq_length can use."""
    if "messages" in record:
        return {**record, "messages": with_texts(record["messages"], over.clip(texts_of(record["messages"])))}
    if "conversations" not in record:
        inp, out = over.clip([record["input"], record["output"]])
        return {**record, "input": inp, "output": out}
    system, *values = over.clip([record.get("system") or ""] + [t["value"] for t in record["conversations"]])
    turns = [{**t, "value": v} for t, v in zip(record["conversations"], values)]
    return {**record, "system": system, "conversations": turns}


def encode_sft(raw: RawData, render: Renderer, seq_length: int, over: Overlong, seed: int) -> Encoded:
    samples, kept, keys = RaggedBuilder(), array("q"), []
    for i, rec in enumerate(raw.records):
        chat = "conversations" in rec or "messages" in rec
        field_name, what = ("messages" if "messages" in rec else "conversations", "the conversation") if chat else (
            "output", "input + output")
        key = sft_prompt_text(rec)
        if over.too_many_chars(_sft_texts(rec)):
            if over.policy != "truncate":
                over.fit(i, None, field_name, what)
                continue
            rec = _clip_sft(rec, over)
        sample = over.fit(i, _render(raw, i, field_name, lambda r=rec: render.sft(r)), field_name,
                          f"{what} with its special tokens")
        if sample is not None:
            samples.append(sample)
            kept.append(i)
            keys.append(key_digest(key, seed))
    return _arrays_encoded(raw, kept, keys, samples, seq_length, render.tok, over)


def _render(raw: RawData, i: int, field_name: str, fn):
    try:
        return fn()
    except ChatTemplateError as exc:
        raise raw.error(i, field_name, str(exc)) from None


def _prompt_response_sample(raw: RawData, i: int, render: Renderer, over: Overlong, prompt: Any, response: Any,
                            field_name: str) -> Sample | None:
    """The sample of a prompt and response (strings or chat messages), fitted to seq_length per ``over``."""
    what = f"prompt + {field_name} with special tokens"
    texts = texts_of(prompt) + texts_of(response)
    if over.too_many_chars(texts):
        if over.policy != "truncate":
            return over.fit(i, None, field_name, what)
        texts = over.clip(texts)
        n = len(texts_of(prompt))
        prompt, response = with_texts(prompt, texts[:n]), with_texts(response, texts[n:])
    return over.fit(i, _render(raw, i, field_name, lambda: render.prompt_response(prompt, response)), field_name, what)


def encode_preference(raw: RawData, render: Renderer, seq_length: int, over: Overlong, seed: int) -> Encoded:
    sides = {"chosen": RaggedBuilder(), "rejected": RaggedBuilder()}
    rewards: dict[str, array] = {side: array("f") for side in sides}
    kept, keys = array("q"), []
    for i, rec in enumerate(raw.records):
        pair = {}
        for side in sides:
            pair[side] = _prompt_response_sample(raw, i, render, over, rec["prompt"], rec[f"{side}_response"],
                                                 f"{side}_response")
            if pair[side] is None:
                break
        if any(v is None for v in pair.values()) or len(pair) < 2:
            continue
        for side, sample in pair.items():
            sides[side].append(sample)
            rewards[side].append(float(rec.get(f"{side}_reward", np.nan)))
        kept.append(i)
        keys.append(key_digest(key_text(rec["prompt"]), seed))
    # A pair counts once: truncated when either side was, dropped when either side was.
    over.dropped = sorted(set(over.dropped))
    over.truncated = sorted(set(over.truncated) - set(over.dropped))
    arrays: dict[str, Any] = {}
    for side, samples in sides.items():
        arrays.update(samples.arrays(prefix=f"{side}_"))
        arrays[f"{side}_reward"] = np.frombuffer(rewards[side], dtype=np.float32)  # [N]
    _require_some(raw, kept, over)
    return Encoded(keys=keys, arrays=arrays, max_tokens=max(samples.longest for samples in sides.values()),
                   overlong=over.metrics())


def encode_prompts(raw: RawData, render: Renderer, seq_length: int, over: Overlong, seed: int) -> Encoded:
    """Prompt records: every raw field, ``answer`` (None when absent) and ``prompt_ids`` (rendered with the chat
    template's generation prompt when there is one). A prompt must leave room for one generated token and, with a
    string ``answer``, for the answer and EOS (a prompt is never truncated: ``overlong.prompts`` is error or drop)."""
    records, kept, keys, longest = SpilledRecords(), array("q"), [], 0
    for i, rec in enumerate(raw.records):
        if over.too_many_chars(texts_of(rec["prompt"])):
            over.fit(i, None, "prompt", "the prompt")
            continue
        prompt_ids = _render(raw, i, "prompt", lambda r=rec: render.prompt(r["prompt"]))
        answer = rec.get("answer")
        n, field_name, what = len(prompt_ids) + 1, "prompt", "the prompt + 1 generated token"
        if isinstance(answer, str):
            n, field_name, what = len(prompt_ids) + len(render.tok.encode(answer)) + 1, "answer", "prompt + answer + EOS"
        if over.fit(i, ([0] * n, [True] * n), field_name, what) is None:
            continue
        longest = max(longest, n)
        records.append({**rec, "answer": answer, "prompt_ids": prompt_ids})
        kept.append(i)
        keys.append(key_digest(key_text(rec["prompt"]), seed))
    _require_some(raw, kept, over)
    return Encoded(keys=keys, records=records, max_tokens=longest, overlong=over.metrics())


def encode_regression(raw: RawData, render: Renderer, seq_length: int, over: Overlong, seed: int) -> Encoded:
    """SteerLM-style records -> SFT-like arrays (loss_mask marks the response) + ``reward_labels`` [N, A] float32
    (NaN = missing label), attributes in sorted order (``Encoded.attributes``, copied into the sidecar meta)."""
    samples, kept, keys, labels, names = RaggedBuilder(), array("q"), [], [], set()
    for i, rec in enumerate(raw.records):
        names.update(rec["labels"])
        sample = _prompt_response_sample(raw, i, render, over, rec["prompt"], rec["response"], "response")
        if sample is not None:
            samples.append(sample)
            kept.append(i)
            keys.append(key_digest(rec["prompt"], seed))
            labels.append(rec["labels"])
    attributes = sorted(names)
    table = np.array(
        [[np.nan if row.get(k) is None else float(row[k]) for k in attributes] for row in labels], dtype=np.float32,
    ).reshape(len(labels), len(attributes))  # [N, A]
    enc = _arrays_encoded(raw, kept, keys, samples, seq_length, render.tok, over)
    assert enc.arrays is not None
    enc.arrays["reward_labels"] = table
    enc.attributes = attributes
    return enc


def _require_some(raw: RawData, kept: Sequence[int], over: Overlong) -> None:
    if not kept:
        raise raw.error(0, None, f"every sample is longer than model.seq_length = {over.seq_length} "
                                 f"(data_prep.overlong.{raw.kind} = {over.policy}): nothing is left")


def _arrays_encoded(raw: RawData, kept: Sequence[int], keys: list[bytes], samples: RaggedBuilder, seq_length: int,
                    tok: TextTokenizer, over: Overlong) -> Encoded:
    _require_some(raw, kept, over)
    return Encoded(keys=keys, arrays=samples.arrays(), max_tokens=samples.longest, overlong=over.metrics())


ENCODERS = {
    "sft": encode_sft,
    "preference": encode_preference,
    "prompts": encode_prompts,
    "regression": encode_regression,
}


def encode(raw: RawData, tok: TextTokenizer, seq_length: int, config: DataPrepConfig | None = None) -> Encoded:
    """Tokenize a validated file (chat template per ``config.tokenizer.use_chat_template``); a sample that does not
    fit ``seq_length`` is refused (``DataValidationError``), truncated or dropped per ``config.overlong``."""
    config = config or DataPrepConfig()
    render = renderer_for(tok, config.tokenizer.use_chat_template).for_file(raw)
    over = Overlong(raw, tok, seq_length, getattr(config.overlong, raw.kind))
    return ENCODERS[raw.kind](raw, render, seq_length, over, config.seed)


def split_encoded(
    enc: Encoded, raw: RawData, tok: TextTokenizer, config: DataPrepConfig, seq_length: int
) -> dict[str, ArrayBundle | RecordBundle]:
    """``{"train": bundle, "val": bundle}`` with the sidecar metadata of each artifact."""
    val_fraction = config.val_fraction_for(raw.kind)
    train, val = split_digests(enc.keys, val_fraction)
    out: dict[str, ArrayBundle | RecordBundle] = {}
    for split, idx in zip(SPLITS, (train, val)):
        meta = {
            "kind": raw.kind,
            "split": split,
            "num_samples": len(idx),
            "seq_length": seq_length,
            "max_tokens": enc.max_tokens,
            "tokenizer_fingerprint": tok.fingerprint,
            "pad_id": tok.pad_id,
            "source": raw.source,
            "source_sha256": raw.sha256,
            "val_fraction": val_fraction,
            "split_seed": config.seed,
        }
        if enc.attributes is not None:
            meta["attributes"] = enc.attributes
        if enc.arrays is not None:
            out[split] = ArrayBundle(arrays=select(enc.arrays, idx), meta=meta)  # spilled tokens: selected lazily
        else:
            assert enc.records is not None
            out[split] = RecordBundle(records=enc.records.take(idx), meta=meta)
    return out


__all__ = [
    "DataPrepConfig",
    "Encoded",
    "encode",
    "key_digest",
    "split_digests",
    "split_encoded",
    "split_indices",
]
