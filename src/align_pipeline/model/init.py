"""Where a stage's model starts: random init, a model checkpoint of ours, or a Hugging Face model directory."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from align_pipeline.config import ModelConfig, from_dict
from align_pipeline.model import checkpoint


@dataclasses.dataclass
class ModelSource:
    """The architecture to build, the vocabulary size, and how to fill the built model (None = keep random init)."""

    model: ModelConfig
    vocab_size: int
    load: Callable[[Any], Any] | None
    parent: dict[str, Any]
    """Lineage of the source: {"kind": "random"|"checkpoint"|"hf", "path": ..., "meta": {...}}."""


def resolve(init_from: str | None, model: ModelConfig, tokenizer_vocab_size: int) -> ModelSource:
    """Decide the model to build from ``init_from``.

    * None: ``model`` as configured (vocab from the tokenizer unless set), random weights.
    * a checkpoint directory (has meta.json): the checkpoint's own architecture and vocab; its weights.
    * an HF model directory (has config.json): architecture converted from the HF config; its weights.
    """
    if init_from is None:
        vocab = model.vocab_size or tokenizer_vocab_size
        return ModelSource(model, vocab, None, {"kind": "random"})
    path = Path(init_from)
    if checkpoint.is_checkpoint(path):
        meta = checkpoint.read_meta(path)
        ckpt_model = from_dict(ModelConfig, meta["model"])
        # Keep run-time choices (attention kernel) from the current config; the architecture is the checkpoint's.
        ckpt_model = dataclasses.replace(ckpt_model, attention_backend=model.attention_backend)
        return ModelSource(
            ckpt_model,
            int(meta["vocab_size"]),
            lambda m: checkpoint.load_model(path, m),
            {"kind": "checkpoint", "path": str(path), "meta": {k: meta.get(k) for k in ("stage", "step", "lineage")}},
        )
    if (path / "config.json").is_file():
        from align_pipeline.model import hf

        hf_model, vocab = hf.model_config_from_hf(path, base=model)
        return ModelSource(hf_model, vocab, lambda m: hf.load_hf_weights(path, m), {"kind": "hf", "path": str(path)})
    raise FileNotFoundError(f"init_from={init_from!r} is neither a checkpoint (meta.json) nor an HF model dir")
