"""Hugging Face Llama / Qwen2 / Qwen3 / Mistral (and Qwen3-MoE / Qwen2-MoE / Mixtral) model directories -> our Megatron-core GPT (architecture and weights, any TP/PP).

:func:`model_config_from_hf` converts ``config.json`` to a :class:`~align_pipeline.config.ModelConfig`;
:func:`load_hf_weights` fills one built pipeline stage (``build_gpt``) from ``*.safetensors`` (single or sharded with
``model.safetensors.index.json``) or ``pytorch_model*.bin``.

Name mapping (HF ``model.`` prefix optional; ``i`` = global layer index, Megatron names use the stage-local index):

=====================================================  ==========================================================
Megatron parameter                                     HF tensor(s)
=====================================================  ==========================================================
``embedding.word_embeddings.weight``                   ``model.embed_tokens.weight`` (rows zero-padded)
``decoder.layers.i.input_layernorm.weight`` [1]_       ``model.layers.i.input_layernorm.weight``
``decoder.layers.i.self_attention.linear_qkv.weight``  ``q_proj``, ``k_proj``, ``v_proj`` ``.weight`` fused per group
``decoder.layers.i.self_attention.linear_qkv.bias``    ``q_proj``, ``k_proj``, ``v_proj`` ``.bias`` (Qwen2)
``decoder.layers.i.self_attention.linear_proj.weight`` ``model.layers.i.self_attn.o_proj.weight``
``decoder.layers.i.self_attention.q_layernorm.weight`` ``model.layers.i.self_attn.q_norm.weight`` (Qwen3; k: ``k_``)
``decoder.layers.i.pre_mlp_layernorm.weight`` [1]_     ``model.layers.i.post_attention_layernorm.weight``
``decoder.layers.i.mlp.linear_fc1.weight``             ``[gate_proj; up_proj]`` ``.weight``
``decoder.layers.i.mlp.linear_fc2.weight``             ``model.layers.i.mlp.down_proj.weight``
``decoder.final_layernorm.weight``                     ``model.norm.weight``
``output_layer.weight``                                ``lm_head.weight`` (tied: ``model.embed_tokens.weight``)
=====================================================  ==========================================================

.. [1] With Transformer Engine's spec the norms are fused into the next linear:
   ``self_attention.linear_qkv.layer_norm_weight`` and ``mlp.linear_fc1.layer_norm_weight``.

Megatron's fused QKV rows are grouped by key/value head: for each of the ``ng`` groups, the ``np/ng`` query heads,
then its key head, then its value head (``head_dim`` rows each). ``linear_fc1`` rows are ``[gate; up]`` *per TP rank*.

Tensor parallelism: the full tensor is built, then this rank's slice is taken: column-parallel (QKV by whole groups,
fc1 gate and up sliced separately then concatenated, vocab rows of the padded embedding / output layer) along dim 0,
row-parallel (``linear_proj``, ``linear_fc2``) along dim 1; norms and row-parallel biases are replicated.
Pipeline parallelism: each local layer's global index is its ``layer_number - 1`` (Megatron adds the stage offset of
``get_transformer_layer_offset``); only the stage's own tensors are read (embedding on the first stage, final norm and
output layer on the last).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from align_pipeline.config.checks import HF_MODEL_TYPES
from align_pipeline.config.common import MLAConfig, ModelConfig, MoEConfig

SUPPORTED_MODEL_TYPES = HF_MODEL_TYPES  # one list, also read before any node runs (config.checks.start_arch)


class HFConversionError(ValueError):
    """The HF model cannot be represented by our GPT, or its weights do not match the architecture."""


# ---------------------------------------------------------------------------------------------------------------------
# config.json -> ModelConfig


def read_hf_config(path: str | Path) -> dict[str, Any]:
    config_path = Path(path) / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} not found (not a Hugging Face model directory)")
    return json.loads(config_path.read_text())


def _rope(cfg: dict[str, Any], where: Path) -> dict[str, Any]:
    """RoPE fields of :class:`ModelConfig` from ``rope_parameters`` (transformers 5) or ``rope_theta`` +
    ``rope_scaling`` (4.x): plain, ``linear`` and ``llama3`` scaling; anything else is refused."""
    rope = dict(cfg.get("rope_parameters") or {})
    if isinstance(rope.get("full_attention"), dict):  # per-layer-type form
        rope = dict(rope["full_attention"])
    rope |= {k: v for k, v in (cfg.get("rope_scaling") or {}).items() if k not in rope}
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    partial = cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise HFConversionError(f"{where}: partial_rotary_factor={partial} is not supported (only 1.0)")
    theta = float(rope.get("rope_theta", cfg.get("rope_theta")) or 10000.0)
    if rope_type == "default":
        return {"rotary_base": theta}

    def factor(key: str) -> Any:
        if rope.get(key) is None:
            raise HFConversionError(f"{where}: RoPE scaling {rope_type!r} needs {key!r}")
        return rope[key]

    if rope_type == "linear":
        return {"rotary_base": theta, "rope_scaling": "linear", "rope_scaling_factor": float(factor("factor"))}
    if rope_type == "llama3":
        return {"rotary_base": theta, "rope_scaling": "llama3", "rope_scaling_factor": float(factor("factor")),
                "rope_low_freq_factor": float(factor("low_freq_factor")),
                "rope_high_freq_factor": float(factor("high_freq_factor")),
                "rope_original_max_position": int(factor("original_max_position_embeddings"))}
    if rope_type == "yarn":
        # transformers: cos/sin times get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim) when both are
        # set (else get_mscale(factor)), the softmax scale times get_mscale(factor, mscale_all_dim)^2 when that is
        # set: Megatron's MLA computes exactly this from (mscale, mscale_all_dim) = (1, 0) when neither is set.
        mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
        if bool(mscale) != bool(mscale_all_dim) or rope.get("attention_factor") is not None \
                or rope.get("truncate", True) is False:
            raise HFConversionError(f"{where}: YaRN with mscale={mscale}, mscale_all_dim={mscale_all_dim}, "
                                    f"attention_factor={rope.get('attention_factor')}, truncate={rope.get('truncate')}"
                                    " is not supported (both mscales or neither; no attention_factor; truncate)")
        return {"rotary_base": theta, "rope_scaling": "yarn", "rope_scaling_factor": float(factor("factor")),
                "rope_original_max_position": int(factor("original_max_position_embeddings")),
                "yarn_beta_fast": float(rope.get("beta_fast") or 32.0),
                "yarn_beta_slow": float(rope.get("beta_slow") or 1.0),
                "yarn_mscale": float(mscale or 1.0), "yarn_mscale_all_dim": float(mscale_all_dim or 0.0)}
    raise HFConversionError(f"{where}: RoPE scaling {rope_type!r} ({rope}) is not supported; supported: default, "
                            "linear, llama3, yarn (multi-head latent attention)")


def _sliding_window(cfg: dict[str, Any], model_type: str, seq_length: int, where: Path) -> int | None:
    """The window of sliding-window attention, if the model uses one. Within a window attention is full, so a model
    with a window of at least ``seq_length`` is reproduced exactly; a shorter window is refused."""
    window = cfg.get("sliding_window")
    if model_type in ("qwen2", "qwen3", "qwen3_moe", "qwen2_moe"):
        used = cfg.get("use_sliding_window", False) or "sliding_attention" in (cfg.get("layer_types") or [])
        window = window if used else None
    if window is None:
        return None
    if int(window) < seq_length:
        raise HFConversionError(
            f"{where}: sliding_window={window} is shorter than model.seq_length={seq_length}; sliding-window "
            f"attention is not implemented, so train with model.seq_length <= {window} (attention is then full)"
        )
    return int(window)


def _moe(cfg: dict[str, Any], model_type: str, layers: int, where: Path) -> MoEConfig:
    """The MoE section of a Qwen3-MoE, Qwen2-MoE or Mixtral ``config.json`` (a dense family: none).

    Qwen3-MoE: ``num_experts`` (transformers 5 writes ``num_local_experts``) of ``moe_intermediate_size``, top
    ``num_experts_per_tok``; layer i is MoE unless it is in ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step``
    (those are dense MLPs of ``intermediate_size``); ``norm_topk_prob`` renormalises the chosen experts'
    probabilities. Qwen2-MoE: the same, plus a shared expert of ``shared_expert_intermediate_size`` in every MoE
    layer, gated by sigmoid(``shared_expert_gate``). Mixtral: ``num_local_experts`` of ``intermediate_size`` in
    every layer, always renormalised. All: the load-balancing loss with ``router_aux_loss_coef`` when
    ``output_router_logits`` (HF trains with it only then)."""
    if model_type == "deepseek_v3":
        return _deepseek_moe(cfg, layers, where)
    if model_type not in ("qwen3_moe", "qwen2_moe", "mixtral"):
        return MoEConfig()

    def need(*keys: str) -> Any:
        for key in keys:
            if cfg.get(key) is not None:
                return cfg[key]
        raise HFConversionError(f"{where}: required field {keys[0]!r} is missing")

    if model_type == "mixtral":
        experts, ffn, normalised, pattern = int(need("num_local_experts")), int(need("intermediate_size")), True, None
        if float(cfg.get("router_jitter_noise") or 0.0):
            raise HFConversionError(f"{where}: router_jitter_noise={cfg['router_jitter_noise']} is not supported "
                                    "(only 0.0)")
    else:
        experts, ffn = int(need("num_experts", "num_local_experts")), int(need("moe_intermediate_size"))
        normalised = bool(cfg.get("norm_topk_prob", False))
        step, dense = int(cfg.get("decoder_sparse_step") or 1), set(cfg.get("mlp_only_layers") or [])
        pattern = [int(i not in dense and (i + 1) % step == 0) for i in range(layers)]
        if all(pattern):
            pattern = None
        elif not any(pattern):
            raise HFConversionError(f"{where}: mlp_only_layers / decoder_sparse_step leave no MoE layer")
        elif cfg.get("intermediate_size") is None:
            raise HFConversionError(f"{where}: required field 'intermediate_size' is missing (the dense layers' MLP)")
    if experts < 1:
        raise HFConversionError(f"{where}: {'num_local_experts' if model_type == 'mixtral' else 'num_experts'}="
                                f"{experts}: no experts")
    topk = int(need("num_experts_per_tok"))
    if not 1 <= topk <= experts:
        raise HFConversionError(f"{where}: num_experts_per_tok={topk} is not in [1, {experts}]")
    aux = float(cfg.get("router_aux_loss_coef") or 0.0) if cfg.get("output_router_logits") else 0.0
    shared = int(need("shared_expert_intermediate_size")) if model_type == "qwen2_moe" else 0
    if model_type == "qwen2_moe" and shared < 1:
        raise HFConversionError(f"{where}: shared_expert_intermediate_size={shared}: Qwen2-MoE's shared expert needs "
                                "a width of at least 1")
    return MoEConfig(num_experts=experts, router_topk=topk, ffn_hidden_size=ffn, layers=pattern,
                     router_pre_softmax=not normalised, aux_loss_coeff=aux, shared_expert_ffn_hidden_size=shared,
                     shared_expert_gate=model_type == "qwen2_moe")


def _deepseek_moe(cfg: dict[str, Any], layers: int, where: Path) -> MoEConfig:
    """DeepSeek-V3's MoE: ``n_routed_experts`` of ``moe_intermediate_size``, top ``num_experts_per_tok`` by
    sigmoid score plus ``e_score_correction_bias``, within the ``topk_group`` best of ``n_group`` groups (a group
    ranked by the sum of its two best scores), the chosen scores renormalised and times ``routed_scaling_factor``;
    ``n_shared_experts`` shared experts (one MLP of their summed width, ungated); the first
    ``first_k_dense_replace`` layers dense. Megatron ranks a group by its top ``topk / topk_group`` scores and always
    renormalises sigmoid scores: other settings are refused."""
    def need(key: str) -> Any:
        if cfg.get(key) is None:
            raise HFConversionError(f"{where}: required field {key!r} is missing")
        return cfg[key]

    experts, topk = int(need("n_routed_experts")), int(need("num_experts_per_tok"))
    groups, group_topk = int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1)
    if not 1 <= topk <= experts:
        raise HFConversionError(f"{where}: num_experts_per_tok={topk} is not in [1, {experts}]")
    if not cfg.get("norm_topk_prob", True):
        raise HFConversionError(f"{where}: norm_topk_prob=false is not supported (Megatron renormalises the chosen "
                                "experts' sigmoid scores)")
    if groups > 1 and (experts % groups or not 1 <= group_topk <= groups or topk != 2 * group_topk):
        raise HFConversionError(f"{where}: n_group={groups}, topk_group={group_topk} with num_experts_per_tok={topk}"
                                " is not supported (groups ranked by their top-2 scores need num_experts_per_tok = "
                                "2 x topk_group, and n_group must divide n_routed_experts)")
    dense = int(cfg.get("first_k_dense_replace") or 0)
    if dense >= layers:
        raise HFConversionError(f"{where}: first_k_dense_replace={dense} leaves no MoE layer of {layers}")
    pattern = [int(i >= dense) for i in range(layers)] if dense else None
    shared = int(cfg.get("n_shared_experts") or 0) * int(need("moe_intermediate_size"))
    return MoEConfig(num_experts=experts, router_topk=topk, ffn_hidden_size=int(need("moe_intermediate_size")),
                     layers=pattern, router_pre_softmax=False, shared_expert_ffn_hidden_size=shared,
                     router_score_function="sigmoid", router_expert_bias=True,
                     router_num_groups=groups if groups > 1 else 0, router_group_topk=group_topk if groups > 1 else 0,
                     router_topk_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0))


def _mla(cfg: dict[str, Any], where: Path) -> MLAConfig:
    """DeepSeek-V3's multi-head latent attention widths; its rotary part interleaved (``rope_interleave``, what
    Megatron's MLA applies)."""
    if cfg.get("rope_interleave", True) is False:
        raise HFConversionError(f"{where}: rope_interleave=false is not supported (Megatron's MLA rotates "
                                "interleaved pairs, as DeepSeek-V3 does)")
    if cfg.get("attention_bias"):
        raise HFConversionError(f"{where}: attention_bias=true is not supported for deepseek_v3")
    if cfg.get("quantization_config"):
        raise HFConversionError(f"{where}: a quantized checkpoint ({cfg['quantization_config'].get('quant_method')})"
                                " is not supported: dequantize it to bf16 first")
    for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        if not cfg.get(key):
            raise HFConversionError(f"{where}: required field {key!r} is missing")
    return MLAConfig(kv_lora_rank=int(cfg["kv_lora_rank"]), q_lora_rank=int(cfg.get("q_lora_rank") or 0),
                     qk_head_dim=int(cfg["qk_nope_head_dim"]), qk_pos_emb_head_dim=int(cfg["qk_rope_head_dim"]),
                     v_head_dim=int(cfg["v_head_dim"]))


def model_config_from_hf(path: str | Path, base: ModelConfig) -> tuple[ModelConfig, int]:
    """Our :class:`ModelConfig` for the HF Llama / Qwen2 / Qwen3 / Mistral / Qwen3-MoE / Qwen2-MoE / Mixtral model in ``path``, and its vocabulary size.

    Architecture comes from ``config.json``; run-time choices come from ``base``: ``seq_length`` (the training length
    is ours to choose), ``attention_backend``, ``make_vocab_size_divisible_by`` and the dropouts.

    Raises:
        HFConversionError: another model type, or a feature our GPT cannot reproduce (RoPE scaling other than
            linear/llama3, a sliding window shorter than ``seq_length``, biases on attention but not the MLP,
            non-SiLU activation, ...), named with its field.
    """
    path = Path(path)
    cfg = read_hf_config(path)
    where = path / "config.json"
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise HFConversionError(
            f"{where}: model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )

    def need(key: str) -> Any:
        if cfg.get(key) is None:
            raise HFConversionError(f"{where}: required field {key!r} is missing")
        return cfg[key]

    hidden, heads, layers = int(need("hidden_size")), int(need("num_attention_heads")), int(need("num_hidden_layers"))
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    if model_type != "deepseek_v3" and ((cfg.get("head_dim") is None and hidden % heads) or heads % kv_heads):
        raise HFConversionError(f"{where}: hidden_size={hidden}, num_attention_heads={heads}, "
                                f"num_key_value_heads={kv_heads} are inconsistent")
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise HFConversionError(f"{where}: hidden_act={act!r} is not supported (these families use 'silu')")

    if model_type == "qwen2":
        add_qkv_bias, add_bias_linear = True, False
    elif model_type in ("mistral", "mixtral"):
        add_qkv_bias, add_bias_linear = False, False
    elif model_type == "qwen2_moe":  # biases on q, k and v (qkv_bias, true unless a config says otherwise)
        add_qkv_bias, add_bias_linear = bool(cfg.get("qkv_bias", True)), False
    elif model_type == "deepseek_v3":  # attention_bias refused by _mla
        add_qkv_bias, add_bias_linear = False, False
    elif model_type == "qwen3_moe":
        if cfg.get("attention_bias"):
            raise HFConversionError(f"{where}: attention_bias=true is not supported for qwen3_moe (our MoE GPT has "
                                    "no biases)")
        add_qkv_bias, add_bias_linear = False, False
    else:  # llama, qwen3: attention_bias (q, k, v and o) and, for llama, mlp_bias
        attention_bias, mlp_bias = bool(cfg.get("attention_bias", False)), bool(cfg.get("mlp_bias", False))
        if attention_bias != mlp_bias:
            raise HFConversionError(
                f"{where}: attention_bias={attention_bias} with mlp_bias={mlp_bias} is not supported (our GPT has "
                "biases on all linear layers or on none)"
            )
        add_qkv_bias, add_bias_linear = False, attention_bias

    vocab = int(need("vocab_size"))
    moe = _moe(cfg, model_type, layers, where)
    dense_ffn = cfg.get("intermediate_size") if model_type in ("qwen3_moe", "qwen2_moe") else need("intermediate_size")
    mla = _mla(cfg, where) if model_type == "deepseek_v3" else MLAConfig()
    if mla.enabled():
        kv_heads, head_dim = heads, hidden // heads  # MLA has no key/value heads of its own; head_dim unused
    model = ModelConfig(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=kv_heads,
        ffn_hidden_size=int(dense_ffn or moe.ffn_hidden_size),
        seq_length=base.seq_length,
        vocab_size=vocab,
        make_vocab_size_divisible_by=base.make_vocab_size_divisible_by,
        position_embedding_type="rope",
        **_rope(cfg, where),
        kv_channels=head_dim if head_dim * heads != hidden else None,
        qk_layernorm=model_type in ("qwen3", "qwen3_moe"),
        sliding_window=_sliding_window(cfg, model_type, base.seq_length, where),
        normalization="RMSNorm",
        norm_epsilon=float(cfg.get("rms_norm_eps", 1e-6)),
        activation="swiglu",
        add_bias_linear=add_bias_linear,
        add_qkv_bias=add_qkv_bias,
        share_embeddings_and_output_weights=bool(cfg.get("tie_word_embeddings", False)),
        init_method_std=float(cfg.get("initializer_range", base.init_method_std)),
        attention_dropout=base.attention_dropout,
        hidden_dropout=base.hidden_dropout,
        attention_backend=base.attention_backend,
        max_position_embeddings=cfg.get("max_position_embeddings"),
        hf_family=model_type,
        moe=moe,
        mla=mla,
    )
    model.validate()
    return model, vocab


# ---------------------------------------------------------------------------------------------------------------------
# Reading the weight files


class HFTensors:
    """Lazy access to the tensors of an HF model directory, by name (``model.`` prefix stripped)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._where: dict[str, tuple[Path, str]] = {}  # canonical name -> (file, stored name)
        self._open: dict[Path, Any] = {}
        files, weight_map = self._files()
        for file in files:
            for stored in self._keys_of(file):
                self._add(stored, file)
        stored_names = {s for _, s in self._where.values()}
        listed_not_found = sorted(set(weight_map) - stored_names)
        if listed_not_found:
            raise FileNotFoundError(f"{self.path}: the index lists tensors no shard holds: {listed_not_found[:10]}")

    def _files(self) -> tuple[list[Path], dict[str, Path]]:
        p = self.path
        for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
            index = p / index_name
            if index.is_file():
                weight_map = {k: p / v for k, v in json.loads(index.read_text())["weight_map"].items()}
                files = sorted(set(weight_map.values()))
                missing = [f.name for f in files if not f.is_file()]
                if missing:
                    raise FileNotFoundError(f"{index}: shard files missing: {missing}")
                return files, weight_map
        for name in ("model.safetensors", "pytorch_model.bin"):
            if (p / name).is_file():
                return [p / name], {}
        found = sorted(p.glob("*.safetensors"))
        if found:
            return found, {}
        raise FileNotFoundError(f"{p}: no model.safetensors(.index.json) or pytorch_model.bin(.index.json) found")

    def _keys_of(self, file: Path) -> Iterable[str]:
        if file.suffix == ".safetensors":
            from safetensors import safe_open

            handle = safe_open(str(file), framework="pt")
            self._open[file] = handle
            return list(handle.keys())
        try:
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # legacy (non-zip) torch.save format cannot be memory-mapped
            state = torch.load(file, map_location="cpu", weights_only=True)
        self._open[file] = state
        return list(state.keys())

    def _add(self, stored: str, file: Path) -> None:
        name = stored.removeprefix("model.")
        if name in self._where:
            raise HFConversionError(f"{self.path}: tensor {name!r} stored twice ({self._where[name][1]!r}, {stored!r})")
        self._where[name] = (file, stored)

    def keys(self) -> set[str]:
        return set(self._where)

    def stored_name(self, name: str) -> str:
        return self._where[name][1]

    def get(self, name: str) -> torch.Tensor:
        file, stored = self._where[name]
        handle = self._open[file]
        return handle.get_tensor(stored) if file.suffix == ".safetensors" else handle[stored]


# ---------------------------------------------------------------------------------------------------------------------
# Weights -> a built GPT stage


_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")


def _tp_rank_size(gpt) -> tuple[int, int]:
    """This rank's place in the model's tensor-parallel group (the process groups it was built with)."""
    pgs = getattr(gpt, "pg_collection", None)
    if pgs is None or getattr(pgs, "tp", None) is None:
        raise ValueError("the model has no process groups (build it with model.gpt.build_gpt)")
    return pgs.tp.rank(), pgs.tp.size()


def is_moe_layer(config, i: int) -> bool:
    """Layer ``i`` of a Megatron ``TransformerConfig`` has an MoE MLP."""
    if not config.num_moe_experts:
        return False
    freq = config.moe_layer_freq
    return bool(freq[i]) if isinstance(freq, list) else i % freq == 0


class MoENames:
    """HF names of one MoE layer's router and experts: Qwen3-MoE and Qwen2-MoE (``mlp.gate``,
    ``mlp.experts.E.{gate,up,down}_proj``; Qwen2-MoE's shared expert ``mlp.shared_expert.*``) or Mixtral (``block_sparse_moe.gate``, ``block_sparse_moe.experts.E.{w1,w3,w2}``: gate, up, down). transformers 5
    holds the experts fused in memory (``mlp.experts.gate_up_proj`` [E, 2F, H] with the gate rows first,
    ``mlp.experts.down_proj`` [E, H, F]) and writes them per expert; a directory with the fused form reads too."""

    def __init__(self, family: str):
        if family == "mixtral":
            self.block, self.parts = "block_sparse_moe", ("w1", "w3", "w2")
        else:
            self.block, self.parts = "mlp", ("gate_proj", "up_proj", "down_proj")
        self.shared_block = "shared_experts" if family == "deepseek_v3" else "shared_expert"

    def expert_bias(self, pre: str) -> str:
        """DeepSeek-V3's routing bias (``e_score_correction_bias``: chooses experts, does not weight them)."""
        return f"{pre}{self.block}.gate.e_score_correction_bias"

    def router(self, pre: str) -> str:
        return f"{pre}{self.block}.gate.weight"

    def expert(self, pre: str, e: int, part: int) -> str:
        """``part``: 0 gate, 1 up, 2 down."""
        return f"{pre}{self.block}.experts.{e}.{self.parts[part]}.weight"

    def shared(self, pre: str, gate: bool) -> tuple[str, ...]:
        """The shared expert's gate, up and down projections (Qwen2-MoE ``mlp.shared_expert``, DeepSeek-V3
        ``mlp.shared_experts``: its shared experts as one MLP of their summed width), and Qwen2-MoE's sigmoid gate."""
        return (*(f"{pre}mlp.{self.shared_block}.{p}_proj.weight" for p in ("gate", "up", "down")),
                *((f"{pre}mlp.shared_expert_gate.weight",) if gate else ()))

    @staticmethod
    def fused(pre: str) -> tuple[str, str]:
        return f"{pre}mlp.experts.gate_up_proj", f"{pre}mlp.experts.down_proj"

    def keys(self, pre: str, experts: int, present: set[str]) -> set[str]:
        if set(self.fused(pre)) & present:
            return {self.router(pre), *self.fused(pre)}
        return {self.router(pre)} | {self.expert(pre, e, k) for e in range(experts) for k in range(3)}


def expected_hf_keys(config, tied: bool, family: str | None = None,
                     present: set[str] | None = None) -> tuple[set[str], set[str]]:
    """(required, optional) canonical HF names for a Megatron ``TransformerConfig`` (whole model, every stage);
    an MoE model's experts are named as ``family`` names them, per expert or fused as ``present`` holds them."""
    required = {"embed_tokens.weight", "norm.weight"}
    optional = set()
    (optional if tied else required).add("lm_head.weight")
    moe = MoENames(family or "")
    for i in range(config.num_layers):
        pre = f"layers.{i}."
        required |= {pre + n for n in ("input_layernorm.weight", "post_attention_layernorm.weight",
                                       "self_attn.o_proj.weight")}
        if getattr(config, "multi_latent_attention", False):
            required |= {pre + "self_attn." + n for n in (
                ("q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight") if config.q_lora_rank
                else ("q_proj.weight",)) + ("kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight", "kv_b_proj.weight")}
        else:
            required |= {pre + f"self_attn.{p}_proj.weight" for p in "qkv"}
        if is_moe_layer(config, i):
            required |= moe.keys(pre, config.num_moe_experts, present or set())
            if config.moe_router_enable_expert_bias:
                required.add(moe.expert_bias(pre))
            if config.moe_shared_expert_intermediate_size:
                required |= set(moe.shared(pre, config.moe_shared_expert_gate))
        else:
            required |= {pre + n for n in ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")}
        if config.qk_layernorm and not getattr(config, "multi_latent_attention", False):
            required |= {pre + "self_attn.q_norm.weight", pre + "self_attn.k_norm.weight"}
        if config.add_qkv_bias or config.add_bias_linear:
            required |= {pre + f"self_attn.{p}_proj.bias" for p in "qkv"}
        if config.add_bias_linear:
            required |= {pre + n for n in ("self_attn.o_proj.bias", "mlp.gate_proj.bias", "mlp.up_proj.bias",
                                           "mlp.down_proj.bias")}
    return required, optional


def _rows(t: torch.Tensor, rank: int, size: int, dim: int = 0) -> torch.Tensor:
    return t.chunk(size, dim=dim)[rank] if size > 1 else t


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] > rows:
        raise HFConversionError(f"vocabulary of {t.shape[0]} rows does not fit the model's {rows} embedding rows")
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def load_hf_weights(path: str | Path, module) -> dict[str, Any]:
    """Copy the HF weights in ``path`` into ``module`` (a GPT stage from ``build_gpt``, possibly wrapped), in place.

    Every parameter of the stage gets a value, and every tensor in the files belongs to the architecture (rotary
    ``inv_freq`` buffers excepted). A model with a value head (:func:`~align_pipeline.model.heads.attach_value_head`)
    takes everything but the LM head (``lm_head.weight`` is then optional and unused). Otherwise :class:`HFConversionError` names the offending keys. Each rank reads
    only the tensors of its own stage and keeps its own TP slice.

    Returns:
        {"loaded": number of parameters filled, "hf_tensors_read": number of HF tensors read on this rank}.
    """
    from align_pipeline.model import lora
    from align_pipeline.model.gpt import unwrap

    gpt = unwrap(module)
    config = gpt.config
    value_head = getattr(gpt, "head", "lm") == "value"
    tied = bool(getattr(gpt, "share_embeddings_and_output_weights", False))
    tp_rank, tp_size = _tp_rank_size(gpt)
    hf = HFTensors(path)

    present = hf.keys()
    hf_config = read_hf_config(path)
    family = hf_config.get("model_type")
    if family == "deepseek_v3":  # the multi-token-prediction layers after the last (transformers drops them too)
        mtp = re.compile(r"^layers\.(\d+)\.")
        present = {k for k in present if not ((m := mtp.match(k)) and int(m.group(1)) >= config.num_layers)}
    required, optional = expected_hf_keys(config, tied or value_head, family, present)  # lm_head optional
    missing = sorted(required - present)
    unexpected = sorted(k for k in present - required - optional if not _IGNORED.search(k))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing HF tensors: {missing[:20]}{' ...' if len(missing) > 20 else ''}")
        if unexpected:
            shown = [hf.stored_name(k) for k in unexpected[:20]]
            parts.append(f"unexpected HF tensors (not part of the architecture): {shown}"
                         f"{' ...' if len(unexpected) > 20 else ''}")
        raise HFConversionError(f"{path}: weights do not match the model config: " + "; ".join(parts))

    heads, groups = config.num_attention_heads, config.num_query_groups or config.num_attention_heads
    head_dim = config.kv_channels or config.hidden_size // heads
    mla = getattr(config, "multi_latent_attention", False)
    hidden, ffn = config.hidden_size, config.ffn_hidden_size
    if groups % tp_size:
        raise HFConversionError(f"num_query_groups={groups} is not divisible by TP={tp_size}")
    read: set[str] = set()

    def get(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        t = hf.get(name)
        if tuple(t.shape) != shape:
            raise HFConversionError(f"{path}: {hf.stored_name(name)} has shape {tuple(t.shape)}, expected {shape}")
        read.add(name)
        return t

    def qkv(pre: str, suffix: str) -> torch.Tensor:
        rest = (hidden,) if suffix == "weight" else ()
        q = get(f"{pre}self_attn.q_proj.{suffix}", (heads * head_dim, *rest))
        k = get(f"{pre}self_attn.k_proj.{suffix}", (groups * head_dim, *rest))
        v = get(f"{pre}self_attn.v_proj.{suffix}", (groups * head_dim, *rest))
        fused = torch.cat([q.reshape(groups, heads // groups * head_dim, *rest),
                           k.reshape(groups, head_dim, *rest), v.reshape(groups, head_dim, *rest)], dim=1)
        return _rows(fused, tp_rank, tp_size).reshape(-1, *rest)  # whole groups per rank

    def fc1(pre: str, suffix: str) -> torch.Tensor:
        rest = (hidden,) if suffix == "weight" else ()
        gate = get(f"{pre}mlp.gate_proj.{suffix}", (ffn, *rest))
        up = get(f"{pre}mlp.up_proj.{suffix}", (ffn, *rest))
        return torch.cat([_rows(gate, tp_rank, tp_size), _rows(up, tp_rank, tp_size)])

    moe = MoENames(family or "")
    if config.num_moe_experts:
        ep_rank, ep_size = gpt.pg_collection.ep.rank(), gpt.pg_collection.ep.size()
        etp_rank, etp_size = gpt.pg_collection.expt_tp.rank(), gpt.pg_collection.expt_tp.size()
        experts, expert_ffn = config.num_moe_experts, config.moe_ffn_hidden_size
        local_experts = experts // ep_size

    def expert_weight(pre: str, j: int, part: int) -> torch.Tensor:
        """Local expert ``j``'s gate (0), up (1) or down (2) weight, whole (this EP rank's expert ep_rank x local + j)."""
        e = ep_rank * local_experts + j
        shape = (hidden, expert_ffn) if part == 2 else (expert_ffn, hidden)
        gate_up, down = moe.fused(pre)
        if gate_up in present:
            fused = get(down, (experts, hidden, expert_ffn)) if part == 2 else \
                get(gate_up, (experts, 2 * expert_ffn, hidden))
            return fused[e] if part == 2 else fused[e].chunk(2)[part]
        return get(moe.expert(pre, e, part), shape)

    def expert_fc1(pre: str, j: int) -> torch.Tensor:
        return torch.cat([_rows(expert_weight(pre, j, 0), etp_rank, etp_size),
                          _rows(expert_weight(pre, j, 1), etp_rank, etp_size)])

    def expert_fc2(pre: str, j: int) -> torch.Tensor:
        return _rows(expert_weight(pre, j, 2), etp_rank, etp_size, dim=1)

    def shared_fc1(pre: str) -> torch.Tensor:
        width = config.moe_shared_expert_intermediate_size
        gate, up, _ = moe.shared(pre, False)
        return torch.cat([_rows(get(gate, (width, hidden)), tp_rank, tp_size),
                          _rows(get(up, (width, hidden)), tp_rank, tp_size)])

    def expert_source(pre: str, rest: str) -> Callable[[], torch.Tensor] | None:
        m = _EXPERT.match(rest)
        if rest == "mlp.router.weight":
            return lambda: get(moe.router(pre), (experts, hidden))
        if rest == "mlp.shared_experts.linear_fc1.weight":
            return lambda: shared_fc1(pre)
        if rest == "mlp.shared_experts.linear_fc2.weight":
            return lambda: _rows(get(moe.shared(pre, False)[2], (hidden, config.moe_shared_expert_intermediate_size)),
                                 tp_rank, tp_size, dim=1)
        if rest == "mlp.shared_experts.gate_weight":
            return lambda: get(moe.shared(pre, True)[3], (1, hidden))
        # Grouped experts (model.moe's GroupedMLP): each local expert's fc1 / fc2 transposed, one after the other
        if rest == "mlp.experts.weight1":
            return lambda: torch.stack([expert_fc1(pre, j).t() for j in range(local_experts)]).reshape(hidden, -1)
        if rest == "mlp.experts.weight2":
            return lambda: torch.stack([expert_fc2(pre, j).t() for j in range(local_experts)]).reshape(-1, hidden)
        if m is None:
            return None
        j, linear = int(m.group(1)), m.group(2)
        if linear == "linear_fc1.weight":
            return lambda: expert_fc1(pre, j)
        if linear == "linear_fc2.weight":
            return lambda: expert_fc2(pre, j)
        return None

    def vocab_rows(name: str, local_rows: int) -> torch.Tensor:
        t = hf.get(name)
        if t.dim() != 2 or t.shape[1] != hidden:
            raise HFConversionError(f"{path}: {hf.stored_name(name)} has shape {tuple(t.shape)}, expected [vocab, "
                                    f"{hidden}]")
        read.add(name)
        return _rows(_pad_rows(t, local_rows * tp_size), tp_rank, tp_size)

    def mla_source(pre: str, rest: str) -> Callable[[], torch.Tensor] | None:
        """Multi-head latent attention: every linear but the output projection is column-parallel, its rows sliced
        contiguously by TP (the down projections too: Megatron gathers their outputs); the per-head up projections'
        rows are [nope | rope] (queries) and [nope | v] (keys/values) per head in both layouts."""
        a = pre + "self_attn."
        q_width, kv_latent = heads * (config.qk_head_dim + config.qk_pos_emb_head_dim), config.kv_lora_rank
        return {
            "self_attention.linear_q_proj.weight": lambda: _rows(get(a + "q_proj.weight", (q_width, hidden)),
                                                                 tp_rank, tp_size),
            "self_attention.linear_q_down_proj.weight": lambda: _rows(
                get(a + "q_a_proj.weight", (config.q_lora_rank, hidden)), tp_rank, tp_size),
            "self_attention.q_layernorm.weight": lambda: get(a + "q_a_layernorm.weight", (config.q_lora_rank,)),
            "self_attention.linear_q_up_proj.weight": lambda: _rows(
                get(a + "q_b_proj.weight", (q_width, config.q_lora_rank)), tp_rank, tp_size),
            "self_attention.linear_kv_down_proj.weight": lambda: _rows(get(
                a + "kv_a_proj_with_mqa.weight", (kv_latent + config.qk_pos_emb_head_dim, hidden)), tp_rank, tp_size),
            "self_attention.kv_layernorm.weight": lambda: get(a + "kv_a_layernorm.weight", (kv_latent,)),
            "self_attention.linear_kv_up_proj.weight": lambda: _rows(get(
                a + "kv_b_proj.weight", (heads * (config.qk_head_dim + config.v_head_dim), kv_latent)),
                tp_rank, tp_size),
            "self_attention.linear_proj.weight": lambda: _rows(
                get(a + "o_proj.weight", (hidden, heads * config.v_head_dim)), tp_rank, tp_size, dim=1),
        }.get(rest)

    def layer_source(pre: str, rest: str) -> Callable[[], torch.Tensor] | None:
        norm = (hidden,)
        if mla and rest.startswith("self_attention."):
            return mla_source(pre, rest)
        return {
            "input_layernorm.weight": lambda: get(pre + "input_layernorm.weight", norm),
            "self_attention.linear_qkv.layer_norm_weight": lambda: get(pre + "input_layernorm.weight", norm),
            "pre_mlp_layernorm.weight": lambda: get(pre + "post_attention_layernorm.weight", norm),
            "mlp.linear_fc1.layer_norm_weight": lambda: get(pre + "post_attention_layernorm.weight", norm),
            "self_attention.q_layernorm.weight": lambda: get(pre + "self_attn.q_norm.weight", (head_dim,)),
            "self_attention.k_layernorm.weight": lambda: get(pre + "self_attn.k_norm.weight", (head_dim,)),
            "self_attention.linear_qkv.weight": lambda: qkv(pre, "weight"),
            "self_attention.linear_qkv.bias": lambda: qkv(pre, "bias"),
            "self_attention.linear_proj.weight": lambda: _rows(
                get(pre + "self_attn.o_proj.weight", (hidden, heads * head_dim)), tp_rank, tp_size, dim=1),
            "self_attention.linear_proj.bias": lambda: get(pre + "self_attn.o_proj.bias", (hidden,)),
            "mlp.linear_fc1.weight": lambda: fc1(pre, "weight"),
            "mlp.linear_fc1.bias": lambda: fc1(pre, "bias"),
            "mlp.linear_fc2.weight": lambda: _rows(
                get(pre + "mlp.down_proj.weight", (hidden, ffn)), tp_rank, tp_size, dim=1),
            "mlp.linear_fc2.bias": lambda: get(pre + "mlp.down_proj.bias", (hidden,)),
        }.get(rest)

    # Every parameter (including tied/shared ones appearing once) must have a source.
    plan: list[tuple[str, torch.nn.Parameter, Callable[[], torch.Tensor]]] = []
    unmapped = []
    for name, param in gpt.named_parameters():
        source = None
        if value_head and name.startswith("output_layer."):
            continue  # a new value head (reward model / critic from a causal LM) keeps its initialisation
        if lora.is_adapter(name):
            continue  # fresh LoRA adapters keep theirs
        if name == "embedding.word_embeddings.weight":
            source = (lambda p=param: vocab_rows("embed_tokens.weight", p.shape[0]))
        elif name == "decoder.final_layernorm.weight":
            source = (lambda: get("norm.weight", (hidden,)))
        elif name == "output_layer.weight":
            # Tied embeddings with PP > 1: the last stage holds its own copy of the embedding.
            key = "embed_tokens.weight" if tied else "lm_head.weight"
            source = (lambda p=param, key=key: vocab_rows(key, p.shape[0]))
        elif m := _LAYER.match(name):
            global_index = gpt.decoder.layers[int(m.group(1))].layer_number - 1  # includes the PP stage offset
            pre = f"layers.{global_index}."
            source = layer_source(pre, m.group(2)) or (
                expert_source(pre, m.group(2)) if config.num_moe_experts else None)
        if source is None:
            unmapped.append(name)
        else:
            plan.append((name, param, source))
    if unmapped:
        raise HFConversionError(f"no HF tensor maps to these Megatron parameters: {unmapped}")

    if config.num_moe_experts and config.moe_router_enable_expert_bias:  # a buffer, not a parameter
        for layer in gpt.decoder.layers:
            if getattr(layer.mlp, "router", None) is not None:
                bias = moe.expert_bias(f"layers.{layer.layer_number - 1}.")
                plan.append((bias, layer.mlp.router.expert_bias, lambda bias=bias: get(bias, (experts,))))

    with torch.no_grad():
        for name, param, source in plan:
            value = source()
            if tuple(value.shape) != tuple(param.shape):
                raise HFConversionError(f"{name}: converted shape {tuple(value.shape)} != parameter shape "
                                        f"{tuple(param.shape)} (TP rank {tp_rank}/{tp_size})")
            param.copy_(value.to(dtype=param.dtype))

    # An explicit lm_head next to tied embeddings must be the embedding itself, or logits would silently change.
    if tied and "lm_head.weight" in present and "embed_tokens.weight" in read and not torch.equal(
        hf.get("lm_head.weight"), hf.get("embed_tokens.weight")
    ):
        raise HFConversionError(f"{path}: tie_word_embeddings=true but lm_head.weight differs from embed_tokens")
    return {"loaded": len(plan), "hf_tensors_read": len(read)}


def load_hf(hf_dir: str | Path, head: str):
    """The export loaded by ``transformers`` in fp32 (``head="value"``: as ``*ForSequenceClassification``)."""
    if head == "value":
        from transformers import AutoModelForSequenceClassification

        return AutoModelForSequenceClassification.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()


def hf_outputs(model, head: str, ids: torch.Tensor) -> torch.Tensor:
    """A loaded export's outputs on ``ids``: a policy's logits, or a value model's per-token values (its score layer
    on every position, plus the ``score_bias`` the export's note keeps). Call under ``torch.no_grad()``."""
    if head == "value":
        hidden = getattr(model, model.base_model_prefix)(ids).last_hidden_state
        return model.score(hidden) + torch.tensor(
            (getattr(model.config, "align_pipeline", None) or {}).get("score_bias") or 0.0)
    return model(ids).logits
