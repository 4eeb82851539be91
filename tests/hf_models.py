"""Tiny random-init Hugging Face models of every family the project imports and exports (made with `transformers`,
never downloaded), shared by the import, export and Kedro tests."""

from __future__ import annotations

import torch

VOCAB = 100


def _tiny(model_type: str, **overrides):
    import transformers

    name = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral", "qwen3_moe": "Qwen3Moe",
            "qwen2_moe": "Qwen2Moe", "mixtral": "Mixtral", "deepseek_v3": "DeepseekV3"}[model_type]
    config_cls, model_cls = getattr(transformers, f"{name}Config"), getattr(transformers, f"{name}ForCausalLM")
    kwargs = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "intermediate_size": 128, "vocab_size": VOCAB, "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
              **overrides}
    torch.manual_seed(0)
    model = model_cls(config_cls(**kwargs))
    with torch.no_grad():  # make every weight matter: norms != 1, biases != 0, larger embeddings
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
            elif "embed_tokens" in name or "lm_head" in name:
                p.copy_(torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    return model.eval()


# Llama 3.1 scaling with a short original context, so that all three frequency bands occur within 12 positions.
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}


def tiny_family_models() -> dict:
    """{name: transformers model} for every supported family and its distinctive features (shared with the export
    tests): Llama-2 style, Llama-3.2 style (llama3 RoPE scaling, tied), linear RoPE scaling, Qwen2.5 style (QKV
    biases, tied), Qwen3 (head_dim 32 != 64/4, QK norm, tied), Mistral (head_dim 32, a sliding window >= seq_length)."""
    return {
        "llama": _tiny("llama", rope_theta=50000.0),
        "llama3": _tiny("llama", rope_parameters=dict(LLAMA3_ROPE), tie_word_embeddings=True),
        "llama_linear": _tiny("llama", rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
        "qwen2": _tiny("qwen2", tie_word_embeddings=True),
        "qwen3": _tiny("qwen3", head_dim=32, tie_word_embeddings=True),
        "mistral": _tiny("mistral", head_dim=32, sliding_window=64),
    }


def tiny_moe_models() -> dict:
    """{name: transformers model} of the MoE families: Qwen3-MoE (4 experts, top 2, renormalised, QK norm, head_dim 32,
    the last of 4 layers dense through ``mlp_only_layers``), Qwen3-MoE without ``norm_topk_prob`` (the chosen
    experts' probabilities as the softmax over all gives them), Qwen2-MoE (the same layout without QK norm, with QKV
    biases and a gated shared expert of width 40, not renormalised as its default is), Mixtral (4 experts, top 2,
    every layer MoE), DeepSeek-V3 (multi-head latent attention with a query bottleneck and YaRN RoPE, the first
    layer dense, 8 experts in 2 groups of which a token may use 1, top 2 by sigmoid score plus a random routing
    bias, scaled by 2.5, one shared expert) and DeepSeek-V3 with a full-rank query projection and plain RoPE. The
    router weights are scaled up so that tokens spread over the experts (a near-uniform router ties)."""
    qwen = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48, "head_dim": 32,
            "num_hidden_layers": 4, "mlp_only_layers": [3], "decoder_sparse_step": 1}
    models = {
        "qwen3_moe": _tiny("qwen3_moe", norm_topk_prob=True, **qwen),
        "qwen3_moe_unnormalised": _tiny("qwen3_moe", norm_topk_prob=False, **qwen),
        "qwen2_moe": _tiny("qwen2_moe", norm_topk_prob=False, shared_expert_intermediate_size=40,
                           **{k: v for k, v in qwen.items() if k != "head_dim"}),
        "mixtral": _tiny("mixtral", num_local_experts=4, num_experts_per_tok=2, intermediate_size=48),
        "deepseek_v3": _tiny("deepseek_v3", q_lora_rank=32, rope_parameters=dict(YARN_ROPE), **DEEPSEEK),
        "deepseek_v3_q_proj": _tiny("deepseek_v3", q_lora_rank=None, **DEEPSEEK),
    }
    torch.manual_seed(1)
    with torch.no_grad():
        for model in models.values():
            for name, p in model.named_parameters():
                if name.endswith("gate.weight") and p.shape[0] == 4:
                    p.mul_(4.0)
            for name, b in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    b.copy_(0.3 * torch.randn_like(b))
    return models


# DeepSeek-V3's layout in small: widths that TP=2 divides (query bottleneck 32, latent 16 + rotary 8, 4 heads).
DEEPSEEK = {"num_hidden_layers": 3, "num_key_value_heads": 4, "first_k_dense_replace": 1, "n_routed_experts": 8,
            "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "n_shared_experts": 1,
            "moe_intermediate_size": 32, "intermediate_size": 96, "kv_lora_rank": 16, "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 8, "v_head_dim": 16, "norm_topk_prob": True, "routed_scaling_factor": 2.5}
YARN_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
             "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0}


def demo_hf_tokenizer(path, raw=None, added: tuple[str, ...] = (), chat_template: bool = True):
    """A character tokenizer that covers the raw data (``raw``, default the demo's ``data/01_raw``), trained with
    ``tokenizers`` and saved to ``path`` as a ``transformers`` fast tokenizer with ``added`` special tokens on top
    and (``chat_template``) a plain chat template; returns it."""
    from pathlib import Path

    from transformers import PreTrainedTokenizerFast

    from align_pipeline.data.schemas import read_raw_jsonl, record_texts
    from align_pipeline.data.tokenizer import train_tokenizer

    raw = Path(raw) if raw is not None else Path(__file__).resolve().parents[1] / "data" / "01_raw"
    texts = [t for kind in ("sft", "preference", "prompts")
             for rec in read_raw_jsonl(raw / f"{kind}.jsonl", kind).records for t in record_texts(rec)]
    ours = train_tokenizer(texts)
    tok = PreTrainedTokenizerFast(tokenizer_object=ours.tokenizer, bos_token=ours.id_to_token(ours.bos_id),
                                  eos_token=ours.id_to_token(ours.eos_id), pad_token=ours.id_to_token(ours.pad_id))
    if added:
        tok.add_special_tokens({"additional_special_tokens": list(added)})
    if chat_template:
        tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    tok.save_pretrained(str(path))
    return tok
