"""Our model checkpoints -> Hugging Face model directories (``transformers`` ``*ForCausalLM``), in one plain process.

:func:`export_hf` reads a model checkpoint written by :func:`align_pipeline.model.checkpoint.save_model` (any TP/PP
layout: the torch_dist files hold each tensor whole, layers stacked on a leading axis) with
``torch.distributed.checkpoint`` — no Megatron model, no process group — and writes ``config.json``,
``generation_config.json``, safetensors shards (+ ``model.safetensors.index.json`` when there are several), the
tokenizer files and ``align_pipeline_meta.json`` (the checkpoint's meta.json: lineage, stage, metrics).

The name mapping is the inverse of :mod:`align_pipeline.model.hf` (fused QKV rows grouped by key/value head: for each
group its query heads, then its key head, then its value head; ``linear_fc1`` = ``[gate; up]``). Tensors are read one
parameter kind at a time (all layers of it), so peak host memory is about the largest kind (the MLP's fc1: ~1/3 of
the model) plus one output shard, not the whole model.

Family: Qwen2 when the model has QKV-only biases, else Llama (biases on every linear layer = Llama's
``attention_bias`` + ``mlp_bias``). Only plain RoPE models exist here, so no ``rope_scaling`` is written. The
vocabulary is the checkpoint's real one (``meta.json`` ``vocab_size``): Megatron's padding rows are dropped, so the
HF logits equal the Megatron logits over the real tokens.

Reward models and critics (value heads) are refused: their HF form (``*ForSequenceClassification``) is not written yet.

:func:`check_parity` runs the checkpoint in Megatron (a one-rank torchrun job of :mod:`align_pipeline.model.logits_job`)
and the export in ``transformers`` on the same fixed tokens and returns ``max |Δlogit|``.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from align_pipeline.config import ModelConfig, from_dict
from align_pipeline.data.formats import checkpoint_meta

DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3


class HFExportError(ValueError):
    """The checkpoint cannot be written as an HF model directory."""


def _reader(path: Path):
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(str(path))


class CheckpointTensors:
    """The whole (TP/PP-gathered) tensors of a model checkpoint, read by name without building the model."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        metadata = _reader(self.path).read_metadata().state_dict_metadata
        self.shapes = {k: (tuple(v.size), v.properties.dtype) for k, v in metadata.items() if hasattr(v, "size")}

    def has(self, name: str) -> bool:
        return name in self.shapes

    def read(self, *names: str) -> dict[str, torch.Tensor]:
        import torch.distributed.checkpoint as dcp

        missing = [n for n in names if n not in self.shapes]
        if missing:
            raise HFExportError(f"{self.path}: the checkpoint has no tensor(s) {missing}")
        state = {n: torch.empty(self.shapes[n][0], dtype=self.shapes[n][1]) for n in names}
        dcp.load(state, storage_reader=_reader(self.path))
        return state


def family_of(model: ModelConfig) -> str:
    """``"qwen2"`` (QKV-only biases) or ``"llama"``; raises :class:`HFExportError` for an architecture neither has."""
    problems = []
    if model.position_embedding_type != "rope":
        problems.append(f"position_embedding_type={model.position_embedding_type!r} (needs rope)")
    if model.normalization != "RMSNorm":
        problems.append(f"normalization={model.normalization!r} (needs RMSNorm)")
    if model.activation != "swiglu":
        problems.append(f"activation={model.activation!r} (needs swiglu)")
    if problems:
        raise HFExportError("no HF family (llama, qwen2) has this architecture: " + "; ".join(problems))
    return "qwen2" if model.add_qkv_bias and not model.add_bias_linear else "llama"


def hf_config(model: ModelConfig, vocab_size: int, dtype: torch.dtype, tokens: dict[str, int | None]):
    """The ``transformers`` config object of the export."""
    from transformers import LlamaConfig, Qwen2Config

    family = family_of(model)
    common = dict(
        vocab_size=vocab_size,
        hidden_size=model.hidden_size,
        intermediate_size=model.ffn_hidden_size,
        num_hidden_layers=model.num_layers,
        num_attention_heads=model.num_attention_heads,
        num_key_value_heads=model.num_query_groups or model.num_attention_heads,
        max_position_embeddings=model.seq_length,
        rms_norm_eps=model.norm_epsilon,
        hidden_act="silu",
        initializer_range=model.init_method_std,
        tie_word_embeddings=model.share_embeddings_and_output_weights,
        rope_theta=model.rotary_base,
        torch_dtype=dtype,
        **tokens,
    )
    if family == "qwen2":
        return Qwen2Config(**common, use_sliding_window=False)
    return LlamaConfig(**common, attention_bias=model.add_bias_linear, mlp_bias=model.add_bias_linear)


def hf_tensors(ckpt: CheckpointTensors, model: ModelConfig, vocab_size: int) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every weight of the export, one parameter kind at a time."""
    layers, hidden = model.num_layers, model.hidden_size
    heads = model.num_attention_heads
    groups = model.num_query_groups or heads
    head_dim = hidden // heads

    def one(name: str) -> torch.Tensor:
        return ckpt.read(name)[name]

    def first(*names: str) -> torch.Tensor:
        for name in names:
            if ckpt.has(name):
                return one(name)
        raise HFExportError(f"{ckpt.path}: none of {list(names)} is in the checkpoint")

    def weight_and_bias(module: str) -> list[str]:
        return [f"{module}.weight"] + ([f"{module}.bias"] if ckpt.has(f"{module}.bias") else [])

    def per_layer(hf_name: str, stacked: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        if stacked.shape[0] != layers:
            raise HFExportError(f"{ckpt.path}: {hf_name} holds {stacked.shape[0]} layers, expected {layers}")
        for i in range(layers):
            yield f"model.layers.{i}.{hf_name}", stacked[i].contiguous()

    yield "model.embed_tokens.weight", one("embedding.word_embeddings.weight")[:vocab_size].contiguous()
    yield from per_layer("input_layernorm.weight", first("decoder.layers.self_attention.linear_qkv.layer_norm_weight",
                                                         "decoder.layers.input_layernorm.weight"))
    for name in weight_and_bias("decoder.layers.self_attention.linear_qkv"):
        suffix = name.rsplit(".", 1)[1]
        fused = one(name)  # [L, groups * (heads/groups + 2) * head_dim, (hidden)]
        rest = fused.shape[2:]
        per_group = fused.reshape(layers, groups, (heads // groups + 2) * head_dim, *rest)
        q, k, v = per_group.split([heads // groups * head_dim, head_dim, head_dim], dim=2)
        yield from per_layer(f"self_attn.q_proj.{suffix}", q.reshape(layers, heads * head_dim, *rest))
        yield from per_layer(f"self_attn.k_proj.{suffix}", k.reshape(layers, groups * head_dim, *rest))
        yield from per_layer(f"self_attn.v_proj.{suffix}", v.reshape(layers, groups * head_dim, *rest))
    yield from per_layer("self_attn.o_proj.weight", one("decoder.layers.self_attention.linear_proj.weight"))
    if ckpt.has("decoder.layers.self_attention.linear_proj.bias"):
        yield from per_layer("self_attn.o_proj.bias", one("decoder.layers.self_attention.linear_proj.bias"))
    yield from per_layer("post_attention_layernorm.weight", first("decoder.layers.mlp.linear_fc1.layer_norm_weight",
                                                                  "decoder.layers.pre_mlp_layernorm.weight"))
    for name in weight_and_bias("decoder.layers.mlp.linear_fc1"):
        suffix = name.rsplit(".", 1)[1]
        gate, up = one(name).chunk(2, dim=1)  # [L, 2 * ffn, (hidden)] = [gate; up]
        yield from per_layer(f"mlp.gate_proj.{suffix}", gate)
        yield from per_layer(f"mlp.up_proj.{suffix}", up)
    yield from per_layer("mlp.down_proj.weight", one("decoder.layers.mlp.linear_fc2.weight"))
    if ckpt.has("decoder.layers.mlp.linear_fc2.bias"):
        yield from per_layer("mlp.down_proj.bias", one("decoder.layers.mlp.linear_fc2.bias"))
    yield "model.norm.weight", one("decoder.final_layernorm.weight")
    if not model.share_embeddings_and_output_weights:
        yield "lm_head.weight", one("output_layer.weight")[:vocab_size].contiguous()


def _write_shards(tensors: Iterator[tuple[str, torch.Tensor]], out: Path, dtype: torch.dtype,
                  max_shard_bytes: int) -> dict[str, Any]:
    """Write safetensors shards as tensors arrive; returns {"files": n, "bytes": total, "params": total}."""
    from safetensors.torch import save_file

    written: list[tuple[str, list[str]]] = []
    shard: dict[str, torch.Tensor] = {}
    size = total = params = 0

    def flush() -> None:
        nonlocal shard, size
        if shard:
            name = f"model-{len(written) + 1:05d}.safetensors"
            save_file(shard, str(out / name), metadata={"format": "pt"})
            written.append((name, list(shard)))
            shard, size = {}, 0

    for name, tensor in tensors:
        tensor = tensor.to(dtype).contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        if shard and size + nbytes > max_shard_bytes:
            flush()
        shard[name] = tensor
        size, total, params = size + nbytes, total + nbytes, params + tensor.numel()
    flush()
    if len(written) == 1:
        (out / written[0][0]).rename(out / "model.safetensors")
    else:
        weight_map = {}
        for i, (name, keys) in enumerate(written):
            final = f"model-{i + 1:05d}-of-{len(written):05d}.safetensors"
            (out / name).rename(out / final)
            weight_map.update(dict.fromkeys(keys, final))
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))
    return {"files": len(written), "bytes": total, "params": params}


def _tokenizer_files(tokenizer_dir: Path, out: Path) -> dict[str, int | None]:
    """Write the tokenizer as HF files (``tokenizer.json``, ``tokenizer_config.json``, its chat template if any);
    returns its special token ids."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if (tokenizer_dir / "tokenizer_config.json").is_file():  # from an HF model (data_prep.tokenizer.hf_model_dir)
        tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    else:  # trained by data_prep
        from align_pipeline.data.tokenizer import load_tokenizer

        ours = load_tokenizer(tokenizer_dir)
        tok = PreTrainedTokenizerFast(tokenizer_object=ours.tokenizer, bos_token=ours.id_to_token(ours.bos_id),
                                      eos_token=ours.id_to_token(ours.eos_id), pad_token=ours.id_to_token(ours.pad_id))
    tok.save_pretrained(str(out))
    return {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}


def export_hf(checkpoint: str | os.PathLike, out_dir: str | os.PathLike, tokenizer: str | os.PathLike | None = None,
              dtype: str = "float32", max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> dict[str, Any]:
    """Write the policy checkpoint at ``checkpoint`` as an HF model directory ``out_dir`` (created; must not exist).

    ``tokenizer``: the tokenizer directory to include (default: the one recorded in the checkpoint's meta.json, if it
    still exists; none = no tokenizer files). ``dtype``: the weights' dtype in the files ("float32", "bfloat16",
    "float16"). Returns a summary: family, files, parameters, bytes, and the output directory.
    """
    checkpoint, out = Path(checkpoint), Path(out_dir)
    meta = checkpoint_meta(checkpoint)
    if meta.get("kind") != "model":
        raise HFExportError(f"{checkpoint} is a {meta.get('kind')!r} checkpoint; export a model checkpoint (the "
                            "stage's artifact, or <run_dir>/<model>/model)")
    if meta.get("head", "lm") != "lm":
        raise HFExportError(f"{checkpoint} has a {meta.get('head')!r} head (reward model / critic): exporting it as "
                            "*ForSequenceClassification is not supported yet; only policies (LM head) are")
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(dtype)
    if torch_dtype is None:
        raise HFExportError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
    model = from_dict(ModelConfig, meta["model"], "meta.json model")
    vocab_size = int(meta["vocab_size"])
    family = family_of(model)
    if out.exists():
        raise HFExportError(f"{out} exists; export into a new directory")
    tmp = out.parent / f".tmp-{out.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tokenizer = Path(tokenizer) if tokenizer else Path((meta.get("tokenizer") or {}).get("path") or "")
    tokens = _tokenizer_files(tokenizer, tmp) if tokenizer.name and tokenizer.is_dir() else {}
    config = hf_config(model, vocab_size, torch_dtype, tokens)
    config.architectures = ["Qwen2ForCausalLM" if family == "qwen2" else "LlamaForCausalLM"]
    config.save_pretrained(str(tmp))
    if tokens:
        from transformers import GenerationConfig

        GenerationConfig(**{k: v for k, v in tokens.items() if v is not None}).save_pretrained(str(tmp))
    written = _write_shards(hf_tensors(CheckpointTensors(checkpoint), model, vocab_size), tmp, torch_dtype,
                            max_shard_bytes)
    (tmp / "align_pipeline_meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True, default=str))
    os.replace(tmp, out)
    return {"family": family, "out_dir": str(out), "tokenizer": bool(tokens), **written}


def check_parity(checkpoint: str | os.PathLike, hf_dir: str | os.PathLike, work_dir: str | os.PathLike,
                 batch: int = 2, length: int = 16, seed: int = 0) -> float:
    """``max |Δlogit|`` between our checkpoint (Megatron, fp32, one rank) and the HF export (``transformers``, fp32)
    on ``batch`` x ``length`` random token ids of the real vocabulary."""
    import numpy as np
    from transformers import AutoModelForCausalLM

    from align_pipeline.config import LaunchConfig
    from align_pipeline.launch import run_torchrun

    meta = checkpoint_meta(checkpoint)
    model_cfg = from_dict(ModelConfig, meta["model"], "meta.json model")
    length = min(length, model_cfg.seq_length)
    tokens = np.random.default_rng(seed).integers(0, int(meta["vocab_size"]), size=(batch, length)).tolist()
    work_dir = Path(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    ours = run_torchrun("align_pipeline.model.logits_job", {"checkpoint": str(checkpoint), "tokens": tokens},
                        LaunchConfig(nproc_per_node=1), work_dir, name="export --check")["logits"]
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = model(torch.tensor(tokens)).logits
    ours_t = torch.tensor(ours, dtype=torch.float32)
    if tuple(theirs.shape) != tuple(ours_t.shape):
        raise HFExportError(f"logits shapes differ: HF {tuple(theirs.shape)} vs ours {tuple(ours_t.shape)}")
    return float((theirs - ours_t).abs().max())
