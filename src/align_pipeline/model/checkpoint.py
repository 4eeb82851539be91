"""Checkpoints: Megatron ``dist_checkpointing`` shards + ``meta.json``, written atomically.

Two kinds, same layout (a directory with ``meta.json`` and the shards):

* **model checkpoint** (the artifact a stage hands to the next): model weights only. Loadable at any TP/PP size.
* **training checkpoint** (``<run_dir>/checkpoints/iter_0000100``): weights + optimizer + LR scheduler + step/data
  position + per-rank RNG states, for bit-exact resume.

A checkpoint is written into ``.tmp-<name>`` beside its final place and renamed only after every rank has finished
and ``meta.json`` is written, so a directory named ``iter_*`` (or a model artifact) is always complete.

Loading runs no code from the checkpoint: importing this module installs :mod:`align_pipeline.model.safe_pickle`
(``.metadata`` and the shards' objects through a restricted unpickler), ``common.pt`` and the RNG files are read with
``weights_only=True``, and pickled Transformer Engine extra state is refused (:func:`_check_extra_state`).
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as tdist
from megatron.core import dist_checkpointing, tensor_parallel
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME, TorchCommonLoadStrategy

from align_pipeline.data.formats import CHECKPOINT_META as META_FILE
from align_pipeline.data.formats import TOKENIZER_DIR, is_checkpoint, lora_adapters_only
from align_pipeline.data.formats import checkpoint_meta as read_meta
from align_pipeline.model import lora, memory, safe_pickle
from align_pipeline.model.gpt import unwrap

safe_pickle.install()

FORMAT_VERSION = 1
_ITER_RE = re.compile(r"^iter_(\d{7})$")
# "fully_reshardable": the distributed optimizer's default sharding type fails to load on CPU ("ShardedTensor.
# flattened_range is not supported"), and this one also reshards across DP sizes.
_OPTIM_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def iteration_dir(run_dir: str | os.PathLike, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"iter_{step:07d}"


def complete_checkpoints(run_dir: str | os.PathLike) -> dict[int, Path]:
    """step -> directory of every complete training checkpoint under ``run_dir/checkpoints``."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return {}
    return {int(m.group(1)): p for p in root.iterdir() if (m := _ITER_RE.match(p.name)) and is_checkpoint(p)}


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The complete training checkpoint with the highest step under ``run_dir/checkpoints``, or None."""
    found = complete_checkpoints(run_dir)
    return found[max(found)] if found else None


def reward_pooling(path: str | os.PathLike) -> str:
    """How the value-head checkpoint at ``path`` pools per-token values into a sequence reward (set when the reward
    model was trained; "last" or "mean")."""
    meta = read_meta(path)
    if meta.get("head") != "value" or "reward_head" not in meta:
        raise ValueError(f"{path} is not a reward model (meta.json has no value head / reward_head.pooling)")
    return meta["reward_head"]["pooling"]


ADAPTERS_DIR = "adapters"
"""Subdirectory of a LoRA stage's model checkpoint holding its adapters alone (a Megatron sharded checkpoint)."""


def _atomic_dir_write(final: Path, write_fn, meta: dict[str, Any]) -> Path:
    """Run ``write_fn(tmp_dir)`` on all ranks, then rank 0 writes meta.json and renames tmp -> final."""
    final = Path(final)
    tmp = final.parent / f".tmp-{final.name}"
    rank = tdist.get_rank() if tdist.is_initialized() else 0
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    _barrier()
    write_fn(tmp)
    _barrier()
    if rank == 0:
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True, default=str))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    _barrier()
    return final


def _barrier() -> None:
    if tdist.is_initialized():
        tdist.barrier()


def _fork_started_results_queue() -> None:
    """Megatron's torch_dist saver collects its writer processes' results through a ``multiprocessing`` Manager queue
    that it starts with *spawn* the first time a process saves: the manager re-imports the entry point (torch +
    Megatron: 4-8 s on 2 CPU cores, per stage) before the first checkpoint can be written. A manager started by *fork*
    serves the same queue in ~0.1 s; it runs no CUDA (Megatron forks its writer processes the same way)."""
    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = multiprocessing.get_context("fork").Manager().Queue()


def _save(state: dict[str, Any], directory: Path) -> None:
    _fork_started_results_queue()
    with memory.phase("save"):
        dist_checkpointing.save(state, str(directory))


class _WeightsOnlyCommonLoad(TorchCommonLoadStrategy):
    """Megatron's ``common.pt`` loader with ``weights_only=True`` stated (Megatron relies on torch's default, which
    ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` turns off) and a refusal naming the file."""

    def load_common(self, checkpoint_dir: str | os.PathLike):
        path = Path(checkpoint_dir) / COMMON_STATE_FNAME
        if not path.is_file():
            raise FileNotFoundError(f"checkpoint {checkpoint_dir} has no {COMMON_STATE_FNAME}")
        return safe_pickle.weights_only_load(path)

    def load_sharded_objects(self, sharded_objects_state_dict, checkpoint_dir):
        raise safe_pickle.UnsafeCheckpoint(f"checkpoint {checkpoint_dir}: objects stored as separate .pt files (not "
                                           "the torch_dist format this project writes) are not loaded")


def _load(sharded: dict[str, Any], path: str | os.PathLike) -> dict[str, Any]:
    """``dist_checkpointing.load`` with :class:`_WeightsOnlyCommonLoad`; pickled extra state refused."""
    with safe_pickle.refusals_unwrapped():
        state = dist_checkpointing.load(sharded, str(path), common_strategy=_WeightsOnlyCommonLoad())
    _check_extra_state(state, path)
    return state


def _check_extra_state(state: Any, path: str | os.PathLike, key: str = "") -> None:
    """Refuse a non-empty ``*._extra_state``: Transformer Engine's layers ``pickle.loads`` theirs in
    ``load_state_dict`` (FP8 scaling state, which this project never trains with: without FP8 it is empty or None).
    """
    if isinstance(state, dict):
        for k, v in state.items():
            _check_extra_state(v, path, f"{key}.{k}" if key else str(k))
    elif key.endswith("_extra_state") and state is not None:
        empty = isinstance(state, torch.Tensor) and state.numel() == 0
        if not empty and not (isinstance(state, list | tuple) and all(x is None for x in state)):
            raise safe_pickle.UnsafeCheckpoint(
                f"checkpoint {path}: refused to load {key} ({type(state).__name__}: pickled Transformer Engine FP8 "
                "state, which this project does not train with; a checkpoint from elsewhere cannot run code)")


def save_model(path: str | os.PathLike, model, meta: dict[str, Any], adapters_only: bool = False) -> Path:
    """Save model weights (sharded, any parallel layout) with ``meta`` as ``meta.json``.

    A model with LoRA adapters is saved either as its adapters alone (``adapters_only``: ``adapters/`` and meta
    ``lora.storage: adapters`` with ``lora.base``, the checkpoint or HF directory they apply to; a few MB, merged
    into the base on load by :func:`align_pipeline.model.init.resolve`), or merged (``W + (alpha / r) B A``, no
    adapter entries, ``lora.storage: merged``) with the adapters beside it in ``adapters/``. A value-head model, or
    one whose base has no path (random init), is always saved merged. The tokenizer meta names (the job's) is copied
    into ``tokenizer/`` and meta.json names that copy, so the artifact is self-contained."""
    inner = unwrap(model)
    adapters = lora.describe(inner)
    meta = {"format": FORMAT_VERSION, "kind": "model", **meta}
    base = ((meta.get("lineage") or {}).get("parent") or {}).get("path")
    adapters_only = bool(adapters and adapters_only and base and meta.get("head", "lm") == "lm")
    if adapters:
        meta["lora"] = {**adapters, "merged": not adapters_only, "storage": "adapters" if adapters_only else "merged",
                        "adapters": ADAPTERS_DIR, "base": str(Path(base).resolve()) if base else None}

    tokenizer = _own_tokenizer(meta)
    if tokenizer is not None:
        meta["tokenizer"] = {**meta["tokenizer"], "path": TOKENIZER_DIR, "source": str(tokenizer)}

    def write(tmp: Path) -> None:
        if tokenizer is not None and (tdist.get_rank() if tdist.is_initialized() else 0) == 0:
            shutil.copytree(tokenizer, tmp / TOKENIZER_DIR)  # the artifact carries the tokenizer it was trained with
        sharded = inner.sharded_state_dict()
        if not adapters_only:
            _save(lora.merge_into_sharded_state_dict(inner, sharded) if adapters else sharded, tmp)
        if adapters:
            if (tdist.get_rank() if tdist.is_initialized() else 0) == 0:
                (tmp / ADAPTERS_DIR).mkdir()
            _barrier()
            _save({k: v for k, v in inner.sharded_state_dict().items() if lora.is_adapter(k)}, tmp / ADAPTERS_DIR)

    return _atomic_dir_write(Path(path), write, meta)


def _own_tokenizer(meta: dict[str, Any]) -> Path | None:
    """The tokenizer directory a model's meta names by an absolute path (the job's tokenizer), to copy into the
    checkpoint; None when it names none or already its own copy."""
    entry = meta.get("tokenizer")
    path = Path(entry["path"]) if isinstance(entry, dict) and entry.get("path") else None
    return path if path is not None and path.is_absolute() and path.is_dir() else None


def merge_stored_adapters(path: str | os.PathLike, model) -> None:
    """Add the adapters of the checkpoint at ``path`` (its ``adapters/``) into ``model``'s base weights, in place:
    ``W += (alpha / r) B A`` on this rank's shard of every adapted linear (any TP/PP layout: the adapters are read
    whole, layer by layer, and sliced the way the weight is sharded; a gated fc1's rows as [gate; up] per rank)."""
    from align_pipeline.model.hf_export import CheckpointTensors

    meta = read_meta(path)
    spec = meta["lora"]
    scaling = spec["alpha"] / spec["rank"]
    stored = CheckpointTensors(Path(path) / spec.get("adapters", ADAPTERS_DIR))
    inner = unwrap(model)
    gated = bool(getattr(inner.config, "gated_linear_unit", False))
    with torch.no_grad():
        for layer in getattr(inner.decoder, "layers", []):
            i = layer.layer_number - 1  # global layer index (pipeline stages hold a slice)
            for block_name, block in (("self_attention", layer.self_attention), ("mlp", layer.mlp)):
                for target in spec["target_modules"]:
                    linear = getattr(block, target, None)
                    key = f"decoder.layers.{block_name}.{target}"
                    if linear is None or not stored.has(f"{key}.lora_A"):
                        continue
                    a, b = stored.layer(f"{key}.lora_A", i).float(), stored.layer(f"{key}.lora_B", i).float()
                    r = linear.tp_group.rank()
                    rows, cols = linear.weight.shape
                    if target in ("linear_qkv", "linear_fc1"):  # column-parallel: this rank's rows of B
                        if target == "linear_fc1" and gated:
                            half = rows // 2
                            b = torch.cat([part[r * half:(r + 1) * half] for part in b.chunk(2)])
                        else:
                            b = b[r * rows:(r + 1) * rows]
                    else:  # row-parallel: this rank's columns of A
                        a = a[:, r * cols:(r + 1) * cols]
                    weight = linear.weight
                    delta = (b.to(weight.device) @ a.to(weight.device)) * scaling
                    weight.copy_((weight.float() + delta).to(weight.dtype))


def load_model(path: str | os.PathLike, model) -> dict[str, Any]:
    """Load weights saved by :func:`save_model` or :func:`save_training` into ``model`` (resharding TP/PP as needed).

    Returns the checkpoint's meta.
    """
    meta = read_meta(path)
    if lora_adapters_only(meta):
        raise ValueError(f"{path} holds LoRA adapters only (base: {meta['lora'].get('base')}); load it through "
                         "align_pipeline.model.init.resolve, which merges them into their base")
    inner = unwrap(model)
    sharded = inner.sharded_state_dict()
    new_head = getattr(inner, "head", "lm") == "value" and meta.get("head", "lm") == "lm"
    if new_head:  # an LM checkpoint into a value model: everything but the (new, randomly initialised) value head
        sharded = {k: v for k, v in sharded.items() if not k.startswith("output_layer.")}
    # only a LoRA training checkpoint holds adapters; anything else (a base model, a merged LoRA export) leaves a
    # model with adapters its fresh ones
    fresh_adapters = not meta.get("lora") or meta["lora"]["merged"]
    if fresh_adapters:
        sharded = {k: v for k, v in sharded.items() if not lora.is_adapter(k)}
    if meta.get("kind") == "training":
        state = _load({"model": sharded}, path)["model"]
    else:
        state = _load(sharded, path)
    missing, unexpected = inner.load_state_dict(state, strict=False)
    missing = [k for k in missing if not ((new_head and k.startswith("output_layer."))
                                          or (fresh_adapters and lora.is_adapter(k)))]
    if missing or unexpected:
        raise RuntimeError(f"{path}: loading left {missing} missing, {unexpected} unexpected")
    return meta


def _rng_state() -> dict[str, Any]:
    """This rank's RNG states as tensors and plain Python values (loadable with ``torch.load(weights_only=True)``)."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": (name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)),
        "torch": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def save_training(
    run_dir: str | os.PathLike,
    step: int,
    model,
    optimizer,
    scheduler,
    train_state: dict[str, Any],
    meta: dict[str, Any],
) -> Path:
    """Save a resumable training checkpoint ``run_dir/checkpoints/iter_<step>``."""
    inner = unwrap(model)
    rank = tdist.get_rank() if tdist.is_initialized() else 0
    world = tdist.get_world_size() if tdist.is_initialized() else 1
    meta = {"format": FORMAT_VERSION, "kind": "training", "step": step, "world_size": world, **meta}
    adapters = lora.describe(inner)
    if adapters:
        meta["lora"] = {**adapters, "merged": False}  # the adapters beside the frozen base: resumed as they are

    _init_unstepped_optimizer_states(optimizer)

    def write(tmp: Path) -> None:
        model_sd = inner.sharded_state_dict()
        state = {
            "model": model_sd,
            "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=False, metadata=_OPTIM_METADATA),
            "scheduler": scheduler.state_dict(),
            "train_state": train_state,
        }
        _save(state, tmp)
        (tmp / "rng").mkdir(exist_ok=True)
        torch.save(_rng_state(), tmp / "rng" / f"rank_{rank:05d}.pt")

    return _atomic_dir_write(iteration_dir(run_dir, step), write, meta)


def load_training(path: str | os.PathLike, model, optimizer, scheduler) -> dict[str, Any]:
    """Restore model, optimizer, scheduler and this rank's RNG from a training checkpoint; returns ``train_state``."""
    path = Path(path)
    meta = read_meta(path)
    inner = unwrap(model)
    _init_empty_optimizer_states(optimizer)
    model_sd = inner.sharded_state_dict()
    sharded = {
        "model": model_sd,
        "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=True, metadata=_OPTIM_METADATA),
    }
    state = _load(sharded, path)
    inner.load_state_dict(state["model"], strict=True)
    _zero_step_where_missing(state["optimizer"])
    with _tolerate_missing_adam_step(optimizer):
        optimizer.load_state_dict(state["optimizer"])
    _unshare_adam_steps(optimizer)
    scheduler.load_state_dict(state["scheduler"])
    rank = tdist.get_rank() if tdist.is_initialized() else 0
    rng_file = path / "rng" / f"rank_{rank:05d}.pt"
    world = tdist.get_world_size() if tdist.is_initialized() else 1
    if meta.get("world_size") == world and rng_file.is_file():
        _set_rng_state(safe_pickle.weights_only_load(rng_file))
    return state["train_state"]


@contextlib.contextmanager
def _tolerate_missing_adam_step(optimizer):
    """Distributed optimizer + torch AdamW: restoring main params copies every state key, but the reshardable state
    carries no per-parameter ``step`` (it is restored separately), giving ``KeyError: 'step'``. Keys the checkpoint does
    not provide keep their current value."""
    patched = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if hasattr(opt, "_set_main_param_and_optimizer_states") and hasattr(opt, "_get_main_param_and_optimizer_states"):
            original_set = opt._set_main_param_and_optimizer_states
            get = opt._get_main_param_and_optimizer_states

            def set_states(model_param, tensors, _set=original_set, _get=get):
                _set(model_param, {**_get(model_param), **tensors})

            opt._set_main_param_and_optimizer_states = set_states
            patched.append(opt)
    try:
        yield
    finally:
        for opt in patched:
            del opt._set_main_param_and_optimizer_states  # back to the class method


def _init_unstepped_optimizer_states(optimizer) -> None:
    """An optimizer that has not stepped yet (PPO's actor during the critic warm-up) has no AdamW state, so its
    checkpoint would lack the moments a resume loads. Give it the state AdamW's first step creates (step 0, zero
    moments): the step after a resume does the same arithmetic as an uninterrupted first step."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if inner is None or inner.state:
            continue
        if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            for group in inner.param_groups:
                for p in group["params"]:
                    inner.state[p] = {"step": torch.tensor(0.0, dtype=torch.float32),
                                      "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                                      "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
        elif getattr(opt, "init_state_fn", None) is not None:  # Megatron's own (TE/Apex Adam keep step per group)
            opt.init_state_fn(inner, opt.config)


def _zero_step_where_missing(state: Any) -> None:
    """Megatron saves the AdamW ``step`` shared by all parameters only when it is non-zero, so the checkpoint of an
    optimizer saved before its first step (see :func:`_init_unstepped_optimizer_states`) has moments but no step;
    torch's AdamW refuses such a state. Restore step 0 there."""
    if isinstance(state, dict):
        per_param = state.get("state")
        if isinstance(per_param, dict) and "param_groups" in state and "common_step" not in per_param:
            for param_state in per_param.values():
                if isinstance(param_state, dict) and "exp_avg" in param_state and "step" not in param_state:
                    param_state["step"] = torch.tensor(0.0, dtype=torch.float32)
        for value in state.values():
            _zero_step_where_missing(value)
    elif isinstance(state, list | tuple):
        for value in state:
            _zero_step_where_missing(value)


def _init_empty_optimizer_states(optimizer) -> None:
    """A fresh distributed optimizer has no AdamW state yet, but builds its loading state dict from that state."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if inner is not None and not inner.state and hasattr(opt, "_init_optimizer_states_with_dummy_values"):
            opt._init_optimizer_states_with_dummy_values()


def _unshare_adam_steps(optimizer) -> None:
    """Give every parameter its own AdamW ``step`` tensor after a restore.

    Megatron restores one common ``step`` and may assign the *same* tensor object to every parameter's state (seen with
    the distributed optimizer and torch AdamW); AdamW increments ``step`` in place once per parameter, so a shared
    tensor advances N times per optimizer step and bias correction is silently wrong after resume.
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        for pstate in inner.state.values():
            step = pstate.get("step")
            if isinstance(step, torch.Tensor):
                pstate["step"] = step.detach().clone()
