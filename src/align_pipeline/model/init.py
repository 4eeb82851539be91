"""Where a stage's model starts: random init, a model checkpoint of ours, or a Hugging Face model directory."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

from align_pipeline.config.base import from_dict
from align_pipeline.config.common import ModelConfig
from align_pipeline.data.formats import lora_adapters_only
from align_pipeline.model import checkpoint


@dataclasses.dataclass
class ModelSource:
    """The architecture to build, the vocabulary size, and how to fill the built model (None = keep random init)."""

    model: ModelConfig
    vocab_size: int
    load: Callable[[Any], Any] | None
    parent: dict[str, Any]
    """Lineage of the source: {"kind": "random"|"checkpoint"|"hf", "path": ..., "meta": {...}}."""
    head: str = "lm"
    """Output head of the source weights: "lm" (vocab logits) or "value" (reward model / critic)."""
    num_outputs: int = 1
    """Outputs of a value head."""


def _base_then_adapters(base: ModelSource, path: Path, model) -> None:
    base.load(model)
    checkpoint.merge_stored_adapters(path, model)


def resolve(init_from: str | None, model: ModelConfig, tokenizer_vocab_size: int) -> ModelSource:
    """Decide the model to build from ``init_from``.

    * None: ``model`` as configured (vocab from the tokenizer unless set), random weights.
    * a checkpoint directory (has meta.json): the checkpoint's own architecture and vocab; its weights (a LoRA
      artifact of adapters alone: its base's weights with the adapters merged in).
    * an HF model directory (has config.json): architecture converted from the HF config; its weights.
    * a NeMo 1.x ``.nemo`` (:mod:`align_pipeline.model.nemo`): its HF conversion, as above.
    """
    if init_from is None:
        vocab = model.vocab_size or tokenizer_vocab_size
        return ModelSource(model, vocab, None, {"kind": "random"})
    path = Path(init_from)
    from align_pipeline.model import nemo

    if nemo.is_nemo(path):  # a NeMo 1.x .nemo: its HF conversion (made once, cached by content)
        source = resolve(str(nemo.hf_dir_for(path)), model, tokenizer_vocab_size)
        return dataclasses.replace(source, parent={"kind": "nemo", "path": str(path.resolve()),
                                                   "hf": source.parent["path"]})
    if checkpoint.is_checkpoint(path):
        meta = checkpoint.read_meta(path)
        ckpt_model = from_dict(ModelConfig, meta["model"])
        # Keep run-time choices (attention kernel) from the current config; the architecture is the checkpoint's.
        ckpt_model = dataclasses.replace(ckpt_model, attention_backend=model.attention_backend)
        load = functools.partial(checkpoint.load_model, path)
        if lora_adapters_only(meta):  # LoRA adapters alone: the base's weights, then the adapters merged in
            base = meta["lora"].get("base")
            if not base or not Path(base).exists():
                raise FileNotFoundError(f"{path} holds LoRA adapters for the base {base!r}, which is gone; keep "
                                        "the base version (or store the stage merged: <stage>.lora.store: merged)")
            load = functools.partial(_base_then_adapters, resolve(base, ckpt_model, tokenizer_vocab_size), path)
        return ModelSource(
            ckpt_model,
            int(meta["vocab_size"]),
            load,
            {"kind": "checkpoint", "path": str(path), "meta": {k: meta.get(k) for k in ("stage", "step", "lineage")}},
            head=meta.get("head", "lm"),
            num_outputs=int(meta.get("num_outputs", 1)),
        )
    if (path / "config.json").is_file():
        from align_pipeline.model import hf

        hf_model, vocab = hf.model_config_from_hf(path, base=model)
        if tokenizer_vocab_size > vocab:
            raise ValueError(f"the tokenizer has {tokenizer_vocab_size} tokens but {path} has only {vocab} embeddings")
        return ModelSource(hf_model, vocab, lambda m: hf.load_hf_weights(path, m), {"kind": "hf", "path": str(path)})
    raise FileNotFoundError(f"init_from={init_from!r} is neither a checkpoint (meta.json) nor an HF model dir")


def build_model(source: ModelSource, parallel, dist, head: str = "lm", num_outputs: int = 1, lora=None):
    """Build this rank's stage of the model described by ``source`` and fill it with the source weights.

    ``head``: the head the caller wants. An LM source can become a value model (the transformer is loaded, the new
    value head starts at random: reward model from SFT, critic from the reward model's value head keeps its head).
    A value model is built with untied embeddings whatever the source: it has no LM head to tie (and with PP > 1 a
    tied last stage would hold an embedding copy that Megatron keeps in step with the first stage's). ``lora``
    (a :class:`~align_pipeline.config.LoRAConfig` with rank > 0): with adapters (fresh unless the source is a LoRA
    training checkpoint).
    """
    from align_pipeline.model.gpt import build_gpt
    from align_pipeline.model.heads import attach_value_head

    source_head = source.head if source.load is not None else head
    if head != source_head and not (head == "value" and source_head == "lm"):
        raise ValueError(f"cannot turn a {source_head!r}-head checkpoint into a {head!r}-head model")
    model = source.model
    if head == "value":
        model = dataclasses.replace(model, share_embeddings_and_output_weights=False)
    gpt = build_gpt(model, parallel, source.vocab_size, dist.pgs,
                    pre_process=dist.is_first_stage, post_process=dist.is_last_stage, lora=lora)
    if head == "value":
        attach_value_head(gpt, source.num_outputs if source_head == "value" else num_outputs)
    if source.load is not None:
        source.load(gpt)  # an LM source fills everything but the new value head
    return gpt
