"""DPO speed against TRL: our DPO stage and TRL's ``DPOTrainer`` on one GPU, same model, data and batch shape, in one
run.

    python benchmarks/dpo_vs_trl.py --preset 350m --steps 30 --warmup 5 --micro-batch 4 --global-batch 32 \\
        --out /tmp/dpo_vs_trl

Both sides start from one random HF Llama checkpoint written here with ``transformers`` (seeded; the shapes of
``sft_scaling.PRESETS``) and train on the same synthetic preference pairs, ``--micro-batch`` pairs per forward and
``--global-batch`` pairs per optimizer step, sigmoid DPO with beta 0.1, bf16 on a GPU (fp32 on CPU).

* Data: ``N = global batch x steps`` pairs (every step sees new pairs, one epoch on both sides) of random token ids
  (seeded): a prompt of ``--prompt-len`` tokens (``<bos>`` first), chosen and rejected responses of ``seq -
  prompt-len`` tokens (``<eos>`` last). Every sequence is exactly ``--seq`` tokens, so there is no padding and both
  trainers run the same tokens: ``2 x seq`` per pair, the loss on the response tokens. Written as our tokenized
  preference ``.npz`` (ragged ``chosen_*`` / ``rejected_*`` groups, :mod:`align_pipeline.data.store`) with a tokenizer
  dir, and as the pre-tokenized ``prompt_ids`` / ``chosen_ids`` / ``rejected_ids`` columns TRL's collator reads.
* Ours: the reference log-probs are computed first by our reference job (``align_pipeline.train.reference_logps``,
  untimed), then the DPO job (``align_pipeline.train.dpo``, Megatron-core, one torchrun process) trains from the HF
  dir with no validation and no checkpoints during the run. Its step times are the trainer's own per-step wall times
  (``result["history"][i]["step_time_s"]``: batch assembly, forward/backward of every micro-batch, optimizer step).
* TRL: ``DPOTrainer`` in a subprocess of its own (``--worker trl``: its memory and CUDA state are separate), the
  model loaded by TRL from the same HF dir (fp32 weights, ``attn_implementation="sdpa"``, bf16 autocast: TRL's
  ``bf16=True``). Row ``precomputed``: ``precompute_ref_log_probs=True`` (TRL's reference pass over the whole data
  runs inside the trainer's constructor, before training; the worker checks that the first timed step starts after
  it). Row ``default``: TRL's default, a reference-model forward in every step (``--skip-trl-default`` leaves it
  out). TRL 1.16 always tokenizes text columns, so the benchmark's subclass skips that dataset preparation (the
  columns are already its tokenized form); training is TRL's code unchanged. Gradient checkpointing, which TRL turns
  on by default, is off as in our job (``--trl-gradient-checkpointing`` turns it on).
  Step times: a ``TrainerCallback`` from ``on_step_begin`` to ``on_step_end`` (``torch.cuda.synchronize`` at both),
  i.e. the micro-batches' forward/backward, clipping and the optimizer step; TRL's batch prefetch and logging fall
  outside, which favours TRL.
* Optimizer on both sides: AdamW, betas (0.9, 0.95), weight decay 0.01, gradient clip 1.0, constant ``--lr``.
  Our bf16 keeps bf16 weights with fp32 main weights in the optimizer (Megatron), TRL fp32 weights under bf16
  autocast.
* pairs/s and tokens/s: steady state over the steps after ``--warmup``; speed-up = our pairs/s / TRL's (precomputed).
  Peak memory: ours, the training phase's peak (``peak_memory_by_phase_gib["train"]``); TRL,
  ``torch.cuda.max_memory_allocated`` from the start of training.

Writes ``<out>/dpo_vs_trl.json`` (everything, with per-step times and losses) and ``<out>/dpo_vs_trl.md`` (the section
for docs/benchmarks.md: command, date, device, versions, table, notes). Needs ``trl`` (1.16), ``datasets`` and
``accelerate`` importable; where there is no package registry, carry the wheels of trl, datasets, dill and
multiprocess (and whatever else of theirs is missing) and install them with ``pip install --no-deps``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from sft_scaling import PRESETS, header_lines, make_hf_init, run_header, versions

BETA = 0.1
ADAM = {"beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.01, "clip_grad": 1.0}
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2  # the ids of a trained tokenizer (align_pipeline.data.tokenizer.SPECIAL_TOKENS)
FIRST_ID = 4  # ids below are <pad>, <bos>, <eos>, <unk>


# ---------------------------------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------------------------------


def synthetic_pairs(n: int, vocab: int, prompt_len: int, seq: int, seed: int) -> dict[str, np.ndarray]:
    """``n`` preference pairs of random ids: prompt [n, P] (``<bos>`` first), chosen / rejected [n, seq - P]
    (``<eos>`` last)."""
    rng = np.random.default_rng(seed)
    response = seq - prompt_len
    prompt = rng.integers(FIRST_ID, vocab, size=(n, prompt_len), dtype=np.int64)
    prompt[:, 0] = BOS_ID
    chosen = rng.integers(FIRST_ID, vocab, size=(n, response), dtype=np.int64)
    rejected = rng.integers(FIRST_ID, vocab, size=(n, response), dtype=np.int64)
    chosen[:, -1] = rejected[:, -1] = EOS_ID
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected}


def make_pref_data(out: Path, vocab: int, prompt_len: int, seq: int, n_train: int, n_val: int,
                   seed: int) -> dict[str, str]:
    """Tokenizer dir, our train/val preference .npz (+ sidecars) and TRL's pairs (``trl_train.npz``)."""
    from align_pipeline.data.formats import save_npz
    from align_pipeline.data.store import ragged
    from align_pipeline.data.tokenizer import TokenizerConfig, build_tokenizer, load_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(TokenizerConfig(), ["preference pairs"]).save(out / "tokenizer")  # only its directory is needed
    tok = load_tokenizer(out / "tokenizer")
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (PAD_ID, BOS_ID, EOS_ID), "trained tokenizer's special ids moved"
    paths = {"tokenizer": str(out / "tokenizer")}
    for split, n, split_seed in (("train", n_train, seed), ("val", n_val, seed + 1)):
        pairs = synthetic_pairs(n, vocab, prompt_len, seq, split_seed)
        is_response = [False] * prompt_len + [True] * (seq - prompt_len)
        arrays: dict[str, np.ndarray] = {}
        for side in ("chosen", "rejected"):
            ids = np.concatenate([pairs["prompt"], pairs[side]], axis=1)  # [n, seq]
            arrays.update(ragged([(row.tolist(), is_response) for row in ids], prefix=f"{side}_"))
        arrays["chosen_reward"] = np.full(n, np.nan, dtype=np.float32)
        arrays["rejected_reward"] = np.full(n, np.nan, dtype=np.float32)
        meta = {"kind": "preference", "split": split, "num_samples": n, "seq_length": seq, "max_tokens": seq,
                "pad_id": PAD_ID, "tokenizer_fingerprint": tok.fingerprint, "source": "synthetic"}
        save_npz(out / f"pref_{split}.npz", arrays, meta)
        paths[split] = str(out / f"pref_{split}.npz")
        if split == "train":
            np.savez(out / "trl_train.npz", **pairs)
            paths["trl_train"] = str(out / "trl_train.npz")
    return paths


# ---------------------------------------------------------------------------------------------------------------------
# Ours: reference log-probs job, then the DPO job
# ---------------------------------------------------------------------------------------------------------------------


def reference_logps(args: argparse.Namespace, data: dict[str, str], hf_dir: str, out: Path, bf16: bool) -> str:
    """Our reference log-probs of the train and val pairs (the HF init is the reference), not timed."""
    from align_pipeline.config import LaunchConfig, ParallelConfig, ReferenceLogpsJob, to_dict
    from align_pipeline.launch import run_torchrun

    run_dir = out / "runs" / "reference_logps"
    run_dir.mkdir(parents=True, exist_ok=True)
    job = ReferenceLogpsJob(run_dir=str(run_dir), checkpoint=hf_dir,
                            data={"train": data["train"], "val": data["val"]},
                            output=str(out / "reference_logps.npz"), parallel=ParallelConfig(bf16=bf16),
                            micro_batch_size=args.micro_batch)
    run_torchrun("align_pipeline.train.reference_logps", to_dict(job), LaunchConfig(nproc_per_node=1), run_dir,
                 name="reference_logps")
    return job.output


def dpo_job(args: argparse.Namespace, data: dict[str, str], hf_dir: str, ref_path: str, run_dir: Path,
            n_val: int, bf16: bool):
    from align_pipeline.config import (
        DPOConfig,
        DPOJob,
        DPOPaths,
        ModelConfig,
        OptimizerConfig,
        ParallelConfig,
        PreferenceLossConfig,
        TrainingConfig,
    )

    optimizer = OptimizerConfig(lr=args.lr, min_lr=args.lr, warmup_steps=0, weight_decay=ADAM["weight_decay"],
                                adam_beta1=ADAM["beta1"], adam_beta2=ADAM["beta2"], adam_eps=ADAM["eps"],
                                clip_grad=ADAM["clip_grad"])
    training = TrainingConfig(seed=args.seed, train_steps=args.steps, global_batch_size=args.global_batch,
                              micro_batch_size=args.micro_batch, log_interval=max(args.steps // 5, 1),
                              eval_interval=0, eval_samples=n_val, save_interval=0, keep_checkpoints=1,
                              optimizer=optimizer)
    paths = DPOPaths(run_dir=str(run_dir), train_data=data["train"], val_data=data["val"],
                     tokenizer=data["tokenizer"], init_from=hf_dir, reference_logps=ref_path)
    return DPOJob(dpo=DPOConfig(training=training, loss=PreferenceLossConfig(name="dpo", beta=BETA)),
                  model=ModelConfig(seq_length=args.seq),  # the architecture comes from the HF dir
                  parallel=ParallelConfig(bf16=bf16), paths=paths)


def run_ours(args: argparse.Namespace, data: dict[str, str], hf_dir: str, out: Path, n_val: int,
             bf16: bool) -> dict[str, Any]:
    from align_pipeline.config import LaunchConfig, to_dict
    from align_pipeline.launch import run_torchrun

    print("[dpo_vs_trl] ours: reference log-probs (not timed) ...", flush=True)
    t = time.perf_counter()
    ref_path = reference_logps(args, data, hf_dir, out, bf16)
    ref_s = time.perf_counter() - t
    run_dir = out / "runs" / "dpo"
    run_dir.mkdir(parents=True, exist_ok=True)
    job = dpo_job(args, data, hf_dir, ref_path, run_dir, n_val, bf16)
    print("[dpo_vs_trl] ours: DPO ...", flush=True)
    if args.profile:  # the last warm-up step (left out of the timing) under torch.profiler
        os.environ.update(ALIGN_PROFILE_DIR=str(out / "profile_ours"), ALIGN_PROFILE_STEP=str(max(args.warmup, 1)))
    try:
        result = run_torchrun("align_pipeline.train.dpo", to_dict(job), LaunchConfig(nproc_per_node=1), run_dir,
                              name="dpo")
    finally:
        os.environ.pop("ALIGN_PROFILE_DIR", None)
    profile = out / "profile_ours" / "rank0_kernels.json"
    if profile.is_file():
        summary = json.loads(profile.read_text())
        print(f"[dpo_vs_trl] ours, profiled step: {summary['kernels']} kernels, GPU {summary['total_us'] / 1e3:.0f} ms "
              f"of {summary['step_wall_us'] / 1e3:.0f} ms wall ({summary['gpu_busy_share']:.0%} busy); "
              + ", ".join(f"{k} {v['share']:.0%}" for k, v in summary["categories"].items()), flush=True)
    history = result["history"]
    tokens = {h.get("step_tokens") for h in history}
    if tokens != {2 * args.seq * args.global_batch}:
        raise SystemExit(f"[dpo_vs_trl] our steps ran {sorted(tokens)} tokens, expected {2 * args.seq * args.global_batch}")
    phases = result.get("peak_memory_by_phase_gib") or {}
    return row("ours", "precomputed (reference_logps job)", [h["step_time_s"] for h in history],
               [h["loss"] for h in history], phases.get("train", result.get("peak_memory_gib")), args,
               {"reference_pass_s": ref_s, "peak_memory_gib_overall": result.get("peak_memory_gib"),
                "peak_memory_by_phase_gib": phases})


# ---------------------------------------------------------------------------------------------------------------------
# TRL, in a worker process
# ---------------------------------------------------------------------------------------------------------------------


def run_trl(args: argparse.Namespace, data: dict[str, str], hf_dir: str, out: Path, precompute: bool,
            bf16: bool) -> dict[str, Any]:
    name = "precomputed" if precompute else "default"
    work = out / "trl" / name
    work.mkdir(parents=True, exist_ok=True)
    cfg = {"hf_dir": hf_dir, "tokenizer": data["tokenizer"], "pairs": data["trl_train"], "work_dir": str(work),
           "result": str(work / "result.json"), "precompute": precompute, "bf16": bf16, "steps": args.steps,
           "micro_batch": args.micro_batch, "global_batch": args.global_batch, "seq": args.seq, "lr": args.lr,
           "seed": args.seed, "gradient_checkpointing": args.trl_gradient_checkpointing}
    (work / "config.json").write_text(json.dumps(cfg, indent=2))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(work / "hf_datasets_cache"), "TOKENIZERS_PARALLELISM": "false",
           "WANDB_DISABLED": "true", "TQDM_DISABLE": "1"}
    if "CUDA_VISIBLE_DEVICES" not in env:
        env["CUDA_VISIBLE_DEVICES"] = "0"  # Trainer would wrap a multi-GPU view in nn.DataParallel
    print(f"[dpo_vs_trl] TRL ({name} reference log-probs) ...", flush=True)
    proc = subprocess.run([sys.executable, "-u", str(Path(__file__).resolve()), "--worker", "trl",
                           "--worker-config", str(work / "config.json")], check=False, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"[dpo_vs_trl] the TRL worker ({name}) failed with exit status {proc.returncode}")
    r = json.loads((work / "result.json").read_text())
    reference = "precomputed (precompute_ref_log_probs=True)" if precompute else "reference forward every step"
    return row(f"TRL {r['versions']['trl']}", reference, r["step_times_s"], r["losses"], r["peak_memory_gib"], args,
               {k: v for k, v in r.items() if k not in ("step_times_s", "losses", "peak_memory_gib")})


def trl_worker(cfg_path: str) -> None:
    """One TRL DPO run as ``cfg_path`` describes; writes per-step times, losses and peak memory as JSON."""
    from importlib.metadata import version

    import datasets
    import torch
    from transformers import PreTrainedTokenizerFast, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    cfg = json.loads(Path(cfg_path).read_text())
    cuda = torch.cuda.is_available()

    class PretokenizedDPOTrainer(DPOTrainer):
        """TRL's DPOTrainer on columns that are already tokenized (``prompt_ids``, ``chosen_ids``, ``rejected_ids``,
        the output of its own ``_prepare_dataset``): TRL 1.16 tokenizes text columns unconditionally."""

        def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
            missing = {"prompt_ids", "chosen_ids", "rejected_ids"} - set(dataset.column_names)
            if missing:
                raise ValueError(f"{dataset_name} dataset lacks the tokenized columns {sorted(missing)}")
            return dataset

    class StepTimer(TrainerCallback):
        """Wall time of every optimizer step (on_step_begin -> on_step_end, synchronized) and the logged losses."""

        def __init__(self):
            self.begin: list[float] = []
            self.end: list[float] = []
            self.losses: dict[int, float] = {}
            self.tokens: dict[int, float] = {}
            self.train_begin: float | None = None

        def _now(self) -> float:
            if cuda:
                torch.cuda.synchronize()
            return time.perf_counter()

        def on_train_begin(self, args, state, control, **kwargs):
            self.train_begin = self._now()
            if cuda:
                torch.cuda.reset_peak_memory_stats()  # the training peak (the weights are already allocated)

        def on_step_begin(self, args, state, control, **kwargs):
            self.begin.append(self._now())

        def on_step_end(self, args, state, control, **kwargs):
            self.end.append(self._now())

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.losses[state.global_step] = float(logs["loss"])
            if logs and "num_tokens" in logs:
                self.tokens[state.global_step] = float(logs["num_tokens"])  # TRL's running count (attention mask)

    pairs = np.load(cfg["pairs"])
    dataset = datasets.Dataset.from_dict({"prompt_ids": pairs["prompt"].tolist(), "chosen_ids": pairs["chosen"].tolist(),
                                          "rejected_ids": pairs["rejected"].tolist()})
    tok_dir = Path(cfg["tokenizer"])
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(tok_dir / "tokenizer.json"), bos_token="<bos>",
                                        eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")
    micro, accumulate = cfg["micro_batch"], cfg["global_batch"] // cfg["micro_batch"]
    config = DPOConfig(
        output_dir=str(Path(cfg["work_dir"]) / "output"), per_device_train_batch_size=micro,
        gradient_accumulation_steps=accumulate, max_steps=cfg["steps"], learning_rate=cfg["lr"],
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=ADAM["weight_decay"], adam_beta1=ADAM["beta1"],
        adam_beta2=ADAM["beta2"], adam_epsilon=ADAM["eps"], max_grad_norm=ADAM["clip_grad"], bf16=cfg["bf16"],
        gradient_checkpointing=cfg["gradient_checkpointing"], precompute_ref_log_probs=cfg["precompute"],
        max_length=cfg["seq"], loss_type="sigmoid", beta=BETA, logging_steps=1, save_strategy="no", report_to=[],
        seed=cfg["seed"], disable_tqdm=True,
        model_init_kwargs={"dtype": "float32", "attn_implementation": "sdpa"},
    )
    timer = StepTimer()
    t0 = time.perf_counter()
    trainer = PretokenizedDPOTrainer(model=cfg["hf_dir"], args=config, train_dataset=dataset,
                                     processing_class=tokenizer, callbacks=[timer])
    constructed = time.perf_counter()  # the precompute pass (precompute_ref_log_probs) runs in the constructor
    columns = trainer.train_dataset.column_names
    if cfg["precompute"] and not {"ref_chosen_logps", "ref_rejected_logps"} <= set(columns):
        raise RuntimeError(f"precompute_ref_log_probs=True but the train dataset has no reference columns: {columns}")
    if cfg["precompute"] and trainer.ref_model is not None:
        raise RuntimeError("precompute_ref_log_probs=True but TRL kept a reference model")
    trainer.train()
    if len(timer.begin) != cfg["steps"] or len(timer.end) != cfg["steps"]:
        raise RuntimeError(f"expected {cfg['steps']} optimizer steps, timed {len(timer.begin)} / {len(timer.end)}")
    if timer.begin[0] < constructed:
        raise RuntimeError("the first timed step started before the reference pass ended")
    expected = cfg["steps"] * cfg["global_batch"] * 2 * cfg["seq"]
    if timer.tokens.get(cfg["steps"]) != expected:
        raise RuntimeError(f"TRL counted {timer.tokens.get(cfg['steps'])} tokens, expected {expected} (no padding)")
    param = next(trainer.model.parameters())
    result = {
        "step_times_s": [e - b for b, e in zip(timer.begin, timer.end)],
        "step_periods_s": [b - a for a, b in zip(timer.end, timer.end[1:])],  # end to end: prefetch + logging too
        "losses": [timer.losses.get(step) for step in range(1, cfg["steps"] + 1)],
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "constructor_s": constructed - t0,  # model load, (precompute pass), accelerate set-up
        "train_begin_to_first_step_s": timer.begin[0] - timer.train_begin,
        "reference_model_kept": trainer.ref_model is not None,
        "weights_dtype": str(param.dtype), "attn_implementation": trainer.model.config._attn_implementation,
        "optim": str(getattr(trainer.args.optim, "value", trainer.args.optim)), "bf16": bool(trainer.args.bf16),
        "gradient_checkpointing": bool(trainer.args.gradient_checkpointing),
        "train_columns": columns,
        "versions": {"trl": version("trl"), "transformers": version("transformers"), "datasets": version("datasets"),
                     "accelerate": version("accelerate")},
    }
    Path(cfg["result"]).write_text(json.dumps(result, indent=2))


# ---------------------------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------------------------


def row(trainer: str, reference: str, step_times: list[float], losses: list[float | None], peak_gib: float | None,
        args: argparse.Namespace, extra: dict[str, Any]) -> dict[str, Any]:
    """A table row: steady-state speed over the steps after ``--warmup``."""
    timed = step_times[args.warmup:]
    if not timed:
        raise SystemExit(f"--warmup {args.warmup} leaves no steps to time; raise --steps")
    s_per_step = sum(timed) / len(timed)
    pairs_per_s = args.global_batch / s_per_step
    return {"trainer": trainer, "reference": reference, "s_per_step": s_per_step, "pairs_per_s": pairs_per_s,
            "tokens_per_s": pairs_per_s * 2 * args.seq, "peak_memory_gib": peak_gib,
            "loss_first": losses[0], "loss_last": losses[-1], "step_times_s": step_times, "losses": losses, **extra}


def library_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = versions()
    for name in ("transformers", "trl", "datasets", "accelerate"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "missing"
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    missing = [m for m in ("trl", "datasets", "accelerate") if importlib.util.find_spec(m) is None]
    if missing or subprocess.run([sys.executable, "-c", "from trl import DPOConfig, DPOTrainer"], check=False).returncode:
        raise SystemExit(f"[dpo_vs_trl] TRL's DPOTrainer does not import ({', '.join(missing) or 'see above'}): "
                         "install trl, datasets and their needs first (wheels: pip install --no-deps)")
    if args.global_batch % args.micro_batch:
        raise SystemExit(f"--global-batch {args.global_batch} must be a multiple of --micro-batch {args.micro_batch}")
    if not 1 <= args.prompt_len < args.seq - 1:
        raise SystemExit(f"--prompt-len {args.prompt_len} must leave at least 2 response tokens in --seq {args.seq}")
    out = Path(args.out).resolve()
    on_gpu = torch.cuda.is_available()
    bf16 = on_gpu and not args.fp32
    preset = {**PRESETS[args.preset], "seq_length": args.seq}  # max_position_embeddings = seq
    n_train, n_val = args.global_batch * args.steps, 2 * args.micro_batch
    data = make_pref_data(out / "data", preset["vocab_size"], args.prompt_len, args.seq, n_train, n_val, args.seed)
    hf_dir, params = make_hf_init(out / "hf_init", preset, args.seed)
    print(f"[dpo_vs_trl] preset {args.preset}: {params / 1e6:.1f}M parameters, {n_train} pairs of 2 x {args.seq} "
          f"tokens (prompt {args.prompt_len}), micro-batch {args.micro_batch}, global batch {args.global_batch}, "
          f"{'bf16' if bf16 else 'fp32'} on {'GPU' if on_gpu else 'CPU'}", flush=True)

    rows = [run_ours(args, data, hf_dir, out, n_val, bf16), run_trl(args, data, hf_dir, out, True, bf16)]
    if not args.skip_trl_default:
        rows.append(run_trl(args, data, hf_dir, out, False, bf16))
    base = rows[1]["pairs_per_s"]
    for r in rows:
        r["speedup_vs_trl_precomputed"] = r["pairs_per_s"] / base
        print(f"[dpo_vs_trl] {r['trainer']} ({r['reference']}): {r['pairs_per_s']:.2f} pairs/s, "
              f"{r['tokens_per_s']:,.0f} tokens/s, {r['s_per_step']:.3f} s/step, "
              f"loss {fmt(r['loss_first'], '.4f')} -> {fmt(r['loss_last'], '.4f')}", flush=True)
    report = {**run_header(), "versions": library_versions(), "preset": args.preset, "parameters": params,
              "precision": "bf16" if bf16 else "fp32", "pairs": n_train, "settings": vars(args), "rows": rows,
              "speedup": rows[0]["speedup_vs_trl_precomputed"]}
    (out / "dpo_vs_trl.json").write_text(json.dumps(report, indent=2))
    (out / "dpo_vs_trl.md").write_text(markdown(report))
    print(markdown(report), flush=True)
    return report


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def markdown(report: dict[str, Any]) -> str:
    s, rows = report["settings"], report["rows"]
    trl = rows[1]
    gpu = report["precision"] == "bf16"
    lines = [
        *header_lines(report),
        (f"Model: preset `{report['preset']}` (Llama shape, random init), {report['parameters'] / 1e6:.1f}M parameters, "
         f"{report['precision']}; {report['pairs']} synthetic pairs, every sequence {s['seq']} tokens (prompt "
         f"{s['prompt_len']} + response {s['seq'] - s['prompt_len']}, no padding); micro-batch {s['micro_batch']} pairs, "
         f"global batch {s['global_batch']} pairs, {s['steps']} steps (timed: steps {s['warmup'] + 1}-{s['steps']}); "
         f"sigmoid DPO, beta {BETA}, lr {s['lr']:g}"),
        "",
        ("| trainer | reference log-probs | pairs/s | tokens/s | s/step | peak mem GiB | loss first -> last "
         "| speed-up vs TRL (precomputed) |"),
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['trainer']} | {r['reference']} | {r['pairs_per_s']:.2f} | {r['tokens_per_s']:,.0f} "
                     f"| {r['s_per_step']:.3f} | {fmt(r['peak_memory_gib'], '.1f')} "
                     f"| {fmt(r['loss_first'], '.4f')} -> {fmt(r['loss_last'], '.4f')} "
                     f"| {r['speedup_vs_trl_precomputed']:.2f}x |")
    precision = (f"ours bf16 weights with fp32 main weights in Megatron's optimizer; TRL {trl['weights_dtype']} weights "
                 "under bf16 autocast (`bf16=True`, TRL's default)" if gpu else
                 f"fp32 on both sides (CPU check run; TRL weights {trl['weights_dtype']})")
    checkpointing = ("on (TRL's default)" if trl["gradient_checkpointing"] else
                     "off (TRL defaults to on; off matches our job, which recomputes nothing)")
    notes = [
        (f"Precision: {precision}. Attention: ours Megatron-core's; TRL "
         f"`attn_implementation=\"{trl['attn_implementation']}\"`."),
        (f"Optimizer: AdamW on both sides (TRL `optim={trl['optim']}`), betas ({ADAM['beta1']}, {ADAM['beta2']}), "
         f"weight decay {ADAM['weight_decay']}, clip {ADAM['clip_grad']}, constant lr. TRL gradient checkpointing: "
         f"{checkpointing}."),
        ("Ours: step times are the trainer's per-step wall times (batch assembly included); reference log-probs from "
         f"our reference_logps job before training ({rows[0]['reference_pass_s']:.1f} s, not timed). Peak memory: "
         "the training phase's peak."),
        ("TRL: step times from `on_step_begin` to `on_step_end` with CUDA synchronisation (batch prefetch and logging "
         "outside, which favours TRL); its reference pass ran in the trainer's constructor "
         f"({trl['constructor_s']:.1f} s with model load), before the first timed step. The benchmark's "
         "`DPOTrainer` subclass skips TRL's text tokenization (the columns `prompt_ids`/`chosen_ids`/`rejected_ids` "
         "are given); training is TRL's code. Peak memory: `torch.cuda.max_memory_allocated` from the start of "
         "training."),
        (f"Losses: the first step's loss is ln 2 = 0.6931 on both sides (the policy equals the reference); lr "
         f"{s['lr']:g} moves it little in {s['steps']} steps on random tokens."),
    ]
    lines += ["", (f"Speed-up, ours / TRL with precomputed reference log-probs: **{report['speedup']:.2f}x** "
                   "(the issue's target: >= 1.5x)."), "", "Notes:", *(f"- {n}" for n in notes)]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="350m")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the timing")
    p.add_argument("--micro-batch", type=int, default=4, help="pairs per forward/backward")
    p.add_argument("--global-batch", type=int, default=32, help="pairs per optimizer step")
    p.add_argument("--seq", type=int, default=512, help="tokens of every chosen / rejected sequence (prompt included)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--fp32", action="store_true", help="fp32 on GPUs too (bf16 is the GPU default)")
    p.add_argument("--skip-trl-default", action="store_true",
                   help="leave out the TRL row with a reference forward every step")
    p.add_argument("--trl-gradient-checkpointing", action="store_true",
                   help="TRL's default (on); off by default here, as our job recomputes nothing")
    p.add_argument("--profile", action="store_true",
                   help="kernel profile of our last warm-up step (<out>/profile_ours; GPU only)")
    p.add_argument("--out", required=True, help="working directory: data, HF init, runs, dpo_vs_trl.json/.md")
    return p.parse_args(argv)


if __name__ == "__main__":
    os.environ.setdefault("KEDRO_DISABLE_TELEMETRY", "true")
    if sys.argv[1:2] == ["--worker"]:
        worker = argparse.ArgumentParser()
        worker.add_argument("--worker", choices=["trl"], required=True)
        worker.add_argument("--worker-config", required=True)
        trl_worker(worker.parse_args().worker_config)
    else:
        run(parse_args())
