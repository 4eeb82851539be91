"""Our model checkpoints -> Hugging Face model directories (``*ForCausalLM`` / ``*ForSequenceClassification``), in
one plain process.

:func:`export_hf` reads a model checkpoint written by :func:`align_pipeline.model.checkpoint.save_model` (any TP/PP
layout: the torch_dist files hold each tensor whole, layers stacked on a leading axis) with
``torch.distributed.checkpoint`` — no Megatron model, no process group — and writes ``config.json``,
``generation_config.json``, safetensors shards (+ ``model.safetensors.index.json`` when there are several), the
tokenizer files and ``align_pipeline_meta.json`` (the checkpoint's meta.json: lineage, stage, metrics).

The name mapping is the inverse of :mod:`align_pipeline.model.hf` (fused QKV rows grouped by key/value head: for each
group its query heads, then its key head, then its value head; ``linear_fc1`` = ``[gate; up]``). Streaming: each
safetensors file's header is written from the planned shapes, then every tensor is read (one layer of one kind, from
its own chunks of the ``.distcp`` files) and written before the next is read, so peak host memory is about one
layer's fused fc1 or the embedding, whatever the model's size.

Family: the one the model was imported from (``model.hf_family``: llama, qwen2, qwen3, mistral), else the one its
architecture implies (QK norm: Qwen3; QKV-only biases: Qwen2; else Llama). RoPE scaling, ``head_dim``, the tie flag,
the sliding window and the source's context length are written back. The vocabulary is the checkpoint's real one
(``meta.json`` ``vocab_size``): Megatron's padding rows are dropped, so the HF logits equal the Megatron logits over
the real tokens. Value heads (reward models, critics) become ``score.weight`` of ``*ForSequenceClassification``.

:func:`parity` compares our outputs on fixed tokens (computed by :mod:`align_pipeline.train.jobs.logits`) with an HF
directory's in ``transformers``: ``max |Δlogit|`` (both directions use it). Nothing here launches a job: the
launchers of the model jobs (import, export, merge, outputs) are in :mod:`align_pipeline.launch.model_jobs`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from align_pipeline.config.base import from_dict
from align_pipeline.config.common import ModelConfig
from align_pipeline.data.formats import checkpoint_meta, lora_adapters_only
from align_pipeline.errors import UserError
from align_pipeline.model import rope, safe_pickle
from align_pipeline.model.export_check import export_tokenizer
from align_pipeline.model.hf import hf_outputs, load_hf

DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3


class HFExportError(UserError, ValueError):
    """The checkpoint cannot be written as an HF model directory."""


def _reader(path: Path):
    """torch DCP's reader, its ``.metadata`` and objects read through :mod:`align_pipeline.model.safe_pickle`."""
    from torch.distributed.checkpoint import FileSystemReader

    safe_pickle.install()
    return FileSystemReader(str(path))


@contextlib.contextmanager
def _refused_as_export_error():
    """A checkpoint refused by :mod:`align_pipeline.model.safe_pickle` as an :class:`HFExportError` (same message)."""
    try:
        with safe_pickle.refusals_unwrapped():
            yield
    except safe_pickle.UnsafeCheckpoint as exc:
        raise HFExportError(str(exc)) from None


_PER_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


class CheckpointTensors:
    """The whole (TP/PP-gathered) tensors of a model checkpoint, read by name without building the model.

    Megatron stores the layers of a kind stacked on a leading axis, each layer (and TP shard) as its own chunk:
    :meth:`layer` reads only layer ``i``'s chunks from the ``.distcp`` files, so memory never holds more than one
    layer of one kind."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        with _refused_as_export_error():
            self._metadata = _reader(self.path).read_metadata()
        metadata = self._metadata.state_dict_metadata
        self.shapes = {k: (tuple(v.size), v.properties.dtype) for k, v in metadata.items() if hasattr(v, "size")}
        # Megatron stores the layers one key each when they differ (an MoE model with dense layers among its MoE
        # ones): "decoder.layers.<i>.<rest>"; those read as the stacked name "decoder.layers.<rest>" does.
        self._per_layer = {f"decoder.layers.{m.group(2)}" for k in self.shapes if (m := _PER_LAYER.match(k))}

    def has(self, name: str) -> bool:
        return name in self.shapes or name in self._per_layer

    def has_layer(self, name: str, i: int) -> bool:
        """Whether layer ``i`` has the ``decoder.layers.*`` tensor ``name`` (an MoE model's MoE and dense layers
        differ)."""
        if name in self.shapes:
            return True
        return name.replace("decoder.layers.", f"decoder.layers.{i}.", 1) in self.shapes

    def read(self, *names: str) -> dict[str, torch.Tensor]:
        """Whole tensors (through ``torch.distributed.checkpoint``)."""
        import torch.distributed.checkpoint as dcp

        missing = [n for n in names if n not in self.shapes]
        if missing:
            raise HFExportError(f"{self.path}: the checkpoint has no tensor(s) {missing}")
        state = {n: torch.empty(self.shapes[n][0], dtype=self.shapes[n][1]) for n in names}
        with _refused_as_export_error():
            dcp.load(state, storage_reader=_reader(self.path))
        return state

    def layer(self, name: str, i: int) -> torch.Tensor:
        """Layer ``i`` of a stacked ``decoder.layers.*`` tensor, assembled from its chunks (TP shards)."""
        import io

        from torch.distributed.checkpoint.metadata import MetadataIndex

        if name not in self.shapes and name in self._per_layer:
            own = name.replace("decoder.layers.", f"decoder.layers.{i}.", 1)
            return self.read(own)[own]
        if name not in self.shapes:
            raise HFExportError(f"{self.path}: the checkpoint has no tensor {name}")
        shape, dtype = self.shapes[name]
        out = torch.empty(shape[1:], dtype=dtype)
        filled = 0
        for chunk in self._metadata.state_dict_metadata[name].chunks:
            if chunk.offsets[0] > i or chunk.offsets[0] + chunk.sizes[0] <= i:
                continue
            info = self._metadata.storage_data[MetadataIndex(name, chunk.offsets)]
            if chunk.sizes[0] != 1 or getattr(info, "transform_descriptors", None):
                return self.read(name)[name][i]  # a layout this reader does not slice: whole tensor
            with open(self.path / info.relative_path, "rb") as f:
                f.seek(info.offset)
                blob = f.read(info.length)
            with _refused_as_export_error():
                part = safe_pickle.weights_only_load(io.BytesIO(blob), self.path / info.relative_path)
            region = tuple(slice(o, o + n) for o, n in zip(chunk.offsets[1:], chunk.sizes[1:]))
            out[region] = part.reshape(tuple(chunk.sizes))[0]
            filled += part.numel()
        if filled != out.numel():
            raise HFExportError(f"{self.path}: chunks of {name} cover {filled} of layer {i}'s {out.numel()} values")
        return out


class MergedCheckpointTensors:
    """A LoRA artifact of adapters alone read like :class:`CheckpointTensors`: its base's tensors (the base may be
    such an artifact itself) with ``(alpha / r) B A`` added to every adapted weight, one layer at a time. The
    adapters are stored whole in the weights' own row order (a gated fc1's B as [gate; up], like its weight)."""

    def __init__(self, path: Path, base, meta: dict[str, Any]) -> None:
        spec = meta["lora"]
        self.path, self.base = Path(path), base
        self.shapes = base.shapes
        self.adapters = CheckpointTensors(self.path / spec.get("adapters", "adapters"))
        self.scaling = spec["alpha"] / spec["rank"]

    def has(self, name: str) -> bool:
        return self.base.has(name)

    def read(self, *names: str) -> dict[str, torch.Tensor]:
        out = self.base.read(*names)
        for name in names:
            if self._adapter(name) is not None:
                out[name] = torch.stack([self.layer(name, i) for i in range(out[name].shape[0])])
        return out

    def _adapter(self, name: str) -> str | None:
        prefix = name.removesuffix(".weight")
        return prefix if name.endswith(".weight") and self.adapters.has(f"{prefix}.lora_A") else None

    def layer(self, name: str, i: int) -> torch.Tensor:
        weight = self.base.layer(name, i)
        prefix = self._adapter(name)
        if prefix is None:
            return weight
        a, b = self.adapters.layer(f"{prefix}.lora_A", i).float(), self.adapters.layer(f"{prefix}.lora_B", i).float()
        return (weight.float() + (b @ a) * self.scaling).to(weight.dtype)


def open_tensors(checkpoint: str | os.PathLike):
    """The model tensors of a checkpoint: :class:`CheckpointTensors`, or for a LoRA artifact of adapters alone
    :class:`MergedCheckpointTensors` over its base; None when the chain of bases ends in an HF directory (not
    readable tensor by tensor here)."""
    checkpoint = Path(checkpoint)
    meta = checkpoint_meta(checkpoint)
    if not lora_adapters_only(meta):
        return CheckpointTensors(checkpoint)
    base = Path(meta["lora"].get("base") or "")
    if not (base / "meta.json").is_file():
        return None
    inner = open_tensors(base)
    return MergedCheckpointTensors(checkpoint, inner, meta) if inner is not None else None


FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3")
MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3")
CLASS_PREFIX = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral", "qwen3_moe": "Qwen3Moe",
                "qwen2_moe": "Qwen2Moe", "mixtral": "Mixtral", "deepseek_v3": "DeepseekV3"}


def family_of(model: ModelConfig) -> str:
    """The HF family the model is written as: its ``hf_family`` (set on import), else the one its architecture
    implies (QK norm: qwen3; QKV-only biases: qwen2; else llama). Raises :class:`HFExportError` when the family
    cannot represent the architecture."""
    problems = []
    if model.position_embedding_type != "rope":
        problems.append(f"position_embedding_type={model.position_embedding_type!r} (needs rope)")
    if model.normalization != "RMSNorm":
        problems.append(f"normalization={model.normalization!r} (needs RMSNorm)")
    if model.activation != "swiglu":
        problems.append(f"activation={model.activation!r} (needs swiglu)")
    if problems:
        raise HFExportError(f"no HF family ({', '.join(FAMILIES)}) has this architecture: " + "; ".join(problems))
    qkv_only_bias = model.add_qkv_bias and not model.add_bias_linear
    if model.mla.enabled() and not model.moe.enabled():
        raise HFExportError("multi-head latent attention (model.mla) is written as deepseek_v3, which needs "
                            "model.moe (a dense MLA model has no HF family here)")
    if model.moe.enabled():
        return _moe_family(model)
    family = model.hf_family or ("qwen3" if model.qk_layernorm else "qwen2" if qkv_only_bias else "llama")
    if family in MOE_FAMILIES:
        raise HFExportError(f"model.hf_family={family!r} is a mixture-of-experts family but model.moe.num_experts is 0")
    needs = {  # family -> (QK norm, QKV-only biases, biases on every linear layer allowed)
        "llama": (False, False, True), "qwen2": (False, True, False), "qwen3": (True, False, True),
        "mistral": (False, False, False),
    }[family]
    if family == "qwen2" and rope.head_dim(model) * model.num_attention_heads != model.hidden_size:
        raise HFExportError(f"Qwen2 has no head_dim: kv_channels={model.kv_channels} must be hidden / heads")
    if (model.qk_layernorm, qkv_only_bias) != needs[:2] or (model.add_bias_linear and not needs[2]):
        raise HFExportError(f"model.hf_family={family!r} cannot hold qk_layernorm={model.qk_layernorm}, "
                            f"add_qkv_bias={model.add_qkv_bias}, add_bias_linear={model.add_bias_linear}")
    return family


def _moe_family(model: ModelConfig) -> str:
    """An MoE model's family: its ``hf_family``, else Qwen3-MoE with QK norm, Qwen2-MoE with a shared expert and
    Mixtral otherwise. Mixtral has no dense layers, no QK norm, no shared expert and always renormalises the chosen
    experts' weights; Qwen3-MoE always has QK norm and no shared expert; Qwen2-MoE has no QK norm and always a
    gated shared expert; only Qwen2-MoE has (QKV) biases."""
    moe = model.moe
    shared = moe.shared_expert_ffn_hidden_size > 0
    family = model.hf_family or ("deepseek_v3" if model.mla.enabled() else "qwen3_moe" if model.qk_layernorm
                                 else "qwen2_moe" if shared else "mixtral")
    if family == "deepseek_v3":
        return _deepseek_family(model)
    problems = []
    if model.mla.enabled():
        problems.append("multi-head latent attention (model.mla: only deepseek_v3 has it)")
    if moe.router_score_function != "softmax" or moe.router_expert_bias or moe.router_num_groups \
            or moe.router_topk_scaling_factor != 1.0:
        problems.append("DeepSeek-V3's routing (sigmoid scores, expert bias, groups, scaling)")
    if family not in MOE_FAMILIES:
        problems.append(f"model.hf_family={family!r} has no experts")
    if model.add_bias_linear or (model.add_qkv_bias and family != "qwen2_moe"):
        problems.append("linear biases")
    if family in ("mixtral", "qwen2_moe") and model.qk_layernorm:
        problems.append(f"qk_layernorm ({CLASS_PREFIX.get(family, family)} has none)")
    if family == "qwen3_moe" and not model.qk_layernorm:
        problems.append("no qk_layernorm (Qwen3-MoE always has it)")
    if family == "qwen2_moe" and not (shared and moe.shared_expert_gate):
        problems.append("no gated shared expert (moe.shared_expert_ffn_hidden_size, moe.shared_expert_gate: every "
                        "Qwen2-MoE layer has one)")
    if family != "qwen2_moe" and shared:
        problems.append("a shared expert (moe.shared_expert_ffn_hidden_size)")
    if family == "qwen2_moe" and rope.head_dim(model) * model.num_attention_heads != model.hidden_size:
        problems.append(f"kv_channels={model.kv_channels} (Qwen2-MoE's head width is hidden / heads)")
    if family == "mixtral" and moe.layers is not None and not all(moe.layers):
        problems.append(f"dense layers (moe.layers={moe.layers}; every Mixtral layer is MoE)")
    if family == "mixtral" and moe.router_pre_softmax:
        problems.append("moe.router_pre_softmax (Mixtral renormalises the chosen experts' weights)")
    if problems:
        raise HFExportError(f"the MoE model cannot be written as {family!r}: " + "; ".join(problems))
    return family


def _deepseek_family(model: ModelConfig) -> str:
    """DeepSeek-V3 has multi-head latent attention, sigmoid routing with an expert bias (renormalised, scaled,
    optionally group-limited with groups ranked by their top-2 scores), ungated shared experts of the routed
    experts' width, its dense layers first, and no biases."""
    moe, problems = model.moe, []
    ffn = moe.ffn_hidden_size or model.ffn_hidden_size or 4 * model.hidden_size
    if not model.mla.enabled():
        problems.append("no multi-head latent attention (model.mla.kv_lora_rank)")
    if moe.router_score_function != "sigmoid" or not moe.router_expert_bias or moe.router_pre_softmax:
        problems.append("routing other than sigmoid scores with an expert bias (moe.router_score_function, "
                        "moe.router_expert_bias)")
    if moe.router_num_groups and moe.router_topk != 2 * moe.router_group_topk:
        problems.append("groups not ranked by their top-2 scores (moe.router_topk != 2 x moe.router_group_topk)")
    if moe.shared_expert_gate or moe.shared_expert_ffn_hidden_size % ffn:
        problems.append(f"a shared expert that is gated or not a multiple of the experts' width {ffn}")
    pattern = [moe.layer_is_moe(i) for i in range(model.num_layers)]
    if pattern != sorted(pattern):
        problems.append(f"dense layers after MoE layers (moe.layers={moe.layers}; DeepSeek-V3's come first)")
    if model.add_bias_linear or model.add_qkv_bias or model.qk_layernorm:
        problems.append("biases or QK norm")
    if model.rope_scaling not in ("none", "yarn"):
        problems.append(f"rope_scaling={model.rope_scaling!r}")
    if moe.aux_loss_coeff or moe.z_loss_coeff:
        problems.append("an aux or z loss (the export would not say it)")
    if problems:
        raise HFExportError("the model cannot be written as 'deepseek_v3': " + "; ".join(problems))
    return "deepseek_v3"


def _moe_config_kwargs(model: ModelConfig, family: str) -> dict[str, Any]:
    moe = model.moe
    expert_ffn = moe.ffn_hidden_size or model.ffn_hidden_size or 4 * model.hidden_size
    if family == "deepseek_v3":
        mla = model.mla
        return {"n_routed_experts": moe.num_experts, "num_experts_per_tok": moe.router_topk,
                "moe_intermediate_size": expert_ffn, "n_shared_experts": moe.shared_expert_ffn_hidden_size // expert_ffn,
                "first_k_dense_replace": sum(not moe.layer_is_moe(i) for i in range(model.num_layers)),
                "n_group": moe.router_num_groups or 1, "topk_group": moe.router_group_topk or 1,
                "norm_topk_prob": True, "routed_scaling_factor": moe.router_topk_scaling_factor,
                "intermediate_size": model.ffn_hidden_size or 4 * model.hidden_size,
                "q_lora_rank": mla.q_lora_rank or None, "kv_lora_rank": mla.kv_lora_rank,
                "qk_nope_head_dim": mla.qk_head_dim, "qk_rope_head_dim": mla.qk_pos_emb_head_dim,
                "v_head_dim": mla.v_head_dim, "rope_interleave": True, "attention_bias": False}
    common = {"num_experts_per_tok": moe.router_topk, "router_aux_loss_coef": moe.aux_loss_coeff or 0.001,
              "output_router_logits": moe.aux_loss_coeff > 0}
    if family == "mixtral":
        return {**common, "num_local_experts": moe.num_experts, "intermediate_size": expert_ffn,
                "router_jitter_noise": 0.0}
    dense = [i for i in range(model.num_layers) if not moe.layer_is_moe(i)]
    kwargs = {**common, "num_experts": moe.num_experts, "moe_intermediate_size": expert_ffn,
              "intermediate_size": model.ffn_hidden_size or 4 * model.hidden_size, "decoder_sparse_step": 1,
              "mlp_only_layers": dense, "norm_topk_prob": not moe.router_pre_softmax}
    if family == "qwen2_moe":
        kwargs |= {"shared_expert_intermediate_size": moe.shared_expert_ffn_hidden_size,
                   "qkv_bias": model.add_qkv_bias}
    return kwargs


def _rope_parameters(model: ModelConfig) -> dict[str, Any]:
    rope: dict[str, Any] = {"rope_type": "default" if model.rope_scaling == "none" else model.rope_scaling,
                            "rope_theta": model.rotary_base}
    if model.rope_scaling != "none":
        rope["factor"] = model.rope_scaling_factor
    if model.rope_scaling == "llama3":
        rope |= {"low_freq_factor": model.rope_low_freq_factor, "high_freq_factor": model.rope_high_freq_factor,
                 "original_max_position_embeddings": model.rope_original_max_position}
    if model.rope_scaling == "yarn":  # (mscale, mscale_all_dim) = (1, 0) is transformers' default: keys omitted
        rope |= {"original_max_position_embeddings": model.rope_original_max_position,
                 "beta_fast": model.yarn_beta_fast, "beta_slow": model.yarn_beta_slow}
        if model.yarn_mscale_all_dim:
            rope |= {"mscale": model.yarn_mscale, "mscale_all_dim": model.yarn_mscale_all_dim}
    return rope


def hf_config(model: ModelConfig, vocab_size: int, dtype: torch.dtype, tokens: dict[str, int | None],
              num_labels: int | None = None):
    """The ``transformers`` config object of the export (``num_labels``: a sequence-classification head)."""
    import transformers

    family = family_of(model)
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=model.hidden_size,
        intermediate_size=model.ffn_hidden_size,
        num_hidden_layers=model.num_layers,
        num_attention_heads=model.num_attention_heads,
        num_key_value_heads=model.num_query_groups or model.num_attention_heads,
        max_position_embeddings=model.max_position_embeddings or model.seq_length,
        rms_norm_eps=model.norm_epsilon,
        hidden_act="silu",
        initializer_range=model.init_method_std,
        tie_word_embeddings=model.share_embeddings_and_output_weights and num_labels is None,
        rope_parameters=_rope_parameters(model),
        dtype=dtype,
        **tokens,
    )
    if num_labels is not None:
        kwargs["num_labels"] = num_labels
    if family not in ("qwen2", "qwen2_moe", "deepseek_v3"):  # Qwen2: hidden / heads (family_of checks); MLA: its own
        kwargs["head_dim"] = rope.head_dim(model)
    if family == "llama":
        kwargs |= {"attention_bias": model.add_bias_linear, "mlp_bias": model.add_bias_linear}
    elif family in ("qwen3", "qwen3_moe"):
        kwargs |= {"attention_bias": model.add_bias_linear, "use_sliding_window": False,
                   "sliding_window": model.sliding_window}
    elif family in ("qwen2", "qwen2_moe"):
        kwargs |= {"use_sliding_window": False, "sliding_window": model.sliding_window}
    elif family == "deepseek_v3":
        kwargs["num_key_value_heads"] = model.num_attention_heads
    else:
        kwargs |= {"sliding_window": model.sliding_window}
    if family in MOE_FAMILIES:
        kwargs |= _moe_config_kwargs(model, family)
    return getattr(transformers, f"{CLASS_PREFIX[family]}Config")(**kwargs)


def architecture(family: str, head: str) -> str:
    """``LlamaForCausalLM``, ``Qwen3ForSequenceClassification``, ..."""
    return CLASS_PREFIX[family] + ("ForCausalLM" if head == "lm" else "ForSequenceClassification")


Producer = Callable[[], torch.Tensor]


def split_qkv(fused: torch.Tensor, model: ModelConfig) -> list[torch.Tensor]:
    """Megatron's fused QKV rows ``[groups * (h/g + 2) * d, ...]`` (per key/value group: its query heads, its key
    head, its value head) -> HF's ``[q, k, v]`` rows."""
    heads = model.num_attention_heads
    groups, head_dim = model.num_query_groups or heads, rope.head_dim(model)
    rest = fused.shape[1:]
    per_group = fused.reshape(groups, (heads // groups + 2) * head_dim, *rest)
    pieces = per_group.split([heads // groups * head_dim, head_dim, head_dim], dim=1)
    return [p.reshape(-1, *rest).contiguous() for p in pieces]


def hf_tensors(ckpt: CheckpointTensors, model: ModelConfig, vocab_size: int,
               head: str = "lm") -> list[tuple[str, tuple[int, ...], Producer]]:
    """The export's tensors as (HF name, shape, producer) in file order (embedding, then layer by layer, then the
    final norm and head). A producer reads only what it needs when called: one layer of one kind (the fused QKV or
    fc1 of a layer is read once and split), so the writer holds at most one layer's tensors.

    ``head="value"``: the value head's weight becomes ``score.weight`` (its bias is not a parameter of HF's head:
    :func:`export_hf` handles it)."""
    layers, hidden = model.num_layers, model.hidden_size
    heads = model.num_attention_heads
    groups = model.num_query_groups or heads
    head_dim = rope.head_dim(model)
    ffn = model.ffn_hidden_size or 4 * hidden
    cache: dict[tuple[str, int], torch.Tensor] = {}

    def layer(name: str, i: int) -> torch.Tensor:
        if (name, i) not in cache:
            cache.clear()  # keep one layer of one kind
            cache[(name, i)] = ckpt.layer(name, i)
        return cache[(name, i)]

    def first(*names: str) -> str:
        for name in names:
            if ckpt.has(name):
                return name
        raise HFExportError(f"{ckpt.path}: none of {list(names)} is in the checkpoint")

    for name, (shape, _) in ckpt.shapes.items():
        if name.startswith("decoder.layers.") and not _PER_LAYER.match(name) and shape[0] != layers:
            raise HFExportError(f"{ckpt.path}: {name} holds {shape[0]} layers, expected {layers}")

    def qkv_part(suffix: str, i: int, part: int) -> torch.Tensor:
        return split_qkv(layer(f"decoder.layers.self_attention.linear_qkv.{suffix}", i), model)[part]

    def fc1_part(suffix: str, i: int, part: int) -> torch.Tensor:
        return layer(f"decoder.layers.mlp.linear_fc1.{suffix}", i).chunk(2, dim=0)[part].contiguous()  # [gate; up]

    plan: list[tuple[str, tuple[int, ...], Producer]] = [
        ("model.embed_tokens.weight", (vocab_size, hidden),
         lambda: ckpt.read("embedding.word_embeddings.weight")["embedding.word_embeddings.weight"][:vocab_size])]
    input_norm = first("decoder.layers.self_attention.linear_qkv.layer_norm_weight",
                       "decoder.layers.input_layernorm.weight")
    mlp_norm = first("decoder.layers.mlp.linear_fc1.layer_norm_weight", "decoder.layers.pre_mlp_layernorm.weight")
    qkv_suffixes = ["weight"] + (["bias"] if ckpt.has("decoder.layers.self_attention.linear_qkv.bias") else [])
    fc1_suffixes = ["weight"] + (["bias"] if ckpt.has("decoder.layers.mlp.linear_fc1.bias") else [])
    for i in range(layers):
        pre = f"model.layers.{i}."
        plan.append((pre + "input_layernorm.weight", (hidden,), lambda i=i: layer(input_norm, i)))
        if model.mla.enabled():
            plan += _mla_tensors(layer, model, i)
        for suffix in [] if model.mla.enabled() else qkv_suffixes:
            rest = (hidden,) if suffix == "weight" else ()
            for part, (proj, rows) in enumerate((("q", heads), ("k", groups), ("v", groups))):
                plan.append((pre + f"self_attn.{proj}_proj.{suffix}", (rows * head_dim, *rest),
                             lambda i=i, s=suffix, p=part: qkv_part(s, i, p)))
        if model.qk_layernorm and not model.mla.enabled():
            for proj in ("q", "k"):
                plan.append((pre + f"self_attn.{proj}_norm.weight", (head_dim,), lambda i=i, p=proj: layer(
                    f"decoder.layers.self_attention.{p}_layernorm.weight", i)))
        plan.append((pre + "self_attn.o_proj.weight", (hidden, heads * (model.mla.v_head_dim if model.mla.enabled()
                                                                        else head_dim)),
                     lambda i=i: layer("decoder.layers.self_attention.linear_proj.weight", i)))
        if ckpt.has("decoder.layers.self_attention.linear_proj.bias"):
            plan.append((pre + "self_attn.o_proj.bias", (hidden,),
                         lambda i=i: layer("decoder.layers.self_attention.linear_proj.bias", i)))
        plan.append((pre + "post_attention_layernorm.weight", (hidden,), lambda i=i: layer(mlp_norm, i)))
        if model.moe.layer_is_moe(i):
            plan += _expert_tensors(layer, model, i)
            continue
        for suffix in fc1_suffixes:
            rest = (hidden,) if suffix == "weight" else ()
            for part, proj in enumerate(("gate", "up")):
                plan.append((pre + f"mlp.{proj}_proj.{suffix}", (ffn, *rest),
                             lambda i=i, s=suffix, p=part: fc1_part(s, i, p)))
        plan.append((pre + "mlp.down_proj.weight", (hidden, ffn),
                     lambda i=i: layer("decoder.layers.mlp.linear_fc2.weight", i)))
        if ckpt.has("decoder.layers.mlp.linear_fc2.bias"):
            plan.append((pre + "mlp.down_proj.bias", (hidden,),
                         lambda i=i: layer("decoder.layers.mlp.linear_fc2.bias", i)))
    plan.append(("model.norm.weight", (hidden,),
                 lambda: ckpt.read("decoder.final_layernorm.weight")["decoder.final_layernorm.weight"]))
    if head == "value":
        outputs = ckpt.shapes["output_layer.weight"][0][0]
        plan.append(("score.weight", (outputs, hidden), lambda: ckpt.read("output_layer.weight")["output_layer.weight"]))
    elif not model.share_embeddings_and_output_weights:
        plan.append(("lm_head.weight", (vocab_size, hidden),
                     lambda: ckpt.read("output_layer.weight")["output_layer.weight"][:vocab_size]))
    return plan


def _mla_tensors(layer: Callable[[str, int], torch.Tensor], model: ModelConfig,
                 i: int) -> list[tuple[str, tuple[int, ...], Producer]]:
    """Layer ``i``'s multi-head latent attention as DeepSeek-V3 names it (the same rows in both layouts)."""
    mla, hidden, heads = model.mla, model.hidden_size, model.num_attention_heads
    pre, ours = f"model.layers.{i}.self_attn.", "decoder.layers.self_attention."
    q_width = heads * (mla.qk_head_dim + mla.qk_pos_emb_head_dim)
    names = ([("q_a_proj.weight", "linear_q_down_proj.weight", (mla.q_lora_rank, hidden)),
              ("q_a_layernorm.weight", "q_layernorm.weight", (mla.q_lora_rank,)),
              ("q_b_proj.weight", "linear_q_up_proj.weight", (q_width, mla.q_lora_rank))] if mla.q_lora_rank
             else [("q_proj.weight", "linear_q_proj.weight", (q_width, hidden))])
    names += [("kv_a_proj_with_mqa.weight", "linear_kv_down_proj.weight",
               (mla.kv_lora_rank + mla.qk_pos_emb_head_dim, hidden)),
              ("kv_a_layernorm.weight", "kv_layernorm.weight", (mla.kv_lora_rank,)),
              ("kv_b_proj.weight", "linear_kv_up_proj.weight",
               (heads * (mla.qk_head_dim + mla.v_head_dim), mla.kv_lora_rank))]
    return [(pre + hf, shape, lambda name=ours + name: layer(name, i)) for hf, name, shape in names]


def _expert_tensors(layer: Callable[[str, int], torch.Tensor], model: ModelConfig,
                    i: int) -> list[tuple[str, tuple[int, ...], Producer]]:
    """MoE layer ``i``'s router and experts, per expert as the family's checkpoints name them (:class:`MoENames`):
    every expert's gate and up (one read of the layer's stacked fc1), then every expert's down (one of fc2), then
    the shared expert (Qwen2-MoE)."""
    from align_pipeline.model.hf import MoENames

    hidden, experts = model.hidden_size, model.moe.num_experts
    ffn = model.moe.ffn_hidden_size or model.ffn_hidden_size or 4 * hidden
    names, pre = MoENames(family_of(model)), f"model.layers.{i}."
    fc1, fc2 = "decoder.layers.mlp.experts.experts.linear_fc1.weight", "decoder.layers.mlp.experts.experts.linear_fc2.weight"
    plan = [(names.router(pre), (experts, hidden), lambda: layer("decoder.layers.mlp.router.weight", i))]
    if model.moe.router_expert_bias:
        plan.append((names.expert_bias(pre), (experts,), lambda: layer("decoder.layers.mlp.router.expert_bias", i)))
    plan += [(names.expert(pre, e, part), (ffn, hidden),
              lambda e=e, part=part: layer(fc1, i)[e].chunk(2, dim=0)[part].contiguous())
             for e in range(experts) for part in (0, 1)]
    plan += [(names.expert(pre, e, 2), (hidden, ffn), lambda e=e: layer(fc2, i)[e])
             for e in range(experts)]
    shared = model.moe.shared_expert_ffn_hidden_size
    if shared:
        gate, up, down, *gated = names.shared(pre, model.moe.shared_expert_gate)
        shared_fc1 = "decoder.layers.mlp.shared_experts.linear_fc1.weight"
        plan += [(name, (shared, hidden), lambda part=part: layer(shared_fc1, i).chunk(2, dim=0)[part].contiguous())
                 for part, name in enumerate((gate, up))]
        plan.append((down, (hidden, shared), lambda: layer("decoder.layers.mlp.shared_experts.linear_fc2.weight", i)))
        plan += [(name, (1, hidden), lambda: layer("decoder.layers.mlp.shared_experts.gate_weight", i))
                 for name in gated]
    return plan


_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def _write_shards(plan: list[tuple[str, tuple[int, ...], Producer]], out: Path, dtype: torch.dtype,
                  max_shard_bytes: int, progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Write the plan as safetensors shards, streaming: each file's header is written from the planned shapes, then
    each tensor's bytes as its producer makes them. Returns {"files": n, "bytes": total, "params": total}."""
    import math

    itemsize = torch.empty((), dtype=dtype).element_size()
    shards: list[list[tuple[str, tuple[int, ...], Producer]]] = [[]]
    size = 0
    for entry in plan:
        nbytes = math.prod(entry[1]) * itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes
    names = (["model.safetensors"] if len(shards) == 1
             else [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))])
    total = params = done = 0
    weight_map = {}
    for file_name, shard in zip(names, shards):
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, shape, _ in shard:
            nbytes = math.prod(shape) * itemsize
            header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        with open(out / file_name, "wb") as f:
            f.write(len(blob).to_bytes(8, "little"))
            f.write(blob)
            for name, shape, produce in shard:
                tensor = produce().to(dtype).contiguous()
                if tuple(tensor.shape) != tuple(shape):
                    raise HFExportError(f"{name}: produced shape {tuple(tensor.shape)}, planned {shape}")
                f.write(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))
                params += tensor.numel()
                weight_map[name] = file_name
                done += 1
                if progress:
                    progress(done, len(plan))
        total += offset
    if len(names) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))
    return {"files": len(names), "bytes": total, "params": params}


def _tokenizer_files(ours, out: Path) -> dict[str, Any]:
    """Write the tokenizer ``ours`` (a :class:`~align_pipeline.data.tokenizer.TextTokenizer`) as HF files
    (``tokenizer.json``, ``tokenizer_config.json``, its chat template if any) and, byte for byte, as our tokenizer
    directory ``align_tokenizer/`` (its fingerprint verifiable); returns its special token ids, the eos ids being
    every stop id (EOS and a chat template's end-of-turn token) when there are several."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from align_pipeline.model.export_check import PACKED_TOKENIZER

    ours.save(out / PACKED_TOKENIZER)
    if "tokenizer_config.json" in ours.extra_files:  # from an HF model (data_prep.tokenizer.hf_model_dir)
        tok = AutoTokenizer.from_pretrained(str(out / PACKED_TOKENIZER))
    else:  # trained by data_prep: a sequence starts with BOS (add_bos_token), as in training
        tok = PreTrainedTokenizerFast(tokenizer_object=ours.tokenizer, bos_token=ours.id_to_token(ours.bos_id),
                                      eos_token=ours.id_to_token(ours.eos_id), pad_token=ours.id_to_token(ours.pad_id),
                                      add_bos_token=ours.add_bos)
        if ours.chat_template is not None:  # data_prep.tokenizer.chat_template
            tok.chat_template = ours.chat_template.source
    tok.save_pretrained(str(out))
    stops = list(ours.stop_ids)
    return {"bos_token_id": tok.bos_token_id, "eos_token_id": stops if len(stops) > 1 else tok.eos_token_id,
            "pad_token_id": tok.pad_token_id}


def _value_head_note(meta: dict[str, Any], pooling: str | None, bias: list[float] | None) -> tuple[dict, str]:
    """(the ``align_pipeline`` entry of config.json, README text) for a value-head export."""
    how = {
        "last": "score = the model's `logits` (HF pools the last non-pad token, as the project does)",
        "mean": "score = mean over the response tokens of `model.score(model.model(input_ids).last_hidden_state)` "
                "(HF's `logits` are the last token's value only)",
        None: "per-token values = `model.score(model.model(input_ids).last_hidden_state)` (a critic)",
    }[pooling]
    if bias is not None:
        how += f"; then add score_bias={bias} (HF's score layer has no bias)"
    entry = {"head": "value", "stage": meta.get("stage"), "pooling": pooling, "score_bias": bias,
             "loss": (meta.get("reward_head") or {}).get("loss"), "how_to_score": how}
    readme = (f"# Value model exported by align-pipeline ({meta.get('stage')})\n\n"
              f"Pooling in training: {pooling or 'none (per-token values)'}.\n\nHow to score: {how}.\n")
    return entry, readme


def _add_legacy_keys(config_json: Path, model: ModelConfig, dtype: str) -> None:
    """transformers 5 writes RoPE as ``rope_parameters`` and the dtype as ``dtype``; readers built on transformers 4.x
    (vLLM releases among them) read ``rope_theta`` / ``rope_scaling`` / ``torch_dtype`` and would silently fall back
    to theta 10000 without scaling. Both spellings are written (transformers 5 reads the file unchanged)."""
    cfg = json.loads(config_json.read_text())
    rope = _rope_parameters(model)
    cfg["rope_theta"] = rope["rope_theta"]
    if model.rope_scaling != "none":
        cfg["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    cfg["torch_dtype"] = dtype
    config_json.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _refuse_existing(out: Path) -> None:
    """An export never writes into an existing directory (the command's ``--overwrite`` stages beside it)."""
    if out.exists():
        raise HFExportError(f"{out} exists; export into a new directory "
                            "(`align-pipeline export --overwrite` replaces it)")


def export_hf(checkpoint: str | os.PathLike, out_dir: str | os.PathLike, tokenizer: str | os.PathLike | None = None,
              dtype: str = "float32", max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
              progress: Callable[[int, int], None] | None = None,
              merge: Callable[[Path, Path], Path] | None = None) -> dict[str, Any]:
    """Write the model checkpoint at ``checkpoint`` as an HF model directory ``out_dir`` (created; must not exist).

    Policies (LM head) become ``*ForCausalLM``. Reward models and critics (value head) become
    ``*ForSequenceClassification`` with ``num_labels`` = the head's outputs: a last-token-pooled reward model scores
    exactly as in the project (HF pools the last non-pad token); a mean-pooled one or a critic is exported with a
    note (config.json ``align_pipeline.how_to_score`` and README.md) saying how to score it, since HF's head pools
    the last token. A non-zero value-head bias (HF's score layer has none) is kept in that note as ``score_bias``.

    ``tokenizer``: the tokenizer directory to include (default: the checkpoint's own, see
    :func:`~align_pipeline.model.export_check.export_tokenizer`: a tokenizer whose fingerprint differs from the one
    meta.json records is refused before anything is written; none recorded = no tokenizer files). ``dtype``: the weights' dtype in the files ("float32", "bfloat16",
    "float16"). ``progress(done, total)`` is called after each tensor written. ``merge(artifact, out) -> out``: how
    an adapters-only LoRA artifact whose base is an HF directory becomes a plain checkpoint first (it needs a model
    built: the export job merges in its own process, the command launches :mod:`align_pipeline.train.jobs.merge`);
    without it such an artifact is refused. Returns a summary: family,
    architecture, files, parameters, bytes, and the output directory.
    """
    checkpoint, out = Path(checkpoint), Path(out_dir)
    meta = checkpoint_meta(checkpoint)
    if meta.get("kind") != "model":
        raise HFExportError(f"{checkpoint} is a {meta.get('kind')!r} checkpoint; export a model checkpoint (the "
                            "stage's artifact, or <run_dir>/<model>/model)")
    tok = export_tokenizer(checkpoint, meta, tokenizer)  # refused before anything is written: not the trained one
    ckpt = open_tensors(checkpoint)  # adapters alone on a checkpoint base: merged layer by layer while writing
    if ckpt is None:  # adapters on an HF directory: merged into it first (a model must be built)
        if merge is None:
            raise HFExportError(f"{checkpoint} holds LoRA adapters on an HF base; merge them first "
                                "(`align-pipeline export` does)")
        _refuse_existing(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=f".merge-{out.name}-", dir=out.parent))
        try:
            merged = merge(checkpoint, work / "merged")
            if tok is not None:  # the one resolved (and verified) against the LoRA artifact's own meta.json
                tok.save(work / "tokenizer")
            summary = export_hf(merged, out, work / "tokenizer" if tok is not None else None, dtype,
                                max_shard_bytes, progress)
        except BaseException:  # a merge job's run directory (<work>/job: its error names the logs) is kept
            for child in work.iterdir():
                if child.name != "job":
                    shutil.rmtree(child, ignore_errors=True) if child.is_dir() else child.unlink(missing_ok=True)
            raise
        shutil.rmtree(work, ignore_errors=True)
        return summary
    head = meta.get("head", "lm")
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(dtype)
    if torch_dtype is None:
        raise HFExportError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
    model = from_dict(ModelConfig, meta["model"], "meta.json model")
    vocab_size = int(meta["vocab_size"])
    family = family_of(model)
    _refuse_existing(out)
    tmp = out.parent / f".tmp-{out.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tokens = _tokenizer_files(tok, tmp) if tok is not None else {}
    num_labels = int(meta.get("num_outputs", 1)) if head == "value" else None
    config = hf_config(model, vocab_size, torch_dtype, tokens, num_labels=num_labels)
    config.architectures = [architecture(family, head)]
    if head == "value":
        bias = ckpt.read("output_layer.bias")["output_layer.bias"] if ckpt.has("output_layer.bias") else None
        bias = bias.tolist() if bias is not None and bool(bias.abs().max() > 0) else None
        pooling = (meta.get("reward_head") or {}).get("pooling") if meta.get("stage") != "ppo" else None
        config.align_pipeline, readme = _value_head_note(meta, pooling, bias)
        (tmp / "README.md").write_text(readme)
    config.save_pretrained(str(tmp))
    _add_legacy_keys(tmp / "config.json", model, dtype)
    if tokens:
        from transformers import GenerationConfig

        GenerationConfig(**{k: v for k, v in tokens.items() if v is not None}).save_pretrained(str(tmp))
    written = _write_shards(hf_tensors(ckpt, model, vocab_size, head), tmp, torch_dtype, max_shard_bytes, progress)
    (tmp / "align_pipeline_meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True, default=str))
    os.replace(tmp, out)
    return {"family": family, "architecture": config.architectures[0], "out_dir": str(out),
            "tokenizer": bool(tokens), **written}


PEFT_MODULES = {"linear_qkv": ("self_attn", ("q_proj", "k_proj", "v_proj")), "linear_proj": ("self_attn", ("o_proj",)),
                "linear_fc1": ("mlp", ("gate_proj", "up_proj")), "linear_fc2": ("mlp", ("down_proj",)),
                # multi-head latent attention (DeepSeek-V3): one HF module per linear
                "linear_q_proj": ("self_attn", ("q_proj",)), "linear_q_up_proj": ("self_attn", ("q_b_proj",)),
                "linear_kv_up_proj": ("self_attn", ("kv_b_proj",))}
"""Our adapted linears -> HF's modules (a fused linear's adapter becomes one per HF module: the same A, B's rows
split the way the fused weight's are)."""


def export_peft(checkpoint: str | os.PathLike, out_dir: str | os.PathLike,
                base_model: str | os.PathLike | None = None) -> dict[str, Any]:
    """Write the adapters of a LoRA stage's model checkpoint as a PEFT LoRA adapter directory (``adapter_config.json``
    + ``adapter_model.safetensors``) that ``peft.PeftModel.from_pretrained`` loads onto the HF export of the stage's
    base model (``align-pipeline export <base checkpoint> <base_hf>``); ``base_model`` is recorded as
    ``base_model_name_or_path`` (default: the base checkpoint the stage started from). Policies only (an LM head)."""
    from safetensors.torch import save_file

    checkpoint, out = Path(checkpoint), Path(out_dir)
    meta = checkpoint_meta(checkpoint)
    adapters = meta.get("lora")
    if not adapters or not (checkpoint / adapters.get("adapters", "-")).is_dir():
        raise HFExportError(f"{checkpoint} holds no LoRA adapters (trained with <stage>.lora.rank > 0 by this "
                            "version or later?)")
    if meta.get("head", "lm") != "lm":
        raise HFExportError(f"{checkpoint} is a value-head model; PEFT export covers policies (export the merged "
                            "model with `align-pipeline export` instead)")
    _refuse_existing(out)
    model = from_dict(ModelConfig, meta["model"], "meta.json model")
    ckpt = CheckpointTensors(checkpoint / adapters["adapters"])
    tensors: dict[str, torch.Tensor] = {}
    targets = []
    # (our module, HF module): dense MLPs and attention; an MoE layer's shared expert (Qwen2-MoE, DeepSeek-V3)
    from align_pipeline.model.hf import MoENames

    shared = "mlp." + MoENames(family_of(model) if model.moe.enabled() else "").shared_block
    blocks = [(f"decoder.layers.{'self_attention' if block == 'self_attn' else 'mlp'}.{ours}", ours, block, theirs)
              for ours, (block, theirs) in PEFT_MODULES.items()]
    blocks += [(f"decoder.layers.mlp.shared_experts.{ours}", ours, shared, theirs)
               for ours, (block, theirs) in PEFT_MODULES.items() if block == "mlp"]
    if model.moe.enabled() and family_of(model) == "deepseek_v3" and any(
            ckpt.has(f"{name}.lora_A") for name, _, block, _ in blocks if block != "self_attn"):
        # peft (0.21) reads gate_proj / up_proj / down_proj of a deepseek_v3 model as its routed experts' fused
        # weights (transformers 5's layout): adapters on the dense and shared MLPs would be loaded onto the wrong
        # modules (seen: the routed experts wrapped, the dense MLP left alone)
        raise HFExportError(f"{checkpoint}: a DeepSeek-V3 model's MLP adapters (dense layers, shared experts) do not "
                            "load into peft, which maps gate_proj / up_proj / down_proj of deepseek_v3 onto the routed "
                            "experts; export the merged model (`align-pipeline export`), or train with "
                            "lora.target_modules [linear_qkv, linear_proj] for a PEFT export")
    for name, ours, block, theirs in blocks:
        if not ckpt.has(f"{name}.lora_A"):
            continue
        targets += [t for t in theirs if t not in targets]
        for i in range(model.num_layers):
            if not ckpt.has_layer(f"{name}.lora_A", i):
                continue  # an MoE layer has no dense MLP (and a dense layer no shared expert)
            a, b = ckpt.layer(f"{name}.lora_A", i), ckpt.layer(f"{name}.lora_B", i)
            parts = split_qkv(b, model) if ours == "linear_qkv" else b.chunk(2) if ours == "linear_fc1" else [b]
            for module, b_part in zip(theirs, parts):
                pre = f"base_model.model.model.layers.{i}.{block}.{module}"
                tensors[f"{pre}.lora_A.weight"] = a.float().clone()  # one copy per HF module
                tensors[f"{pre}.lora_B.weight"] = b_part.float().contiguous()
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": adapters["rank"], "lora_alpha": adapters["alpha"],
              "lora_dropout": adapters["dropout"], "target_modules": targets, "bias": "none",
              "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
              "base_model_name_or_path": str(base_model or adapters.get("base") or ""),
              "revision": None, "modules_to_save": None}
    tmp = out.parent / f".tmp-{out.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
    (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2))
    (tmp / "align_pipeline_meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True, default=str))
    os.replace(tmp, out)
    return {"out_dir": str(out), "target_modules": targets, "tensors": len(tensors),
            "params": sum(t.numel() for t in tensors.values()), "base_model": config["base_model_name_or_path"]}


def parity(ours: list, tokens: list[list[int]], hf_dir: str | os.PathLike, head: str) -> float:
    """``max |Δ|`` between our outputs ``ours`` on ``tokens`` (logits of a policy, per-token values of a value model:
    :mod:`align_pipeline.train.jobs.logits`) and the HF directory's (``transformers``, fp32; a value model's
    ``score`` over every position, plus the exported ``score_bias``)."""
    with torch.no_grad():
        theirs = hf_outputs(load_hf(hf_dir, head), head, torch.tensor(tokens))
    ours_t = torch.tensor(ours, dtype=torch.float32)
    if tuple(theirs.shape) != tuple(ours_t.shape):
        raise HFExportError(f"output shapes differ: HF {tuple(theirs.shape)} vs ours {tuple(ours_t.shape)}")
    return float((theirs - ours_t).abs().max())


def progress_printer(label: str, stream=None) -> Callable[[int, int], None]:
    """A ``progress`` callback printing ``label: k/n tensors`` at every tenth of the way (long exports)."""
    import sys

    stream = stream or sys.stderr
    step = {"next": 0.1}

    def show(done: int, total: int) -> None:
        if done / total >= step["next"] or done == total:
            print(f"{label}: {done}/{total} tensors written", file=stream, flush=True)
            step["next"] = done / total + 0.1

    return show
