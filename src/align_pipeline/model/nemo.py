"""NeMo-Aligner migration: a NeMo 1.x Megatron GPT ``.nemo`` checkpoint -> a Hugging Face directory, which every
model path of this project then reads (``align-pipeline import model.nemo CKPT``, ``init_from: model.nemo``,
``data_prep.tokenizer.hf_model_dir: model.nemo``).

The layout read (as NeMo 1.x writes it; NVIDIA/NeMo ``nemo/core/connectors/save_restore_connector.py``
``SaveRestoreConnector``, ``nemo/collections/nlp/parts/nlp_overrides.py`` ``NLPSaveRestoreConnector.save_to``,
Megatron-core ``dist_checkpointing``):

* a tar archive (uncompressed since NeMo 1.7, gzip before; member names may start with ``./``), or the directory it
  unpacks to, holding ``model_config.yaml`` (the model's config), the weights and the tokenizer's files as
  "artifacts" ``<32 hex>_<name>`` that the config names as ``nemo:<32 hex>_<name>``;
* the weights in ``model_weights/``: a Megatron-core distributed checkpoint (``metadata.json`` names its backend:
  ``torch_dist`` = torch DCP's ``.metadata`` + ``__*_*.distcp``, read through :mod:`.safe_pickle`'s restricted
  unpickler; ``zarr`` = one directory per tensor with ``.zarray`` and raw, uncompressed chunks), tensors whole (TP/PP
  do not matter), every key under ``model.``, the layers stacked on a leading axis (``model.decoder.layers.
  self_attention.linear_qkv.weight`` [L, (heads + 2 groups) x head_dim, hidden]) and named as Transformer Engine
  names them (``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``) whatever the layer spec;
* QKV rows grouped per key/value group (that group's query heads, then its key head, then its value head;
  Megatron-core ``SelfAttention.get_query_key_value_tensors``); ``linear_fc1`` = [gate; up] (``mlp.py`` glu);
* the config keys of a Megatron GPT (``megatron_gpt_model.py`` / ``build_transformer_config``): hidden_size,
  num_layers, num_attention_heads, num_query_groups (null = heads), kv_channels (null = hidden / heads),
  ffn_hidden_size (null = 4 x hidden), normalization, layernorm_epsilon, activation, bias, qkv_bias,
  position_embedding_type, rotary_base, rotary_percentage, rotary_interleaved, seq_len_interpolation_factor
  (linear RoPE scaling), scale_positional_embedding (Llama 3.1 RoPE scaling), share_embeddings_and_output_weights,
  encoder_seq_length / max_position_embeddings; the vocabulary rows beyond the tokenizer's (Megatron's padding) are
  dropped;
* the tokenizer section: ``library: sentencepiece`` (or ``megatron`` with ``type: GPTSentencePieceTokenizer``) with
  ``model: nemo:<...>.model``; ``library: huggingface`` whose ``type`` (or ``model``) is a ``nemo:`` directory or
  ``tokenizer.json`` inside the archive, or whose ``vocab_file`` / ``merge_file`` are (GPT-2 BPE; also ``megatron``
  ``GPT2BPETokenizer``). A ``type`` that is a hub id brings no files: the import goes on without a tokenizer (the
  note says so) and the model's tokenizer must be given (``data_prep.tokenizer.hf_model_dir``).

What maps becomes a Llama (or, with ``qkv_bias``, a Qwen2) HF directory; anything else is refused naming the config
key (``mcore_gpt: false`` — the legacy ``model.language_model.*`` layout —, LayerNorm, GELU, linear biases, learned
positions, partial or interleaved RoPE, MoE, QK-norm, FP8, a NeMo 2 directory, ``model_weights.ckpt``). Nothing in
an archive runs: members are extracted as plain files only (no links, no absolute or ``..`` paths), the YAML is read
with ``yaml.safe_load`` and every pickle through the restricted loaders.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from align_pipeline.errors import UserError

if TYPE_CHECKING:
    import torch

CONVERTER_VERSION = 1
"""Part of the conversion cache's key: a change to what :func:`convert` writes makes old entries unused."""
CONFIG_FILE = "model_config.yaml"
WEIGHTS_DIR = "model_weights"
PREFIX = "model."


class NemoConversionError(UserError, ValueError):
    """A ``.nemo`` checkpoint that cannot be converted; the message names the file and the key."""


def is_nemo(path: str | os.PathLike) -> bool:
    """A ``.nemo`` archive, or a directory holding an unpacked one (``model_config.yaml`` + ``model_weights``)."""
    p = Path(path)
    if p.is_file():
        return p.suffix == ".nemo"
    return p.is_dir() and (p / CONFIG_FILE).is_file() and not (p / "config.json").is_file()


# ---------------------------------------------------------------------------------------------------------------
# The archive
# ---------------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def unpacked(path: str | os.PathLike) -> Iterator[Path]:
    """The directory of a ``.nemo``: itself when unpacked, else a temporary extraction (removed afterwards) of its
    regular files and directories only."""
    path = Path(path)
    if path.is_dir():
        yield _root_of(path, path)
        return
    if not path.is_file():
        raise NemoConversionError(f"{path}: no such .nemo file")
    with tempfile.TemporaryDirectory(prefix="align-nemo-") as tmp:
        try:
            archive = tarfile.open(path, "r:*")  # noqa: SIM115 - closed by the with below
        except (tarfile.TarError, OSError) as exc:
            raise NemoConversionError(f"{path}: not a .nemo archive (a tar file): {exc}") from None
        with archive, _tar_errors(path):
            for member in archive:
                name = Path(os.path.normpath(member.name.lstrip("/")))
                if name.is_absolute() or ".." in name.parts:
                    raise NemoConversionError(f"{path}: member {member.name!r} points outside the archive")
                if str(name) == ".":
                    continue
                target = Path(tmp) / name
                if member.isdir():
                    target.mkdir(parents=True, exist_ok=True)
                elif member.isfile():
                    if target.exists():
                        raise NemoConversionError(f"{path}: member {member.name!r} appears twice")
                    target.parent.mkdir(parents=True, exist_ok=True)
                    with archive.extractfile(member) as src, open(target, "wb") as dst:
                        shutil.copyfileobj(src, dst, 1 << 24)
                else:
                    raise NemoConversionError(f"{path}: member {member.name!r} is a link or device file; a .nemo "
                                              "holds regular files only")
        yield _root_of(Path(tmp), path)


@contextlib.contextmanager
def _tar_errors(path: Path) -> Iterator[None]:
    """A truncated or inconsistent archive (a member that is a file and a directory) as one refusal."""
    try:
        yield
    except (tarfile.TarError, EOFError, FileExistsError, IsADirectoryError, NotADirectoryError) as exc:
        raise NemoConversionError(f"{path}: a damaged or inconsistent .nemo archive ({type(exc).__name__}: "
                                  f"{exc})") from None


def _root_of(directory: Path, origin: Path) -> Path:
    """The directory holding ``model_config.yaml`` (the archive's root, or one nested level)."""
    if (directory / CONFIG_FILE).is_file():
        return directory
    found = sorted(directory.glob(f"*/{CONFIG_FILE}"))
    if found:
        return found[0].parent
    if (directory / "context").is_dir() and (directory / "weights").is_dir():
        raise NemoConversionError(f"{origin}: a NeMo 2 checkpoint (context/ + weights/), not a NeMo 1.x .nemo; "
                                  "export it to Hugging Face with NeMo 2's own exporter")
    raise NemoConversionError(f"{origin}: no {CONFIG_FILE} (not a .nemo checkpoint)")


def read_config(root: Path, origin: Path) -> dict[str, Any]:
    import yaml

    try:
        cfg = yaml.safe_load((root / CONFIG_FILE).read_text())
    except yaml.YAMLError as exc:
        raise NemoConversionError(f"{origin}: {CONFIG_FILE} is not readable YAML: {exc}") from None
    if not isinstance(cfg, dict):
        raise NemoConversionError(f"{origin}: {CONFIG_FILE} is not a mapping")
    return cfg


def artifact(root: Path, ref: Any) -> Path | None:
    """The file (or directory) a config value names: ``nemo:<name>`` inside the archive (or a bare name NeMo would
    look up there); None for an absent value or one outside the archive (a hub id, a path at save time)."""
    if not isinstance(ref, str) or ref in ("", "None", "null"):
        return None
    name = ref[len("nemo:"):] if ref.startswith("nemo:") else Path(ref).name
    if "/" in name or name in (".", ".."):
        return None
    candidate = root / name
    return candidate if candidate.exists() else None


# ---------------------------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------------------------


def hf_config(cfg: dict[str, Any], vocab_size: int, origin: Path) -> dict[str, Any]:
    """The HF config (Llama, or Qwen2 with ``qkv_bias``) of a NeMo GPT config; refuses what does not map, naming
    the key."""

    def refuse(key: str, problem: str) -> NemoConversionError:
        return NemoConversionError(f"{origin}: {CONFIG_FILE} {key}: {problem}")

    def value(key: str, default: Any = None) -> Any:
        v = cfg.get(key, default)
        return default if v is None else v

    if not cfg.get("mcore_gpt", False):
        raise refuse("mcore_gpt", "absent or false: a legacy (non-Megatron-core) NeMo GPT, whose weights are "
                                  "model.language_model.* per TP rank; only mcore_gpt: true checkpoints import")
    checks = [
        ("normalization", value("normalization", "layernorm") == "rmsnorm", "only rmsnorm maps (Llama family)"),
        ("layernorm_zero_centered_gamma", not value("layernorm_zero_centered_gamma", False), "not supported"),
        ("activation", value("activation", "gelu") in ("swiglu", "fast-swiglu"), "only swiglu / fast-swiglu map"),
        ("bias", not value("bias", True), "biases on every linear layer are not supported (bias: false maps)"),
        ("position_embedding_type", value("position_embedding_type", "learned_absolute") == "rope",
         "only rope maps"),
        ("rotary_percentage", float(value("rotary_percentage", 1.0)) == 1.0, "partial RoPE is not supported"),
        ("rotary_interleaved", not value("rotary_interleaved", False), "interleaved RoPE is not supported"),
        ("num_moe_experts", not value("num_moe_experts", 0), "mixture-of-experts models are not supported"),
        ("qk_layernorm", not value("qk_layernorm", False), "QK layer norms are not supported"),
        ("multi_latent_attention", not value("multi_latent_attention", False), "not supported"),
        ("apply_embedding_scaling", not value("apply_embedding_scaling", False), "not supported"),
        ("fp8", not value("fp8", False), "FP8 checkpoints (scales in _extra_state) are not supported"),
    ]
    for key, ok, problem in checks:
        if not ok:
            raise refuse(key, f"{cfg.get(key)!r}: {problem}")
    for key in ("hidden_size", "num_layers", "num_attention_heads"):
        if not isinstance(cfg.get(key), int) or cfg[key] <= 0:
            raise refuse(key, f"expected a positive integer, got {cfg.get(key)!r}")
    if value("window_size") is not None:
        raise refuse("window_size", f"{cfg['window_size']!r}: sliding-window attention is not supported")
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    groups = int(value("num_query_groups", heads))
    if groups <= 0 or heads % groups:
        raise refuse("num_query_groups", f"{groups} does not divide num_attention_heads = {heads}")
    head_dim = int(value("kv_channels", hidden // heads))
    qkv_bias = bool(value("qkv_bias", False))
    if qkv_bias and head_dim * heads != hidden:
        raise refuse("kv_channels", f"{head_dim}: a Qwen2 model (qkv_bias) has head_dim = hidden_size / heads")
    theta = float(value("rotary_base", 10000))
    rope = {"rope_type": "default", "rope_theta": theta}
    if value("seq_len_interpolation_factor") is not None:
        rope = {"rope_type": "linear", "rope_theta": theta, "factor": float(cfg["seq_len_interpolation_factor"])}
    if value("scale_positional_embedding", False):
        if rope["rope_type"] != "default":
            raise refuse("scale_positional_embedding", "together with seq_len_interpolation_factor")
        rope = {"rope_type": "llama3", "rope_theta": theta, "factor": float(value("scale_factor", 8.0)),
                        "low_freq_factor": float(value("low_freq_factor", 1.0)),
                        "high_freq_factor": float(value("high_freq_factor", 4.0)),
                        "original_max_position_embeddings": int(value("old_context_len", 8192))}
    context = int(value("encoder_seq_length", value("max_position_embeddings", 4096)))
    out = {
        "architectures": ["Qwen2ForCausalLM" if qkv_bias else "LlamaForCausalLM"],
        "model_type": "qwen2" if qkv_bias else "llama",
        "hidden_size": hidden,
        "num_hidden_layers": cfg["num_layers"],
        "num_attention_heads": heads,
        "num_key_value_heads": groups,
        "intermediate_size": int(value("ffn_hidden_size", 4 * hidden)),
        "hidden_act": "silu",
        "rms_norm_eps": float(value("layernorm_epsilon", 1e-5)),
        "rope_parameters": rope,
        "max_position_embeddings": context,
        "tie_word_embeddings": bool(value("share_embeddings_and_output_weights", True)),
        "vocab_size": vocab_size,
    }
    if not qkv_bias:
        out.update({"head_dim": head_dim, "attention_bias": False, "mlp_bias": False})
    return out


# ---------------------------------------------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------------------------------------------


class _Weights:
    """The tensors of ``model_weights/`` by key (``torch_dist`` or ``zarr``), read one key at a time."""

    def __init__(self, root: Path, origin: Path):
        self.origin = origin
        self.dir = root / WEIGHTS_DIR
        if not self.dir.is_dir():
            legacy = sorted(p.name for p in root.iterdir() if p.name.endswith(".ckpt") or p.name.startswith(
                ("mp_rank_", "tp_rank_")))
            if legacy:
                raise NemoConversionError(f"{origin}: weights in {legacy[0]} (a torch pickle per rank, NeMo's "
                                          "legacy layout); only a model_weights/ distributed checkpoint imports")
            raise NemoConversionError(f"{origin}: no {WEIGHTS_DIR}/ (a .nemo without weights)")
        try:
            info = json.loads((self.dir / "metadata.json").read_text())
        except (OSError, ValueError):
            info = None
        if not isinstance(info, dict):
            raise NemoConversionError(f"{origin}: {WEIGHTS_DIR}/metadata.json is missing or not a JSON object (not a "
                                      "Megatron distributed checkpoint)")
        backend = info.get("sharded_backend")
        self.backend = backend
        if backend == "torch_dist":
            from align_pipeline.model import safe_pickle

            safe_pickle.install()
            self.meta = safe_pickle.load_metadata(self.dir / ".metadata")
            from torch.distributed.checkpoint.metadata import TensorStorageMetadata

            self.shapes = {k: (tuple(v.size), v.properties.dtype) for k, v in self.meta.state_dict_metadata.items()
                           if isinstance(v, TensorStorageMetadata)}
        elif backend == "zarr":
            self.shapes = {}
            for d in sorted(self.dir.iterdir()):
                if (d / ".zarray").is_file():
                    spec = json.loads((d / ".zarray").read_text())
                    self.shapes[d.name] = (tuple(spec["shape"]), _zarr_dtype(spec, d, origin))
        else:
            raise NemoConversionError(f"{origin}: {WEIGHTS_DIR}/metadata.json sharded_backend {backend!r} is not "
                                      "torch_dist or zarr")
        if not any(k.startswith(PREFIX) for k in self.shapes):
            raise NemoConversionError(f"{origin}: {WEIGHTS_DIR}/ holds no model.* tensors (a .nemo without weights)")

    def __contains__(self, key: str) -> bool:
        return PREFIX + key in self.shapes

    def __getitem__(self, key: str) -> torch.Tensor:
        full = PREFIX + key
        if full not in self.shapes:
            raise NemoConversionError(f"{self.origin}: {WEIGHTS_DIR}/ has no tensor {full}")
        shape, dtype = self.shapes[full]
        if self.backend == "zarr":
            return _read_zarr(self.dir / full, shape, dtype)
        import torch
        import torch.distributed.checkpoint as dcp

        out = {full: torch.empty(shape, dtype=dtype)}
        # no_dist: read in this process alone, even inside a job whose ranks have a process group (the other ranks
        # wait on hf_dir_for's lock, not in a collective)
        dcp.load(out, storage_reader=dcp.FileSystemReader(str(self.dir)), no_dist=True)
        return out[full]


_ZARR_DTYPES = {"bfloat16": "bfloat16", "<f4": "float32", "<f2": "float16", "<f8": "float64"}
"""zarr dtype -> torch dtype name."""


def _zarr_dtype(spec: dict[str, Any], where: Path, origin: Path) -> torch.dtype:
    shape, chunks = spec.get("shape"), spec.get("chunks")
    if (not isinstance(shape, list) or not isinstance(chunks, list) or len(shape) != len(chunks)
            or not all(isinstance(n, int) and n > 0 for n in [*shape, *chunks])
            or spec.get("dimension_separator", ".") not in (".", "/")):
        raise NemoConversionError(f"{origin}: {where.name}/.zarray: shape {shape!r}, chunks {chunks!r}, "
                                  f"dimension_separator {spec.get('dimension_separator')!r} do not describe an array")
    dtype = spec.get("dtype")
    if dtype not in _ZARR_DTYPES or spec.get("compressor") is not None or spec.get("order", "C") != "C" or spec.get(
            "filters"):
        raise NemoConversionError(f"{origin}: {where.name}/.zarray: dtype {dtype!r}, compressor "
                                  f"{spec.get('compressor')!r}, order {spec.get('order')!r}: only uncompressed C-order "
                                  f"{', '.join(_ZARR_DTYPES)} arrays (what Megatron-core writes) are read")
    import torch

    return getattr(torch, _ZARR_DTYPES[dtype])


def _read_zarr(directory: Path, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zarr v2 array of raw chunks (no compressor), chunk files named ``i.j.k``."""
    import itertools

    import torch

    spec = json.loads((directory / ".zarray").read_text())
    chunks = tuple(spec["chunks"])
    separator = spec.get("dimension_separator", ".")
    out = torch.empty(shape, dtype=dtype)
    counts = [-(-s // c) for s, c in zip(shape, chunks)]
    for index in itertools.product(*(range(n) for n in counts)):
        path = directory / separator.join(str(i) for i in index)
        raw = bytearray(path.read_bytes())
        size = torch.Size(chunks).numel() * torch.empty((), dtype=dtype).element_size()
        if len(raw) != size:
            raise NemoConversionError(f"{path}: {len(raw)} bytes, not the {size} of a chunk {list(chunks)}")
        data = torch.frombuffer(raw, dtype=dtype).reshape(chunks)
        region = tuple(slice(i * c, min((i + 1) * c, s)) for i, c, s in zip(index, chunks, shape))
        out[region] = data[tuple(slice(0, r.stop - r.start) for r in region)]
    return out


def hf_tensors(weights: _Weights, hf: dict[str, Any], vocab: int) -> Iterator[dict[str, torch.Tensor]]:
    """The HF tensors, one NeMo key at a time (a dict per key: the layers of one stacked tensor)."""
    layers, heads, groups = hf["num_hidden_layers"], hf["num_attention_heads"], hf["num_key_value_heads"]
    hidden = hf["hidden_size"]
    head_dim = hf.get("head_dim") or hidden // heads
    per_group = heads // groups
    origin = weights.origin
    qkv_rows = weights.shapes.get(PREFIX + "decoder.layers.self_attention.linear_qkv.weight", ((0, 0),))[0][1:2]
    if qkv_rows != ((heads + 2 * groups) * head_dim,):
        raise NemoConversionError(f"{origin}: {PREFIX}decoder.layers.self_attention.linear_qkv.weight has rows "
                                  f"{qkv_rows}, not (num_attention_heads + 2 num_query_groups) x kv_channels = "
                                  f"{(heads + 2 * groups) * head_dim} (model_config.yaml and the weights disagree)")
    has_bias = "decoder.layers.self_attention.linear_qkv.bias" in weights
    if has_bias != (hf["model_type"] == "qwen2"):
        raise NemoConversionError(f"{origin}: model_config.yaml qkv_bias: {hf['model_type'] == 'qwen2'} but the "
                                  f"weights {'have' if has_bias else 'have no'} linear_qkv.bias")
    present = "output_layer.weight" in weights
    if present == hf["tie_word_embeddings"]:
        raise NemoConversionError(f"{origin}: model_config.yaml share_embeddings_and_output_weights: "
                                  f"{hf['tie_word_embeddings']} but {PREFIX}output_layer.weight is "
                                  f"{'present' if present else 'absent'}")
    yield {"model.embed_tokens.weight": weights["embedding.word_embeddings.weight"][:vocab].contiguous()}

    def stacked(key: str) -> torch.Tensor:
        t = weights[key]
        if t.shape[0] != layers:
            raise NemoConversionError(f"{weights.origin}: {PREFIX}{key} has {t.shape[0]} layers on its leading axis, "
                                      f"the config num_layers = {layers}")
        return t

    def norm(te_name: str, local_name: str) -> torch.Tensor:
        return stacked(te_name if te_name in weights else local_name)

    at = "model.layers.{}."
    t = norm("decoder.layers.self_attention.linear_qkv.layer_norm_weight", "decoder.layers.input_layernorm.weight")
    yield {at.format(i) + "input_layernorm.weight": t[i] for i in range(layers)}
    for suffix in ("weight", "bias"):
        key = f"decoder.layers.self_attention.linear_qkv.{suffix}"
        if key not in weights:
            continue
        qkv = stacked(key)
        rows = qkv.reshape(layers, groups, per_group + 2, head_dim, *qkv.shape[2:])
        out = {}
        for i in range(layers):
            out[at.format(i) + f"self_attn.q_proj.{suffix}"] = rows[i, :, :per_group].reshape(
                heads * head_dim, *qkv.shape[2:]).contiguous()
            out[at.format(i) + f"self_attn.k_proj.{suffix}"] = rows[i, :, per_group].reshape(
                groups * head_dim, *qkv.shape[2:]).contiguous()
            out[at.format(i) + f"self_attn.v_proj.{suffix}"] = rows[i, :, per_group + 1].reshape(
                groups * head_dim, *qkv.shape[2:]).contiguous()
        yield out
    t = stacked("decoder.layers.self_attention.linear_proj.weight")
    yield {at.format(i) + "self_attn.o_proj.weight": t[i] for i in range(layers)}
    t = norm("decoder.layers.mlp.linear_fc1.layer_norm_weight", "decoder.layers.pre_mlp_layernorm.weight")
    yield {at.format(i) + "post_attention_layernorm.weight": t[i] for i in range(layers)}
    fc1 = stacked("decoder.layers.mlp.linear_fc1.weight")
    ffn = hf["intermediate_size"]
    if fc1.shape[1] != 2 * ffn:
        raise NemoConversionError(f"{weights.origin}: {PREFIX}decoder.layers.mlp.linear_fc1.weight has "
                                  f"{fc1.shape[1]} rows, not 2 x ffn_hidden_size = {2 * ffn} ([gate; up])")
    out = {}
    for i in range(layers):
        out[at.format(i) + "mlp.gate_proj.weight"] = fc1[i, :ffn].contiguous()
        out[at.format(i) + "mlp.up_proj.weight"] = fc1[i, ffn:].contiguous()
    yield out
    t = stacked("decoder.layers.mlp.linear_fc2.weight")
    yield {at.format(i) + "mlp.down_proj.weight": t[i] for i in range(layers)}
    yield {"model.norm.weight": weights["decoder.final_layernorm.weight"]}
    if not hf["tie_word_embeddings"]:
        yield {"lm_head.weight": weights["output_layer.weight"][:vocab].contiguous()}


# ---------------------------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------------------------


def write_tokenizer(cfg: dict[str, Any], root: Path, out: Path, origin: Path) -> str | None:
    """Write the archive's tokenizer into the HF directory ``out``; returns a note when there is none to write."""
    section = cfg.get("tokenizer") or {}
    if not isinstance(section, dict):
        raise NemoConversionError(f"{origin}: {CONFIG_FILE} tokenizer: expected a mapping")
    library, kind = section.get("library"), section.get("type")
    model = artifact(root, section.get("model")) or artifact(root, section.get("tokenizer_model"))
    sentencepiece = library == "sentencepiece" or (library == "megatron" and kind == "GPTSentencePieceTokenizer")
    if sentencepiece:
        if model is None:
            raise NemoConversionError(f"{origin}: {CONFIG_FILE} tokenizer.model: {section.get('model')!r} is not a "
                                      "file inside the archive")
        _sentencepiece_to_hf(model, out)
    elif library == "huggingface" or (library == "megatron" and kind == "GPT2BPETokenizer"):
        inside = artifact(root, kind) or model
        vocab, merges = artifact(root, section.get("vocab_file")), artifact(root, section.get("merge_file"))
        if inside is not None and inside.is_dir():
            for f in inside.iterdir():
                if f.is_file() and f.name != "config.json":
                    shutil.copy(f, out / f.name)
        elif inside is not None and inside.name.endswith("tokenizer.json"):
            shutil.copy(inside, out / "tokenizer.json")
            (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
        elif vocab is not None and merges is not None:
            from transformers import GPT2TokenizerFast

            GPT2TokenizerFast(vocab_file=str(vocab), merges_file=str(merges)).save_pretrained(str(out))
        else:
            return (f"tokenizer.type {kind!r} names no files inside the archive (a hub id): no tokenizer was "
                    "written; give the model's tokenizer as data_prep.tokenizer.hf_model_dir")
    else:
        raise NemoConversionError(f"{origin}: {CONFIG_FILE} tokenizer.library: {library!r} is not supported "
                                  "(sentencepiece, huggingface, megatron GPT2BPETokenizer / GPTSentencePieceTokenizer)")
    if section.get("chat_template"):
        config_path = out / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        config["chat_template"] = section["chat_template"]
        config_path.write_text(json.dumps(config, indent=2))
    return None


def _sentencepiece_to_hf(model: Path, out: Path) -> None:
    """A SentencePiece model as a Llama-style HF tokenizer (transformers converts it to ``tokenizer.json``)."""
    import sentencepiece as spm
    from transformers import AutoTokenizer

    sp = spm.SentencePieceProcessor(model_file=str(model))
    specials = {name: sp.id_to_piece(i) for name, i in (("bos_token", sp.bos_id()), ("eos_token", sp.eos_id()),
                                                        ("unk_token", sp.unk_id())) if i >= 0}
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(model, Path(tmp) / "tokenizer.model")
        (Path(tmp) / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer",
                                                                     **specials}))
        AutoTokenizer.from_pretrained(tmp).save_pretrained(str(out))
    from tokenizers import Tokenizer

    converted = Tokenizer.from_file(str(out / "tokenizer.json"))
    # the model's own normal pieces, decoded to text (not control, unknown, unused or byte pieces)
    pieces = [i for i in range(min(sp.get_piece_size(), 2000))
              if not (sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i) or sp.is_byte(i))]
    probe = sp.decode(pieces)
    if converted.encode(probe, add_special_tokens=False).ids != sp.encode(probe):
        raise NemoConversionError(f"{model.name}: the SentencePiece model's HF conversion tokenizes differently from "
                                  "SentencePiece itself (a normalizer or option transformers does not reproduce); "
                                  "give an HF tokenizer as data_prep.tokenizer.hf_model_dir and import the weights "
                                  "with it")


def tokenizer_size(out: Path) -> int | None:
    if not (out / "tokenizer.json").is_file() and not (out / "tokenizer_config.json").is_file():
        return None
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(str(out)))


# ---------------------------------------------------------------------------------------------------------------
# Conversion
# ---------------------------------------------------------------------------------------------------------------


def convert(path: str | os.PathLike, out: str | os.PathLike) -> dict[str, Any]:
    """Write the HF directory of the ``.nemo`` at ``path`` into ``out`` (must not exist; written in a sibling
    temporary directory and renamed into place). Returns a summary (family, vocab, tokenizer note)."""
    from safetensors.torch import save_file

    path, out = Path(path).resolve(), Path(out).resolve()
    if out.exists():
        raise NemoConversionError(f"{out} exists; convert into a new directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        with unpacked(path) as root:
            cfg = read_config(root, path)
            if not cfg.get("mcore_gpt", False):
                hf_config(cfg, 0, path)  # names the key
            weights = _Weights(root, path)
            if "rm_head.weight" in weights:
                raise NemoConversionError(f"{path}: {PREFIX}rm_head.* (a NeMo-Aligner reward model): its value head "
                                          "is not imported; import its policy, or train a reward model here")
            note = write_tokenizer(cfg, root, tmp, path)
            if PREFIX + "embedding.word_embeddings.weight" not in weights.shapes:
                raise NemoConversionError(f"{path}: {WEIGHTS_DIR}/ has no {PREFIX}embedding.word_embeddings.weight")
            padded = weights.shapes[PREFIX + "embedding.word_embeddings.weight"][0][0]
            vocab = tokenizer_size(tmp) or padded
            if vocab > padded:
                raise NemoConversionError(f"{path}: the tokenizer has {vocab} tokens but the embedding "
                                          f"{padded} rows")
            hf = hf_config(cfg, vocab, path)
            index, total = {}, 0
            for n, tensors in enumerate(hf_tensors(weights, hf, vocab)):
                name = f"model-{n:05d}.safetensors"
                save_file(tensors, str(tmp / name), metadata={"format": "pt"})
                index.update({k: name for k in tensors})
                total += sum(t.numel() * t.element_size() for t in tensors.values())
            (tmp / "model.safetensors.index.json").write_text(json.dumps(
                {"metadata": {"total_size": total}, "weight_map": dict(sorted(index.items()))}, indent=1))
            dtype = weights.shapes[PREFIX + "embedding.word_embeddings.weight"][1]
            hf["torch_dtype"] = str(dtype).removeprefix("torch.")
            (tmp / "config.json").write_text(json.dumps(hf, indent=2))
            (tmp / "nemo_source.json").write_text(json.dumps({"nemo": str(path), "tokenizer_note": note}, indent=2))
        tmp.chmod(0o755)  # mkdtemp makes it 0700
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"hf_dir": str(out), "family": hf["model_type"], "vocab_size": vocab, "tokenizer_note": note}


def cache_root() -> Path:
    """Where converted ``.nemo`` checkpoints are kept, by content (``ALIGN_PIPELINE_CACHE``, default
    ``~/.cache/align-pipeline``)."""
    return Path(os.environ.get("ALIGN_PIPELINE_CACHE") or Path.home() / ".cache" / "align-pipeline") / "nemo"


def resolve_path(path: str | os.PathLike) -> Path:
    """``path`` itself, or for a ``.nemo`` its HF conversion (:func:`hf_dir_for`): what every reader of HF
    directories (``init_from``, ``hf_model_dir``) opens."""
    return hf_dir_for(path) if is_nemo(path) else Path(path)


def cache_target(path: str | os.PathLike) -> Path:
    """Where the HF conversion of a ``.nemo`` is kept: :func:`cache_root` / ``<name>-<sha256 of its content>``."""
    from align_pipeline.data.sources import source_sha256

    path = Path(path).resolve()
    digest = source_sha256(path, "dir" if path.is_dir() else "file")[:16]
    return cache_root() / f"{path.stem}-{digest}-v{CONVERTER_VERSION}"


def hf_dir_for(path: str | os.PathLike) -> Path:
    """The HF directory of a ``.nemo`` (``init_from`` / ``hf_model_dir``): converted once per content (sha256 of the
    archive, or of an unpacked directory's files) into :func:`cache_root`; concurrent callers (the ranks of a job)
    wait on a file lock and reuse it. The Kedro process does not call this (it imports no torch): it launches
    :mod:`align_pipeline.train.jobs.nemo_convert` (``launch.model_jobs.nemo_hf_dir``)."""
    import fcntl

    target = cache_target(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "config.json").is_file():
            if target.exists():
                shutil.rmtree(target)
            convert(path, target)
    return target


__all__ = ["NemoConversionError", "cache_root", "cache_target", "convert", "hf_config", "hf_dir_for", "is_nemo", "resolve_path",
           "unpacked"]
