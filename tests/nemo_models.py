"""``.nemo`` archives written here in NeMo 1.x's layout (model/nemo.py's docstring names the NeMo source), from tiny
transformers models: ``model_config.yaml``, the tokenizer as ``nemo:<hex>_<name>`` artifacts, and ``model_weights/``
as a Megatron-core distributed checkpoint (torch DCP ``torch_dist`` written by torch itself, or ``zarr`` raw chunks)
with every key under ``model.``, layers stacked on a leading axis, Transformer Engine norm names, QKV grouped per
key/value group and fc1 = [gate; up], the embedding padded to a multiple of 128 rows with junk."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path
from typing import Any

import torch
import yaml

HEX = "0123456789abcdef" * 2


def nemo_tensors(model, pad_to: int = 128) -> dict[str, torch.Tensor]:
    """The NeMo (mcore) tensors of a transformers Llama / Qwen2 model."""
    cfg = model.config
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    layers, heads, groups = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    per_group = heads // groups
    vocab = sd["model.embed_tokens.weight"].shape[0]
    padded = -(-vocab // pad_to) * pad_to
    junk = torch.randn(padded - vocab, cfg.hidden_size, generator=torch.Generator().manual_seed(5))

    def layer(name: str, i: int) -> torch.Tensor:
        return sd[f"model.layers.{i}.{name}"]

    def qkv(suffix: str, i: int) -> torch.Tensor:
        q = layer(f"self_attn.q_proj.{suffix}", i).reshape(groups, per_group, head_dim, -1)
        k = layer(f"self_attn.k_proj.{suffix}", i).reshape(groups, 1, head_dim, -1)
        v = layer(f"self_attn.v_proj.{suffix}", i).reshape(groups, 1, head_dim, -1)
        out = torch.cat([q, k, v], dim=1).reshape((heads + 2 * groups) * head_dim, -1)
        return out.squeeze(-1) if suffix == "bias" else out

    stack = lambda fn: torch.stack([fn(i) for i in range(layers)])
    out = {
        "model.embedding.word_embeddings.weight": torch.cat([sd["model.embed_tokens.weight"], junk]),
        "model.decoder.layers.self_attention.linear_qkv.layer_norm_weight": stack(
            lambda i: layer("input_layernorm.weight", i)),
        "model.decoder.layers.self_attention.linear_qkv.weight": stack(lambda i: qkv("weight", i)),
        "model.decoder.layers.self_attention.linear_proj.weight": stack(lambda i: layer("self_attn.o_proj.weight", i)),
        "model.decoder.layers.mlp.linear_fc1.layer_norm_weight": stack(
            lambda i: layer("post_attention_layernorm.weight", i)),
        "model.decoder.layers.mlp.linear_fc1.weight": stack(
            lambda i: torch.cat([layer("mlp.gate_proj.weight", i), layer("mlp.up_proj.weight", i)])),
        "model.decoder.layers.mlp.linear_fc2.weight": stack(lambda i: layer("mlp.down_proj.weight", i)),
        "model.decoder.final_layernorm.weight": sd["model.norm.weight"],
    }
    if "model.layers.0.self_attn.q_proj.bias" in sd:
        out["model.decoder.layers.self_attention.linear_qkv.bias"] = stack(lambda i: qkv("bias", i))
    if not cfg.tie_word_embeddings:
        out["model.output_layer.weight"] = torch.cat([sd["lm_head.weight"], junk])
    return out


def nemo_config(model, **overrides: Any) -> dict[str, Any]:
    """model_config.yaml of a Megatron GPT as NeMo's Llama converter writes it."""
    cfg = model.config
    rope = getattr(cfg, "rope_parameters", None) or {}
    out = {
        "mcore_gpt": True, "transformer_engine": True, "precision": "bf16", "megatron_amp_O2": True,
        "encoder_seq_length": cfg.max_position_embeddings, "max_position_embeddings": cfg.max_position_embeddings,
        "num_layers": cfg.num_hidden_layers, "hidden_size": cfg.hidden_size,
        "ffn_hidden_size": cfg.intermediate_size, "num_attention_heads": cfg.num_attention_heads,
        "num_query_groups": cfg.num_key_value_heads, "kv_channels": None, "normalization": "rmsnorm",
        "layernorm_epsilon": cfg.rms_norm_eps, "activation": "fast-swiglu", "bias": False,
        "qkv_bias": cfg.model_type == "qwen2", "position_embedding_type": "rope",
        "rotary_base": rope.get("rope_theta", 10000.0), "rotary_percentage": 1.0,
        "share_embeddings_and_output_weights": bool(cfg.tie_word_embeddings), "make_vocab_size_divisible_by": 128,
        "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1,
        "target": "nemo.collections.nlp.models.language_modeling.megatron_gpt_model.MegatronGPTModel",
        "nemo_version": "1.23.0",
    }
    return {**out, **overrides}


def write_torch_dist(tensors: dict[str, torch.Tensor], directory: Path) -> None:
    """A Megatron ``torch_dist`` checkpoint: torch DCP's own writer (one process), Megatron's metadata.json and an
    empty common.pt."""
    import torch.distributed.checkpoint as dcp

    directory.mkdir(parents=True)
    dcp.save(dict(tensors), storage_writer=dcp.FileSystemWriter(str(directory)))
    (directory / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                                                         "common_backend": "torch", "common_backend_version": 1}))
    torch.save({}, directory / "common.pt")


def write_zarr(tensors: dict[str, torch.Tensor], directory: Path) -> None:
    """A Megatron ``zarr`` checkpoint: per key a zarr v2 array of raw C-order chunks (no compressor), chunk 1 on the
    layer axis and the rest whole, as Megatron-core writes a TP=1 shard."""
    directory.mkdir(parents=True)
    dtypes = {torch.float32: "<f4", torch.bfloat16: "bfloat16", torch.float16: "<f2"}
    for key, t in tensors.items():
        d = directory / key
        d.mkdir()
        stacked = key.startswith("model.decoder.layers.")
        chunks = [1, *t.shape[1:]] if stacked else list(t.shape)
        (d / ".zarray").write_text(json.dumps({"zarr_format": 2, "shape": list(t.shape), "chunks": chunks,
                                               "dtype": dtypes[t.dtype], "compressor": None, "fill_value": None,
                                               "order": "C", "filters": None}))
        raw = t.contiguous()
        if stacked:
            for i in range(t.shape[0]):
                (d / ".".join([str(i)] + ["0"] * (t.dim() - 1))).write_bytes(_bytes(raw[i]))
        else:
            (d / ".".join(["0"] * t.dim())).write_bytes(_bytes(raw))
    (directory / "metadata.json").write_text(json.dumps({"sharded_backend": "zarr", "sharded_backend_version": 1,
                                                         "common_backend": "torch", "common_backend_version": 1}))


def _bytes(t: torch.Tensor) -> bytes:
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().tobytes()
    return t.numpy().tobytes()


def write_nemo(out: Path, model, tokenizer: dict[str, Any], files: dict[str, Path], *, backend: str = "torch_dist",
               dtype: torch.dtype = torch.float32, overrides: dict[str, Any] | None = None,
               tensors: dict[str, torch.Tensor] | None = None, directory: bool = False) -> Path:
    """Write ``out`` (.nemo tar, or with ``directory`` the unpacked directory): ``tokenizer`` is the config's
    tokenizer section, whose ``nemo:<name>`` values name ``files`` (name -> a file or directory to store as the
    artifact ``<hex>_<name>``)."""
    stage = out.parent / (out.name + ".stage") if not directory else out
    stage.mkdir(parents=True)
    section = dict(tokenizer)
    for key, value in list(section.items()):
        if isinstance(value, str) and value.startswith("nemo:"):
            name = value[5:]
            section[key] = f"nemo:{HEX}_{name}"
            src = files[name]
            target = stage / f"{HEX}_{name}"
            if src.is_dir():
                import shutil

                shutil.copytree(src, target)
            else:
                target.write_bytes(src.read_bytes())
    cfg = nemo_config(model, tokenizer=section, **(overrides or {}))
    (stage / "model_config.yaml").write_text(yaml.safe_dump(cfg))
    tensors = {k: v.to(dtype) for k, v in (tensors if tensors is not None else nemo_tensors(model)).items()}
    (write_torch_dist if backend == "torch_dist" else write_zarr)(tensors, stage / "model_weights")
    if directory:
        return out
    with tarfile.open(out, "w:") as tar:
        tar.add(stage, arcname=".")
    import shutil

    shutil.rmtree(stage)
    return out


def add_member(archive: Path, name: str, data: bytes = b"x", kind: bytes = tarfile.REGTYPE, link: str = "") -> None:
    """Append a member (a file, or a link with ``kind``) to a tar archive."""
    with tarfile.open(archive, "a:") as tar:
        info = tarfile.TarInfo(name)
        info.type = kind
        info.linkname = link
        info.size = len(data) if kind == tarfile.REGTYPE else 0
        tar.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)
