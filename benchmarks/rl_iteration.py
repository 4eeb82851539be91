"""REINFORCE (GRPO) iterations at reasoning length on one GPU, through the stage's real entry point (torchrun).

    python benchmarks/rl_iteration.py --out /tmp/rl_iteration --work /tmp/rl_work                # GPU: issue 33
    python benchmarks/rl_iteration.py --out /tmp/rl_iteration --work /tmp/rl_work --shape tiny   # CPU smoke run

The shape of issue 33: a random-init Llama (the Llama-3.2-1B shape: 1.24B parameters, GQA 32/8, vocab 128256) written
as an HF directory with ``transformers``; 32 prompts of random ids, lengths drawn uniformly from 64-512 tokens, 8
samples each (256 rows), up to 2,048 new tokens, T=1; one optimizer step per rollout (on-policy GRPO, micro-batch
``--micro-batch``), KL beta 0.05 (the reference forward runs), bf16, SDPA, prompts padded to multiples of 64.

The model's tokenizer is word-level with one token per id (``t<id>``), so every sampled id decodes; the reward is a
hash of the response text (every group has signal). Lengths:

* **uniform**: one stop id (drawn with probability ~1/128256 per token): nearly every response runs to 2,048.
* **variable**: the stop ids of ``generation_config.json`` are sized so that the random-init model emits one with
  probability ~1/``--mean`` per token: geometric lengths, long-tailed, capped at 2,048.

Each run is ``--iterations`` iterations of ``python -m align_pipeline.train.reinforce``; the figures are the last
iteration's (the first includes the allocator's and cuDNN's first-use costs; the KV cache and CUDA graphs are set up
before iteration 1 and logged apart). ``generated + trained tokens/s`` = (response tokens generated + prompt and
response tokens of the training step) / the iteration's wall time; ``generation share`` = generate_s /
iteration_s. Peak memory: the job's ``peak_memory_by_phase_gib``. Writes ``<out>/rl_iteration.json`` and
``<out>/rl_iteration.md``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import sys
import zlib
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

RUNS = {
    "1b": {"model": "1b_b64", "prompts": 32, "samples": 8, "prompt_range": (64, 512), "new": 2048, "bucket": 64},
    "tiny": {"model": "tiny", "prompts": 4, "samples": 4, "prompt_range": (4, 12), "new": 32, "bucket": 8},
}


def hash_reward(prompt: str, response: str, record: dict) -> float:
    """The benchmark's reward: a hash of the response (samples of a prompt score differently)."""
    return zlib.crc32(response.encode()) % 1000 / 1000


def write_model(hf: Path, shape: dict[str, Any], stop_ids: list[int]) -> int:
    """The HF directory: random-init Llama weights, a word-level tokenizer of one token per id, ``stop_ids`` as the
    generation config's eos ids -> parameter count."""
    from generation import make_hf_model
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    params = make_hf_model(hf, shape, seed=0)
    vocab = shape["vocab_size"]
    backend = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="t1", eos_token="t2", pad_token="t0",
                            unk_token="t0").save_pretrained(hf)
    (hf / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": stop_ids}))
    return params


def write_prompts(path: Path, run: dict[str, Any], vocab: int, lowest: int = 3) -> list[list[int]]:
    """``run["prompts"]`` prompts of random ids in [``lowest``, ``vocab``), lengths drawn from
    ``run["prompt_range"]`` (seeded), written as the stage's prompts jsonl at ``path`` -> the prompts' ids."""
    rng = random.Random(1)
    lo, hi = run["prompt_range"]
    prompts = [[rng.randrange(lowest, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(run["prompts"])]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"prompt": " ".join(f"t{i}" for i in p), "prompt_ids": p, "answer": "0"})
                            + "\n" for p in prompts))
    return prompts


def run_reinforce(run_dir: Path, run: dict[str, Any], data: Path, tokenizer: Path, hf: Path, seq_length: int,
                  bf16: bool, *, iterations: int, micro_batch: int, beta: float, lr: float,
                  weight_decay: float = 0.01, compile_step: bool = False, optimizer_precision: str = "fp32") -> dict[str, Any]:
    """``python -m align_pipeline.train.reinforce`` under torchrun on one process: on-policy GRPO (token-mean loss)
    over ``run``'s prompts x samples, the hash reward, no validation or checkpoints -> the job's result."""
    from align_pipeline.config import (
        GenerationConfig,
        KLConfig,
        LaunchConfig,
        ModelConfig,
        OptimizerConfig,
        ParallelConfig,
        ReinforceConfig,
        ReinforceJob,
        ReinforceLossConfig,
        RewardConfig,
        RewardFunctionConfig,
        RLLoopConfig,
        RLPaths,
        to_dict,
    )
    from align_pipeline.launch import run_torchrun

    section = ReinforceConfig(
        rl=RLLoopConfig(seed=1, iterations=iterations, prompts_per_iteration=run["prompts"], epochs=1,
                        minibatches=1, micro_batch_size=micro_batch, log_interval=1, eval_interval=0,
                        eval_prompts=0, save_interval=0),
        generation=GenerationConfig(max_new_tokens=run["new"], samples_per_prompt=run["samples"], seed=3,
                                    batch_size=run["prompts"] * run["samples"], prefill_bucket=run["bucket"],
                                    compile_step=compile_step),
        reward=RewardConfig(reward_model_weight=0.0,
                            functions=[RewardFunctionConfig(name="rl_iteration:hash_reward")]),
        loss=ReinforceLossConfig(estimator="grpo", aggregation="token_mean"), kl=KLConfig(estimator="k3", beta=beta),
        optimizer=OptimizerConfig(lr=lr, min_lr=lr, warmup_steps=0, weight_decay=weight_decay))
    run_dir.mkdir(parents=True, exist_ok=True)
    job = ReinforceJob(reinforce=section, model=ModelConfig(attention_backend="sdpa", seq_length=seq_length),
                       parallel=ParallelConfig(bf16=bf16, optimizer_precision=optimizer_precision if bf16 else "fp32"),
                       paths=RLPaths(run_dir=str(run_dir), prompts=str(data), tokenizer=str(tokenizer),
                                     policy=str(hf)))
    env = {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    return run_torchrun("align_pipeline.train.reinforce", to_dict(job), LaunchConfig(nproc_per_node=1),
                        str(run_dir), env=env)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work", type=Path, required=True, help="models, data and run directories")
    parser.add_argument("--shape", default="1b", choices=list(RUNS))
    parser.add_argument("--iterations", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--mean", type=float, default=400.0, help="mean response length wanted (variable lengths)")
    parser.add_argument("--lengths", nargs="+", default=["variable", "uniform"], choices=["variable", "uniform"])
    parser.add_argument("--compile-step", nargs="+", default=["off"], choices=["off", "on"],
                        help="generation.compile_step of the runs (on: the decode step through torch.compile); "
                        "both: each length twice, side by side")
    parser.add_argument("--optimizer-precision", default="fp32", choices=["fp32", "bf16"],
                        help="parallel.optimizer_precision (GPU: bf16 = no fp32 main weights, gradients, moments)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    from generation import model_shape
    from sft_scaling import device_name, versions

    from align_pipeline.data.tokenizer import load_hf_tokenizer

    run = RUNS[args.shape]
    shape = model_shape(run["model"])
    vocab, new = shape["vocab_size"], run["new"]
    data = args.work / "prompts.jsonl"
    prompts = write_prompts(data, run, vocab)
    longest = -(-max(len(p) for p in prompts) // run["bucket"]) * run["bucket"]
    gpu = device_name()
    bf16 = "CPU" not in gpu
    report: dict[str, Any] = {
        "date": datetime.date.today().isoformat(), "device": gpu, "versions": versions(),
        "command": "python benchmarks/rl_iteration.py " + " ".join(argv or sys.argv[1:]),
        "rows": run["prompts"] * run["samples"], "prompt_lengths": [len(p) for p in prompts], "max_new_tokens": new,
        "micro_batch": args.micro_batch, "results": {},
    }
    for lengths, compiled in [(x, c) for x in args.lengths for c in args.compile_step]:
        stops = [2] if lengths == "uniform" else list(range(2, 2 + max(1, round(vocab / args.mean))))
        hf = args.work / f"hf_{lengths}"
        report["parameters"] = write_model(hf, shape, stops)
        tokenizer = args.work / f"tokenizer_{lengths}"
        load_hf_tokenizer(hf).save(tokenizer)
        name = lengths + (" compiled step" if compiled == "on" else "")
        result = run_reinforce(args.work / f"run_{lengths}_{compiled}", run, data, tokenizer, hf, longest + new, bf16,
                               iterations=args.iterations, micro_batch=args.micro_batch, beta=0.05, lr=1e-6,
                               compile_step=compiled == "on", optimizer_precision=args.optimizer_precision)
        last = result["history"][-1]
        generated = last["rollout/response_length/mean"] * report["rows"]
        trained = generated + run["samples"] * sum(len(p) for p in prompts)
        it = last["timing/iteration_s"]
        report["results"][name] = {
            "stop_ids": len(stops), "iteration_s": it, "generate_s": last["timing/generate_s"],
            "score_s": last["timing/score_s"], "train_s": last["timing/train_s"],
            "generation_share": last["timing/generate_s"] / it, "generated_tokens": generated,
            "trained_tokens": trained, "tokens_per_s": (generated + trained) / it,
            "generated_tokens_per_s": last["throughput/generated_tokens_per_s"],
            "response_length": {k: last[f"rollout/response_length/{k}"] for k in ("mean", "p50", "p90", "max")},
            "decode_slots": last["rollout/decode_slots"], "refills": last["rollout/decode_refills"],
            "setup_s": result["history"][0].get("timing/decode_setup_s"),
            "peak_gib": result.get("peak_memory_by_phase_gib", {}),
            "history": result["history"],
        }
        (args.out / "rl_iteration.json").write_text(json.dumps(report, indent=1))
    (args.out / "rl_iteration.md").write_text(markdown(report))
    print(markdown(report))


def markdown(r: dict[str, Any]) -> str:
    lines = [
        (f"{r['date']}, {r['device']}; `{r['command']}`; {r['parameters'] / 1e9:.2f}B parameters, {r['rows']} rows, "
         f"prompts {min(r['prompt_lengths'])}-{max(r['prompt_lengths'])} tokens, up to {r['max_new_tokens']} new, "
         f"micro-batch {r['micro_batch']}; the last iteration of each run."),
        "",
        ("| lengths | response mean / p90 / max | iteration s | generate s | score s | train s | generation share "
        "| generated + trained tokens/s | peak GiB (train) |"),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, x in r["results"].items():
        rl = x["response_length"]
        lines.append(f"| {name} ({x['stop_ids']} stop ids) | {rl['mean']:.0f} / {rl['p90']:.0f} / {rl['max']:.0f} | "
                     f"{x['iteration_s']:.2f} | {x['generate_s']:.2f} | {x['score_s']:.2f} | {x['train_s']:.2f} | "
                     f"{100 * x['generation_share']:.0f} % | {x['tokens_per_s']:,.0f} | "
                     f"{x['peak_gib'].get('train', 0):.1f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
