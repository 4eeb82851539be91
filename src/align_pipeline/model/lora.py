"""Low-rank adapters (LoRA, Hu et al. 2021) on Megatron-core's tensor-parallel linears.

``y = W x + (alpha / r) · B A x`` with ``A`` [r, in], ``B`` [out, r]; ``B`` starts at zero, so a model with fresh
adapters computes exactly what its base computes. The adapted layers are subclasses of Megatron's
``ColumnParallelLinear`` / ``RowParallelLinear`` put into the layer spec (:func:`lora_layer_spec`), so the base
weights keep their names and shards and the adapters sit beside them (``linear_qkv.lora_A``, ``linear_qkv.lora_B``).

Tensor parallelism (TP ranks ``t``), the adapters sharded the way the base weight is:

* column-parallel (``linear_qkv``, ``linear_fc1``; W sharded by output rows): ``A`` whole on every rank, ``B`` sharded
  by rows like W. ``A x`` is the same on every rank; its gradient (``Bₜᵀ g``) is a partial sum per rank, summed over
  TP before it reaches ``A`` and ``x``. With sequence parallelism ``x`` is gathered along the sequence first.
* row-parallel (``linear_proj``, ``linear_fc2``; W sharded by input columns, input sharded): ``A`` sharded by
  columns, ``B`` whole. ``Aₜ xₜ`` are partial sums, all-reduced (r numbers per token); ``B`` then gives the whole
  output, of which sequence parallelism keeps this rank's sequence shard, as the base's reduce-scatter does.

Adapter initialisation draws the whole ``A`` (Kaiming-uniform, as PEFT) from the default generator on every rank and
keeps this rank's shard: every TP size starts from the same adapters.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from align_pipeline.model.logprobs import sum_grad_over_group

TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
MLA_INPUTS = ("linear_q_proj", "linear_q_up_proj", "linear_kv_up_proj")
"""Multi-head latent attention's per-head input linears (column-parallel, one adapter each), which the ``linear_qkv``
target adapts in such a layer: the query projection (or the query bottleneck's up projection) and the key/value up
projection. The down projections into the latents keep their weights (Megatron 0.16 builds them only from its own
linear classes)."""
"""The Megatron linears an adapter can be put on (attention in/out projections, MLP in/out projections)."""


def _init_a(rows: int, cols: int, shard: slice | None, dtype: torch.dtype) -> torch.Tensor:
    """PEFT's A initialisation (Kaiming-uniform, a=sqrt(5): U(-1/sqrt(in), 1/sqrt(in))) of the whole [rows, cols],
    drawn from the default generator on every rank; ``shard``: the columns this rank keeps."""
    bound = 1.0 / math.sqrt(cols)
    full = torch.empty(rows, cols, dtype=torch.float32).uniform_(-bound, bound)
    return (full[:, shard] if shard is not None else full).to(dtype).contiguous()


class _Adapter:
    """What both adapted linears share: rank, scaling, dropout, the parameters' placement."""

    def _adapter_init(self, rank: int, alpha: float, dropout: float) -> None:
        if rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {rank}")
        self.lora_rank, self.lora_alpha, self.lora_dropout = rank, alpha, dropout
        self.lora_scaling = alpha / rank
        self.lora_enabled = True  # off: the base linear alone (:func:`disabled`)

    def _place(self, tensor: torch.Tensor) -> torch.nn.Parameter:
        device = self.weight.device
        return torch.nn.Parameter(tensor.to(device=device, dtype=self.weight.dtype))

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, self.lora_dropout, self.training) if self.lora_dropout else x


class LoRAColumnParallelLinear(_Adapter, ColumnParallelLinear):
    """``ColumnParallelLinear`` + adapter: ``lora_A`` [r, in] (whole), ``lora_B`` [out/t, r] (this rank's rows)."""

    def __init__(self, *args, lora_rank: int, lora_alpha: float, lora_dropout: float = 0.0, **kwargs):
        super().__init__(*args, **kwargs)
        self._adapter_init(lora_rank, lora_alpha, lora_dropout)
        self.lora_A = self._place(_init_a(lora_rank, self.input_size, None, torch.float32))
        self.lora_B = self._place(torch.zeros(self.output_size_per_partition, lora_rank))

    def forward(self, input_, weight=None, runtime_gather_output=None):
        output, bias = super().forward(input_, weight=weight, runtime_gather_output=runtime_gather_output)
        if not self.lora_enabled:
            return output, bias
        x = input_
        if self.sequence_parallel:  # [s/t, b, in] -> [s, b, in]; each rank's input gradient is then whole
            x = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False, group=self.tp_group)
        z = F.linear(self._drop(x), self.lora_A)  # [s, b, r], the same on every rank
        if self.tp_group.size() > 1:
            z = sum_grad_over_group(z, self.tp_group)  # its gradient Bₜᵀ g is a partial sum per rank
        y = F.linear(z, self.lora_B) * self.lora_scaling  # [s, b, out/t]
        gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
        if gather and self.tp_group.size() > 1:
            y = gather_from_tensor_model_parallel_region(y, group=self.tp_group)
        return output + y, bias

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        state_dict = self.state_dict(prefix="", keep_vars=True)
        sharded = make_sharded_tensors_for_checkpoint(state_dict, prefix, {"weight": 0, "bias": 0, "lora_B": 0},
                                                      sharded_offsets, tp_group=self.tp_group,
                                                      dp_cp_group=_dp_cp_group(metadata))
        if self.config.gated_linear_unit and prefix.endswith("linear_fc1."):
            # B's rows follow the gated fc1 weight's: this rank's [gate; up] rows, stored as the whole [gate; up]
            # the way Megatron's MLP stores the weight (so any TP size reads the same adapters)
            from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

            key = f"{prefix}lora_B"
            sharded[key] = apply_swiglu_sharded_factory(sharded[key], sharded_offsets,
                                                        (metadata or {}).get("singleton_local_shards", False))
        return sharded


class LoRARowParallelLinear(_Adapter, RowParallelLinear):
    """``RowParallelLinear`` + adapter: ``lora_A`` [r, in/t] (this rank's columns), ``lora_B`` [out, r] (whole)."""

    def __init__(self, *args, lora_rank: int, lora_alpha: float, lora_dropout: float = 0.0, **kwargs):
        super().__init__(*args, **kwargs)
        self._adapter_init(lora_rank, lora_alpha, lora_dropout)
        t, rank = self.tp_group.size(), self.tp_group.rank()
        part = self.input_size_per_partition
        self.lora_A = self._place(_init_a(lora_rank, part * t, slice(rank * part, (rank + 1) * part), torch.float32))
        self.lora_B = self._place(torch.zeros(self.output_size, lora_rank))

    def forward(self, input_):
        output, bias = super().forward(input_)
        if not self.lora_enabled:
            return output, bias
        z = F.linear(self._drop(input_), self.lora_A)  # [s, b, r]: this rank's partial sum
        if self.tp_group.size() > 1:
            z = reduce_from_tensor_model_parallel_region(z, group=self.tp_group)
        y = F.linear(z, self.lora_B) * self.lora_scaling  # [s, b, out], the same on every rank
        if self.sequence_parallel:  # the base output is this rank's sequence shard (reduce-scatter)
            y = scatter_to_sequence_parallel_region(y, group=self.tp_group)
        return output + y, bias

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        state_dict = self.state_dict(prefix="", keep_vars=True)
        return make_sharded_tensors_for_checkpoint(state_dict, prefix, {"weight": 1, "lora_A": 1},
                                                   sharded_offsets, tp_group=self.tp_group,
                                                   dp_cp_group=_dp_cp_group(metadata))


def _dp_cp_group(metadata: dict | None):
    """The data-parallel group a sharded tensor's replica id counts (as Megatron's own linears pass it): without it,
    every data-parallel rank claimed the main replica and a checkpoint did not load at DP > 1."""
    return (metadata or {}).get("dp_cp_group")


def lora_layer_spec(layer, rank: int, alpha: float, dropout: float, targets: tuple[str, ...] = TARGETS):
    """The transformer-layer spec (Megatron's local spec) with the ``targets`` linears adapted. In an MoE layer the
    MLP targets adapt its shared experts (when the model has them), never the routed experts."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    unknown = set(targets) - set(TARGETS)
    if unknown:
        raise ValueError(f"LoRA target_modules {sorted(unknown)} are not among {list(TARGETS)}")
    params = {"lora_rank": rank, "lora_alpha": alpha, "lora_dropout": dropout}

    def adapted(base, name):
        if name not in targets:
            return base
        if base is ColumnParallelLinear:
            return ModuleSpec(module=LoRAColumnParallelLinear, params=params)
        if base is RowParallelLinear:
            return ModuleSpec(module=LoRARowParallelLinear, params=params)
        raise ValueError(f"LoRA on {name}: the layer spec has {base!r}, not a Megatron column/row-parallel linear "
                         "(Transformer Engine's fused linears take no adapters here; use attention_backend: sdpa)")

    attn, mlp = layer.submodules.self_attention, layer.submodules.mlp
    if hasattr(attn.submodules, "linear_kv_up_proj"):  # multi-head latent attention: linear_qkv = its input linears
        inputs = {name: adapted(getattr(attn.submodules, name), "linear_qkv") for name in MLA_INPUTS}
    else:
        inputs = {"linear_qkv": adapted(attn.submodules.linear_qkv, "linear_qkv")}
    attn = dataclasses.replace(attn, submodules=dataclasses.replace(
        attn.submodules, **inputs, linear_proj=adapted(attn.submodules.linear_proj, "linear_proj")))

    def adapted_mlp(mlp):
        return dataclasses.replace(mlp, submodules=dataclasses.replace(
            mlp.submodules, linear_fc1=adapted(mlp.submodules.linear_fc1, "linear_fc1"),
            linear_fc2=adapted(mlp.submodules.linear_fc2, "linear_fc2")))

    if hasattr(mlp.submodules, "experts"):  # an MoE layer: the routed experts keep their weights (no adapters)
        shared = mlp.submodules.shared_experts
        if shared is not None and getattr(shared, "submodules", None) is not None:
            mlp = dataclasses.replace(mlp, submodules=dataclasses.replace(mlp.submodules,
                                                                          shared_experts=adapted_mlp(shared)))
    else:
        mlp = adapted_mlp(mlp)
    return dataclasses.replace(layer, submodules=dataclasses.replace(layer.submodules, self_attention=attn, mlp=mlp))


def is_adapter(name: str) -> bool:
    """Whether a parameter name is an adapter's."""
    return name.endswith(("lora_A", "lora_B"))


def freeze_base(model: torch.nn.Module, keep: tuple[str, ...] = ()) -> int:
    """Only adapter parameters (and those whose names start with one of ``keep``, e.g. a new value head) train;
    returns how many parameters do."""
    trainable = 0
    for name, param in model.named_parameters():
        train = is_adapter(name) or name.startswith(keep)
        param.requires_grad_(train)
        trainable += param.numel() if train else 0
    return trainable


def adapted_linears(model: torch.nn.Module) -> dict[str, _Adapter]:
    """The adapted linears of a model, by module name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, _Adapter)}


@contextlib.contextmanager
def disabled(model: torch.nn.Module):
    """The base model inside the block: every adapter of ``model`` off (its linears compute ``W x`` alone), back on
    after. A LoRA policy trained from a model is that model with its adapters off: the reference of DPO and the KL
    reference of RL, with no second copy of the weights."""
    linears = adapted_linears(model)
    for m in linears.values():
        m.lora_enabled = False
    try:
        yield model
    finally:
        for m in linears.values():
            m.lora_enabled = True


@contextlib.contextmanager
def as_reference(model: torch.nn.Module):
    """The base model as a frozen reference inside the block: adapters off (:func:`disabled`) and eval mode (no
    dropout, as a separately loaded reference model runs), both restored after."""
    training = model.training
    with disabled(model):
        model.eval()
        try:
            yield model
        finally:
            model.train(training)


def describe(model: torch.nn.Module) -> dict | None:
    """The adapters of a model as checkpoint meta (None without adapters): rank, alpha, dropout, target modules."""
    linears = adapted_linears(model)
    if not linears:
        return None
    first = next(iter(linears.values()))
    targets = sorted({"linear_qkv" if name.rsplit(".", 1)[-1] in MLA_INPUTS else name.rsplit(".", 1)[-1]
                      for name in linears})
    return {"rank": first.lora_rank, "alpha": first.lora_alpha, "dropout": first.lora_dropout,
            "target_modules": targets}


def merged_weight(m: _Adapter) -> torch.Tensor:
    """This rank's shard of ``W + (alpha / r) B A`` (a new tensor; the layer is unchanged)."""
    with torch.no_grad():
        delta = (m.lora_B.float() @ m.lora_A.float()) * m.lora_scaling  # column: [out/t, in]; row: [out, in/t]
        return (m.weight.float() + delta).to(m.weight.dtype)


def merge_into_sharded_state_dict(model: torch.nn.Module, sharded: dict) -> dict:
    """A model's sharded state dict with every adapted linear's weight replaced by its merged weight and the adapter
    entries left out: what a plain (adapter-less) model of the same architecture loads."""
    merged = {f"{name}.weight": merged_weight(m) for name, m in adapted_linears(model).items()}
    out = {}
    for key, value in sharded.items():
        if is_adapter(key):
            continue
        if key in merged:
            value = dataclasses.replace(value, data=merged[key])
        out[key] = value
    return out
