"""Typed configuration shared by the Kedro nodes and the torchrun entry points.

Every config is a dataclass with a docstring per field (Megatron-core's style). :func:`from_dict` builds one from a
plain dict (Kedro parameters or a JSON file), rejects unknown keys and wrong types, and names the offending key, so a
bad ``parameters_*.yml`` fails before any process is launched. Nothing here imports Kedro, Megatron or torch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar, get_args, get_origin, get_type_hints

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration value is missing, unknown or of the wrong type."""


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
    """auto = Transformer Engine when importable, else SDPA core attention; local = Megatron's unfused attention."""


@dataclass
class ParallelConfig:
    """How the model and data are split across ranks. world size = TP * PP * DP."""

    tensor_model_parallel_size: int = 1
    """Tensor parallel size (shards attention heads and MLP)."""
    pipeline_model_parallel_size: int = 1
    """Pipeline parallel size (splits layers into stages)."""
    sequence_parallel: bool = False
    """Shard norms/dropout along the sequence across TP ranks (needs TP > 1)."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state across data-parallel ranks (ZeRO-1)."""
    recompute_granularity: Literal["none", "selective", "full"] = "none"
    """Activation recomputation to save memory."""
    recompute_num_layers: int = 1
    """Layers per recompute chunk for full recomputation."""
    bf16: bool = False
    """Train in bf16 with fp32 main weights (GPU)."""


@dataclass
class LaunchConfig:
    """How a node starts its torchrun job."""

    nproc_per_node: int = 1
    """Processes (GPUs, or CPU workers) per node."""
    nnodes: int = 1
    """Nodes in the job."""
    node_rank: int = 0
    """This node's rank (multi-node runs)."""
    master_addr: str = "127.0.0.1"
    """Rendezvous host."""
    master_port: int = 0
    """Rendezvous port; 0 = pick a free one."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """torch.distributed backend; auto = nccl with CUDA, else gloo."""
    threads_per_process: int | None = None
    """OMP/torch threads per rank on CPU; None = cores / nproc_per_node."""
    log_tail_lines: int = 40
    """Lines of a failing rank's log to include in the error."""


@dataclass
class OptimizerConfig:
    """AdamW with warmup + cosine decay, through Megatron's optimizer."""

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

    def validate(self) -> None:
        if not 0 <= self.min_lr <= self.lr:
            raise ConfigError(f"optimizer: need 0 <= min_lr ({self.min_lr}) <= lr ({self.lr})")


@dataclass
class TrainingConfig:
    """The optimisation loop shared by the training stages."""

    seed: int = 1234
    """Seed for init, data order and dropout (same on every rank; Megatron derives per-TP-rank streams)."""
    train_steps: int = 300
    """Optimizer steps."""
    global_batch_size: int = 32
    """Samples per optimizer step, over all data-parallel ranks and micro-batches."""
    micro_batch_size: int = 8
    """Samples per forward/backward; global = micro x grad-accumulation x DP."""
    log_interval: int = 10
    """Steps between progress lines / metric logs."""
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

    def validate(self) -> None:
        if self.global_batch_size % self.micro_batch_size:
            raise ConfigError(
                f"training.global_batch_size ({self.global_batch_size}) must be a multiple of "
                f"training.micro_batch_size ({self.micro_batch_size})"
            )
        if self.train_steps < 1:
            raise ConfigError("training.train_steps must be >= 1")


@dataclass(kw_only=True)
class TrainJobConfig:
    """What every training entry point needs (written by the node, or by hand as JSON)."""

    run_dir: str
    """Working directory: config, logs, training checkpoints, result.json; the final model goes to run_dir/model."""
    train_data: str
    """Tokenized training .npz (SFT: input_ids/labels/loss_mask; preference: chosen_*/rejected_*)."""
    val_data: str
    """Tokenized validation .npz (same format)."""
    tokenizer: str
    """Tokenizer directory (ours or an HF model's)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Architecture for random init; a checkpoint / HF ``init_from`` brings its own."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    init_from: str | None = None
    """Model checkpoint dir (meta.json) or HF model dir to start from; None = random init."""
    lineage: dict[str, Any] = field(default_factory=dict)
    """Recorded into the output checkpoint's meta.json (data fingerprints, parent checkpoint, config hash, ...)."""
    stop_after_steps: int | None = None
    """Exit cleanly after this many steps of *this* invocation (simulates an interruption; used by resume tests)."""


@dataclass(kw_only=True)
class SFTJobConfig(TrainJobConfig):
    """``python -m align_pipeline.train.sft``: next-token loss on response tokens."""


@dataclass
class RewardHeadConfig:
    """How the reward model turns hidden states into a reward."""

    pooling: Literal["last", "mean"] = "mean"
    """last = the value at the final response token (EOS); mean = mean over the response tokens."""
    margin_scale: float = 0.0
    """Bradley-Terry margin = margin_scale * (chosen_reward - rejected_reward) where the data has both (Llama 2)."""
    loss: Literal["bradley_terry", "regression"] = "bradley_terry"
    """bradley_terry: pairwise on preference pairs; regression: SteerLM-style multi-attribute labels (the data is a
    tokenized "regression" file with ``reward_labels`` [N, A]; missing labels are masked)."""


@dataclass(kw_only=True)
class RewardModelJobConfig(TrainJobConfig):
    """``python -m align_pipeline.train.reward_model``: Bradley-Terry reward model on preference pairs.

    ``init_from`` (required) is usually sft_policy; its LM head is replaced by a fresh value head.
    """

    reward: RewardHeadConfig = field(default_factory=RewardHeadConfig)

    def validate(self) -> None:
        if self.init_from is None:
            raise ConfigError("RewardModelJobConfig.init_from: a reward model starts from a checkpoint or HF dir")


@dataclass
class PreferenceLossConfig:
    """Which preference loss (a function in ``align_pipeline.losses.preference``) and its hyper-parameters."""

    name: Literal["dpo", "ipo", "rpo", "simpo", "hinge"] = "dpo"
    """The loss function (the registry key); each cites its paper."""
    beta: float = 0.1
    """beta of the paper (KL strength / reward scale)."""
    options: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments of that loss, e.g. label_smoothing (dpo), eta (rpo), gamma (simpo)."""
    sft_weight: float = 0.0
    """Weight of the SFT (mean NLL of the chosen response) term added to the preference loss; 0 = off."""


@dataclass
class ReferenceLogpsJobConfig:
    """``python -m align_pipeline.train.reference_logps``: sequence log-probs of a frozen model on preference data."""

    run_dir: str
    checkpoint: str
    """The reference model (normally sft_policy)."""
    data: dict[str, str]
    """split name -> preference .npz (e.g. {"train": ..., "val": ...})."""
    output: str
    """Where rank 0 writes the .npz: <split>_chosen_logps, <split>_rejected_logps, <split>_*_tokens."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    micro_batch_size: int = 16
    """Sequence pairs per forward."""


@dataclass(kw_only=True)
class DPOJobConfig(TrainJobConfig):
    """``python -m align_pipeline.train.dpo``: DPO-family training against cached reference log-probs.

    ``init_from`` (required) is the policy's starting checkpoint, normally sft_policy.
    """

    reference_logps: str | None = None
    """Cached reference log-probs (.npz from reference_logps); None only for reference-free losses (simpo)."""
    loss: PreferenceLossConfig = field(default_factory=PreferenceLossConfig)

    def validate(self) -> None:
        if self.init_from is None:
            raise ConfigError("DPOJobConfig.init_from: the policy starts from a checkpoint or HF dir")


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
    """Prompts per generation call."""


@dataclass
class EvaluationJobConfig:
    """``python -m align_pipeline.train.evaluate``: compare policies on held-out prompts and preference pairs."""

    run_dir: str
    output_dir: str
    """Where rank 0 writes report.json, the plots and meta.json."""
    tokenizer: str
    prompts: str
    """Held-out prompts .jsonl (prompt, prompt_ids, answer)."""
    policies: dict[str, str]
    """name -> policy checkpoint (the first named "sft" is the KL reference if ``reference`` is None)."""
    reference: str | None = None
    """KL reference checkpoint (normally sft_policy)."""
    reward_model: str | None = None
    """Reward-model checkpoint (value head) to score responses and measure RM accuracy; None = skip."""
    preference_data: str | None = None
    """Held-out preference pairs .npz for RM accuracy."""
    sft_data: str | None = None
    """Held-out SFT .npz for validation perplexity."""
    checker: str = "align_pipeline.data.demo_task:check"
    """``module:function(prompt, response, answer) -> bool``, the verifiable reward."""
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    greedy: bool = True
    """Also report greedy-decoding accuracy."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    micro_batch_size: int = 64
    """Rows per scoring forward."""
    lineage: dict[str, Any] = field(default_factory=dict)


@dataclass
class RewardConfig:
    """How a rollout's sequence-level score is made (PPO, REINFORCE)."""

    reward_model_weight: float = 1.0
    """Weight of the reward model's score (needs a reward model; 0 = not used)."""
    checker_weight: float = 0.0
    """Weight of the verifiable reward: 1 when ``checker`` accepts the response (needs ``answer`` or a checker that
    computes it), else 0."""
    checker: str = "align_pipeline.data.demo_task:check"
    """``module:function(prompt, response, answer) -> bool``."""
    missing_eos_penalty: float = 0.0
    """Subtracted from the score of a response that stopped at ``max_new_tokens`` without EOS."""

    def validate(self) -> None:
        if self.reward_model_weight == 0 and self.checker_weight == 0:
            raise ConfigError("reward: reward_model_weight and checker_weight are both 0 (no reward)")


@dataclass
class KLConfig:
    """The KL-to-reference penalty of PPO's per-token rewards."""

    estimator: Literal["k1", "k2", "k3"] = "k1"
    """Per-token KL estimator (align_pipeline.rl.kl)."""
    coef: float = 0.05
    """beta: the initial (adaptive) or constant (fixed) coefficient."""
    adaptive: bool = False
    """Adaptive controller (Ziegler et al. 2019) driving the per-sequence KL towards ``target``."""
    target: float = 6.0
    """KL target in nats per sequence (adaptive only)."""
    horizon: float = 10000.0
    """Controller horizon in samples (adaptive only)."""


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
    """Iterations between progress lines / metric logs."""
    eval_interval: int = 10
    """Iterations between greedy validation passes on held-out prompts (0 = only at the end)."""
    eval_prompts: int = 64
    """Held-out prompts per validation pass."""
    save_interval: int = 10
    """Iterations between resumable checkpoints (0 = only at the end)."""
    keep_checkpoints: int = 2
    """Training checkpoints kept (oldest deleted)."""
    resume: bool = True
    """Resume from the latest complete checkpoint in the run directory."""

    def validate(self) -> None:
        if self.iterations < 1 or self.epochs < 1 or self.minibatches < 1 or self.prompts_per_iteration < 1:
            raise ConfigError("rl: iterations, epochs, minibatches and prompts_per_iteration must be >= 1")


@dataclass
class PPOLossConfig:
    """PPO's clipped objective, GAE and whitening."""

    clip_eps: float = 0.2
    """Ratio clip epsilon of the policy loss."""
    value_clip_eps: float = 0.2
    """How far (in reward units) the value may move from its rollout estimate before clipping."""
    gamma: float = 1.0
    """GAE discount."""
    lam: float = 0.95
    """GAE lambda."""
    entropy_coef: float = 0.0
    """Entropy bonus weight (0 = off; entropy is reported either way)."""
    whiten_advantages: bool = True
    """Whiten advantages over the whole rollout (all DP ranks)."""


@dataclass
class OffloadConfig:
    """Memory options for large models (no effect on CPU)."""

    frozen_models: bool = False
    """Keep the reference and reward model on the CPU except while they score a rollout."""
    optimizer_states: bool = False
    """Move the optimizers' Adam moments to the CPU while generating and scoring."""


@dataclass(kw_only=True)
class RLJobConfig:
    """What both RL entry points need."""

    run_dir: str
    prompts: str
    """Training prompts .jsonl (prompt, prompt_ids, optional answer)."""
    val_prompts: str | None = None
    """Held-out prompts .jsonl for the periodic greedy validation (None = no validation)."""
    tokenizer: str
    init_from: str
    """The policy's starting checkpoint (normally sft_policy)."""
    reference: str | None = None
    """Frozen KL reference (None = ``init_from``)."""
    reward_model: str | None = None
    """Frozen reward model (value head); required when ``reward.reward_model_weight`` is not 0."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Only run-time choices apply (attention backend); the architecture comes from the checkpoints."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    rl: RLLoopConfig = field(default_factory=RLLoopConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """The policy's optimizer and schedule (over iterations x epochs x minibatches steps)."""
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    lineage: dict[str, Any] = field(default_factory=dict)
    stop_after_iterations: int | None = None
    """Exit cleanly after this many iterations of *this* invocation (simulates an interruption; resume tests)."""

    def validate(self) -> None:
        if self.reward.reward_model_weight and self.reward_model is None:
            raise ConfigError(f"{type(self).__name__}: reward.reward_model_weight is "
                              f"{self.reward.reward_model_weight} but no reward_model is given")
        if self.parallel.pipeline_model_parallel_size != 1:
            raise ConfigError("RL stages generate rollouts, which needs pipeline_model_parallel_size 1")


@dataclass(kw_only=True)
class PPOJobConfig(RLJobConfig):
    """``python -m align_pipeline.train.ppo``: actor (from init_from) + critic (from ``critic_init``) trained with PPO
    against a frozen reference and reward model, all colocated in one job."""

    critic_init: str | None = None
    """The critic's starting checkpoint: a value-head checkpoint (normally the reward model) or an LM checkpoint
    (a fresh value head); None = ``reward_model``."""
    kl: KLConfig = field(default_factory=KLConfig)
    ppo: PPOLossConfig = field(default_factory=PPOLossConfig)
    critic_optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)

    def validate(self) -> None:
        super().validate()
        if (self.critic_init or self.reward_model) is None:
            raise ConfigError("PPOJobConfig: the critic needs critic_init or reward_model")


@dataclass
class ReinforceLossConfig:
    """The REINFORCE-family estimator."""

    estimator: Literal["rloo", "grpo"] = "rloo"
    """rloo: leave-one-out baseline (Ahmadian et al. 2024); grpo: group mean/std normalisation (Shao et al. 2024)."""
    grpo_scale: bool = True
    """GRPO: divide by the group std (False = Dr. GRPO)."""
    kl_coef: float = 0.0
    """Weight of the KL-to-reference loss term (0 = off; KL is reported either way)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Estimator of that term (k3 = DeepSeekMath eq. 4)."""
    clip_eps: float = 0.2
    """Ratio clip when a rollout is used for more than one optimizer step (epochs or minibatches > 1)."""


@dataclass(kw_only=True)
class ReinforceJobConfig(RLJobConfig):
    """``python -m align_pipeline.train.reinforce``: RLOO / GRPO with ``generation.samples_per_prompt`` >= 2."""

    loss: ReinforceLossConfig = field(default_factory=ReinforceLossConfig)

    def validate(self) -> None:
        super().validate()
        if self.generation.samples_per_prompt < 2:
            raise ConfigError("ReinforceJobConfig: group baselines need generation.samples_per_prompt >= 2")


@dataclass
class StageParams:
    """A training stage's section of ``parameters_<stage>.yml`` (the node adds model/parallel/launch and paths)."""

    training: TrainingConfig = field(default_factory=TrainingConfig)
    """The optimisation loop."""
    init_from: str | None = None
    """Override the stage's starting model (checkpoint or HF dir); None = the stage's default input."""
    runs_dir: str = "data/06_models/_runs"
    """Where run directories live; a run dir is keyed by the job's inputs+config, so a rerun after an interruption
    resumes from its latest checkpoint."""
    keep_run_dir: bool = False
    """Keep the run directory (training checkpoints, logs) after the model has been stored as a catalog version."""


@dataclass
class RewardModelParams(StageParams):
    """``params:reward_model``."""

    reward: RewardHeadConfig = field(default_factory=RewardHeadConfig)
    """How the value head pools the sequence, and the optional margin."""


@dataclass
class DPOParams(StageParams):
    """``params:dpo``."""

    loss: PreferenceLossConfig = field(default_factory=PreferenceLossConfig)
    """The preference loss."""
    reference_cache_dir: str = "data/07_model_output/reference_logps"
    """Cached reference log-probs, one file per (reference checkpoint, preference data, tokenizer)."""
    reference_micro_batch_size: int = 32
    """Pairs per forward when computing reference log-probs."""


@dataclass
class RLParams:
    """What the PPO and REINFORCE sections share (the node adds model/parallel/launch, paths and lineage)."""

    rl: RLLoopConfig = field(default_factory=RLLoopConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    init_from: str | None = None
    """Override the policy's starting model; None = sft_policy."""
    runs_dir: str = "data/06_models/_runs"
    keep_run_dir: bool = False


@dataclass
class PPOParams(RLParams):
    """``params:ppo``."""

    kl: KLConfig = field(default_factory=KLConfig)
    ppo: PPOLossConfig = field(default_factory=PPOLossConfig)
    critic_optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)


@dataclass
class ReinforceParams(RLParams):
    """``params:reinforce``."""

    loss: ReinforceLossConfig = field(default_factory=ReinforceLossConfig)


@dataclass
class EvaluationParams:
    """``params:evaluation``."""

    generation: GenerationConfig = field(default_factory=GenerationConfig)
    greedy: bool = True
    checker: str = "align_pipeline.data.demo_task:check"
    micro_batch_size: int = 64
    runs_dir: str = "data/06_models/_runs"


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _convert(value: Any, tp: Any, where: str) -> Any:
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, where)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(f"{where}: {value!r} is not {_type_name(tp)}")
    if origin is Literal:
        if value not in get_args(tp):
            raise ConfigError(f"{where}: {value!r} is not one of {list(get_args(tp))}")
        return value
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping for {tp.__name__}, got {type(value).__name__}")
        return from_dict(tp, value, where)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {type(value).__name__}")
        (item_tp, *_) = get_args(tp) or (Any,)
        return [_convert(v, item_tp, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__}")
        _, val_tp = get_args(tp) or (Any, Any)
        return {k: _convert(v, val_tp, f"{where}.{k}") for k, v in value.items()}
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true/false, got {value!r}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    if isinstance(tp, type) and not isinstance(value, tp):
        raise ConfigError(f"{where}: expected {tp.__name__}, got {type(value).__name__}")
    return value


def from_dict(cls: type[T], data: dict[str, Any] | None, where: str | None = None) -> T:
    """Build dataclass ``cls`` from ``data``; unknown keys and wrong types raise :class:`ConfigError`."""
    where = where or cls.__name__
    data = dict(data or {})
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(fields)}")
    kwargs = {}
    for name, f in fields.items():
        if name in data:
            kwargs[name] = _convert(data[name], hints[name], f"{where}.{name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{where}.{name}: required key is missing")
    obj = cls(**kwargs)
    validate = getattr(obj, "validate", None)
    if callable(validate):
        validate()
    return obj


def to_dict(obj: Any) -> dict[str, Any]:
    """Plain-dict view of a config dataclass (JSON-serialisable)."""
    return dataclasses.asdict(obj)


def config_hash(obj: Any) -> str:
    """Stable short hash of a config (dataclass or dict), used in lineage and run-directory names."""
    data = to_dict(obj) if dataclasses.is_dataclass(obj) else obj
    blob = json.dumps(data, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


__all__ = [
    "ConfigError",
    "DPOJobConfig",
    "DPOParams",
    "EvaluationJobConfig",
    "EvaluationParams",
    "GenerationConfig",
    "KLConfig",
    "LaunchConfig",
    "ModelConfig",
    "OffloadConfig",
    "OptimizerConfig",
    "PPOJobConfig",
    "PPOLossConfig",
    "PPOParams",
    "ParallelConfig",
    "PreferenceLossConfig",
    "RLJobConfig",
    "RLLoopConfig",
    "RLParams",
    "ReferenceLogpsJobConfig",
    "ReinforceJobConfig",
    "ReinforceLossConfig",
    "ReinforceParams",
    "RewardConfig",
    "RewardHeadConfig",
    "RewardModelJobConfig",
    "RewardModelParams",
    "SFTJobConfig",
    "StageParams",
    "TrainJobConfig",
    "TrainingConfig",
    "config_hash",
    "field",
    "from_dict",
    "to_dict",
]
