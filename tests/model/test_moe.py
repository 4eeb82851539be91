"""Mixture-of-experts models (Qwen3-MoE, Mixtral) on CPU with real Megatron-core MoE layers on gloo: logits equal
transformers' at every expert layout, import -> export returns the source tensors, the config mapping and its
refusals, SFT at EP=2 equals EP=1 and resumes bit-exact, the reward model and PPO at EP=2 equal EP=1, the router's
load metrics."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from hf_models import tiny_moe_models
from jobs import TINY_MODEL, losses, make_sft_data, run_sft, sft_job

from align_pipeline.config import LaunchConfig, ModelConfig, ParallelConfig
from align_pipeline.config.base import ConfigError
from align_pipeline.config.checks import Arch, check_model_parallel, check_world
from align_pipeline.config.common import MLAConfig, MoEConfig
from align_pipeline.launch import run_torchrun
from align_pipeline.model.hf import HFConversionError, model_config_from_hf

TESTS = Path(__file__).resolve().parents[1]
SEQ = 12
TOKENS = np.random.default_rng(0).integers(0, 100, size=(2, SEQ)).tolist()
TOL = 1e-4


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_hf")
    dirs, logits = {}, {}
    for name, model in tiny_moe_models().items():
        model.save_pretrained(root / name)
        dirs[name] = str(root / name)
        with torch.no_grad():
            logits[name] = model(torch.tensor(TOKENS)).logits.float().numpy()
    return dirs, logits


def _run(tmp: Path, nproc: int, layouts: dict, models: dict) -> dict:
    tmp.mkdir(parents=True)
    env = {"PYTHONPATH": os.pathsep.join([str(TESTS / "model"), os.environ.get("PYTHONPATH", "")])}
    config = {"layouts": layouts, "seq_length": 32, "tokens": TOKENS, "models": models, "bad_dirs": {}}
    return run_torchrun("hf_worker", config, LaunchConfig(nproc_per_node=nproc), tmp, env=env)


def _assert_logits(result: dict, expected: dict, layout: str) -> None:
    for name, want in expected.items():
        ours = np.asarray(result[layout]["logits"][name])
        assert ours.shape == want.shape, (layout, name)
        np.testing.assert_allclose(ours, want, atol=TOL, rtol=0, err_msg=f"{layout}: {name}")


def test_logits_equal_transformers_at_ep1(moe_dirs, tmp_path):
    dirs, expected = moe_dirs
    result = _run(tmp_path / "run", 1, {"ep1": {}, "ep1_grouped": {"moe_grouped_gemm": "on"}}, dirs)
    for layout in ("ep1", "ep1_grouped"):  # a GEMM pair per expert; one grouped GEMM per projection
        _assert_logits(result, expected, layout)


def test_logits_equal_transformers_at_ep2_and_tp2_x_ep2(moe_dirs, tmp_path):
    """Four gloo ranks: EP=2 (DP 4), TP=2 x EP=2 with sequence parallelism (experts split over expert TP = 2, or
    whole with expert TP = 1). (PP=2 x EP=2: the import -> export test.)"""
    dirs, expected = moe_dirs
    layouts = {
        "ep2": {"expert_model_parallel_size": 2},
        "tp2_ep2": {"tensor_model_parallel_size": 2, "expert_model_parallel_size": 2, "sequence_parallel": True},
        "tp2_ep2_etp1": {"tensor_model_parallel_size": 2, "expert_model_parallel_size": 2,
                         "expert_tensor_parallel_size": 1, "sequence_parallel": True},
        "tp2_ep2_grouped": {"tensor_model_parallel_size": 2, "expert_model_parallel_size": 2,
                            "sequence_parallel": True, "moe_grouped_gemm": "on"},
    }
    result = _run(tmp_path / "run", 4, layouts, dirs)
    for layout in layouts:
        _assert_logits(result, expected, layout)


@pytest.mark.parametrize("name,layout", [("qwen3_moe", (2, 1, 2)), ("qwen3_moe_unnormalised", (1, 2, 2)),
                                         ("qwen2_moe", (2, 1, 2)), ("mixtral", (1, 1, 2)), ("deepseek_v3", (2, 1, 2)),
                                         ("deepseek_v3_q_proj", (1, 1, 2))])
def test_import_then_export_gives_the_source_tensors_and_config(moe_dirs, tmp_path, name, layout):
    from safetensors.torch import load_file

    from align_pipeline.launch.model_jobs import import_hf
    from align_pipeline.model.hf_export import export_hf

    dirs, _ = moe_dirs
    source = Path(dirs[name])
    tp, pp, ep = layout
    result = import_hf(source, tmp_path / "ckpt", tp=tp, pp=pp, ep=ep, seq_length=32)
    family = {"mixtral": "mixtral", "qwen2_moe": "qwen2_moe"}.get(name, name[:11] if "deepseek" in name else "qwen3_moe")
    assert result["model"]["hf_family"] == family
    summary = export_hf(tmp_path / "ckpt", tmp_path / "out")
    assert summary["architecture"] == {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                                       "deepseek_v3": "DeepseekV3ForCausalLM"}.get(family, "Qwen3MoeForCausalLM")
    theirs, ours = load_file(str(source / "model.safetensors")), load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(ours) == sorted(theirs)
    for key in theirs:
        assert torch.equal(ours[key], theirs[key]), key
    src_cfg, out_cfg = (json.loads((d / "config.json").read_text()) for d in (source, tmp_path / "out"))
    for key in ("model_type", "architectures", "num_experts", "num_local_experts", "num_experts_per_tok",
                "moe_intermediate_size", "intermediate_size", "mlp_only_layers", "norm_topk_prob",
                "decoder_sparse_step", "rope_parameters", "num_key_value_heads", "rms_norm_eps",
                "shared_expert_intermediate_size", "qkv_bias", "n_routed_experts", "n_shared_experts", "n_group",
                "topk_group", "first_k_dense_replace", "routed_scaling_factor", "q_lora_rank", "kv_lora_rank",
                "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "rope_interleave"):
        assert out_cfg.get(key) == src_cfg.get(key), key


def test_config_mapping(moe_dirs):
    dirs, _ = moe_dirs
    qwen, _ = model_config_from_hf(dirs["qwen3_moe"], ModelConfig(seq_length=32))
    assert qwen.moe == MoEConfig(num_experts=4, router_topk=2, ffn_hidden_size=48, layers=[1, 1, 1, 0],
                                 router_pre_softmax=False, aux_loss_coeff=0.0)
    assert qwen.ffn_hidden_size == 128 and qwen.qk_layernorm and qwen.hf_family == "qwen3_moe"
    unnormalised, _ = model_config_from_hf(dirs["qwen3_moe_unnormalised"], ModelConfig(seq_length=32))
    assert unnormalised.moe.router_pre_softmax
    mixtral, _ = model_config_from_hf(dirs["mixtral"], ModelConfig(seq_length=32))
    assert mixtral.moe == MoEConfig(num_experts=4, router_topk=2, ffn_hidden_size=48)
    assert not mixtral.qk_layernorm and mixtral.hf_family == "mixtral"
    qwen2, _ = model_config_from_hf(dirs["qwen2_moe"], ModelConfig(seq_length=32))
    assert qwen2.moe == MoEConfig(num_experts=4, router_topk=2, ffn_hidden_size=48, layers=[1, 1, 1, 0],
                                  router_pre_softmax=True, shared_expert_ffn_hidden_size=40, shared_expert_gate=True)
    assert qwen2.add_qkv_bias and not qwen2.add_bias_linear and not qwen2.qk_layernorm
    assert qwen2.hf_family == "qwen2_moe" and qwen2.kv_channels is None
    deepseek, _ = model_config_from_hf(dirs["deepseek_v3"], ModelConfig(seq_length=32))
    assert deepseek.moe == MoEConfig(num_experts=8, router_topk=2, ffn_hidden_size=32, layers=[0, 1, 1],
                                     shared_expert_ffn_hidden_size=32, router_score_function="sigmoid",
                                     router_expert_bias=True, router_num_groups=2, router_group_topk=1,
                                     router_topk_scaling_factor=2.5)
    assert deepseek.mla == MLAConfig(kv_lora_rank=16, q_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=8,
                                     v_head_dim=16)
    assert (deepseek.rope_scaling, deepseek.rope_scaling_factor, deepseek.rope_original_max_position,
            deepseek.yarn_mscale, deepseek.yarn_mscale_all_dim) == ("yarn", 4.0, 16, 1.0, 1.0)
    plain, _ = model_config_from_hf(dirs["deepseek_v3_q_proj"], ModelConfig(seq_length=32))
    assert plain.mla.q_lora_rank == 0 and plain.rope_scaling == "none" and plain.ffn_hidden_size == 96


def _edited(src: str, dst: Path, **changes) -> str:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)


@pytest.mark.parametrize("name,changes,message", [
    ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise=0.1 is not supported"),
    ("qwen3_moe", {"attention_bias": True}, "attention_bias=true is not supported for qwen3_moe"),
    ("qwen3_moe", {"mlp_only_layers": [0, 1, 2, 3]}, "leave no MoE layer"),
    ("qwen3_moe", {"num_experts_per_tok": 5}, "num_experts_per_tok=5 is not in [1, 4]"),
    ("qwen3_moe", {"output_router_logits": True, "router_aux_loss_coef": 0.02}, None),
    ("qwen2_moe", {"shared_expert_intermediate_size": None}, "required field 'shared_expert_intermediate_size'"),
    ("qwen2_moe", {"shared_expert_intermediate_size": 0}, "shared_expert_intermediate_size=0"),
    ("deepseek_v3", {"rope_interleave": False}, "rope_interleave=false is not supported"),
    ("deepseek_v3", {"norm_topk_prob": False}, "norm_topk_prob=false is not supported"),
    ("deepseek_v3", {"topk_group": 2}, "n_group=2, topk_group=2 with num_experts_per_tok=2 is not supported"),
    ("deepseek_v3", {"quantization_config": {"quant_method": "fp8"}}, "is not supported: dequantize it"),
    ("deepseek_v3", {"first_k_dense_replace": 3}, "first_k_dense_replace=3 leaves no MoE layer"),
])
def test_config_refusals_and_the_aux_loss(moe_dirs, tmp_path, name, changes, message):
    path = _edited(moe_dirs[0][name], tmp_path / "edited", **changes)
    if message is None:  # HF trains with the load-balancing loss only when output_router_logits is on
        model, _ = model_config_from_hf(path, ModelConfig(seq_length=32))
        assert model.moe.aux_loss_coeff == 0.02
        return
    with pytest.raises(HFConversionError, match=message.replace("[", r"\[").replace("]", r"\]")):
        model_config_from_hf(path, ModelConfig(seq_length=32))


MOE = {"num_experts": 4, "router_topk": 2, "ffn_hidden_size": 32, "aux_loss_coeff": 0.01,
       "shared_expert_ffn_hidden_size": 24, "shared_expert_gate": True}
"""The training tests' MoE layers: 4 routed experts, top 2, the aux loss on, a gated shared expert (Qwen2-MoE's
layout, so the models export as qwen2_moe)."""


def test_layout_checks_before_launch():
    arch = Arch(ModelConfig(num_layers=2, seq_length=48, moe=MoEConfig(**MOE)))
    check_model_parallel(arch, ParallelConfig(expert_model_parallel_size=4))
    with pytest.raises(ConfigError, match="expert_model_parallel_size=3 does not divide params:model.moe.num_experts=4"):
        check_model_parallel(arch, ParallelConfig(expert_model_parallel_size=3))
    with pytest.raises(ConfigError, match="need a mixture-of-experts model"):
        check_model_parallel(Arch(ModelConfig(seq_length=48)), ParallelConfig(expert_model_parallel_size=2))
    for ep in (1, 2):  # Megatron's MoE layer trains under TP only with sequence parallelism
        with pytest.raises(ConfigError, match="trains with sequence parallelism.*set params:parallel.sequence_parallel"):
            check_model_parallel(arch, ParallelConfig(tensor_model_parallel_size=2, expert_model_parallel_size=ep))
    with pytest.raises(ConfigError, match="expert TP 4 .* does not divide the experts' ffn_hidden_size=30"):
        check_model_parallel(Arch(ModelConfig(num_layers=2, seq_length=48, moe=MoEConfig(
            **{**MOE, "ffn_hidden_size": 30}))), ParallelConfig(expert_tensor_parallel_size=4))
    with pytest.raises(ConfigError, match="world size 6 is not divisible by params:parallel.expert_model_parallel_size=4"):
        check_world(ParallelConfig(expert_model_parallel_size=4), 6)
    mla = Arch(ModelConfig(num_layers=2, seq_length=48, moe=MoEConfig(**MOE), mla=MLAConfig(
        kv_lora_rank=14, q_lora_rank=32, qk_pos_emb_head_dim=8)))
    check_model_parallel(mla, ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True))
    with pytest.raises(ConfigError, match=r"tensor_model_parallel_size=4 does not divide params:model.mla.kv_lora_rank"
                                          r"=14 \+ params:model.mla.qk_pos_emb_head_dim=8"):
        check_model_parallel(mla, ParallelConfig(tensor_model_parallel_size=4, sequence_parallel=True))
    with pytest.raises(ConfigError, match=r"moe.layers has 3 entries for model.num_layers=2"):
        ModelConfig(num_layers=2, moe=MoEConfig(**MOE, layers=[1, 0, 1])).validate()


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory):
    return make_sft_data(tmp_path_factory.mktemp("moe_sft"), n_train=64)


@pytest.fixture(scope="module")
def moe_base(sft_data, tmp_path_factory):
    """A random-init MoE model (every layer MoE, 4 experts, top 2) after a short SFT at EP=1, its data and prompts."""
    from jobs import make_pref_data, make_prompts

    root = tmp_path_factory.mktemp("moe_base")
    base = run_sft(sft_job(sft_data, root / "sft", model={"moe": MoEConfig(**MOE)}))
    return {"base": base, "tokenizer": sft_data["tokenizer"], "pref": make_pref_data(root / "pref", sft_data["tokenizer"]),
            "prompts": make_prompts(root / "prompts", sft_data["tokenizer"])}


def test_sft_at_ep2_equals_ep1_and_resumes_bit_exact(sft_data, tmp_path):
    """A random-init MoE model (every layer MoE, 4 experts, top 2, aux loss on): the same model at EP=1, EP=2,
    TP=2 x EP=2, and EP=2 and EP=1 with grouped expert GEMMs (the experts are drawn per (layer, expert), not from
    the shared stream), the same losses; 3 steps, stop, resume,
    3 steps at EP=2 give the uninterrupted run's losses and weights. The router's load metrics are logged."""
    model = {"moe": MoEConfig(**MOE)}
    ep1 = run_sft(sft_job(sft_data, tmp_path / "ep1", model=model))
    ep2 = run_sft(sft_job(sft_data, tmp_path / "ep2", model=model,
                          parallel={"expert_model_parallel_size": 2}), nproc=2)
    # TP=2 x EP=2 (sequence parallel): the load-balancing loss weighs the same (PerTokenAuxLossRouter)
    tp2_ep2 = run_sft(sft_job(sft_data, tmp_path / "tp2_ep2", model=model, parallel={
        "tensor_model_parallel_size": 2, "expert_model_parallel_size": 2, "sequence_parallel": True}), nproc=4)
    # grouped expert GEMMs (GroupedMLP on torch's grouped matmul) at EP=2: the same model and steps
    grouped = run_sft(sft_job(sft_data, tmp_path / "grouped", model=model, parallel={
        "expert_model_parallel_size": 2, "moe_grouped_gemm": "on"}), nproc=2)
    # and at EP=1 (one rank: the sync-free token sort)
    grouped_ep1 = run_sft(sft_job(sft_data, tmp_path / "grouped_ep1", model=model, parallel={"moe_grouped_gemm": "on"}))
    for other in (ep2, tp2_ep2, grouped, grouped_ep1):
        np.testing.assert_allclose(losses(other), losses(ep1), atol=2e-5, rtol=0)
        assert abs(other["val_loss"] - ep1["val_loss"]) < 2e-5
    assert "ep=2" in (tmp_path / "ep2" / "logs" / "rank0.log").read_text().splitlines()[0]

    last = ep2["train_metrics"]
    assert 0.9 < last["moe/aux_loss"] < 4.0  # 1.0 = balanced; at most E (= 4) when one expert takes everything
    loads = [last[f"moe/expert_{e}/load"] for e in range(4)]
    assert abs(sum(loads) - 4.0) < 1e-6 and last["moe/load_max"] >= max(loads) and last["moe/load_min"] <= min(loads)
    assert last == pytest.approx(ep1["train_metrics"] | {k: last[k] for k in ("step_time_s", "tokens_per_s")},
                                 abs=2e-5)

    run_dir = tmp_path / "interrupted"
    first = run_sft(sft_job(sft_data, run_dir, model=model,
                            parallel={"expert_model_parallel_size": 2}, stop_after=3), nproc=2)
    assert first["stopped_at_step"] == 3 and losses(first) == losses(ep2)[:3]
    resumed = run_sft(sft_job(sft_data, run_dir, model=model,
                              parallel={"expert_model_parallel_size": 2}), nproc=2)
    assert [h["step"] for h in resumed["history"]] == [4, 5, 6]
    assert losses(resumed) == losses(ep2)[3:] and resumed["val_loss"] == ep2["val_loss"]  # bit-exact


DEEPSEEK_MODEL = {
    "moe": MoEConfig(num_experts=8, router_topk=2, ffn_hidden_size=32, layers=[0, 1], shared_expert_ffn_hidden_size=32,
                     router_score_function="sigmoid", router_expert_bias=True, router_expert_bias_update_rate=0.05,
                     router_num_groups=2, router_group_topk=1, router_topk_scaling_factor=2.5),
    "mla": MLAConfig(kv_lora_rank=16, q_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16),
    "rope_scaling": "yarn", "rope_scaling_factor": 4.0, "rope_original_max_position": 16, "yarn_mscale": 1.0,
    "yarn_mscale_all_dim": 1.0, "num_query_groups": None}
"""DeepSeek-V3's layout in small: multi-head latent attention with YaRN, the first layer dense, 8 experts in 2 groups
(a token may use 1), top 2 by sigmoid score plus a routing bias that moves towards balance after every step
(aux-loss-free balancing), scaled by 2.5, a shared expert."""


def test_deepseek_v3_sft_at_ep2_and_tp2_x_ep2_equals_ep1_and_resumes_bit_exact(sft_data, tmp_path):
    """A random-init DeepSeek-V3-shaped model: SFT at EP=2 and TP=2 x EP=2 (sequence parallel) gives EP=1's losses;
    the routing bias moves after each step (the losses differ from a run with the bias frozen) by the tokens every
    rank routed (so EP=2 equals EP=1 with it); stop after 3 steps and resume: bit-exact, the bias included. Packed
    rows give the padded rows' per-sample NLL."""
    ep1 = run_sft(sft_job(sft_data, tmp_path / "ep1", model=DEEPSEEK_MODEL))
    frozen_moe = dataclasses.replace(DEEPSEEK_MODEL["moe"], router_expert_bias_update_rate=0.0)
    frozen = run_sft(sft_job(sft_data, tmp_path / "frozen", model=DEEPSEEK_MODEL | {"moe": frozen_moe}))
    assert losses(frozen)[0] == losses(ep1)[0] and max(abs(a - b) for a, b in zip(losses(frozen), losses(ep1))) > 1e-4
    ep2 = run_sft(sft_job(sft_data, tmp_path / "ep2", model=DEEPSEEK_MODEL,
                          parallel={"expert_model_parallel_size": 2}), nproc=2)
    tp2_ep2 = run_sft(sft_job(sft_data, tmp_path / "tp2_ep2", model=DEEPSEEK_MODEL, parallel={
        "tensor_model_parallel_size": 2, "expert_model_parallel_size": 2, "sequence_parallel": True}), nproc=4)
    for other in (ep2, tp2_ep2):
        np.testing.assert_allclose(losses(other), losses(ep1), atol=2e-5, rtol=0)
        assert abs(other["val_loss"] - ep1["val_loss"]) < 2e-5

    run_dir = tmp_path / "interrupted"
    first = run_sft(sft_job(sft_data, run_dir, model=DEEPSEEK_MODEL, parallel={"expert_model_parallel_size": 2},
                            stop_after=3), nproc=2)
    assert first["stopped_at_step"] == 3 and losses(first) == losses(ep2)[:3]
    resumed = run_sft(sft_job(sft_data, run_dir, model=DEEPSEEK_MODEL, parallel={"expert_model_parallel_size": 2}),
                      nproc=2)
    assert losses(resumed) == losses(ep2)[3:] and resumed["val_loss"] == ep2["val_loss"]

    # packed rows (several samples per row, each attending to itself: SDPA with the block-diagonal mask, MLA's RoPE
    # restarting per sample) give each sample's padded NLL
    env = {"PYTHONPATH": os.pathsep.join([str(TESTS / "model"), os.environ.get("PYTHONPATH", "")])}
    (tmp_path / "packed").mkdir()
    run_torchrun("packing_worker", {"checkpoint": ep1["model_dir"], "parallel": {}, "data": sft_data["val"],
                                    "samples": list(range(16)), "pairs": None, "reward_model": None},
                 LaunchConfig(nproc_per_node=1), tmp_path / "packed", env=env)
    packed = json.loads((tmp_path / "packed" / "result.json").read_text())
    assert packed["segments"] > packed["rows"]
    np.testing.assert_allclose(packed["packed"], packed["padded"], rtol=0, atol=1e-5)


def _assert_peft_equals_merged(sft_data: dict, tmp: Path) -> None:
    """The PEFT adapters in ``tmp/peft`` loaded (``peft``) onto the base's HF export ``tmp/base_hf`` give the merged
    export ``tmp/merged_hf``'s logits on two validation rows, and differ from the base's (the adapters are applied,
    not ignored)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from align_pipeline.data.store import load_rows

    tokens = torch.tensor(load_rows(sft_data["val"])["input_ids"][:2].tolist())
    with torch.no_grad():
        peft_logits = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(
            tmp / "base_hf", dtype=torch.float32), tmp / "peft")(tokens).logits
        merged = AutoModelForCausalLM.from_pretrained(tmp / "merged_hf", dtype=torch.float32)(tokens).logits
        plain = AutoModelForCausalLM.from_pretrained(tmp / "base_hf", dtype=torch.float32)(tokens).logits
    assert (peft_logits - merged).abs().max() < 1e-4
    assert (plain - merged).abs().max() > 1e-3


def test_deepseek_v3_lora_on_latent_attention_at_tp2_x_ep2_and_its_peft_export(sft_data, tmp_path):
    """LoRA on a DeepSeek-V3-shaped model: adapters on multi-head latent attention's per-head linears (the query and
    key/value up projections, the output projection) and the shared expert, none on the down projections, routed
    experts or routers; TP=2 x EP=2 (sequence parallel) gives EP=1's losses. The base exports as DeepSeek-V3; the
    merged model exports; attention adapters export as PEFT (``q_b_proj``, ``kv_b_proj``, ``o_proj``), which ``peft``
    loads onto the base with the merged export's logits; MLP adapters are refused for PEFT (peft maps deepseek_v3's
    gate/up/down projections onto the routed experts)."""

    from align_pipeline.model.hf_export import CheckpointTensors, HFExportError, export_hf, export_peft

    base = run_sft(sft_job(sft_data, tmp_path / "base", model=DEEPSEEK_MODEL, training={"train_steps": 3}))
    lora = {"rank": 4, "alpha": 8.0}
    ep1 = run_sft(sft_job(sft_data, tmp_path / "lora_ep1", model=DEEPSEEK_MODEL, init_from=base["model_dir"],
                          lora=lora))
    adapted = run_sft(sft_job(sft_data, tmp_path / "lora", model=DEEPSEEK_MODEL, init_from=base["model_dir"],
                              lora=lora, parallel={"tensor_model_parallel_size": 2, "expert_model_parallel_size": 2,
                                                   "sequence_parallel": True}), nproc=4)
    np.testing.assert_allclose(losses(adapted), losses(ep1), atol=2e-5, rtol=0)
    names = sorted(CheckpointTensors(Path(adapted["model_dir"]) / "adapters").shapes)
    assert {n.split(".")[-2] for n in names} == {"linear_q_up_proj", "linear_kv_up_proj", "linear_proj", "linear_fc1",
                                                "linear_fc2"}
    assert not any(".experts.experts." in n or "router" in n for n in names)

    assert export_hf(base["model_dir"], tmp_path / "base_hf")["architecture"] == "DeepseekV3ForCausalLM"
    with pytest.raises(HFExportError, match="MLP adapters .* do not load into peft"):
        export_peft(adapted["model_dir"], tmp_path / "peft_mlp", base_model=tmp_path / "base_hf")
    attention = run_sft(sft_job(sft_data, tmp_path / "lora_attention", model=DEEPSEEK_MODEL,
                                init_from=base["model_dir"], parallel={"expert_model_parallel_size": 2},
                                lora=lora | {"target_modules": ["linear_qkv", "linear_proj"]}), nproc=2)
    summary = export_peft(attention["model_dir"], tmp_path / "peft", base_model=tmp_path / "base_hf")
    assert sorted(summary["target_modules"]) == ["kv_b_proj", "o_proj", "q_b_proj"]
    export_hf(attention["model_dir"], tmp_path / "merged_hf")
    export_hf(adapted["model_dir"], tmp_path / "merged_mlp_hf")  # the merged export takes every adapter
    _assert_peft_equals_merged(sft_data, tmp_path)


def test_generation_at_ep2_with_different_work_per_rank_equals_ep1(moe_dirs, tmp_path):
    """Greedy generation with the KV cache: rank 0 has 2 short prompts and 3 new tokens, rank 1 has 5 prompts of
    other lengths, 9 new tokens and 2 slots (refills): at EP=2 the ranks run different numbers of forwards (the
    idle one matches the other's with dummy forwards) and generate exactly what one process generates."""
    dirs, _ = moe_dirs
    rng = np.random.default_rng(3)
    work = [{"prompts": [rng.integers(1, 100, 4).tolist(), rng.integers(1, 100, 6).tolist()], "max_new_tokens": 3,
             "max_rows": 2},
            {"prompts": [rng.integers(1, 100, n).tolist() for n in (3, 7, 5, 2, 8)], "max_new_tokens": 9,
             "max_rows": 2}]
    env = {"PYTHONPATH": os.pathsep.join([str(TESTS / "model"), os.environ.get("PYTHONPATH", "")])}
    for name in ("qwen3_moe", "mixtral"):
        runs = {}
        for layout, nproc, parallel in (("ep1", 1, {}), ("ep2", 2, {"expert_model_parallel_size": 2})):
            run_dir = tmp_path / f"{name}_{layout}"
            run_dir.mkdir()
            runs[layout] = run_torchrun("moe_generate_worker", {"hf_dir": dirs[name], "parallel": parallel,
                                                                "work": work}, LaunchConfig(nproc_per_node=nproc),
                                        run_dir, env=env)["tokens"]
        assert [len(t) for t in runs["ep2"][1]] == [9] * 5
        assert runs["ep2"] == runs["ep1"], name


def test_deepseek_v3_greedy_generation_equals_transformers(moe_dirs, tmp_path):
    """DeepSeek-V3 (MLA, YaRN, grouped sigmoid routing with its bias) generates greedily what transformers' own
    ``generate`` does, token for token: with the KV cache (each layer's keys and values as MLA computes them, its
    RoPE at every row's own cache column; 2 slots refilled as rows end), through the recompute path, and at EP=2
    with different work per rank."""
    from transformers import AutoModelForCausalLM

    dirs, _ = moe_dirs
    rng = np.random.default_rng(5)
    prompts = [rng.integers(1, 100, n).tolist() for n in (5, 9, 3)]
    hf = AutoModelForCausalLM.from_pretrained(dirs["deepseek_v3"], dtype=torch.float32).eval()
    with torch.no_grad():
        want = [hf.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    env = {"PYTHONPATH": os.pathsep.join([str(TESTS / "model"), os.environ.get("PYTHONPATH", "")])}
    for name, rows, use_cache in (("cache", 2, True), ("nocache", 3, False)):
        work = [{"prompts": prompts, "max_new_tokens": 8, "max_rows": rows, "use_cache": use_cache}]
        ours = run_torchrun("moe_generate_worker", {"hf_dir": dirs["deepseek_v3"], "parallel": {}, "work": work},
                            LaunchConfig(nproc_per_node=1), tmp_path / name, env=env)["tokens"][0]
        assert ours == want, name
    work = [{"prompts": prompts[:1], "max_new_tokens": 3, "max_rows": 1},
            {"prompts": prompts[1:], "max_new_tokens": 8, "max_rows": 1}]
    ep2 = run_torchrun("moe_generate_worker", {"hf_dir": dirs["deepseek_v3"], "parallel": {
        "expert_model_parallel_size": 2}, "work": work}, LaunchConfig(nproc_per_node=2), tmp_path / "ep2", env=env)
    assert ep2["tokens"] == [[want[0][:3]], want[1:]]


def test_lora_on_moe_adapts_attention_and_dpo_takes_the_adapters_off_reference(sft_data, moe_base, tmp_path):
    """LoRA SFT at EP=2 from an MoE base: adapters on attention and the shared experts, none on the routed experts
    or the routers; the held-out loss falls below the base's. Its PEFT export loads (``peft``) onto the base's HF
    export (Qwen2-MoE) and gives the logits of the merged export. DPO with LoRA at EP=2 and the reference being the
    policy with its adapters off starts at ln 2 (policy == reference)."""
    import math

    from jobs import run_dpo

    from align_pipeline.model.hf_export import CheckpointTensors, export_hf, export_peft

    lora = {"rank": 4, "alpha": 8.0}
    base = moe_base["base"]
    adapted = run_sft(sft_job(sft_data, tmp_path / "lora", init_from=base["model_dir"], lora=lora,
                              parallel={"expert_model_parallel_size": 2}), nproc=2)
    names = sorted(CheckpointTensors(Path(adapted["model_dir"]) / "adapters").shapes)
    assert names and all(".self_attention.linear_" in n or ".mlp.shared_experts.linear_" in n for n in names), names
    assert any(".shared_experts." in n for n in names) and not any(".experts.experts." in n for n in names)
    assert adapted["val_loss"] < base["val_loss"]

    assert export_hf(base["model_dir"], tmp_path / "base_hf")["architecture"] == "Qwen2MoeForCausalLM"
    summary = export_peft(adapted["model_dir"], tmp_path / "peft", base_model=tmp_path / "base_hf")
    assert sorted(summary["target_modules"]) == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj",
                                                 "v_proj"]
    export_hf(adapted["model_dir"], tmp_path / "merged_hf")
    _assert_peft_equals_merged(sft_data, tmp_path)

    dpo = run_dpo(moe_base["pref"], sft_data["tokenizer"], base["model_dir"], tmp_path / "dpo", nproc=2, lora=lora,
                  reference="online", parallel={"expert_model_parallel_size": 2})
    assert "adapters off" in (tmp_path / "dpo" / "logs" / "rank0.log").read_text()
    assert abs(dpo["history"][0]["loss"] - math.log(2)) < 1e-6


def test_cli_import_at_ep2_with_check(moe_dirs, tmp_path):
    """`align-pipeline import HF CKPT --ep 2 --check` on the Mixtral: the checkpoint's logits (Megatron) equal the
    HF model's (transformers)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "align_pipeline", "import", "--json", moe_dirs[0]["mixtral"],
                           str(tmp_path / "ckpt"), "--ep", "2", "--seq-length", "32", "--check"],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["family"] == "mixtral" and summary["ep"] == 2 and summary["max_abs_logit_diff"] <= 1e-4


def test_reward_model_at_ep2_equals_ep1_and_ppo_at_ep2_equals_ep1(moe_base, tmp_path):
    """The two stages the other MoE tests leave out. An MoE policy (SFT at EP=1) -> an MoE reward model at EP=1 and
    at EP=2: the same losses and validation figures. PPO from that policy and reward model (actor, critic, reference
    and reward model all MoE, generation included) on two ranks at EP=1 (DP=2) and at EP=2 (DP=2, the experts
    split): the same per-iteration metrics and the same trained actor."""
    from jobs import run_rm
    from rl_jobs import deterministic, max_diff, outputs_of, ppo_job, run

    model = dataclasses.replace(TINY_MODEL, moe=MoEConfig(**MOE))
    rms = {ep: run_rm(moe_base["pref"], moe_base["tokenizer"], moe_base["base"]["model_dir"], tmp_path / f"rm_ep{ep}", model=model,
                      parallel=ParallelConfig(expert_model_parallel_size=ep), nproc=ep) for ep in (1, 2)}
    np.testing.assert_allclose(losses(rms[2]), losses(rms[1]), atol=2e-5, rtol=0)
    assert rms[2]["train_metrics"]["moe/aux_loss"] == pytest.approx(rms[1]["train_metrics"]["moe/aux_loss"], abs=2e-5)
    val = {k: (rms[1][k], rms[2][k]) for k in rms[1] if k.startswith("val_")}
    for key in ("val_loss", "val_accuracy", "val_reward_margin"):
        assert abs(val[key][0] - val[key][1]) < 2e-5, val
    # The rewards themselves may move together: the value head's bias has no gradient under the pairwise loss, so
    # Adam turns the float noise of another summation order into lr-sized steps (measured: the bias alone differed,
    # by 1.2e-4; every other tensor within 1e-6).
    shift = val["val_reward_chosen"][1] - val["val_reward_chosen"][0]
    assert abs(shift) < 1e-3 and abs(val["val_reward_rejected"][1] - val["val_reward_rejected"][0] - shift) < 2e-5, val

    models = {"tokenizer": moe_base["tokenizer"], "prompts": moe_base["prompts"],
              "sft": moe_base["base"]["model_dir"], "rm": rms[1]["model_dir"]}
    ppo = {ep: run("ppo", ppo_job(models, tmp_path / f"ppo_ep{ep}", model=model,
                                  parallel=ParallelConfig(expert_model_parallel_size=ep)), nproc=2) for ep in (1, 2)}
    for a, b in zip(deterministic(ppo[1]["history"]), deterministic(ppo[2]["history"]), strict=True):
        assert a.keys() == b.keys()
        for k in a:
            assert b[k] == pytest.approx(a[k], rel=1e-3, abs=1e-4), (k, a[k], b[k])
    assert {"train/moe/aux_loss", "critic/moe/aux_loss", "critic/moe/expert_3/load"} <= ppo[2]["history"][-1].keys()
    assert max_diff(outputs_of(ppo[1]["actor_dir"], tmp_path / "o1"), outputs_of(ppo[2]["actor_dir"], tmp_path / "o2")) < 1e-4


def test_reinforce_with_dynamic_sampling_and_multi_turn_episodes_at_ep2_equals_ep1(moe_base, tmp_path):
    """The two loops in which each rank makes its own number of generation calls: dynamic sampling (half the groups
    without signal: a rank runs rounds until it has its groups) and multi-turn episodes (Nudge: 1 to 3 turns by
    prompt). At EP=2 a rank whose rounds or episodes are done takes part in its peer's forwards; both runs on two
    ranks at EP=2 give the metrics of EP=1 (DP=2). (Without that, the episodes' run at EP=2 hung: checked.)"""
    from rl_jobs import deterministic, reinforce_job, rl_section, run

    from align_pipeline.config import DynamicSamplingConfig, EnvConfig, KLConfig, RewardConfig, RewardFunctionConfig

    env = {"PYTHONPATH": os.pathsep.join([str(TESTS / "train"), str(TESTS / "envs"), os.environ.get("PYTHONPATH", "")])}
    model = dataclasses.replace(TINY_MODEL, moe=MoEConfig(**MOE))
    models = {"tokenizer": moe_base["tokenizer"], "prompts": moe_base["prompts"], "sft": moe_base["base"]["model_dir"]}
    jobs = {
        "dynamic": lambda ep: reinforce_job(
            models, tmp_path / f"dynamic_ep{ep}", iterations=1, model=model,
            rl=dataclasses.replace(rl_section(1)["rl"], seed=19),  # rank 0 needs 4 rounds, rank 1 one
            reward=RewardConfig(reward_model_weight=0.0,
                                functions=[RewardFunctionConfig(name="group_reward:half_without_signal")]),
            dynamic_sampling=DynamicSamplingConfig(enabled=True, max_rounds=6)),
        "episodes": lambda ep: reinforce_job(
            models, tmp_path / f"episodes_ep{ep}", iterations=1, model=model,
            reward=RewardConfig(reward_model_weight=0.0, functions=[]), kl=KLConfig(estimator="k3", beta=0.0),
            env=EnvConfig(name="toy_envs:Nudge", workers=2, step_timeout_s=20.0, max_turns=3,
                          config={"turns_mod": 3})),
    }
    for name, job in jobs.items():
        one, two = (run("reinforce", dataclasses.replace(job(ep), parallel=ParallelConfig(
            expert_model_parallel_size=ep)), nproc=2, env=env)["history"] for ep in (1, 2))
        for a, b in zip(deterministic(one), deterministic(two), strict=True):
            assert a.keys() == b.keys()
            for k in a:
                assert b[k] == pytest.approx(a[k], rel=1e-3, abs=1e-4), (name, k, a[k], b[k])
        if name == "dynamic":
            assert one[-1]["rollout/dynamic_sampling/rounds"] == 2.5  # the mean of the ranks' 4 and 1
        else:  # episodes of 1 to 3 turns, some cut short (no stop token within 8 new tokens)
            assert 1.0 < one[-1]["env/turns"] < 3.0


def test_export_family_of_an_moe_model_and_its_refusals():
    from align_pipeline.model.hf_export import HFExportError, family_of

    shared = MoEConfig(**MOE)
    plain = MoEConfig(**{**MOE, "shared_expert_ffn_hidden_size": 0, "shared_expert_gate": False})
    assert family_of(dataclasses.replace(TINY_MODEL, moe=shared)) == "qwen2_moe"
    assert family_of(dataclasses.replace(TINY_MODEL, moe=shared, add_qkv_bias=True)) == "qwen2_moe"
    assert family_of(dataclasses.replace(TINY_MODEL, moe=plain)) == "mixtral"
    assert family_of(dataclasses.replace(TINY_MODEL, moe=plain, qk_layernorm=True)) == "qwen3_moe"
    for model, message in (
        (dataclasses.replace(TINY_MODEL, moe=shared, hf_family="qwen3_moe", qk_layernorm=True), "a shared expert"),
        (dataclasses.replace(TINY_MODEL, moe=shared, hf_family="mixtral"), "a shared expert"),
        (dataclasses.replace(TINY_MODEL, moe=plain, hf_family="qwen2_moe"), "no gated shared expert"),
        (dataclasses.replace(TINY_MODEL, moe=shared, qk_layernorm=True, hf_family="qwen2_moe"), "qk_layernorm"),
        (dataclasses.replace(TINY_MODEL, moe=plain, add_qkv_bias=True), "linear biases"),
    ):
        with pytest.raises(HFExportError, match=message):
            family_of(model)
    with pytest.raises(ConfigError, match="shared_expert_gate needs a shared expert"):
        MoEConfig(**{**MOE, "shared_expert_ffn_hidden_size": 0}).validate()


def test_sync_free_dispatch_equals_megatrons_sort():
    """Grouped experts on one rank sort their tokens with :class:`SyncFreeTokenDispatcher` (no host
    synchronisation): the logits, the aux loss and every gradient of a forward + backward equal those of Megatron's
    all-gather dispatcher (its ``masked_select`` sort) on the same model and tokens, bit for bit; the layers of an
    EP=2 layout keep Megatron's all-to-all dispatcher."""
    from test_megatron_cpu import run_py

    out = run_py(
        """
        import sys, torch
        sys.path.insert(0, "tests")
        from jobs import TINY_MODEL
        from align_pipeline.config import ParallelConfig
        from align_pipeline.config.common import MoEConfig
        import dataclasses
        from align_pipeline.model.gpt import build_gpt
        from align_pipeline.model.moe import SyncFreeTokenDispatcher, moe_layers
        from align_pipeline.train.core.distributed import init_distributed
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

        parallel = ParallelConfig(moe_grouped_gemm="on")
        init_distributed(parallel, seed=0)
        model = dataclasses.replace(TINY_MODEL, moe=MoEConfig(num_experts=8, router_topk=3, ffn_hidden_size=16,
                                                              aux_loss_coeff=0.01, shared_expert_ffn_hidden_size=24))
        gpt = build_gpt(model, parallel, 128, ProcessGroupCollection.use_mpu_process_groups())
        layers = moe_layers(gpt)
        assert layers and all(type(l.mlp.token_dispatcher) is SyncFreeTokenDispatcher for l in layers)
        ids = torch.randint(0, 128, (3, 20))
        pos = torch.arange(20).expand(3, 20)

        def run():
            gpt.zero_grad()
            logits = gpt(ids, pos, None)
            logits.float().pow(2).mean().backward()
            return logits.detach(), {n: p.grad.clone() for n, p in gpt.named_parameters() if p.grad is not None}

        ours = run()
        for l in layers:
            l.mlp.token_dispatcher.__class__ = MoEAllGatherTokenDispatcher
        megatron = run()
        assert torch.equal(ours[0], megatron[0])
        assert ours[1].keys() == megatron[1].keys() and len(ours[1]) > 10
        bad = [n for n in ours[1] if not torch.equal(ours[1][n], megatron[1][n])]
        assert not bad, bad
        print("OK", len(layers), len(ours[1]))
        """
    )
    assert out.startswith("OK")
