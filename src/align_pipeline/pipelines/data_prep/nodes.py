"""Nodes of ``data_prep``: thin, typed functions over :mod:`align_pipeline.data`.

Nothing is persisted until every check has passed: the first two nodes return in-memory values (MemoryDatasets);
only :func:`tokenize_and_split` – which runs the sequence-length checks last – returns the persisted outputs, and
Kedro saves a node's outputs only after the node has returned. Those outputs (catalog ``commit_group: data_prep``)
land together or not at all (:mod:`align_pipeline.kedro.staged_outputs`).
"""

from __future__ import annotations

import logging
from typing import Any

from align_pipeline.config.base import from_dict
from align_pipeline.config.common import ModelConfig
from align_pipeline.data.dubious import find_dubious, handle_dubious
from align_pipeline.data.formats import ArrayBundle, Artifact, RecordBundle
from align_pipeline.data.schemas import RawData, record_texts
from align_pipeline.data.sources import read_raw
from align_pipeline.data.tokenize import DataPrepConfig, encode, split_encoded
from align_pipeline.data.tokenizer import TextTokenizer, build_tokenizer, load_tokenizer
from align_pipeline.rewards.check import check_prompts


def validate_raw_data(
    raw_sft: Any, raw_preference: Any, raw_prompts: Any, params: dict[str, Any],
    ppo: dict[str, Any], reinforce: dict[str, Any], evaluation: dict[str, Any],
) -> tuple[dict[str, RawData], dict[str, int]]:
    """Schema-check the three raw inputs (``DataValidationError`` naming file, line or row, and field), each a raw
    file or directory (:class:`~align_pipeline.datasets.RawDataset`) or a table from the catalog, in the layout
    ``data_prep.layouts`` names or its first record's (:mod:`align_pipeline.data.layouts`); check that every prompt
    has the fields the configured reward functions of ppo / reinforce / evaluation need (so a missing answer fails
    here, not mid-rollout), then find dubious records and warn about / refuse them per ``data_prep.dubious``.
    Returns the data and the dubious counts."""
    config = from_dict(DataPrepConfig, params, "data_prep")  # fail on bad parameters before reading data
    inputs = {"sft": raw_sft, "preference": raw_preference, "prompts": raw_prompts}
    raw = {kind: read_raw(data, kind, getattr(config.layouts, kind), name=f"raw_{kind}")
           for kind, data in inputs.items() if data is not None}
    prompts = raw["prompts"]
    check_prompts(prompts.records, prompts.lines, prompts.source,
                  {"ppo": ppo, "reinforce": reinforce, "evaluation": evaluation}, unit=prompts.unit)
    dubious = [find_dubious(data) for data in raw.values()]
    handle_dubious(dubious, config.dubious)
    return raw, {key: n for d in dubious for key, n in d.metrics().items()}


def validate_raw_prompts(raw_prompts: Any, params: dict[str, Any], ppo: dict[str, Any],
                         reinforce: dict[str, Any], evaluation: dict[str, Any]
                         ) -> tuple[dict[str, RawData], dict[str, int]]:
    """:func:`validate_raw_data` of the prompts alone (``data_prep_prompts``: RL from a model, no SFT or preference
    data)."""
    return validate_raw_data(None, None, raw_prompts, params, ppo, reinforce, evaluation)


def fit_tokenizer(raw: dict[str, RawData], params: dict[str, Any]) -> TextTokenizer:
    """Train the tokenizer on every raw text, or load ``tokenizer.hf_model_dir``'s (a NeMo ``.nemo``: its HF
    conversion's)."""
    import dataclasses

    from align_pipeline.launch.model_jobs import nemo_hf_dir
    from align_pipeline.model.nemo import is_nemo

    config = from_dict(DataPrepConfig, params, "data_prep")
    if config.tokenizer.hf_model_dir and is_nemo(config.tokenizer.hf_model_dir):
        config.tokenizer = dataclasses.replace(config.tokenizer,
                                               hf_model_dir=str(nemo_hf_dir(config.tokenizer.hf_model_dir)))
    texts = (t for data in raw.values() for rec in data.records for t in record_texts(rec))  # one pass, streamed
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
    splits, metrics = _tokenize(raw, tokenizer, dubious, params, model)
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


def tokenize_prompts(raw: dict[str, RawData], tokenizer: TextTokenizer, dubious: dict[str, int],
                     params: dict[str, Any], model: dict[str, Any]
                     ) -> tuple[TextTokenizer, RecordBundle, RecordBundle, dict[str, Any]]:
    """:func:`tokenize_and_split` of the prompts alone: (tokenizer, prompts_train, prompts_val, metrics)."""
    splits, metrics = _tokenize(raw, tokenizer, dubious, params, model)
    return tokenizer, splits["prompts"]["train"], splits["prompts"]["val"], metrics


def _tokenize(raw: dict[str, RawData], tokenizer: TextTokenizer, dubious: dict[str, int], params: dict[str, Any],
              model: dict[str, Any]) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """Every kind of ``raw`` checked, tokenized and split -> ({kind: {"train", "val"}}, metrics)."""
    config = from_dict(DataPrepConfig, params, "data_prep")
    seq_length = from_dict(ModelConfig, model, "model").seq_length
    encoded = {kind: encode(data, tokenizer, seq_length, config) for kind, data in raw.items()}  # all checks first
    splits = {kind: split_encoded(enc, raw[kind], tokenizer, config, seq_length) for kind, enc in encoded.items()}
    for kind, enc in encoded.items():
        _warn_overlong(raw[kind], enc.overlong, config, seq_length)

    metrics: dict[str, Any] = {
        "tokenizer_vocab_size": tokenizer.vocab_size,
        "tokenizer_fingerprint": tokenizer.fingerprint,
        "chat_template": int(tokenizer.chat_template is not None and config.tokenizer.use_chat_template),
        "seq_length": seq_length,
        **dubious,
    }
    for kind, parts in splits.items():
        metrics.update(encoded[kind].overlong)
        metrics[f"{kind}_max_tokens"] = encoded[kind].max_tokens
        metrics[f"{kind}_source_sha256"] = raw[kind].sha256
        for split, bundle in parts.items():
            metrics[f"{kind}_{split}_samples"] = bundle.meta["num_samples"]
    return splits, metrics


def _warn_overlong(raw: RawData, counts: dict[str, int], config: DataPrepConfig, seq_length: int) -> None:
    truncated, dropped = counts.get(f"{raw.kind}_truncated", 0), counts.get(f"{raw.kind}_dropped", 0)
    if truncated or dropped:
        logging.getLogger(__name__).warning(
            "%s: %d of %d samples longer than model.seq_length = %d: %d truncated, %d dropped "
            "(data_prep.overlong.%s = %s)", raw.source, truncated + dropped, len(raw), seq_length, truncated,
            dropped, raw.kind, getattr(config.overlong, raw.kind))


def tokenize_regression(
    raw_regression: Any, tokenizer: Artifact, params: dict[str, Any], model: dict[str, Any]
) -> tuple[ArrayBundle, ArrayBundle, dict[str, Any]]:
    """SteerLM-style attribute data (``{"prompt", "response", "labels": {attribute: number | null}}``) tokenized with
    data_prep's tokenizer (the one the policy and its reward model use) and split like the other kinds: the
    ``reg_train`` / ``reg_val`` arrays of the regression reward model (``reward_labels`` [N, A], attribute names in
    the sidecar). Same checks as data_prep: schema, dubious records, lengths (``data_prep.overlong.regression``)."""
    config = from_dict(DataPrepConfig, params, "data_prep")
    seq_length = from_dict(ModelConfig, model, "model").seq_length
    raw = read_raw(raw_regression, "regression", config.layouts.regression, name="raw_regression")
    dubious = find_dubious(raw)
    handle_dubious([dubious], config.dubious)
    tok = load_tokenizer(tokenizer.path)
    encoded = encode(raw, tok, seq_length, config)
    _warn_overlong(raw, encoded.overlong, config, seq_length)
    parts = split_encoded(encoded, raw, tok, config, seq_length)
    metrics: dict[str, Any] = {
        **dubious.metrics(), **encoded.overlong, "regression_max_tokens": encoded.max_tokens,
        "regression_attributes": len(encoded.attributes or []), "regression_source_sha256": raw.sha256,
        **{f"regression_{split}_samples": b.meta["num_samples"] for split, b in parts.items()},
    }
    return parts["train"], parts["val"], metrics
