"""The rules that span sections: how a job's model, parallel layout, world size and batch sizes fit together.

Range rules of one section are that dataclass's ``validate()`` (run by :func:`~align_pipeline.config.from_dict`);
the rules here need several sections and the world size. Each raises :class:`ConfigError` naming the keys, and
:func:`check_job_layout` applies every rule of a stage. Two callers, one source per rule:

* :class:`align_pipeline.kedro.params_hook.ParamsValidationHook`, for every stage node of the pipeline being run, before any
  node runs (no torchrun job, no MLflow run), with the parameters' keys (``params:parallel.tensor_model_parallel_size``)
  and the world size of ``params:launch``;
* each entry point at its start (it runs without Kedro too), with the job's keys and the real world size.

Where each rule comes from (the code that fails without it):

* world size divisible by TP x PP: Megatron's ``initialize_model_parallel`` (checked in ``train.core.distributed``);
* TP divides ``num_attention_heads``; TP and ``num_query_groups`` divide one another: Megatron's
  ``TransformerConfig`` and attention (key/value heads are sharded, or replicated when fewer than TP); from an HF
  directory TP must divide the key/value heads (``model.hf`` loads whole heads per rank);
* PP divides ``num_layers``: Megatron's ``get_num_layers_to_build`` (no uneven split is configured);
* ``sequence_parallel`` with TP > 1 splits the sequence over the TP ranks: ``seq_length`` divisible by TP
  (Megatron's scatter/reduce-scatter along the sequence);
* PP = 1 for the stages that generate (ppo, reinforce, distill, evaluation): ``model.generate`` and ``forward_rows``;
* supervised stages: ``global_batch_size`` splits over DP ranks into micro-batches (``train.core.batches``);
* RL stages: a rollout splits over DP ranks, and each rank's rows into ``minibatches`` of whole micro-batches
  (``train.core.rollout``);
* a reward model with A > 1 outputs (multi-attribute regression) is scored with A attribute weights
  (``reward.reward_model_attribute_weights``; ``model.sequences.rewards_forward``);
* a starting model a user names (``<stage>.init_from``) is a checkpoint of ours (``meta.json``) or an HF directory
  with a ``config.json`` of a family ``model.hf`` imports (:data:`HF_MODEL_TYPES`): ``model.init.resolve``;
* the tokenizer has no more tokens than an HF model has embedding rows (``vocab_size``): ``model.init.resolve``.

Nothing here imports Kedro, Megatron or torch.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from align_pipeline.config.base import ConfigError, from_dict
from align_pipeline.config.common import MLAConfig, ModelConfig, MoEConfig, ParallelConfig, ScoringConfig

GENERATING_STAGES: dict[str, str] = {
    "ppo": "it generates rollouts",
    "reinforce": "it generates rollouts",
    "distill": "the student generates its samples",
    "evaluation": "it samples responses",
}
"""Stages that need pipeline_model_parallel_size 1 (generation runs on whole models only), and why."""

HF_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3")
"""The ``model_type`` values of an HF ``config.json`` that ``model.hf`` imports (and exports)."""

SUPERVISED_STAGES = frozenset({"sft", "reward_model", "dpo"})
"""Stages whose section has ``training`` (global batches of micro-batches)."""

RL_STAGES = frozenset({"ppo", "reinforce", "distill"})
"""Stages whose section has ``rl`` and ``generation`` (rollouts split into minibatches)."""


@dataclass(frozen=True)
class Arch:
    """A model a job builds, as the checks see it: its architecture and how a message names its fields."""

    model: ModelConfig
    """The architecture (only the sizes are read)."""
    prefix: str = "params:model"
    """A field is named ``<prefix>.<field>``."""
    spelled: dict[str, str] = field(default_factory=dict)
    """Fields named otherwise (the keys of an HF ``config.json``), as whole keys."""
    hf: bool = False
    """Loaded from an HF directory (whose weights are split by whole key/value heads)."""

    def key(self, name: str) -> str:
        return self.spelled.get(name) or f"{self.prefix}.{name}"

    def show(self, name: str) -> str:
        value = self.model
        for part in name.split("."):  # moe.num_experts
            value = getattr(value, part)
        return f"{self.key(name)}={value}"


@dataclass(frozen=True)
class Names:
    """How messages name the job's sections: the parameters' keys (the hook) or the job's own (an entry point)."""

    parallel: str = "params:parallel"
    """Prefix of the parallel keys."""
    section: str = "params:<stage>"
    """Prefix of the stage section's keys."""
    world: str = ""
    """What the world size is made of, e.g. ``params:launch.nproc_per_node=2 x params:launch.nnodes=1 (world size
    2)``; empty: ``world size <n>``."""


def job_names(section: str, world: int) -> Names:
    """Names inside an entry point: the job's fields (``parallel``, ``sft``, ...) and its real world size."""
    return Names(parallel="parallel", section=section, world=f"the job's world size {world}")


def job_arch(model: ModelConfig, init_from: str | None, kind: str = "random") -> Arch:
    """The architecture an entry point resolved (``model.init.resolve``: ``kind`` random, checkpoint, hf or nemo), named
    by where it came from."""
    if init_from is None:
        return Arch(model, "model")
    return Arch(model, f"{init_from} model", hf=kind in ("hf", "nemo"))  # a .nemo is read as its HF conversion


def checkpoint_arch(path: str | Path, label: str | None = None) -> Arch | None:
    """The architecture of a checkpoint directory from its ``meta.json`` (no torch); None if it has none."""
    meta_path = Path(path) / "meta.json"
    if not meta_path.is_file():
        return None
    try:
        meta = json.loads(meta_path.read_text())
    except ValueError:
        return None  # not readable: loading the checkpoint reports that
    if not isinstance(meta, dict) or "model" not in meta:
        return None
    where = f"{label + ' ' if label else ''}{meta_path} model"
    return Arch(from_dict(ModelConfig, meta["model"], where), where)


def hf_arch(path: str | Path, base: ModelConfig, label: str | None = None) -> Arch | None:
    """The sizes that matter for the layout of the HF model in ``path`` (its ``config.json``, as ``model.hf`` reads
    them); ``seq_length`` is ``base``'s (the training length is ours). None without a readable ``config.json``."""
    config_path = Path(path) / "config.json"
    if not config_path.is_file():
        return None
    try:
        cfg = json.loads(config_path.read_text())
        heads, layers = int(cfg["num_attention_heads"]), int(cfg["num_hidden_layers"])
        groups = int(cfg.get("num_key_value_heads") or heads)
    except (KeyError, TypeError, ValueError, AttributeError):
        return None  # not a model the import can read: it reports that itself
    vocab = cfg.get("vocab_size")
    where = f"{label + ' ' if label else ''}{config_path}"
    spelled = {
        "num_layers": f"{where}:num_hidden_layers",
        "num_attention_heads": f"{where}:num_attention_heads",
        "num_query_groups": f"{where}:num_key_value_heads",
        "seq_length": "params:model.seq_length",
    }
    moe = MoEConfig()
    if cfg.get("model_type") in ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3"):  # the experts' layout
        experts_key = next((k for k in ("num_experts", "n_routed_experts") if cfg.get(k) is not None),
                           "num_local_experts")
        width_key = "intermediate_size" if cfg.get("model_type") == "mixtral" else "moe_intermediate_size"
        try:
            moe = MoEConfig(num_experts=int(cfg[experts_key]), router_topk=int(cfg.get("num_experts_per_tok") or 1),
                            ffn_hidden_size=int(cfg[width_key]))
        except (KeyError, TypeError, ValueError):
            return None
        spelled |= {"moe.num_experts": f"{where}:{experts_key}", "moe.ffn_hidden_size": f"{where}:{width_key}"}
    mla = MLAConfig()
    if cfg.get("model_type") == "deepseek_v3":
        try:
            mla = MLAConfig(kv_lora_rank=int(cfg["kv_lora_rank"]), q_lora_rank=int(cfg.get("q_lora_rank") or 0),
                            qk_pos_emb_head_dim=int(cfg["qk_rope_head_dim"]))
        except (KeyError, TypeError, ValueError):
            return None
        spelled |= {"mla.kv_lora_rank": f"{where}:kv_lora_rank", "mla.q_lora_rank": f"{where}:q_lora_rank",
                    "mla.qk_pos_emb_head_dim": f"{where}:qk_rope_head_dim"}
    model = dataclasses.replace(
        base,
        num_layers=layers,
        num_attention_heads=heads,
        num_query_groups=groups,
        vocab_size=vocab if isinstance(vocab, int) and vocab > 0 else None,
        moe=moe,
        mla=mla,
    )
    return Arch(model, where, spelled, hf=True)


def start_arch(path: str | Path, base: ModelConfig, key: str) -> Arch | None:
    """The architecture of a starting model a user names (``key``, e.g. ``params:sft.init_from``), refusing what the
    job's ``model.init.resolve`` would refuse after data_prep has run: no such directory, neither a checkpoint of ours
    (``meta.json``) nor an HF directory (``config.json``), a ``config.json`` that is not JSON or whose ``model_type``
    is not one of :data:`HF_MODEL_TYPES`. None when the sizes cannot be read (the import names the missing field)."""
    path = Path(path)
    if not path.is_dir():
        raise ConfigError(
            f"{key}={str(path)!r}: no such directory (a checkpoint of this project, a Hugging Face model directory "
            "or a NeMo .nemo)"
        )
    if (path / "meta.json").is_file():
        return checkpoint_arch(path, key)  # a checkpoint of ours; an unreadable meta.json is reported on loading
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ConfigError(
            f"{key}={path}: config.json is missing (not a Hugging Face model directory; no meta.json: "
            "not a checkpoint of this project either)"
        )
    try:
        cfg = json.loads(config_path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{config_path} ({key}) is not readable JSON: {e}") from None
    model_type = cfg.get("model_type") if isinstance(cfg, dict) else None
    if model_type not in HF_MODEL_TYPES:
        raise ConfigError(
            f"model_type {model_type!r} in {config_path} ({key}) is not supported (supported: "
            f"{', '.join(HF_MODEL_TYPES)})"
        )
    return hf_arch(path, base, key)


def check_vocab(tokens: int, tokenizer: str, arch: Arch) -> None:
    """Every token id of the tokenizer indexes an embedding row of an HF model: ``tokens`` (the tokenizer's size,
    added tokens included) <= its ``vocab_size``. ``tokenizer`` names it (path and key). Only HF models are checked
    (a random init takes the tokenizer's size)."""
    rows = arch.model.vocab_size
    if arch.hf and rows is not None and tokens > rows:
        raise ConfigError(
            f"tokenizer {tokenizer} has {tokens} tokens (added tokens included) but the model "
            f"{arch.prefix} has {rows} embedding rows (vocab_size)"
        )


def path_arch(path: str | Path, base: ModelConfig, label: str | None = None) -> Arch | None:
    """A starting model given by path: a checkpoint of ours (meta.json) or an HF directory; None if neither."""
    return checkpoint_arch(path, label) or hf_arch(path, base, label)


def check_world(parallel: ParallelConfig, world: int, names: Names = Names()) -> int:
    """world size = TP x PP x DP; returns DP."""
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    if world % (tp * pp):
        raise ConfigError(
            f"{names.world or f'world size {world}'} is not divisible by {names.parallel}.tensor_model_parallel_size={tp} x "
            f"{names.parallel}.pipeline_model_parallel_size={pp} (world size = TP x PP x DP)"
        )
    ep = parallel.expert_model_parallel_size
    etp = parallel.expert_tensor_parallel_size or tp
    if world % (ep * etp * pp):
        raise ConfigError(
            f"{names.world or f'world size {world}'} is not divisible by {names.parallel}.expert_model_parallel_size="
            f"{ep} x expert TP {etp} x {names.parallel}.pipeline_model_parallel_size={pp} (the experts' layout: "
            "EP x expert TP x PP x expert DP)"
        )
    return world // (tp * pp)


def check_model_parallel(arch: Arch, parallel: ParallelConfig, names: Names = Names()) -> None:
    """Heads and key/value groups over TP ranks, layers over PP stages, the sequence over TP ranks (sequence
    parallel)."""
    m, p = arch.model, names.parallel
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    if m.num_attention_heads % tp:
        raise ConfigError(f"{p}.tensor_model_parallel_size={tp} does not divide {arch.show('num_attention_heads')}")
    groups = m.num_query_groups
    if groups is not None and arch.hf and groups % tp:
        raise ConfigError(
            f"{p}.tensor_model_parallel_size={tp} does not divide {arch.show('num_query_groups')} "
            "(HF weights are split over TP ranks by whole key/value heads)"
        )
    if groups is not None and groups % tp and tp % groups:
        raise ConfigError(
            f"{p}.tensor_model_parallel_size={tp} neither divides nor is a multiple of "
            f"{arch.show('num_query_groups')} (key/value heads are split over TP ranks, or replicated "
            "when fewer)"
        )
    ep, etp = parallel.expert_model_parallel_size, parallel.expert_tensor_parallel_size or tp
    if not m.moe.enabled() and (ep > 1 or parallel.expert_tensor_parallel_size not in (None, tp)):
        raise ConfigError(f"{p}.expert_model_parallel_size={ep} / expert_tensor_parallel_size need a "
                          f"mixture-of-experts model ({arch.show('moe.num_experts')} is 0)")
    if m.moe.enabled() and m.moe.num_experts % ep:
        raise ConfigError(f"{p}.expert_model_parallel_size={ep} does not divide {arch.show('moe.num_experts')} "
                          "(every EP rank holds the same number of experts)")
    if m.moe.enabled() and tp > 1 and not parallel.sequence_parallel:
        raise ConfigError(f"a mixture-of-experts model at {p}.tensor_model_parallel_size={tp} trains with sequence "
                          f"parallelism (Megatron's MoE layer): set {p}.sequence_parallel: true")
    expert_ffn = m.moe.ffn_hidden_size or m.ffn_hidden_size
    if m.moe.enabled() and expert_ffn and expert_ffn % etp:
        raise ConfigError(f"expert TP {etp} ({p}.expert_tensor_parallel_size, default: TP) does not divide the "
                          f"experts' ffn_hidden_size={expert_ffn}")
    mla = m.mla
    for key, width in (("mla.q_lora_rank", mla.q_lora_rank),
                       ("mla.kv_lora_rank", mla.kv_lora_rank + mla.qk_pos_emb_head_dim)):
        if mla.enabled() and width % tp:  # the down projections are column-parallel: their outputs split by TP
            extra = f" + {arch.show('mla.qk_pos_emb_head_dim')}" if key == "mla.kv_lora_rank" else ""
            raise ConfigError(f"{p}.tensor_model_parallel_size={tp} does not divide {arch.show(key)}{extra} "
                              "(multi-head latent attention's down projections are split over TP ranks)")
    if m.num_layers % pp:
        raise ConfigError(
            f"{p}.pipeline_model_parallel_size={pp} does not divide {arch.show('num_layers')} "
            "(every pipeline stage holds the same number of layers)"
        )
    if parallel.sequence_parallel and tp > 1 and m.seq_length % tp:
        raise ConfigError(
            f"{p}.sequence_parallel splits the sequence over {p}.tensor_model_parallel_size={tp} "
            f"ranks: {arch.show('seq_length')} is not divisible by it"
        )


def check_stage_parallel(stage: str, parallel: ParallelConfig, key: str = "params:parallel") -> None:
    """The stages that generate need PP = 1."""
    pp = parallel.pipeline_model_parallel_size
    if stage in GENERATING_STAGES and pp != 1:
        raise ConfigError(
            f"{key}.pipeline_model_parallel_size={pp}: the {stage} stage needs 1 "
            f"({GENERATING_STAGES[stage]}, and generation runs with pipeline_model_parallel_size 1 only)"
        )


def check_batch_split(
    global_batch_size: int,
    micro_batch_size: int,
    dp: int,
    global_key: str = "global_batch_size",
    micro_key: str = "micro_batch_size",
    dp_desc: str | None = None,
) -> None:
    """A global batch splits over ``dp`` data-parallel ranks into whole micro-batches: a multiple of DP x micro."""
    if global_batch_size % (dp * micro_batch_size):
        raise ConfigError(
            f"{global_key}={global_batch_size} must split over {dp_desc or f'DP={dp} ranks'} into micro-batches of "
            f"{micro_key}={micro_batch_size}: it must be a multiple of {dp * micro_batch_size}"
        )


def check_rollout_split(section: Any, dp: int, key: str = "params:<stage>", dp_desc: str | None = None) -> None:
    """A rollout (``rl.prompts_per_iteration`` prompts x ``generation.samples_per_prompt``) splits over ``dp`` ranks,
    and each rank's rows into ``rl.minibatches`` minibatches of whole micro-batches of ``rl.micro_batch_size``."""
    rl, spp = section.rl, section.generation.samples_per_prompt
    prompts, minibatches, micro = rl.prompts_per_iteration, rl.minibatches, rl.micro_batch_size
    dp_desc = dp_desc or f"DP={dp} ranks"
    if prompts % dp:
        raise ConfigError(
            f"{key}.rl.prompts_per_iteration={prompts} must split over {dp_desc}: it must be a multiple of {dp}"
        )
    rows = prompts // dp * spp
    if rows % (minibatches * micro):
        raise ConfigError(
            f"a rollout has {rows} rows per data-parallel rank ({key}.rl.prompts_per_iteration={prompts} / DP={dp} x "
            f"{key}.generation.samples_per_prompt={spp}); they must split into {key}.rl.minibatches={minibatches} "
            f"minibatches of whole micro-batches of {key}.rl.micro_batch_size={micro}: a multiple of "
            f"{minibatches * micro}"
        )


def check_job_layout(
    stage: str, section: Any, parallel: ParallelConfig, world: int, models: Iterable[Arch] = (), names: Names = Names()
) -> int:
    """Every layout rule of ``stage``: world size vs TP x PP, each model it builds vs TP / PP / sequence parallel,
    PP = 1 for generating stages, the stage's batches over the data-parallel ranks. Returns the data-parallel size.

    ``section`` is the stage's section (``params:<stage>``; ``params:dpo`` for ``reference_logps``), ``models`` the
    architectures the job builds (those it cannot know yet are left out: the job checks them when it has them)."""
    dp = check_world(parallel, world, names)
    for arch in models:
        check_model_parallel(arch, parallel, names)
    check_stage_parallel(stage, parallel, names.parallel)
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    dp_desc = f"DP={dp} data-parallel ranks (world size {world} / (TP={tp} x PP={pp}))"
    if stage in SUPERVISED_STAGES:
        t = section.training
        check_batch_split(
            t.global_batch_size,
            t.micro_batch_size,
            dp,
            f"{names.section}.training.global_batch_size",
            f"{names.section}.training.micro_batch_size",
            dp_desc,
        )
    elif stage in RL_STAGES:
        check_rollout_split(section, dp, names.section, dp_desc)
    return dp


def check_job(
    stage: str,
    section: Any,
    parallel: ParallelConfig,
    world: int,
    model: ModelConfig | None = None,
    init_from: str | None = None,
    kind: str = "random",
) -> int:
    """:func:`check_job_layout` as an entry point calls it: the job's keys (``parallel``, ``<stage>``), its real world
    size, and the model it resolved from ``init_from`` (``model.init.resolve``; ``kind``: random, checkpoint, hf)."""
    models = [] if model is None else [job_arch(model, init_from, kind)]
    return check_job_layout(stage, section, parallel, world, models, job_names(stage, world))


def reward_model_outputs(path: str | Path) -> int | None:
    """The outputs of a value-head checkpoint (its ``meta.json`` ``num_outputs``; 1 when unset); None when it has no
    readable ``meta.json`` (loading it reports that)."""
    meta_path = Path(path) / "meta.json"
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError):
        return None
    return int(meta.get("num_outputs", 1)) if isinstance(meta, dict) else None


def attribute_weights(weights: list[float] | None, num_outputs: int, key: str, model: str | Path
                      ) -> list[float] | None:
    """The weights a reward model's ``num_outputs`` outputs are combined with (Σ_a w_a x r_a), checked: None for a
    one-output model without weights (its score as it is); a multi-attribute model needs one weight per output.
    ``key`` names the scoring section (``params:ppo.reward``)."""
    if weights is None:
        if num_outputs == 1:
            return None
        raise ConfigError(
            f"{key}.reward_model_attribute_weights is not set, but the reward model {model} has {num_outputs} outputs "
            f"(a multi-attribute regression model): give {num_outputs} weights, one per attribute in the order of "
            "its training labels (sorted names)"
        )
    if len(weights) != num_outputs:
        raise ConfigError(
            f"{key}.reward_model_attribute_weights has {len(weights)} weights, but the reward model {model} has "
            f"{num_outputs} output{'s' if num_outputs > 1 else ''}"
        )
    return list(weights)


def check_reward_model(scoring: ScoringConfig, path: str | Path | None, key: str) -> None:
    """:func:`attribute_weights` for the reward model at ``path`` (read from its ``meta.json``; nothing to check
    without one)."""
    outputs = reward_model_outputs(path) if path is not None else None
    if outputs is not None:
        attribute_weights(scoring.reward_model_attribute_weights, outputs, key, path)
