"""Sections shared by several stages: architecture, parallelism, launch, the optimisation loop, sampling, rewards.

Every config is a dataclass with a docstring per field (Megatron-core's style); ``parameters_model.yml`` holds
``model``, ``parallel`` and ``launch``; the stage files nest the others.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from align_pipeline.config.base import ConfigError, require_at_least, require_one_line, require_range
from align_pipeline.config.reward_spec import load_reward_function


@dataclass
class MoEConfig:
    """Mixture-of-experts MLPs (Megatron-core's MoE layer: a router picks ``router_topk`` of ``num_experts`` SwiGLU
    experts per token). ``num_experts`` 0 = a dense model. Imported HF models (Qwen3-MoE, Mixtral) set every field
    from their ``config.json``."""

    num_experts: int = 0
    """Routed experts per MoE layer; 0 = dense MLPs everywhere."""
    router_topk: int = 2
    """Experts each token is sent to."""
    ffn_hidden_size: int | None = None
    """One expert's inner width (per gate); None = model.ffn_hidden_size."""
    layers: list[int] | None = None
    """Which layers are MoE: one 0/1 per layer (1 = MoE, 0 = a dense MLP of model.ffn_hidden_size); None = all."""
    router_pre_softmax: bool = False
    """The gate weights: false = softmax over the chosen experts' logits (they sum to 1: Mixtral, Qwen3-MoE with
    norm_topk_prob); true = softmax over all experts, the chosen ones' probabilities kept as they are (Qwen3-MoE
    without norm_topk_prob)."""
    aux_loss_coeff: float = 0.0
    """Load-balancing loss (Switch Transformer: experts x sum over experts of the fraction of tokens routed there x
    its mean router probability), per MoE layer and micro-batch, times this; 0 = off. Imported models take the
    family's ``router_aux_loss_coef`` when their config trains with it (``output_router_logits``), else 0."""
    z_loss_coeff: float = 0.0
    """Router z-loss (ST-MoE: mean squared logsumexp of the router logits) times this; 0 = off (neither Qwen3-MoE nor
    Mixtral defines one)."""
    shared_expert_ffn_hidden_size: int = 0
    """A shared expert in every MoE layer: a SwiGLU MLP of this inner width that every token goes through beside its
    routed experts (Qwen2-MoE's ``shared_expert_intermediate_size``); 0 = none."""
    shared_expert_gate: bool = False
    """The shared expert's output times sigmoid(a learned [1, hidden] projection of the token) (Qwen2-MoE's
    ``shared_expert_gate``); needs a shared expert."""
    router_score_function: Literal["softmax", "sigmoid"] = "softmax"
    """The router's scores: softmax over the experts' logits, or each logit's sigmoid (DeepSeek-V3; the chosen
    experts' scores are then renormalised to sum to 1)."""
    router_expert_bias: bool = False
    """A per-expert bias added to the scores to *choose* the experts but not to weight them (DeepSeek-V3's
    ``e_score_correction_bias``, auxiliary-loss-free balancing); sigmoid scores only."""
    router_expert_bias_update_rate: float = 0.0
    """After each optimizer step the bias moves by this much towards balance (+rate for an expert that got fewer
    tokens than the mean, -rate for more; DeepSeek-V3 trained with 1e-3); 0 = the bias stays as loaded."""
    router_num_groups: int = 0
    """Group-limited routing (DeepSeek-V3's ``n_group``): the experts are split into this many groups and a token
    chooses its experts within the ``router_group_topk`` best groups; 0 = no groups."""
    router_group_topk: int = 0
    """Groups a token may route to (``topk_group``), with ``router_num_groups``."""
    router_topk_scaling_factor: float = 1.0
    """The chosen experts' weights times this (DeepSeek-V3's ``routed_scaling_factor``)."""

    def enabled(self) -> bool:
        return self.num_experts > 0

    def layer_is_moe(self, index: int) -> bool:
        """Layer ``index`` (global, 0-based) has an MoE MLP."""
        return self.enabled() and (self.layers is None or bool(self.layers[index]))

    def validate(self, where: str = "model.moe", num_layers: int | None = None) -> None:
        require_at_least(self, where, 0, "num_experts")
        require_at_least(self, where, 1, "router_topk", "ffn_hidden_size")
        require_at_least(self, where, 0, "shared_expert_ffn_hidden_size")
        if self.shared_expert_gate and not self.shared_expert_ffn_hidden_size:
            raise ConfigError(f"{where}.shared_expert_gate needs a shared expert ({where}.shared_expert_ffn_hidden_size "
                              "> 0)")
        for name in ("aux_loss_coeff", "z_loss_coeff", "router_expert_bias_update_rate"):
            require_range(self, where, name, 0)
        require_range(self, where, "router_topk_scaling_factor", 0, low_open=True)
        if self.router_expert_bias and self.router_score_function != "sigmoid":
            raise ConfigError(f"{where}.router_expert_bias needs {where}.router_score_function: sigmoid")
        if self.router_expert_bias_update_rate and not self.router_expert_bias:
            raise ConfigError(f"{where}.router_expert_bias_update_rate needs {where}.router_expert_bias: true")
        if bool(self.router_num_groups) != bool(self.router_group_topk):
            raise ConfigError(f"{where}.router_num_groups and {where}.router_group_topk go together (both > 0 or "
                              "both 0)")
        if not self.enabled():
            return
        if self.router_num_groups and (self.num_experts % self.router_num_groups
                                       or self.router_group_topk > self.router_num_groups):
            raise ConfigError(f"{where}.router_num_groups={self.router_num_groups} must divide {where}.num_experts="
                              f"{self.num_experts}, and router_group_topk={self.router_group_topk} may not exceed it")
        if self.router_topk > self.num_experts:
            raise ConfigError(f"{where}.router_topk={self.router_topk} exceeds {where}.num_experts={self.num_experts}")
        if self.layers is not None:
            if any(v not in (0, 1) for v in self.layers):
                raise ConfigError(f"{where}.layers must hold 0 (dense) or 1 (MoE) per layer, got {self.layers}")
            if num_layers is not None and len(self.layers) != num_layers:
                raise ConfigError(f"{where}.layers has {len(self.layers)} entries for model.num_layers={num_layers}")
            if not any(self.layers):
                raise ConfigError(f"{where}.layers marks no layer as MoE (set {where}.num_experts: 0 for a dense "
                                  "model)")


@dataclass
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3; Megatron-core's ``MLASelfAttention``): queries through an
    optional low-rank bottleneck, keys and values from one shared latent of ``kv_lora_rank`` plus a rotary key part
    shared by all heads. ``kv_lora_rank`` 0 = ordinary attention."""

    kv_lora_rank: int = 0
    """Width of the compressed key/value latent (HF ``kv_lora_rank``); 0 = MLA off."""
    q_lora_rank: int = 0
    """Width of the query bottleneck (HF ``q_lora_rank``); 0 = one full-rank query projection (``q_proj``)."""
    qk_head_dim: int = 128
    """Per-head query/key width without RoPE (HF ``qk_nope_head_dim``)."""
    qk_pos_emb_head_dim: int = 64
    """Per-head query/key width that RoPE rotates (HF ``qk_rope_head_dim``); the key part is shared by all heads."""
    v_head_dim: int = 128
    """Per-head value width (HF ``v_head_dim``)."""

    def enabled(self) -> bool:
        return self.kv_lora_rank > 0

    def validate(self, where: str = "model.mla") -> None:
        require_at_least(self, where, 0, "kv_lora_rank", "q_lora_rank")
        if self.enabled():
            require_at_least(self, where, 1, "qk_head_dim", "v_head_dim")
            require_at_least(self, where, 2, "qk_pos_emb_head_dim")
            if self.qk_pos_emb_head_dim % 2:
                raise ConfigError(f"{where}.qk_pos_emb_head_dim={self.qk_pos_emb_head_dim} must be even (RoPE "
                                  "rotates pairs)")


@dataclass
class ModelConfig:
    """Architecture of the GPT (Llama-style: RoPE, RMSNorm, SwiGLU, optional GQA)."""

    num_layers: int = 2
    """Transformer layers."""
    hidden_size: int = 64
    """Model width."""
    num_attention_heads: int = 4
    """Query heads."""
    num_query_groups: int | None = None
    """Key/value heads for grouped-query attention; None = multi-head (same as num_attention_heads)."""
    ffn_hidden_size: int | None = None
    """MLP inner width; None = 4 * hidden_size (SwiGLU: per gate)."""
    seq_length: int = 64
    """Maximum tokens per sample; longer samples are rejected by data_prep."""
    vocab_size: int | None = None
    """Vocabulary size; None = take it from the tokenizer."""
    make_vocab_size_divisible_by: int = 128
    """Embedding rows are padded to a multiple of this (times the TP size) for even sharding."""
    position_embedding_type: Literal["rope", "learned_absolute"] = "rope"
    """Rotary (Llama) or learned absolute positions."""
    rotary_base: float = 10000.0
    """RoPE theta."""
    rope_scaling: Literal["none", "linear", "llama3", "yarn"] = "none"
    """RoPE frequency scaling: none; linear = every frequency / ``rope_scaling_factor`` (positions interpolated);
    llama3 = Llama 3.1's per-band scaling (``rope_scaling_factor``, the low/high frequency factors, the original
    context); yarn = YaRN (``rope_scaling_factor``, ``rope_original_max_position``, the ``yarn_*`` fields; with MLA
    only, where Megatron-core applies it)."""
    rope_scaling_factor: float = 1.0
    """Scaling factor of ``linear`` and ``llama3`` RoPE scaling."""
    rope_low_freq_factor: float = 1.0
    """llama3 scaling: wavelengths above original context / this are divided by the factor."""
    rope_high_freq_factor: float = 4.0
    """llama3 scaling: wavelengths below original context / this are kept; in between, interpolated."""
    rope_original_max_position: int = 8192
    """llama3 and yarn scaling: the context length the model was pretrained at."""
    yarn_beta_fast: float = 32.0
    """yarn: rotations per context above which a frequency is kept (HF ``beta_fast``)."""
    yarn_beta_slow: float = 1.0
    """yarn: rotations per context below which a frequency is interpolated (HF ``beta_slow``)."""
    yarn_mscale: float = 1.0
    """yarn: the attention-temperature coefficient of the rotary cos/sin (HF ``mscale``)."""
    yarn_mscale_all_dim: float = 0.0
    """yarn: the coefficient applied to the whole query-key product, squared into the softmax scale (HF
    ``mscale_all_dim``; DeepSeek-V3: 1.0)."""
    kv_channels: int | None = None
    """Width of one attention head (HF ``head_dim``); None = hidden_size / num_attention_heads."""
    qk_layernorm: bool = False
    """RMSNorm over each query and key head before RoPE (Qwen3)."""
    sliding_window: int | None = None
    """Sliding-window size of an imported model (Mistral v0.1, some Qwen); kept for export. Must be >= seq_length:
    within its window attention is full, and no shorter window is implemented."""
    normalization: Literal["RMSNorm", "LayerNorm"] = "RMSNorm"
    """Norm layer."""
    norm_epsilon: float = 1e-5
    """Norm epsilon."""
    activation: Literal["swiglu", "gelu"] = "swiglu"
    """MLP activation; swiglu = gated SiLU."""
    add_bias_linear: bool = False
    """Biases in linear layers (Llama: no)."""
    add_qkv_bias: bool = False
    """Bias on the QKV projection only (Qwen2: yes)."""
    share_embeddings_and_output_weights: bool = False
    """Tie the input embedding and the output layer."""
    init_method_std: float = 0.02
    """Std of the normal weight init for random initialisation."""
    attention_dropout: float = 0.0
    """Dropout on attention probabilities."""
    hidden_dropout: float = 0.0
    """Dropout after attention and MLP."""
    attention_backend: Literal["auto", "te", "sdpa", "local"] = "auto"
    """auto = Transformer Engine when importable, else SDPA core attention; local = Megatron's unfused attention.
    A run-time choice: it also applies to models loaded from checkpoints (whose architecture is their own)."""
    max_position_embeddings: int | None = None
    """Context length of an imported model (HF ``max_position_embeddings``), written back on export; None =
    seq_length. Training uses seq_length."""
    hf_family: Literal["llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "qwen2_moe", "mixtral",
                       "deepseek_v3"] | None = None
    """The Hugging Face family the model was imported from and is exported as; None = the family its architecture
    implies (QK norm: qwen3; QKV-only biases: qwen2; else llama)."""
    moe: MoEConfig = field(default_factory=MoEConfig)
    """Mixture-of-experts MLPs (off by default)."""
    mla: MLAConfig = field(default_factory=MLAConfig)
    """Multi-head latent attention (DeepSeek-V3; off by default)."""

    def validate(self, where: str = "model") -> None:
        require_at_least(self, where, 1, "num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                         "ffn_hidden_size", "seq_length", "vocab_size", "make_vocab_size_divisible_by", "kv_channels",
                         "rope_original_max_position", "max_position_embeddings")
        for name in ("rotary_base", "norm_epsilon"):
            require_range(self, where, name, 0, low_open=True)
        require_range(self, where, "init_method_std", 0)
        for name in ("attention_dropout", "hidden_dropout"):
            require_range(self, where, name, 0, 1, high_open=True)
        if self.num_query_groups is not None and self.num_attention_heads % self.num_query_groups:
            raise ConfigError(f"{where}.num_query_groups={self.num_query_groups} does not divide "
                              f"{where}.num_attention_heads={self.num_attention_heads} (each key/value head serves "
                              "a whole group of query heads)")
        if self.rope_scaling != "none" and self.rope_scaling_factor <= 0:
            raise ConfigError(f"{where}.rope_scaling_factor must be > 0, got {self.rope_scaling_factor}")
        if self.rope_scaling == "llama3":
            require_range(self, where, "rope_low_freq_factor", 0, low_open=True)
        if self.rope_scaling == "llama3" and self.rope_high_freq_factor <= self.rope_low_freq_factor:
            raise ConfigError(f"{where}.rope_high_freq_factor must be > {where}.rope_low_freq_factor (llama3 scaling)")
        if self.sliding_window is not None and self.sliding_window < self.seq_length:
            raise ConfigError(f"{where}.seq_length={self.seq_length} exceeds the model's sliding_window="
                              f"{self.sliding_window} (sliding-window attention is not implemented)")
        if self.qk_layernorm and self.normalization != "RMSNorm":
            raise ConfigError(f"{where}.qk_layernorm needs normalization: RMSNorm")
        self.moe.validate(f"{where}.moe", self.num_layers)
        self.mla.validate(f"{where}.mla")
        if self.rope_scaling == "yarn" and not self.mla.enabled():
            raise ConfigError(f"{where}.rope_scaling: yarn is implemented for multi-head latent attention only "
                              f"({where}.mla.kv_lora_rank > 0)")
        if self.mla.enabled() and (self.position_embedding_type != "rope" or self.normalization != "RMSNorm"
                                   or self.add_bias_linear or self.add_qkv_bias):
            raise ConfigError(f"{where}.mla: multi-head latent attention needs position_embedding_type: rope, "
                              "normalization: RMSNorm and no biases")
        if self.mla.enabled() and self.num_query_groups not in (None, self.num_attention_heads):
            raise ConfigError(f"{where}.num_query_groups={self.num_query_groups}: multi-head latent attention has a "
                              f"key and value per head (set it to null or {self.num_attention_heads})")
        if self.moe.enabled() and self.activation != "swiglu":
            raise ConfigError(f"{where}.moe: experts are SwiGLU MLPs; set {where}.activation: swiglu")


@dataclass
class ParallelConfig:
    """How the model and data are split across ranks. world size = TP * PP * DP."""

    tensor_model_parallel_size: int = 1
    """Tensor parallel size (shards attention heads and MLP)."""
    pipeline_model_parallel_size: int = 1
    """Pipeline parallel size (splits layers into stages)."""
    expert_model_parallel_size: int = 1
    """Expert parallel size (EP): an MoE model's experts are split over EP ranks, tokens travel to their experts'
    ranks. EP ranks are data-parallel ranks for the rest of the model: world = TP x PP x DP, and EP x expert TP x PP
    must divide the world too."""
    expert_tensor_parallel_size: int | None = None
    """Tensor parallel size inside each expert (expert TP); None = tensor_model_parallel_size."""
    moe_grouped_gemm: Literal["auto", "on", "off"] = "auto"
    """An MoE model's experts: on = all local experts' weights in two tensors and one grouped GEMM per projection
    (torch's grouped matmul), off = one GEMM pair per local expert over its tokens; auto = on for bf16 on a Hopper
    GPU or newer. The same numbers either way (checkpoints load into both)."""
    sequence_parallel: bool = False
    """Shard norms/dropout along the sequence across TP ranks (needs TP > 1)."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state across data-parallel ranks (ZeRO-1)."""
    recompute_granularity: Literal["none", "selective", "full"] = "none"
    """Activation recomputation to save memory."""
    recompute_num_layers: int = 1
    """Layers per recompute chunk for full recomputation."""
    bf16: bool = False
    """Train in bf16 (GPU); the optimizer's precision: ``optimizer_precision``."""
    optimizer_precision: Literal["fp32", "bf16"] = "fp32"
    """With ``bf16``: what the optimizer keeps. fp32 = Megatron's mixed precision: fp32 main weights, an fp32
    gradient buffer and fp32 AdamW moments beside the bf16 weights (18 bytes per parameter). bf16 = no fp32 copies:
    bf16 weights, gradients and moments (8 bytes per parameter, as HF trains in pure bf16), each step computed in
    fp32 and stored with stochastic rounding so small updates are not lost (``train/core/bf16_adamw.py``). Not with
    the distributed optimizer (it keeps fp32 main weights of its shard)."""
    kernels: Literal["auto", "fused", "eager"] = "auto"
    """Small elementwise operations (RoPE, SwiGLU, norms) of the non-TE layer spec: fused = one compiled kernel per
    operation and direction (``torch.compile``), eager = Megatron's unfused PyTorch code; auto = fused on CUDA, eager
    on CPU. Transformer Engine's spec brings its own fused kernels."""
    logits_chunk_tokens: int = 0
    """The LM loss of SFT and DPO without whole-vocabulary logits: 0 = the output layer computes the logits of every
    token of a micro-batch ([tokens, V/TP], plus their fp32 softmax); N = the loss is computed from the hidden states
    N tokens at a time, each chunk's logits recomputed in the backward pass (memory N x V/TP instead; one more output
    GEMM). For large vocabularies (Llama 3: 128k, Qwen: 152k) at long sequences."""

    def validate(self, where: str = "parallel") -> None:
        require_at_least(self, where, 1, "tensor_model_parallel_size", "pipeline_model_parallel_size",
                         "recompute_num_layers", "expert_model_parallel_size", "expert_tensor_parallel_size")
        require_at_least(self, where, 0, "logits_chunk_tokens")
        if self.optimizer_precision == "bf16":
            if not self.bf16:
                raise ConfigError(f"{where}.optimizer_precision=bf16 needs {where}.bf16: true (a bf16 model)")
            if self.use_distributed_optimizer:
                raise ConfigError(f"{where}.optimizer_precision=bf16 does not work with "
                                  f"{where}.use_distributed_optimizer (its shards keep fp32 main weights); turn one "
                                  "of them off")


@dataclass
class LoRAConfig:
    """Low-rank adapters on a training stage's linears (``model/lora.py``): the base weights frozen, only the adapters
    train. ``rank`` 0 = off (full fine-tuning)."""

    rank: int = 0
    """Adapter rank r (0 = no adapters)."""
    alpha: float = 16.0
    """Scaling numerator: the adapter's output is multiplied by alpha / rank."""
    dropout: float = 0.0
    """Dropout on the adapter's input while training."""
    target_modules: list[str] = field(default_factory=lambda: ["linear_qkv", "linear_proj", "linear_fc1",
                                                                "linear_fc2"])
    """Megatron linears that get adapters: linear_qkv / linear_proj (attention in / out), linear_fc1 / linear_fc2
    (MLP in / out). With multi-head latent attention linear_qkv adapts its per-head query and key/value projections
    (HF ``q_proj`` or ``q_b_proj``, and ``kv_b_proj``), one adapter each; the down projections into the latents
    (``q_a_proj``, ``kv_a_proj_with_mqa``) keep their weights."""
    store: Literal["adapters", "merged"] = "adapters"
    """What the stage's model artifact holds. ``adapters``: the adapters alone (a few MB) and the path of the base
    they apply to; every reader (the next stage, evaluation, the HF export) merges them into the base on load.
    ``merged``: the base with the adapters merged (full size), the adapters beside it. A value-head model (reward
    model, critic) and a base without a path (random init) are always stored merged."""

    def validate(self, where: str = "lora") -> None:
        require_at_least(self, where, 0, "rank")
        if self.rank and self.alpha <= 0:
            raise ConfigError(f"{where}.alpha must be > 0, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"{where}.dropout must be in [0, 1), got {self.dropout}")
        known = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
        unknown = [m for m in self.target_modules if m not in known]
        if unknown or (self.rank and not self.target_modules):
            raise ConfigError(f"{where}.target_modules={self.target_modules}: each must be one of {list(known)} "
                              "(at least one when rank > 0)")


@dataclass
class SlurmConfig:
    """``launch.slurm``: how a stage runs as a Slurm job (``launch.backend: slurm``)."""

    partition: str | None = None
    """``--partition`` (None: the cluster's default)."""
    account: str | None = None
    """``--account``."""
    time: str | None = None
    """``--time`` limit, e.g. "04:00:00" (None: the partition's)."""
    gpus_per_node: int | None = None
    """``--gpus-per-node`` (None: not asked; CPU jobs)."""
    cpus_per_task: int | None = None
    """``--cpus-per-task`` of the one task per node that runs torchrun (None: the cluster's default)."""
    sbatch_lines: list[str] = field(default_factory=list)
    """Extra ``#SBATCH`` options, one per item, e.g. ``["--qos=high", "--exclusive"]``."""
    rdzv_port: int = 29400
    """Port of the c10d rendezvous on the job's first node."""
    poll_s: float = 1.0
    """Seconds between job-state queries while the job is pending or running."""

    def validate(self, where: str = "slurm") -> None:
        require_at_least(self, where, 1, "gpus_per_node", "cpus_per_task")
        if not 1 <= self.rdzv_port <= 65535:
            raise ConfigError(f"{where}.rdzv_port={self.rdzv_port} must be in [1, 65535]")
        if not self.poll_s > 0:
            raise ConfigError(f"{where}.poll_s={self.poll_s} must be > 0")
        # every string here becomes a line of slurm_job.sh: a newline would start a shell command of its own
        for name in ("partition", "account", "time"):
            require_one_line(getattr(self, name), f"{where}.{name}", "Slurm fields")
        for i, line in enumerate(self.sbatch_lines):
            require_one_line(line, f"{where}.sbatch_lines[{i}]", "Slurm fields")
        bad = [line for line in self.sbatch_lines if not str(line).startswith("-")]
        if bad:
            raise ConfigError(f"{where}.sbatch_lines: each is an sbatch option starting with '-', got {bad}")


_LEGACY_DIST_BACKENDS = ("auto", "nccl", "gloo")


@dataclass
class LaunchConfig:
    """How a node starts its torchrun job."""

    nproc_per_node: int | Literal["gpus"] = 1
    """Processes (GPUs, or CPU workers) per node; "gpus" = one per visible GPU (CUDA_VISIBLE_DEVICES, else
    nvidia-smi)."""
    nnodes: int = 1
    """Nodes in the job."""
    node_rank: int = 0
    """Always 0: ``kedro run`` runs on node 0; the other nodes run ``align-pipeline worker`` (multi-node without
    Slurm, ``launch/multinode.py``)."""
    master_addr: str = "127.0.0.1"
    """Node 0's address: its job board for the workers (multi-node), the rendezvous host."""
    master_port: int = 0
    """Port of node 0's job board (multi-node; the c10d rendezvous uses the next port); 0 = pick a free one (one
    node only)."""
    backend: Literal["local", "slurm", "auto", "nccl", "gloo"] = "local"
    """Where the job runs: ``local`` (torchrun started by this process) or ``slurm`` (a Slurm job: ``sbatch``, or
    ``srun`` inside an allocation; see ``slurm``). The old values auto/nccl/gloo name ``dist_backend`` and are read
    as such."""
    dist_backend: Literal["auto", "nccl", "gloo"] = "auto"
    """torch.distributed backend; auto = nccl with CUDA, else gloo."""
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    """Slurm submission settings (``backend: slurm``)."""
    threads_per_process: int | None = None
    """OMP/torch threads per rank on CPU; None = cores / nproc_per_node."""
    log_tail_lines: int = 40
    """Lines of a failing rank's log to include in the error."""

    def __post_init__(self) -> None:
        if self.backend in _LEGACY_DIST_BACKENDS:  # launch.backend used to be the torch.distributed backend
            self.backend, self.dist_backend = "local", self.backend

    def validate(self, where: str = "launch") -> None:
        if self.nproc_per_node != "gpus":
            require_at_least(self, where, 1, "nproc_per_node")
        require_at_least(self, where, 1, "nnodes", "threads_per_process")
        require_at_least(self, where, 0, "log_tail_lines")
        if self.node_rank != 0:
            raise ConfigError(f"{where}.node_rank={self.node_rank}: kedro runs on node 0 only; start every other "
                              "node with `align-pipeline worker --master-addr <node 0> --master-port <port>` "
                              "(README, Multi-node)")
        if not 0 <= self.master_port <= 65535:
            raise ConfigError(f"{where}.master_port={self.master_port} must be in [0, 65535]")
        if self.nnodes > 1 and self.master_port == 0 and self.backend == "local":
            raise ConfigError(f"{where}.master_port=0 (pick a free one) works on one node only; "
                              f"{where}.nnodes={self.nnodes} needs an explicit port")


@dataclass
class OptimizerConfig:
    """AdamW with linear warmup + cosine decay, through Megatron's optimizer."""

    lr: float = 1e-3
    """Peak learning rate."""
    min_lr: float = 1e-4
    """Learning rate at the end of the cosine decay."""
    warmup_steps: int = 10
    """Linear warmup steps."""
    weight_decay: float = 0.01
    """Decoupled weight decay."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.95
    """AdamW beta2."""
    adam_eps: float = 1e-8
    """AdamW epsilon."""
    clip_grad: float = 1.0
    """Global gradient-norm clip (0 = off)."""

    def validate(self, where: str = "optimizer") -> None:
        require_range(self, where, "lr", 0, low_open=True)
        if not 0 <= self.min_lr <= self.lr:
            raise ConfigError(f"{where}: need 0 <= min_lr ({self.min_lr}) <= lr ({self.lr})")
        require_at_least(self, where, 0, "warmup_steps")
        require_range(self, where, "weight_decay", 0)
        for name in ("adam_beta1", "adam_beta2"):
            require_range(self, where, name, 0, 1, high_open=True)
        require_range(self, where, "adam_eps", 0, low_open=True)
        require_range(self, where, "clip_grad", 0)


@dataclass
class TrainingConfig:
    """The optimisation loop of the supervised stages (SFT, reward model, DPO)."""

    seed: int = 1234
    """Seed for init, data order and dropout (same on every rank; Megatron derives per-TP-rank streams)."""
    train_steps: int = 300
    """Optimizer steps."""
    global_batch_size: int = 32
    """Samples per optimizer step, over all data-parallel ranks and micro-batches."""
    micro_batch_size: int = 8
    """Samples per forward/backward; global = micro x grad-accumulation x DP."""
    log_interval: int = 10
    """Steps between progress lines on the console."""
    metrics_interval: int | None = None
    """Steps between MLflow metric points (and ``metrics.jsonl`` lines); None = ``train_steps // 50`` (at least 1): at
    least 50 points per curve, whatever the console shows."""
    eval_interval: int = 50
    """Steps between validation passes (and one at the end); 0 = only at the end."""
    eval_samples: int | None = None
    """Validation samples per pass; None = the whole validation set."""
    save_interval: int = 100
    """Steps between resumable training checkpoints (and one at the end); 0 = only at the end."""
    keep_checkpoints: int = 2
    """Training checkpoints kept in the run directory (oldest deleted)."""
    resume: bool = True
    """Resume from the latest complete checkpoint in the run directory when one exists."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """AdamW + schedule."""

    def validate(self, where: str = "training") -> None:
        require_at_least(self, where, 1, "train_steps", "global_batch_size", "micro_batch_size", "log_interval",
                         "metrics_interval", "eval_samples")
        require_at_least(self, where, 0, "seed", "eval_interval", "save_interval", "keep_checkpoints")
        if self.global_batch_size % self.micro_batch_size:
            raise ConfigError(f"{where}.global_batch_size={self.global_batch_size} must be a multiple of "
                              f"{where}.micro_batch_size={self.micro_batch_size}")


@dataclass
class GenerationConfig:
    """Sampling settings for rollouts and evaluation."""

    max_new_tokens: int = 16
    """Tokens generated per prompt at most (stops earlier at EOS)."""
    temperature: float = 1.0
    """Softmax temperature (1.0 = the policy's own distribution)."""
    top_k: int = 0
    """Keep the k most likely tokens (0 = off)."""
    top_p: float = 1.0
    """Nucleus sampling mass (1.0 = off)."""
    samples_per_prompt: int = 1
    """Independent samples per prompt."""
    seed: int = 0
    """Sampling seed (same on every TP rank; offset by DP rank)."""
    batch_size: int = 256
    """Rows (prompts x samples) decoded at once at most: the rows of the KV cache kept on the policy between
    iterations (its memory: 2 x layers x rows x (prompt + max_new_tokens) x kv_channels x query groups / TP values).
    More rows than this are generated by continuous batching: a row whose response has ended takes the next pending
    sample. The samples are those of static batches of this many rows (seeded by their first row), however the rows
    are refilled."""
    kv_cache_gib: float = 0.0
    """Bound on the KV cache (GiB per GPU): fewer rows than ``batch_size`` are decoded at once when they would not
    fit (the samples stay the same; pending ones wait for a free row). 0 = no bound. A bound too small for one row
    is an error that names the row's size."""
    cuda_graphs: bool = True
    """On a GPU, replay each decode step as a captured CUDA graph, one per batch width (captured before the first
    rollout, reused after, reading the live weights); False runs the same static-cache step eagerly."""
    compile_step: bool = False
    """Run the KV-cache decode step through ``torch.compile`` (what the CUDA graphs then capture): inductor fuses
    each layer's elementwise work between the GEMMs (norms, RoPE, cache writes, SwiGLU, residual adds), so a step
    launches fewer kernels, which is what a decode step at small batch waits on. Compiled once per job at the first
    rollout (seconds to a minute). Dense models at TP=1; ignored otherwise."""
    prefill_bucket: int = 1
    """Prompts are left-padded to a multiple of this many tokens before the prefill (padding is masked: the same
    tokens), so a rollout whose longest prompt is a length not seen before reuses the attention plans of its bucket
    instead of building new ones (0.7-0.9 s each on an H200 for a 1B model). 1 = no bucketing (the CPU default:
    unpadded prompts keep the plain causal prefill); conf/gpu uses 64."""

    def validate(self, where: str = "generation") -> None:
        require_at_least(self, where, 0, "top_k", "seed")
        require_at_least(self, where, 1, "max_new_tokens", "samples_per_prompt", "batch_size", "prefill_bucket")
        require_at_least(self, where, 0, "kv_cache_gib")
        if self.temperature < 0 or not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"{where}: need temperature >= 0 (got {self.temperature}) and 0 < top_p <= 1 "
                              f"(got {self.top_p})")


@dataclass
class RewardFunctionConfig:
    """One reward function of a score and its weight (``reward.functions`` of the RL stages and of evaluation)."""

    name: str
    """``module:function(prompt, response, record) -> float`` (a bool counts as 0/1; pure, no model calls); built-ins:
    ``align_pipeline.rewards:demo_task``, ``:exact_match``, ``:math_answer``. ``record`` is the prompt's record
    (every field of its raw line, ``answer`` or None, ``prompt_ids``). Checked when the parameters are loaded:
    importable, callable with three arguments."""
    weight: float = 1.0
    """Its weight in the sequence score (RL stages) and in evaluation's ``function_reward``; 0 = computed and
    reported (e.g. as the accuracy function), not optimised."""

    def validate(self, where: str = "reward_function") -> None:
        load_reward_function(self.name, f"{where}.name")


@dataclass
class ScoringConfig:
    """How a response is scored, except for the KL term: reward functions, which of them decides accuracy, and how
    a multi-attribute reward model's outputs combine into one score. ``params:evaluation.reward`` is one; the RL
    stages' ``reward`` (:class:`RewardConfig`) adds the weights of the sequence score."""

    functions: list[RewardFunctionConfig] = field(default_factory=list)
    """The reward functions with their weights, e.g. ``[{name: "align_pipeline.rewards:math_answer", weight: 1.0}]``;
    empty = none (reward-model-only scoring: no accuracy metrics, prompts need no ``answer``)."""
    accuracy_function: str | None = None
    """The ``name`` of the function in ``functions`` whose value decides accuracy: a response is correct when it
    returns >= 1 (``rollout/accuracy``, ``val/accuracy``, ``val/greedy_accuracy``, evaluation's ``accuracy``,
    ``greedy_accuracy`` and ``accuracy_<group>``); None = the first of ``functions``. Without functions there are no
    accuracy metrics."""
    reward_model_attribute_weights: list[float] | None = None
    """The weights of a multi-attribute (regression) reward model's A outputs: its score is Σ_a w_a x r_a (one weight
    per output, in the model's attribute order: the sorted label names of its training data). None = a one-output
    model's single score; a model with A > 1 outputs and no weights is refused when the job loads it."""

    def validate(self, where: str = "reward") -> None:
        names = [f.name for f in self.functions]
        for i, name in enumerate(names):
            if name in names[:i]:
                raise ConfigError(f"{where}.functions[{i}].name={name!r} is listed twice (give it one weight)")
        if self.accuracy_function is not None and self.accuracy_function not in names:
            raise ConfigError(f"{where}.accuracy_function={self.accuracy_function!r} is not one of the names in "
                              f"{where}.functions: {names}")
        if self.reward_model_attribute_weights is not None and not self.reward_model_attribute_weights:
            raise ConfigError(f"{where}.reward_model_attribute_weights is empty (null = a one-output reward model)")


@dataclass
class RewardConfig(ScoringConfig):
    """How a rollout's sequence-level score is made (PPO, REINFORCE): ``reward_model_weight`` x the reward model's
    score + Σ_i ``functions[i].weight`` x function_i(prompt, response, record) - ``missing_eos_penalty`` x (no EOS)."""

    reward_model_weight: float = 1.0
    """Weight of the reward model's score (its attributes combined by ``reward_model_attribute_weights``; needs a
    reward model; 0 = not used)."""
    missing_eos_penalty: float = 0.0
    """Subtracted from the score of a response that stopped at ``max_new_tokens`` without EOS."""
    overlong_buffer: int = 0
    """DAPO's soft overlong punishment (:func:`align_pipeline.rl.advantages.overlong_shaping`): a response longer than
    ``generation.max_new_tokens`` - ``overlong_buffer`` tokens gets ``overlong_penalty`` x a penalty growing linearly to
    -1 at the budget; 0 = off."""
    overlong_penalty: float = 1.0
    """Scale of the overlong punishment (DAPO: 1)."""
    workers: int = 0
    """Reward functions evaluated in this many worker processes per rank, each response's values waited for at most
    ``timeout_s`` (a response whose call runs over scores 0 and is counted: ``rollout/reward_timeouts``;
    :mod:`align_pipeline.rewards.pool`); 0 = in the rank itself, no timeout (cheap functions: the default)."""
    timeout_s: float = 30.0
    """Per-response limit of the reward functions with ``workers`` > 0."""

    def validate(self, where: str = "reward") -> None:
        super().validate(where)
        require_range(self, where, "missing_eos_penalty", 0)
        require_range(self, where, "overlong_penalty", 0)
        require_at_least(self, where, 0, "overlong_buffer", "workers")
        require_range(self, where, "timeout_s", 0, low_open=True)

    def has_reward(self) -> bool:
        """A reward model or a function with a non-zero weight (an RL section needs one, or an environment)."""
        return bool(self.reward_model_weight) or any(f.weight for f in self.functions)


@dataclass
class EnvConfig:
    """``<stage>.env``: multi-turn rollouts against an environment (:mod:`align_pipeline.envs`) instead of one
    response per prompt. Each episode starts from the environment's ``reset(record)``; the policy's turns are
    generated (all live episodes batched), the environment's turns appended through the chat template, and the loss
    covers the policy's tokens only. The score of an episode: ``reward_weight`` x the sum of its turn rewards, plus
    the ``reward`` section's terms over its last policy turn."""

    name: str | None = None
    """``module:Class`` of the environment (built-ins: ``align_pipeline.envs.builtin:Calculator``,
    ``:StepVerifier``); None = single-turn rollouts, scored by ``reward`` alone."""
    config: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the environment's constructor."""
    max_turns: int = 4
    """Policy turns per episode at most."""
    max_tokens: int = 0
    """Tokens an episode may add after its first prompt (policy and environment turns); 0 = up to the model's
    seq_length. A policy turn also stops at ``generation.max_new_tokens``."""
    reward_weight: float = 1.0
    """Weight of the episode's return (the sum of its turn rewards) in its score."""
    workers: int = 2
    """Worker processes per rank that run the environment (:mod:`align_pipeline.envs.pool`)."""
    step_timeout_s: float = 30.0
    """A reset or step call that runs longer ends its episode (that turn scores 0; counted: ``env/timeouts``)."""

    def validate(self, where: str = "env") -> None:
        require_at_least(self, where, 1, "max_turns", "workers")
        require_at_least(self, where, 0, "max_tokens")
        require_range(self, where, "step_timeout_s", 0, low_open=True)
        if self.name is not None:
            from align_pipeline.config.env_spec import load_environment_class

            load_environment_class(self.name, f"{where}.name")


@dataclass
class KLConfig:
    """The KL-to-reference term of the RL stages. Its coefficient is ``beta`` in every stage, as in the papers:
    PPO subtracts ``beta x KL`` from the per-token rewards (Ouyang et al. 2022, eq. 2); REINFORCE adds
    ``beta x KL`` to the loss (Shao et al. 2024, eq. 3)."""

    estimator: Literal["k1", "k2", "k3"] = "k3"
    """Per-token KL estimator (:mod:`align_pipeline.rl.kl`). k3 (DeepSeekMath eq. 4: unbiased, >= 0) works both as
    a reward penalty and as a loss term. k1 (log pi - log pi_ref) is the classic per-token reward penalty (PPO's
    default) but is refused as a loss term (REINFORCE with ``beta`` > 0): its gradient is zero in expectation there.
    k2 (1/2 (log ratio)^2) is a biased, low-variance alternative."""
    beta: float = 0.05
    """The coefficient: constant, or the initial value of the adaptive controller. 0 = off: PPO still reports the
    KL; REINFORCE builds no reference model and runs no reference forward (no KL metrics), as TRL and veRL do."""
    adaptive: bool = False
    """Adaptive controller (Ziegler et al. 2019) driving the per-sequence KL towards ``target`` (PPO only)."""
    target: float = 6.0
    """KL target in nats per sequence (adaptive only)."""
    horizon: float = 10000.0
    """Controller horizon in samples (adaptive only)."""

    def validate(self, where: str = "kl") -> None:
        require_range(self, where, "beta", 0)
        for name in ("target", "horizon"):
            require_range(self, where, name, 0, low_open=True)
        if self.adaptive and self.beta == 0:
            raise ConfigError(f"{where}.beta=0 with {where}.adaptive: the adaptive controller scales beta, so it must "
                              "start > 0 (beta 0 = no KL term: set adaptive false)")


@dataclass
class RLLoopConfig:
    """The iteration loop of the RL stages: rollouts, then updates on them."""

    seed: int = 1234
    """Seed for init, prompt order, sampling and minibatch order."""
    iterations: int = 40
    """Rollout + update iterations."""
    prompts_per_iteration: int = 64
    """Prompts per rollout over all data-parallel ranks (each gets ``generation.samples_per_prompt`` samples)."""
    epochs: int = 1
    """Passes over each rollout (PPO's ``ppo_epochs``)."""
    minibatches: int = 1
    """Optimizer steps per pass; the rollout is split into this many minibatches."""
    micro_batch_size: int = 16
    """Rows per forward/backward."""
    log_interval: int = 1
    """Iterations between progress lines on the console."""
    metrics_interval: int | None = None
    """Iterations between MLflow metric points; None = ``iterations // 50`` (at least 1): at least 50 points per
    curve (every iteration of a shorter run)."""
    eval_interval: int = 10
    """Iterations between greedy validation passes on held-out prompts (0 = only at the end)."""
    eval_prompts: int = 64
    """Held-out prompts per validation pass."""
    eval_before_training: bool = False
    """Also validate the starting policy, before iteration 1 (logged at step 0, in the result as ``initial``): the
    run then shows where the policy started and where it ended on the same prompts."""
    save_interval: int = 10
    """Iterations between resumable checkpoints (0 = only at the end)."""
    keep_checkpoints: int = 2
    """Training checkpoints kept (oldest deleted)."""
    resume: bool = True
    """Resume from the latest complete checkpoint in the run directory."""

    def validate(self, where: str = "rl") -> None:
        require_at_least(self, where, 1, "iterations", "prompts_per_iteration", "epochs", "minibatches",
                         "micro_batch_size", "log_interval", "metrics_interval")
        require_at_least(self, where, 0, "seed", "eval_interval", "eval_prompts", "save_interval", "keep_checkpoints")

    @property
    def steps_per_iteration(self) -> int:
        """Optimizer steps per iteration: epochs x minibatches."""
        return self.epochs * self.minibatches


@dataclass
class OffloadConfig:
    """Memory options for large models (no effect on CPU)."""

    frozen_models: bool = False
    """Keep the reference and reward model on the CPU except while they score a rollout."""
    optimizer_states: bool = False
    """Move the optimizers' Adam moments to the CPU while generating and scoring."""


@dataclass
class StageRunConfig:
    """Where a training stage starts and keeps its run (the first fields of every training section)."""

    init_from: str | None = None
    """Override the stage's starting model (checkpoint dir or HF model dir); None = the stage's catalog input
    (sft_policy; SFT: random init from ``params:model``)."""
    runs_dir: str = "data/06_models/_runs"
    """Where run directories live; a run directory is keyed by the job's inputs and config, so a rerun after an
    interruption resumes from its latest checkpoint."""
    keep_run_dir: bool = False
    """Keep the run directory (training checkpoints, logs) after the model has been stored as a catalog version."""
    reuse: bool = True
    """Reuse a stored version made from the same inputs, config and code instead of training again
    (:mod:`align_pipeline.pipelines.reuse`); false = always train (``kedro run --params <stage>.reuse=false``)."""
    export_hf: bool = False
    """Also write each final model as a Hugging Face directory inside its artifact (``<artifact>/hf``: policies as
    ``*ForCausalLM``, reward models / critics as ``*ForSequenceClassification``, with the tokenizer)."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """Low-rank adapters (rank 0 = full fine-tuning). The stage's model is stored merged (base + adapters), so every
    later stage, the evaluation and the HF export read a plain model. PPO: the actor's (the critic's: ``critic_lora``)."""


@dataclass
class ExportConfig:
    """How model checkpoints are written as Hugging Face directories (``params:export``; stages' ``export_hf``)."""

    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype of the exported weights (float32 = the trained master weights, exact logits)."""
    max_shard_gb: float = 2.0
    """Size of one safetensors file."""
    check: bool = True
    """Check the whole export before it counts (:mod:`align_pipeline.model.export_check`): tokenizer vocabulary and
    fingerprint, special tokens / chat template, logits on fixed tokens within ``tolerance``, greedy generation; a
    failing export is removed and the node fails. False = opt out: the export is registered tagged
    ``export.check=skipped``."""
    tolerance: float | None = None
    """Parity tolerance; None = 1e-4 for float32, 5e-2 for bfloat16/float16."""
    work_dir: str = "data/06_models/_runs/export"
    """Where the export pipeline writes before the catalog moves each HF directory into its version."""
    register: bool = True
    """Log each checked export as an MLflow model (a copy of the directory in MLflow's artifact store) and register
    it as a version of the registered model named like its catalog entry (:mod:`align_pipeline.kedro.model_registry`);
    false = the export stays a catalog version only."""

    def validate(self, where: str = "export") -> None:
        for name in ("max_shard_gb", "tolerance"):
            require_range(self, where, name, 0, low_open=True)


@dataclass(kw_only=True)
class TrainPaths:
    """The files a supervised stage's job reads and its run directory (absolute paths, resolved by the node)."""

    run_dir: str
    """Working directory: config, logs, training checkpoints, result.json; the final model goes to run_dir/model."""
    train_data: str
    """Tokenized training .npz (SFT: input_ids/labels/loss_mask; preference: chosen_*/rejected_*)."""
    val_data: str
    """Tokenized validation .npz (same format)."""
    tokenizer: str
    """Tokenizer directory (ours or an HF model's)."""
    init_from: str | None = None
    """The starting model: a checkpoint dir (meta.json) or HF model dir; None = random init from ``model``."""


@dataclass(kw_only=True)
class RLPaths:
    """The files an RL stage's job reads and its run directory (absolute paths, resolved by the node)."""

    run_dir: str
    """Working directory: config, logs, per-model training checkpoints, result.json, the exported models."""
    prompts: str
    """Training prompts .jsonl (prompt, prompt_ids, optional answer)."""
    val_prompts: str | None = None
    """Held-out prompts .jsonl for the periodic validation (None = no validation)."""
    tokenizer: str
    """Tokenizer directory."""
    policy: str
    """The policy's starting checkpoint (normally sft_policy)."""
    reference: str | None = None
    """Frozen KL reference (None = ``policy``)."""
    reward_model: str | None = None
    """Frozen reward model (value head); required when ``reward.reward_model_weight`` is not 0."""


@dataclass(kw_only=True)
class StageJob:
    """What every training job carries besides its section and paths (a job = ``params:<stage>`` + these + paths)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """Architecture for random init (SFT); otherwise only run-time choices apply (attention backend) and the
    architecture comes from the starting checkpoint."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """TP / PP / sequence parallel / distributed optimizer / bf16 (RL stages: PP must be 1)."""
    lineage: dict[str, Any] = field(default_factory=dict)
    """Recorded into the output checkpoints' meta.json (data fingerprints, parent checkpoints, ...)."""
    stop_after: int | None = None
    """Exit cleanly after this many steps (iterations) of *this* invocation: an interruption, for resume tests."""
