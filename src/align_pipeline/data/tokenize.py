"""Tokenize, mask, pad and split validated raw data into the arrays the trainers read.

Sequence conventions (S = ``model.seq_length``; a sample = ``<bos>`` + prompt + response + ``<eos>``, right-padded
with ``pad_id``; a sample longer than S tokens is rejected, never truncated):

* ``input_ids``  int64   [N, S]  the sample's tokens, then ``pad_id``.
* ``labels``     int64   [N, S]  ``labels[:, t] = input_ids[:, t + 1]`` (already shifted); ``pad_id`` past the end.
* ``loss_mask``  float32 [N, S]  1 exactly where ``labels[:, t]`` is a response token or the ``<eos>`` ending a
  response; 0 on prompt tokens and padding. Chat: 1 on Assistant turns (each followed by ``<eos>``).

Artifacts (see :mod:`.formats` for the sidecar):

* SFT ``.npz``: ``input_ids``, ``labels``, ``loss_mask``.
* Preference ``.npz``: ``chosen_input_ids``, ``chosen_labels``, ``chosen_loss_mask``, ``rejected_input_ids``,
  ``rejected_labels``, ``rejected_loss_mask`` (as above), ``chosen_reward``, ``rejected_reward`` float32 [N]
  (NaN where the raw line has none).
* Prompts ``.jsonl``: ``{"answer": str | null, "prompt": str, "prompt_ids": [int]}``; ``prompt_ids`` = ``<bos>`` +
  prompt tokens, unpadded. A prompt must leave room for at least one generated token, and, when it has an answer,
  ``<bos>`` + prompt + answer + ``<eos>`` must fit in S.

Train/val split: the distinct prompt texts are hashed with the seed and the ``round(K * val_fraction)`` lowest of the
K hashes go to val (at least one each side when K >= 2 and val_fraction > 0), with every sample of those prompts; both
splits keep file order. The result depends only on the data and the seed, not on file order, and no prompt is in
both splits.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from align_pipeline.config.base import ConfigError

from .formats import ArrayBundle, RecordBundle
from .schemas import RawData, sft_prompt_text, sft_segments
from .tokenizer import TextTokenizer, TokenizerConfig

SPLITS = ("train", "val")


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


def encode_segments(tok: TextTokenizer, segments: list[tuple[str, bool]]) -> tuple[list[int], list[bool]]:
    """``<bos>`` + each segment's tokens (+ ``<eos>`` after each response segment); per token: is it response."""
    ids, is_response = [tok.bos_id], [False]
    for text, response in segments:
        t = tok.encode(text)
        ids += t
        is_response += [response] * len(t)
        if response:
            ids.append(tok.eos_id)
            is_response.append(True)
    return ids, is_response


def encode_prompt_response(tok: TextTokenizer, prompt: str, response: str) -> tuple[list[int], list[bool]]:
    """``<bos>`` + prompt + response + ``<eos>``, and which tokens are response (response and ``<eos>``)."""
    return encode_segments(tok, [(prompt, False), (response, True)])


def pack(samples: list[tuple[list[int], list[bool]]], seq_length: int, pad_id: int) -> dict[str, np.ndarray]:
    """Right-pad samples to ``seq_length`` and build shifted labels and the response loss mask."""
    n = len(samples)
    input_ids = np.full((n, seq_length), pad_id, dtype=np.int64)  # [N, S]
    labels = np.full((n, seq_length), pad_id, dtype=np.int64)  # [N, S]
    loss_mask = np.zeros((n, seq_length), dtype=np.float32)  # [N, S]
    for i, (ids, is_response) in enumerate(samples):
        L = len(ids)
        if L > seq_length:
            raise ValueError(f"sample {i} has {L} tokens > seq_length {seq_length}")  # checked earlier
        input_ids[i, :L] = ids
        labels[i, : L - 1] = ids[1:]
        loss_mask[i, : L - 1] = is_response[1:]
    return {"input_ids": input_ids, "labels": labels, "loss_mask": loss_mask}


def _too_long(n: int, seq_length: int, what: str) -> str:
    return f"{what} is {n} tokens, longer than model.seq_length = {seq_length}"


# ---------------------------------------------------------------------------------------------------------------
# Split
# ---------------------------------------------------------------------------------------------------------------


def split_indices(keys: list[str], val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Deterministic (train, val) indices into ``keys``; see the module docstring."""
    unique = sorted(set(keys), key=lambda k: hashlib.sha256(f"{seed}\x00{k}".encode()).digest())
    n = len(unique)
    n_val = round(n * val_fraction)
    if val_fraction > 0 and n >= 2:
        n_val = min(max(n_val, 1), n - 1)
    val_keys = set(unique[:n_val])
    val = [i for i, k in enumerate(keys) if k in val_keys]
    return [i for i, k in enumerate(keys) if k not in val_keys], val


# ---------------------------------------------------------------------------------------------------------------
# Whole files
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Encoded:
    """One tokenized file before splitting: per-sample split keys, the arrays or records, the longest sample."""

    keys: list[str]
    arrays: dict[str, np.ndarray] | None = None
    records: list[dict[str, Any]] | None = None
    max_tokens: int = 0
    attributes: list[str] | None = None
    """Regression data: the label names, in the column order of ``reward_labels``."""


def encode_sft(raw: RawData, tok: TextTokenizer, seq_length: int) -> Encoded:
    samples = []
    for i, rec in enumerate(raw.records):
        ids, resp = encode_segments(tok, sft_segments(rec))
        if len(ids) > seq_length:
            chat = "conversations" in rec
            what = "the conversation with <bos>/<eos>" if chat else "<bos> + input + output + <eos>"
            raise raw.error(i, "conversations" if chat else "output", _too_long(len(ids), seq_length, what))
        samples.append((ids, resp))
    return Encoded(
        keys=[sft_prompt_text(r) for r in raw.records],
        arrays=pack(samples, seq_length, tok.pad_id),
        max_tokens=max(len(s[0]) for s in samples),
    )


def encode_preference(raw: RawData, tok: TextTokenizer, seq_length: int) -> Encoded:
    sides: dict[str, list] = {"chosen": [], "rejected": []}
    for i, rec in enumerate(raw.records):
        for side, samples in sides.items():
            ids, resp = encode_prompt_response(tok, rec["prompt"], rec[f"{side}_response"])
            if len(ids) > seq_length:
                what = f"<bos> + prompt + {side}_response + <eos>"
                raise raw.error(i, f"{side}_response", _too_long(len(ids), seq_length, what))
            samples.append((ids, resp))
    arrays: dict[str, np.ndarray] = {}
    for side, samples in sides.items():
        for k, v in pack(samples, seq_length, tok.pad_id).items():
            arrays[f"{side}_{k}"] = v
        arrays[f"{side}_reward"] = np.array(
            [float(r.get(f"{side}_reward", np.nan)) for r in raw.records], dtype=np.float32
        )  # [N]
    return Encoded(
        keys=[r["prompt"] for r in raw.records],
        arrays=arrays,
        max_tokens=max(len(s[0]) for samples in sides.values() for s in samples),
    )


def encode_prompts(raw: RawData, tok: TextTokenizer, seq_length: int) -> Encoded:
    records, longest = [], 0
    for i, rec in enumerate(raw.records):
        prompt_ids = [tok.bos_id] + tok.encode(rec["prompt"])
        if len(prompt_ids) + 1 > seq_length:
            what = "<bos> + prompt + 1 generated token"
            raise raw.error(i, "prompt", _too_long(len(prompt_ids) + 1, seq_length, what))
        answer = rec.get("answer")
        n = len(prompt_ids) + 1
        if answer is not None:
            n = len(prompt_ids) + len(tok.encode(answer)) + 1
            if n > seq_length:
                raise raw.error(i, "answer", _too_long(n, seq_length, "<bos> + prompt + answer + <eos>"))
        longest = max(longest, n)
        records.append({"prompt": rec["prompt"], "answer": answer, "prompt_ids": prompt_ids})
    return Encoded(keys=[r["prompt"] for r in raw.records], records=records, max_tokens=longest)


def encode_regression(raw: RawData, tok: TextTokenizer, seq_length: int) -> Encoded:
    """SteerLM-style records -> SFT-like arrays (loss_mask marks the response) + ``reward_labels`` [N, A] float32
    (NaN = missing label), attributes in sorted order (``Encoded.attributes``, copied into the sidecar meta)."""
    samples = []
    for i, rec in enumerate(raw.records):
        ids, resp = encode_prompt_response(tok, rec["prompt"], rec["response"])
        if len(ids) > seq_length:
            raise raw.error(i, "response", _too_long(len(ids), seq_length, "<bos> + prompt + response + <eos>"))
        samples.append((ids, resp))
    names = sorted({k for r in raw.records for k in r["labels"]})
    labels = np.array(
        [[np.nan if r["labels"].get(k) is None else float(r["labels"][k]) for k in names] for r in raw.records],
        dtype=np.float32,
    )  # [N, A]
    arrays = {**pack(samples, seq_length, tok.pad_id), "reward_labels": labels}
    return Encoded(
        keys=[r["prompt"] for r in raw.records],
        arrays=arrays,
        max_tokens=max(len(s[0]) for s in samples),
        attributes=names,
    )


ENCODERS = {
    "sft": encode_sft,
    "preference": encode_preference,
    "prompts": encode_prompts,
    "regression": encode_regression,
}


def encode(raw: RawData, tok: TextTokenizer, seq_length: int) -> Encoded:
    """Tokenize a validated file; a sample that does not fit ``seq_length`` raises ``DataValidationError``."""
    return ENCODERS[raw.kind](raw, tok, seq_length)


def split_encoded(
    enc: Encoded, raw: RawData, tok: TextTokenizer, config: DataPrepConfig, seq_length: int
) -> dict[str, ArrayBundle | RecordBundle]:
    """``{"train": bundle, "val": bundle}`` with the sidecar metadata of each artifact."""
    val_fraction = config.val_fraction_for(raw.kind)
    train, val = split_indices(enc.keys, val_fraction, config.seed)
    out: dict[str, ArrayBundle | RecordBundle] = {}
    for split, idx in zip(SPLITS, (train, val)):
        meta = {
            "kind": raw.kind,
            "split": split,
            "num_samples": len(idx),
            "seq_length": seq_length,
            "max_tokens": enc.max_tokens,
            "tokenizer_fingerprint": tok.fingerprint,
            "source": raw.source,
            "source_sha256": raw.sha256,
            "val_fraction": val_fraction,
            "split_seed": config.seed,
        }
        if enc.attributes is not None:
            meta["attributes"] = enc.attributes
        if enc.arrays is not None:
            ix = np.asarray(idx, dtype=np.int64)
            out[split] = ArrayBundle(arrays={k: v[ix] for k, v in enc.arrays.items()}, meta=meta)
        else:
            assert enc.records is not None
            out[split] = RecordBundle(records=[enc.records[i] for i in idx], meta=meta)
    return out


__all__ = [
    "DataPrepConfig",
    "Encoded",
    "encode",
    "encode_prompt_response",
    "encode_segments",
    "pack",
    "split_encoded",
    "split_indices",
]
