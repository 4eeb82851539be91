"""Nodes of ``data_prep``: thin, typed functions over :mod:`align_pipeline.data`.

Nothing is persisted until every check has passed: the first two nodes return in-memory values (MemoryDatasets);
only :func:`tokenize_and_split` – which runs the sequence-length checks last – returns the persisted outputs, and
Kedro saves a node's outputs only after the node has returned. Those outputs (catalog ``commit_group: data_prep``)
land together or not at all (:mod:`align_pipeline.data_prep_hook`).
"""

from __future__ import annotations

from typing import Any

from align_pipeline.config import ModelConfig, from_dict
from align_pipeline.data.dubious import find_dubious, handle_dubious
from align_pipeline.data.formats import ArrayBundle, Artifact, RecordBundle
from align_pipeline.data.schemas import RawData, read_raw_jsonl, record_texts
from align_pipeline.data.tokenize import DataPrepConfig, encode, split_encoded
from align_pipeline.data.tokenizer import TextTokenizer, build_tokenizer


def validate_raw_data(
    raw_sft: Artifact, raw_preference: Artifact, raw_prompts: Artifact, params: dict[str, Any]
) -> tuple[dict[str, RawData], dict[str, int]]:
    """Schema-check the three raw files (``DataValidationError`` naming file, line and field), then find dubious
    records and warn about / refuse them per ``data_prep.dubious``. Returns the data and the dubious counts."""
    config = from_dict(DataPrepConfig, params, "data_prep")  # fail on bad parameters before reading data
    artifacts = {"sft": raw_sft, "preference": raw_preference, "prompts": raw_prompts}
    raw = {kind: read_raw_jsonl(a.path, kind, source=a.meta.get("source")) for kind, a in artifacts.items()}
    dubious = [find_dubious(data) for data in raw.values()]
    handle_dubious(dubious, config.dubious)
    return raw, {key: n for d in dubious for key, n in d.metrics().items()}


def fit_tokenizer(raw: dict[str, RawData], params: dict[str, Any]) -> TextTokenizer:
    """Train the tokenizer on every raw text, or load ``tokenizer.hf_model_dir``'s."""
    config = from_dict(DataPrepConfig, params, "data_prep")
    texts = [t for data in raw.values() for rec in data.records for t in record_texts(rec)]
    return build_tokenizer(config.tokenizer, texts)


def tokenize_and_split(
    raw: dict[str, RawData],
    tokenizer: TextTokenizer,
    dubious: dict[str, int],
    params: dict[str, Any],
    model: dict[str, Any],
) -> tuple[
    TextTokenizer,
    ArrayBundle,
    ArrayBundle,
    ArrayBundle,
    ArrayBundle,
    RecordBundle,
    RecordBundle,
    dict[str, Any],
]:
    """Check lengths against ``model.seq_length``, tokenize, mask, pad and split every file.

    Returns the tokenizer (persisted here, after all checks), sft/pref/prompts train and val bundles, and metrics
    (sample counts, longest sample, source hashes, the dubious counts of :func:`validate_raw_data`).
    """
    config = from_dict(DataPrepConfig, params, "data_prep")
    seq_length = from_dict(ModelConfig, model, "model").seq_length
    encoded = {kind: encode(data, tokenizer, seq_length) for kind, data in raw.items()}  # all checks first
    splits = {kind: split_encoded(enc, raw[kind], tokenizer, config, seq_length) for kind, enc in encoded.items()}

    metrics: dict[str, Any] = {
        "tokenizer_vocab_size": tokenizer.vocab_size,
        "tokenizer_fingerprint": tokenizer.fingerprint,
        "seq_length": seq_length,
        **dubious,
    }
    for kind, parts in splits.items():
        metrics[f"{kind}_max_tokens"] = encoded[kind].max_tokens
        metrics[f"{kind}_source_sha256"] = raw[kind].sha256
        for split, bundle in parts.items():
            metrics[f"{kind}_{split}_samples"] = bundle.meta["num_samples"]
    return (
        tokenizer,
        splits["sft"]["train"],
        splits["sft"]["val"],
        splits["preference"]["train"],
        splits["preference"]["val"],
        splits["prompts"]["train"],
        splits["prompts"]["val"],
        metrics,
    )
