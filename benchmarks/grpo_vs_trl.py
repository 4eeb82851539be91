"""GRPO speed against TRL: our REINFORCE stage and TRL 1.16's ``GRPOTrainer`` (``use_vllm=False``) on one GPU, same
model, prompts, samples, reward and generation budget, in one run.

    python benchmarks/grpo_vs_trl.py --out /tmp/grpo_vs_trl --work /tmp/grpo_work                  # GPU: issue 33
    python benchmarks/grpo_vs_trl.py --out /tmp/grpo_vs_trl --work /tmp/grpo_work --shape tiny     # CPU smoke run

Both sides start from one random-init HF Llama written here (``rl_iteration.write_model``: the Llama-3.2-1B shape,
a word-level tokenizer of one token per id, ``--stop-ids`` eos ids in its generation config, so that responses
end with probability ~stop_ids/vocab per token) and train on the same prompts of random ids (``--prompts`` per step,
lengths ``prompt_range``), ``--samples`` responses each, up to ``--new`` new tokens at T=1, reward = a hash of the
response (``rl_iteration.hash_reward``), one optimizer step per generation batch (on-policy), the DAPO token-mean
loss, KL beta ``--beta`` (0: neither side builds a reference model), AdamW at a constant ``--lr``, bf16.

* Ours: ``python -m align_pipeline.train.reinforce`` under torchrun (GRPO advantages, ``aggregation: token_mean``,
  micro-batch ``--micro-batch``); a step = the iteration's wall time (generate + score + train), iterations after
  ``--warmup``.
* TRL: ``GRPOTrainer`` in a subprocess of its own (``--worker trl``), the model loaded by TRL from the same HF dir
  (``attn_implementation="sdpa"``, bf16), ``per_device_train_batch_size`` = ``--micro-batch`` rows,
  ``gradient_accumulation_steps`` = rows / micro-batch, so that one optimizer step is one generation batch of
  prompts x samples (``steps_per_generation`` 1), ``loss_type="dapo"``, ``use_vllm=False`` (transformers'
  ``generate``). A step: ``on_step_begin`` -> ``on_step_end`` (synchronized), which holds TRL's generation, scoring
  and the micro-batches' forward/backward and optimizer step.

Writes ``<out>/grpo_vs_trl.json`` and ``<out>/grpo_vs_trl.md``. Needs ``trl`` (1.16), ``datasets`` and ``accelerate``
importable; where there is no package registry, carry the wheels of trl, datasets, dill, multiprocess and xxhash and
install them with ``pip install --no-deps``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

SHAPES = {
    "1b": {"model": "1b_b64", "prompts": 32, "samples": 8, "prompt_range": (64, 512), "new": 512, "bucket": 64,
           "micro_batch": 8, "steps": 5, "warmup": 2},
    "tiny": {"model": "tiny", "prompts": 2, "samples": 4, "prompt_range": (4, 12), "new": 16, "bucket": 8,
             "micro_batch": 4, "steps": 3, "warmup": 1},
}


def run_ours(args, shape: dict[str, Any], data: Path, tokenizer: Path, hf: Path, seq_length: int, bf16: bool
             ) -> dict[str, Any]:
    from rl_iteration import run_reinforce

    print("[grpo_vs_trl] ours ...", flush=True)
    result = run_reinforce(args.work / "ours", shape, data, tokenizer, hf, seq_length, bf16,
                           iterations=shape["steps"], micro_batch=shape["micro_batch"], beta=args.beta, lr=args.lr,
                           weight_decay=0.0)
    history = result["history"]
    return {"step_times_s": [h["timing/iteration_s"] for h in history],
            "generate_s": [h["timing/generate_s"] for h in history],
            "mean_length": [h["rollout/response_length/mean"] for h in history],
            "peak_gib": result.get("peak_memory_by_phase_gib", {}).get("train")}


def run_trl(args, shape: dict[str, Any], prompts: list[list[int]], hf: Path, bf16: bool) -> dict[str, Any]:
    work = args.work / "trl"
    work.mkdir(parents=True, exist_ok=True)
    cfg = {"hf_dir": str(hf), "prompts": [" ".join(f"t{i}" for i in p) for p in prompts], "work_dir": str(work),
           "result": str(work / "result.json"), "bf16": bf16, "steps": shape["steps"], "samples": shape["samples"],
           "per_step": shape["prompts"], "micro_batch": shape["micro_batch"], "new": shape["new"],
           "beta": args.beta, "lr": args.lr}
    (work / "config.json").write_text(json.dumps(cfg))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(work / "hf_datasets_cache"), "TOKENIZERS_PARALLELISM": "false",
           "WANDB_DISABLED": "true", "TQDM_DISABLE": "1",
           "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    if "CUDA_VISIBLE_DEVICES" not in env:
        env["CUDA_VISIBLE_DEVICES"] = "0"  # Trainer would wrap a multi-GPU view in nn.DataParallel
    print("[grpo_vs_trl] TRL ...", flush=True)
    proc = subprocess.run([sys.executable, "-u", str(Path(__file__).resolve()), "--worker", "trl",
                           "--worker-config", str(work / "config.json")], check=False, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"[grpo_vs_trl] the TRL worker failed with exit status {proc.returncode}")
    return json.loads((work / "result.json").read_text())


def trl_worker(cfg_path: str) -> None:
    """One TRL GRPO run as ``cfg_path`` describes: per-step times, completion lengths, peak memory, as JSON."""
    from importlib.metadata import version

    import datasets
    import torch
    from rl_iteration import hash_reward
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    cfg = json.loads(Path(cfg_path).read_text())
    cuda = torch.cuda.is_available()

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.begin: list[float] = []
            self.end: list[float] = []
            self.lengths: dict[int, float] = {}

        def _now(self) -> float:
            if cuda:
                torch.cuda.synchronize()
            return time.perf_counter()

        def on_train_begin(self, args, state, control, **kwargs):
            if cuda:
                torch.cuda.reset_peak_memory_stats()

        def on_step_begin(self, args, state, control, **kwargs):
            self.begin.append(self._now())

        def on_step_end(self, args, state, control, **kwargs):
            self.end.append(self._now())

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "completions/mean_length" in logs:
                self.lengths[state.global_step] = float(logs["completions/mean_length"])

    def reward(completions, **_):
        return [hash_reward("", c, {}) for c in completions]

    rows = cfg["per_step"] * cfg["samples"]
    dataset = datasets.Dataset.from_dict({"prompt": cfg["prompts"] * cfg["steps"]})
    config = GRPOConfig(
        output_dir=str(Path(cfg["work_dir"]) / "output"), per_device_train_batch_size=cfg["micro_batch"],
        gradient_accumulation_steps=rows // cfg["micro_batch"], num_generations=cfg["samples"],
        max_completion_length=cfg["new"], temperature=1.0, beta=cfg["beta"], loss_type="dapo", num_iterations=1,
        max_steps=cfg["steps"], learning_rate=cfg["lr"], lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, bf16=cfg["bf16"], use_cpu=not cuda, use_vllm=False, logging_steps=1, save_strategy="no",
        report_to=[], seed=1, disable_tqdm=True, shuffle_dataset=False,
        model_init_kwargs={"dtype": "bfloat16" if cfg["bf16"] else "float32", "attn_implementation": "sdpa"},
    )
    timer = StepTimer()
    tokenizer = AutoTokenizer.from_pretrained(cfg["hf_dir"])
    trainer = GRPOTrainer(model=cfg["hf_dir"], reward_funcs=reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[timer])
    trainer.train()
    if len(timer.begin) != cfg["steps"]:
        raise RuntimeError(f"expected {cfg['steps']} optimizer steps, timed {len(timer.begin)}")
    result = {
        "step_times_s": [e - b for b, e in zip(timer.begin, timer.end)],
        "mean_length": [timer.lengths.get(step) for step in range(1, cfg["steps"] + 1)],
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "reference_model": trainer.ref_model is not None,
        "versions": {"trl": version("trl"), "transformers": version("transformers"), "datasets": version("datasets"),
                     "accelerate": version("accelerate")},
    }
    Path(cfg["result"]).write_text(json.dumps(result, indent=2))


def summary(side: dict[str, Any], warmup: int, rows: int) -> dict[str, Any]:
    """Steady state over the steps after ``warmup``: s per step, samples/s, generated tokens/s."""
    times, lengths = side["step_times_s"][warmup:], side["mean_length"][warmup:]
    s = sum(times) / len(times)
    tokens = sum(length * rows for length in lengths if length is not None)
    return {"s_per_step": s, "samples_per_s": rows / s, "generated_tokens_per_s": tokens / sum(times),
            "mean_length": sum(lengths) / len(lengths)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--shape", default="1b", choices=list(SHAPES))
    parser.add_argument("--stop-ids", type=int, default=250, help="eos ids (variable lengths; 1: ~uniform)")
    parser.add_argument("--beta", type=float, default=0.0)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--skip-trl", action="store_true")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)

    from generation import model_shape
    from rl_iteration import write_model, write_prompts
    from sft_scaling import device_name, versions

    from align_pipeline.data.tokenizer import load_hf_tokenizer

    shape = SHAPES[args.shape]
    model = model_shape(shape["model"])
    hf = args.work / "hf"
    parameters = write_model(hf, model, list(range(2, 2 + args.stop_ids)))
    tokenizer = args.work / "tokenizer"
    load_hf_tokenizer(hf).save(tokenizer)
    data = args.work / "prompts.jsonl"
    prompts = write_prompts(data, shape, model["vocab_size"], lowest=3 + args.stop_ids)
    gpu = device_name()
    bf16 = "CPU" not in gpu
    longest = -(-max(len(p) for p in prompts) // shape["bucket"]) * shape["bucket"]
    rows = shape["prompts"] * shape["samples"]
    report: dict[str, Any] = {
        "date": datetime.date.today().isoformat(), "device": gpu, "versions": versions(),
        "command": "python benchmarks/grpo_vs_trl.py " + " ".join(argv or sys.argv[1:]), "parameters": parameters,
        "shape": shape, "stop_ids": args.stop_ids, "beta": args.beta,
    }
    ours = run_ours(args, shape, data, tokenizer, hf, longest + shape["new"], bf16)
    report["ours"] = {**ours, **summary(ours, shape["warmup"], rows)}
    (args.out / "grpo_vs_trl.json").write_text(json.dumps(report, indent=1))
    if not args.skip_trl:
        trl = run_trl(args, shape, prompts, hf, bf16)
        report["trl"] = {**trl, **summary(trl, shape["warmup"], rows)}
        report["speedup"] = report["trl"]["s_per_step"] / report["ours"]["s_per_step"]
        report["speedup_tokens"] = report["ours"]["generated_tokens_per_s"] / report["trl"]["generated_tokens_per_s"]
    (args.out / "grpo_vs_trl.json").write_text(json.dumps(report, indent=1))
    (args.out / "grpo_vs_trl.md").write_text(markdown(report))
    print(markdown(report))


def markdown(r: dict[str, Any]) -> str:
    s = r["shape"]
    lines = [
        (f"{r['date']}, {r['device']}; `{r['command']}`; {r['parameters'] / 1e9:.2f}B parameters, {s['prompts']} "
         f"prompts x {s['samples']} samples per step, up to {s['new']} new tokens, {r['stop_ids']} stop ids, "
         f"KL beta {r['beta']}; steps {s['warmup'] + 1}-{s['steps']} of each run."),
        "",
        "| trainer | s per step | samples/s | generated tokens/s | mean response | peak GiB |",
        "|---|---|---|---|---|---|",
    ]
    for key, name in (("ours", "ours (REINFORCE stage, GRPO)"), ("trl", "TRL GRPOTrainer (use_vllm=False)")):
        if key in r:
            x = r[key]
            peak = f"{x['peak_gib']:.1f}" if x.get("peak_gib") else ""
            lines.append(f"| {name} | {x['s_per_step']:.2f} | {x['samples_per_s']:.1f} | "
                         f"{x['generated_tokens_per_s']:,.0f} | {x['mean_length']:.0f} | {peak} |")
    if "speedup" in r:
        lines += ["", f"Ours / TRL: {r['speedup']:.2f}x per step, {r['speedup_tokens']:.2f}x generated tokens/s."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker = argparse.ArgumentParser()
        worker.add_argument("--worker", choices=["trl"], required=True)
        worker.add_argument("--worker-config", required=True)
        trl_worker(worker.parse_args().worker_config)
    else:
        main()
