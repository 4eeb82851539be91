"""Build a Llama-style GPT with Megatron-core from :class:`~align_pipeline.config.ModelConfig`.

Covers Llama 2/3.x (RoPE scaling), Qwen2/2.5 (QKV biases, tied embeddings), Qwen3 (explicit head width, QK norm) and
Mistral (explicit head width).

Layer spec: Transformer Engine's when importable (fused kernels, GPU), else Megatron's local spec with the core
attention swapped for :class:`~align_pipeline.model.attention.SDPAttention`. ``attention_backend`` in the config can
force either (``local`` keeps Megatron's unfused attention, used as the reference in tests and benchmarks).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from align_pipeline.config.common import LoRAConfig, ModelConfig, ParallelConfig
from align_pipeline.model import kernels, rope
from align_pipeline.model.attention import SDPAttention
from align_pipeline.model.norm import FusedTorchNorm, TorchNorm


def unwrap(model):
    """The GPTModel inside Megatron's wrappers (DDP, Float16Module); a bare GPT as it is."""
    while hasattr(model, "module"):
        model = model.module
    return model


def have_transformer_engine() -> bool:
    """Transformer Engine's torch bindings are importable (GPU containers only)."""
    if not torch.cuda.is_available() or importlib.util.find_spec("transformer_engine") is None:
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # noqa: BLE001 -- a broken TE install must not stop a run: fall back to SDPA
        return False
    return True


def resolve_attention_backend(model: ModelConfig) -> str:
    """The backend actually used: ``te``, ``sdpa`` or ``local``."""
    if model.attention_backend == "auto":
        return "te" if have_transformer_engine() else "sdpa"
    if model.attention_backend == "te" and not have_transformer_engine():
        raise RuntimeError("attention_backend=te but Transformer Engine is not importable (install the `gpu` extra)")
    return model.attention_backend


def padded_vocab_size(vocab_size: int, model: ModelConfig, tp_size: int) -> int:
    """Embedding rows: the tokenizer's vocab rounded up to a multiple of ``lcm(make_vocab_size_divisible_by, TP)``.

    The padding does not depend on TP beyond divisibility, so a model has the same logits at every TP size (a checkpoint
    saved at TP=2 loads at TP=1).
    """
    multiple = math.lcm(model.make_vocab_size_divisible_by, tp_size)
    return int(math.ceil(vocab_size / multiple) * multiple)


def transformer_config(model: ModelConfig, parallel: ParallelConfig, **overrides) -> TransformerConfig:
    """Megatron ``TransformerConfig`` for our model and parallel settings.

    ``calculate_per_token_loss`` is on: loss functions return (sum, token count) and Megatron divides gradients by the
    token count summed over micro-batches and data-parallel ranks, so DP=N equals DP=1 on the same global batch.
    """
    on_gpu = torch.cuda.is_available()
    recompute = parallel.recompute_granularity
    kwargs = {
        "num_layers": model.num_layers,
        "hidden_size": model.hidden_size,
        "num_attention_heads": model.num_attention_heads,
        "num_query_groups": model.num_query_groups or model.num_attention_heads,
        "kv_channels": model.kv_channels,  # None: hidden / heads
        "qk_layernorm": model.qk_layernorm,
        "ffn_hidden_size": model.ffn_hidden_size or 4 * model.hidden_size,
        "normalization": model.normalization,
        "layernorm_epsilon": model.norm_epsilon,
        "gated_linear_unit": model.activation == "swiglu",
        "activation_func": F.silu if model.activation == "swiglu" else F.gelu,
        "add_bias_linear": model.add_bias_linear,
        "add_qkv_bias": model.add_qkv_bias,
        "init_method_std": model.init_method_std,
        "attention_dropout": model.attention_dropout,
        "hidden_dropout": model.hidden_dropout,
        "tensor_model_parallel_size": parallel.tensor_model_parallel_size,
        "pipeline_model_parallel_size": parallel.pipeline_model_parallel_size,
        "sequence_parallel": parallel.sequence_parallel and parallel.tensor_model_parallel_size > 1,
        "bf16": parallel.bf16,
        "params_dtype": torch.bfloat16 if parallel.bf16 else torch.float32,
        "pipeline_dtype": torch.bfloat16 if parallel.bf16 else torch.float32,
        # CPU runs build weights on the host; with it, TP shards are slices of one master init (TP-invariant init).
        "use_cpu_initialization": not on_gpu,
        "perform_initialization": True,
        "calculate_per_token_loss": True,
        # Fusions that need Apex/TE are off; SDPA provides the fused attention, parallel.kernels the fused RoPE,
        # SwiGLU and norms (model/kernels.py).
        "masked_softmax_fusion": False,
        "bias_activation_fusion": False,
        "bias_dropout_fusion": False,
        "apply_rope_fusion": False,
        "gradient_accumulation_fusion": False,
        "persist_layer_norm": False,
        "recompute_granularity": None if recompute == "none" else recompute,
        "recompute_method": "uniform" if recompute == "full" else None,
        "recompute_num_layers": parallel.recompute_num_layers if recompute == "full" else None,
    }
    kwargs.update(moe_config(model, parallel))
    fused = kernels.use_fused(parallel.kernels, resolve_attention_backend(model))
    kwargs.update(kernels.config_overrides(fused, model.activation == "swiglu", model.add_bias_linear))
    if model.mla.enabled():
        kwargs.update(mla_config(model))
    kwargs.update(overrides)
    return (MLATransformerConfig if model.mla.enabled() else TransformerConfig)(**kwargs)


def mla_config(model: ModelConfig) -> dict:
    """Megatron's multi-head latent attention settings for ``model.mla`` (MLATransformerConfig): the latent and head
    widths, and the RoPE of the rotary part (plain, or YaRN with its two attention-temperature coefficients, which
    Megatron folds into the cos/sin and into the softmax scale as DeepSeek-V3's HF code does)."""
    mla = model.mla
    out = {"multi_latent_attention": True, "q_lora_rank": mla.q_lora_rank or None, "kv_lora_rank": mla.kv_lora_rank,
           "qk_head_dim": mla.qk_head_dim, "qk_pos_emb_head_dim": mla.qk_pos_emb_head_dim,
           "v_head_dim": mla.v_head_dim, "kv_channels": mla.v_head_dim, "qk_layernorm": True,
           "rotary_base": model.rotary_base, "rope_type": "rope", "rotary_scaling_factor": 1.0, "mscale": 1.0,
           "mscale_all_dim": 0.0, "rotary_percent": 1.0}
    if model.rope_scaling == "yarn":
        out |= {"rope_type": "yarn", "rotary_scaling_factor": model.rope_scaling_factor,
                "original_max_position_embeddings": model.rope_original_max_position,
                "beta_fast": model.yarn_beta_fast, "beta_slow": model.yarn_beta_slow, "mscale": model.yarn_mscale,
                "mscale_all_dim": model.yarn_mscale_all_dim}
    return out


def _single_rank_moe(parallel: ParallelConfig) -> bool:
    return (parallel.expert_model_parallel_size == 1 and parallel.tensor_model_parallel_size == 1
            and (parallel.expert_tensor_parallel_size or 1) == 1)


def moe_config(model: ModelConfig, parallel: ParallelConfig) -> dict:
    """Megatron's MoE settings for ``model.moe`` (none for a dense model).

    Dropless routing (no capacity factor); the router's logits and softmax in fp32; tokens reach their experts by
    all-to-all (ranks route different numbers of tokens), or, with grouped experts on one rank, by a sort that never
    waits for the GPU (:class:`~align_pipeline.model.moe.SyncFreeTokenDispatcher`). Experts: :class:`SequentialMLP` (one GEMM pair per local
    expert over its sorted tokens), or Megatron's legacy :class:`GroupedMLP` with ``parallel.moe_grouped_gemm``
    (:mod:`align_pipeline.model.moe`)."""
    moe = model.moe
    if not moe.enabled():
        return {}
    from align_pipeline.model.moe import grouped_gemm_wanted

    _without_te_gemm()
    grouped = grouped_gemm_wanted(parallel.moe_grouped_gemm, parallel.bf16)
    balancing = "aux_loss" if moe.aux_loss_coeff > 0 else "none"
    return {
        "num_moe_experts": moe.num_experts,
        "moe_router_topk": moe.router_topk,
        "moe_ffn_hidden_size": moe.ffn_hidden_size or model.ffn_hidden_size or 4 * model.hidden_size,
        "moe_layer_freq": list(moe.layers) if moe.layers is not None else 1,
        "moe_router_pre_softmax": moe.router_pre_softmax,
        "moe_router_load_balancing_type": balancing,
        "moe_aux_loss_coeff": moe.aux_loss_coeff,
        "moe_z_loss_coeff": moe.z_loss_coeff or None,
        "moe_shared_expert_intermediate_size": moe.shared_expert_ffn_hidden_size or None,
        "moe_shared_expert_gate": moe.shared_expert_gate,
        "moe_router_score_function": moe.router_score_function,
        "moe_router_enable_expert_bias": moe.router_expert_bias,
        "moe_router_bias_update_rate": moe.router_expert_bias_update_rate,
        "moe_router_num_groups": moe.router_num_groups or None,
        "moe_router_group_topk": moe.router_group_topk or None,
        "moe_router_topk_scaling_factor": (moe.router_topk_scaling_factor
                                           if moe.router_topk_scaling_factor != 1.0 else None),
        "moe_router_dtype": "fp32",
        # one rank holds every expert and all of the layer (EP = expert TP = TP = 1) with grouped experts: the
        # all-gather dispatcher (nothing to gather), whose sort build_gpt swaps for a sync-free one
        "moe_token_dispatcher_type": "allgather" if grouped and _single_rank_moe(parallel) else "alltoall",
        "moe_grouped_gemm": grouped,
        "moe_use_legacy_grouped_gemm": grouped,
        "expert_model_parallel_size": parallel.expert_model_parallel_size,
        "expert_tensor_parallel_size": parallel.expert_tensor_parallel_size or parallel.tensor_model_parallel_size,
    }


def _mla_without_te() -> None:
    """Megatron 0.16's MLA module believes Transformer Engine present whenever its extension module imports (which it
    does without TE, mocked), and then asks ``isinstance(..., TELinear)`` of a mock: without TE it is told so."""
    if importlib.util.find_spec("transformer_engine") is None:
        from megatron.core.transformer import multi_latent_attention

        multi_latent_attention.HAVE_TE = False


def _without_te_gemm() -> None:
    """Megatron 0.16's router reads ``moe_utils.te_general_gemm``, which exists only when Transformer Engine imports
    (a NameError otherwise): without TE it is None, and the router takes its torch path."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def block_spec(model: ModelConfig, config: TransformerConfig, pp_rank: int, fused: bool = False,
               lora: LoRAConfig | None = None) -> ModuleSpec | TransformerBlockSubmodules:
    """Decoder spec for the resolved attention backend.

    TE: Megatron's TE layer spec. Otherwise the local spec with :class:`SDPAttention` (unless ``local``) and
    :class:`TorchNorm` for every norm (also the final one), so sequence parallelism works without Apex/TE; ``fused``:
    the compiled norms (:class:`FusedTorchNorm`); ``lora`` (rank > 0): adapters on its target linears
    (:mod:`align_pipeline.model.lora`).
    """
    backend = resolve_attention_backend(model)
    mla = model.mla.enabled()
    if mla:
        _mla_without_te()
        backend = "sdpa"  # Megatron's local DotProductAttention takes no separate key/value widths; TE's spec untested
    if backend == "te" and lora is not None and lora.rank:
        raise ValueError("LoRA adapters go on Megatron's local linears: set model.attention_backend: sdpa "
                         "(Transformer Engine's fused linears take none here)")
    n_local = get_num_layers_to_build(config, pp_rank=pp_rank)
    offset = pp_rank * n_local  # every stage holds the same number of layers (checked)
    if backend == "te":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        if not model.moe.enabled():
            return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=model.qk_layernorm)
        from megatron.core.extensions.transformer_engine import TENorm

        te_dense, te_moe = (get_gpt_layer_with_transformer_engine_spec(
            num_experts=experts, moe_grouped_gemm=False, qk_layernorm=model.qk_layernorm)
            for experts in (None, model.moe.num_experts))
        return TransformerBlockSubmodules(
            layer_specs=[te_moe if model.moe.layer_is_moe(offset + i) else te_dense for i in range(n_local)],
            layer_norm=TENorm)
    norm = FusedTorchNorm if fused else TorchNorm

    def local_layer(num_experts: int | None) -> ModuleSpec:
        layer = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False,
                                         normalization=model.normalization, qk_layernorm=model.qk_layernorm or mla,
                                         multi_latent_attention=mla)
        attn = layer.submodules.self_attention
        replaced = {"core_attention": SDPAttention} if backend == "sdpa" else {}
        if mla:  # the norms of the query bottleneck and of the key/value latent
            replaced |= {"q_layernorm": norm, "kv_layernorm": norm}
        elif model.qk_layernorm:
            replaced |= {"q_layernorm": norm, "k_layernorm": norm}
        attn = dataclasses.replace(attn, submodules=dataclasses.replace(attn.submodules, **replaced))
        mlp = layer.submodules.mlp
        if config.use_te_activation_func:  # set by kernels.config_overrides: the fused SwiGLU module
            mlp = _with_activation(mlp, kernels.FusedSwiGLU)
        layer = dataclasses.replace(
            layer,
            submodules=dataclasses.replace(
                layer.submodules, input_layernorm=norm, pre_mlp_layernorm=norm, self_attention=attn, mlp=mlp
            ),
        )
        if lora is not None and lora.rank:
            from align_pipeline.model.lora import lora_layer_spec

            layer = lora_layer_spec(layer, lora.rank, lora.alpha, lora.dropout, tuple(lora.target_modules))
        return layer

    dense = local_layer(None)
    if not model.moe.enabled():
        return TransformerBlockSubmodules(layer_specs=[dense] * n_local, layer_norm=norm)
    from align_pipeline.model.moe import PerTokenAuxLossRouter, SeededGroupedMLP, SeededSequentialMLP

    moe = local_layer(model.moe.num_experts)
    experts = moe.submodules.mlp.submodules.experts
    if config.moe_grouped_gemm:
        experts = dataclasses.replace(experts, module=SeededGroupedMLP, submodules=None)
    else:
        experts = dataclasses.replace(experts, module=SeededSequentialMLP)
    moe = _replace_mlp(moe, experts=experts, router=PerTokenAuxLossRouter)
    return TransformerBlockSubmodules(
        layer_specs=[moe if model.moe.layer_is_moe(offset + i) else dense for i in range(n_local)], layer_norm=norm)


def _replace_mlp(layer: ModuleSpec, **submodules) -> ModuleSpec:
    mlp = layer.submodules.mlp
    mlp = dataclasses.replace(mlp, submodules=dataclasses.replace(mlp.submodules, **submodules))
    return dataclasses.replace(layer, submodules=dataclasses.replace(layer.submodules, mlp=mlp))


def _with_activation(mlp: ModuleSpec, activation) -> ModuleSpec:
    """``mlp`` (a dense MLP's spec, or an MoE layer's) with ``activation`` as the SwiGLU module of every MLP in it."""
    if mlp.submodules is None:
        return mlp
    if hasattr(mlp.submodules, "activation_func"):
        return dataclasses.replace(mlp, submodules=dataclasses.replace(mlp.submodules, activation_func=activation))
    replaced = {name: _with_activation(getattr(mlp.submodules, name), activation)
                for name in ("experts", "shared_experts") if getattr(mlp.submodules, name, None) is not None}
    return dataclasses.replace(mlp, submodules=dataclasses.replace(mlp.submodules, **replaced))


def build_gpt(
    model: ModelConfig,
    parallel: ParallelConfig,
    vocab_size: int,
    pg_collection: ProcessGroupCollection,
    *,
    pre_process: bool = True,
    post_process: bool = True,
    lora: LoRAConfig | None = None,
) -> GPTModel:
    """One pipeline stage of the GPT (``pre_process``/``post_process`` = first/last stage), on the current device;
    ``lora``: with adapters on its linears (base weights not frozen here: :func:`align_pipeline.model.lora.freeze_base`)."""
    config = transformer_config(model, parallel)
    fused = kernels.use_fused(parallel.kernels, resolve_attention_backend(model))
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=block_spec(model, config, pg_collection.pp.rank(), fused=fused, lora=lora),
        vocab_size=padded_vocab_size(vocab_size, model, parallel.tensor_model_parallel_size),
        max_sequence_length=model.seq_length,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=model.share_embeddings_and_output_weights,
        position_embedding_type=model.position_embedding_type,
        rotary_base=model.rotary_base,  # a float theta must not be truncated
        pg_collection=pg_collection,
    )
    if model.moe.enabled() and gpt.config.use_cpu_initialization:
        from align_pipeline.model.moe import init_experts

        init_experts(gpt, torch.initial_seed())  # the same experts at every EP x expert-TP layout
    if model.moe.enabled():
        from align_pipeline.model.moe import use_sync_free_dispatch

        use_sync_free_dispatch(gpt)
    if model.position_embedding_type == "rope" and not model.mla.enabled():  # MLA: each layer's own (YaRN) RoPE
        # Megatron's RoPE knows only plain theta (and Llama 3's scaling with fixed constants): install ours.
        gpt.rotary_pos_emb.inv_freq = rope.inv_freq(model, gpt.rotary_pos_emb.inv_freq.device)
    if torch.cuda.is_available():
        gpt = gpt.cuda(torch.cuda.current_device())
    return gpt
