"""Test helpers: tiny tokenized data made with the real data code, and real torchrun jobs of the entry points."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np

from align_pipeline.config import (
    LaunchConfig,
    LoRAConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    RewardModelConfig,
    RewardModelJob,
    SFTConfig,
    SFTJob,
    TrainingConfig,
    TrainPaths,
    to_dict,
)
from align_pipeline.data.formats import save_jsonl, save_npz
from align_pipeline.data.schemas import read_raw_jsonl, record_texts
from align_pipeline.data.store import select
from align_pipeline.data.tokenize import DataPrepConfig, encode, split_encoded
from align_pipeline.data.tokenizer import TokenizerConfig, build_tokenizer
from align_pipeline.launch import run_torchrun

REPO = Path(__file__).resolve().parents[1]
RAW = REPO / "data" / "01_raw"

TINY_MODEL = ModelConfig(
    num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64, seq_length=48
)


def make_sft_data(out: Path, n_train: int | None = None, raw_file: str = "sft.jsonl") -> dict[str, str]:
    """Tokenizer + sft train/val npz from the shipped demo data (``raw_file`` in data/01_raw; the real data_prep code
    path)."""
    out.mkdir(parents=True, exist_ok=True)
    raw = read_raw_jsonl(RAW / raw_file, "sft")
    tok = build_tokenizer(TokenizerConfig(), [t for r in raw.records for t in record_texts(r)])
    tok.save(out / "tokenizer")
    enc = encode(raw, tok, TINY_MODEL.seq_length)
    parts = split_encoded(enc, raw, tok, DataPrepConfig(), TINY_MODEL.seq_length)
    paths = {"tokenizer": str(out / "tokenizer")}
    for split, bundle in parts.items():
        arrays = bundle.arrays
        if n_train is not None and split == "train":
            arrays = select(arrays, range(n_train))
        save_npz(out / f"sft_{split}.npz", arrays, bundle.meta)
        paths[split] = str(out / f"sft_{split}.npz")
    return paths


def make_pref_data(out: Path, tokenizer_dir: str) -> dict[str, str]:
    """Preference train/val npz from the shipped demo data, tokenized with ``tokenizer_dir``."""
    from align_pipeline.data.tokenizer import load_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    tok = load_tokenizer(tokenizer_dir)
    raw = read_raw_jsonl(RAW / "preference.jsonl", "preference")
    parts = split_encoded(encode(raw, tok, TINY_MODEL.seq_length), raw, tok, DataPrepConfig(), TINY_MODEL.seq_length)
    paths = {"tokenizer_dir": tokenizer_dir}
    for split, bundle in parts.items():
        save_npz(out / f"pref_{split}.npz", bundle.arrays, bundle.meta)
        paths[split] = str(out / f"pref_{split}.npz")
    return paths


def make_prompts(out: Path, tokenizer_dir: str, raw_file: str = "prompts.jsonl") -> dict[str, str]:
    """prompts_train/prompts_val .jsonl (prompt, prompt_ids, answer) from the shipped demo prompts (``raw_file``)."""
    from align_pipeline.data.tokenizer import load_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    tok = load_tokenizer(tokenizer_dir)
    raw = read_raw_jsonl(RAW / raw_file, "prompts")
    parts = split_encoded(encode(raw, tok, TINY_MODEL.seq_length), raw, tok, DataPrepConfig(), TINY_MODEL.seq_length)
    paths = {}
    for split, bundle in parts.items():
        save_jsonl(out / f"prompts_{split}.jsonl", bundle.records, bundle.meta)
        paths[split] = str(out / f"prompts_{split}.jsonl")
    return paths


def sft_job(data: dict[str, str], run_dir: Path, **overrides: Any) -> SFTJob:
    """A tiny SFT job; ``overrides``: training/parallel/model/lora (dicts of fields), stop_after, init_from."""
    training = TrainingConfig(
        seed=7, train_steps=6, global_batch_size=8, micro_batch_size=2, log_interval=1, eval_interval=0,
        eval_samples=32, save_interval=0, optimizer=OptimizerConfig(lr=1e-2, min_lr=1e-3, warmup_steps=2),
    )
    training = dataclasses.replace(training, **overrides.pop("training", {}))
    paths = TrainPaths(run_dir=str(run_dir), train_data=data["train"], val_data=data["val"], tokenizer=data["tokenizer"],
                       init_from=overrides.pop("init_from", None))
    model = overrides.pop("model", {})
    model = model if isinstance(model, ModelConfig) else dataclasses.replace(TINY_MODEL, **model)
    lora = LoRAConfig(**overrides.pop("lora", {}))
    return SFTJob(sft=SFTConfig(training=training, lora=lora), model=model,
                  parallel=ParallelConfig(**overrides.pop("parallel", {})), paths=paths, **overrides)


def run_sft(job: SFTJob, nproc: int = 1) -> dict[str, Any]:
    Path(job.paths.run_dir).mkdir(parents=True, exist_ok=True)
    return run_torchrun("align_pipeline.train.sft", to_dict(job), LaunchConfig(nproc_per_node=nproc),
                        job.paths.run_dir)


def run_rm(pref: dict[str, str], tokenizer: str, policy: str, run_dir: Path, model: ModelConfig = TINY_MODEL,
           parallel: ParallelConfig | None = None, nproc: int = 1, **section: Any) -> dict[str, Any]:
    """A tiny Bradley-Terry reward model on ``pref`` from ``policy`` (``section``: RewardModelConfig fields)."""
    training = TrainingConfig(seed=3, train_steps=4, global_batch_size=8, micro_batch_size=4, eval_interval=0,
                              eval_samples=16, save_interval=0, optimizer=OptimizerConfig(lr=1e-3, warmup_steps=1))
    job = RewardModelJob(reward_model=RewardModelConfig(training=section.pop("training", training), **section),
                         model=model, parallel=parallel or ParallelConfig(), paths=TrainPaths(run_dir=str(run_dir), train_data=pref["train"],
                                                            val_data=pref["val"], tokenizer=tokenizer,
                                                            init_from=policy))
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    return run_torchrun("align_pipeline.train.reward_model", to_dict(job), LaunchConfig(nproc_per_node=nproc), run_dir)


def run_dpo(pref: dict[str, str], tokenizer: str, policy: str, run_dir: Path, nproc: int = 1,
            reference_model: str | None = None, reference_logps: str | None = None,
            parallel: dict[str, Any] | None = None, **section: Any) -> dict[str, Any]:
    """A tiny DPO job on ``pref`` from ``policy`` (``section``: DPOConfig fields, ``lora`` as a dict;
    ``reference_model`` / ``reference_logps``: the job's paths; ``parallel``: ParallelConfig fields)."""
    from align_pipeline.config import DPOConfig, DPOJob, DPOPaths

    training = TrainingConfig(seed=5, train_steps=4, global_batch_size=8, micro_batch_size=4, log_interval=1,
                              eval_interval=0, eval_samples=16, save_interval=0,
                              optimizer=OptimizerConfig(lr=1e-2, warmup_steps=1))
    lora = LoRAConfig(**section.pop("lora", {}))
    job = DPOJob(dpo=DPOConfig(training=section.pop("training", training), lora=lora, **section), model=TINY_MODEL,
                 parallel=ParallelConfig(**(parallel or {})),
                 paths=DPOPaths(run_dir=str(run_dir), train_data=pref["train"], val_data=pref["val"],
                                tokenizer=tokenizer, init_from=policy, reference=reference_model,
                                reference_logps=reference_logps))
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    return run_torchrun("align_pipeline.train.dpo", to_dict(job), LaunchConfig(nproc_per_node=nproc), run_dir)


def losses(result: dict[str, Any]) -> list[float]:
    return [h["loss"] for h in result["history"]]


def load_result(run_dir: Path) -> dict[str, Any]:
    return json.loads((Path(run_dir) / "result.json").read_text())


def assert_close(a, b, tol: float) -> None:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    assert np.max(np.abs(a - b)) <= tol, f"max diff {np.max(np.abs(a - b))} > {tol}\n{a}\n{b}"
