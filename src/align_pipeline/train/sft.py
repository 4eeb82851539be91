"""Supervised fine-tuning (SFT) entry point.

    torchrun --nproc_per_node 2 -m align_pipeline.train.sft --config run/config.json     # any world size
    python -m align_pipeline.train.sft --config run/config.json                          # single process

The config is an :class:`align_pipeline.config.SFTJobConfig` as JSON. Loss: next-token cross-entropy on response
tokens only (``loss_mask``). Resumes from the latest checkpoint in ``run_dir`` when one exists. Writes the final model
checkpoint to ``run_dir/model`` and a summary to ``run_dir/result.json`` (rank 0).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

from align_pipeline.config import SFTJobConfig, config_hash, from_dict, to_dict
from align_pipeline.data.tokenizer import load_tokenizer
from align_pipeline.losses.sft import masked_token_loss
from align_pipeline.model import checkpoint, init
from align_pipeline.tracking import RunLogger
from align_pipeline.train import loop
from align_pipeline.train.distributed import init_distributed, shutdown

METRICS = ["lm_loss"]


def forward_loss(module, batch):
    # input_ids/labels/loss_mask: [b, s]; Megatron returns per-token CE [b, s] on the last stage.
    output = module(batch["input_ids"], loop.position_ids_like(batch["input_ids"]), None, labels=batch["labels"])
    return output, lambda token_losses: masked_token_loss(token_losses, batch["loss_mask"])


def main(job: SFTJobConfig) -> dict:
    run_dir = Path(job.run_dir)
    tcfg = job.training
    dist = init_distributed(job.parallel, tcfg.seed)
    logger = RunLogger(rank=dist.rank)
    tokenizer = load_tokenizer(job.tokenizer)
    source = init.resolve(job.init_from, job.model, tokenizer.vocab_size)
    loop.log(dist, f"[sft] world={dist.world_size} tp={dist.tp_size} pp={dist.pp_size} dp={dist.dp_size} "
                   f"backend={dist.backend} init={source.parent['kind']}")

    model, optimizer, scheduler = loop.build_model_and_optimizer(
        source.model, job.parallel, tcfg, source.vocab_size, dist, load_weights=source.load
    )
    train = loop.ArrayBatches(dict(np.load(job.train_data)), tcfg.global_batch_size, tcfg.micro_batch_size, dist,
                              seed=tcfg.seed)
    val = loop.ArrayBatches(dict(np.load(job.val_data)), tcfg.global_batch_size, tcfg.micro_batch_size, dist,
                            seed=tcfg.seed, shuffle=False)

    step = 0
    latest = checkpoint.latest_checkpoint(run_dir) if tcfg.resume else None
    if latest is not None:
        state = checkpoint.load_training(latest, model, optimizer, scheduler)
        step = int(state["step"])
        assert state["consumed_samples"] == step * tcfg.global_batch_size, "data position does not match the step"
        loop.log(dist, f"[sft] resumed from {latest} at step {step}")
    logger.log_params({"job": to_dict(job), "world_size": dist.world_size, "resumed_from_step": step})

    def evaluate() -> float:
        model.eval()
        m = loop.run_microbatches(model, val.eval_microbatches(tcfg.eval_samples), forward_loss, METRICS, dist,
                                  source.model.seq_length, forward_only=True)
        model.train()
        return m["lm_loss"]

    def save(at_step: int) -> None:
        checkpoint.save_training(run_dir, at_step, model, optimizer, scheduler,
                                 {"step": at_step, "consumed_samples": at_step * tcfg.global_batch_size},
                                 {"stage": "sft", "config_hash": config_hash(job)})
        _prune(run_dir, tcfg.keep_checkpoints, dist)

    progress = loop.Progress(tcfg.train_steps, step, dist.is_logging_rank)
    tokens_per_step = tcfg.global_batch_size * source.model.seq_length
    history, last = [], {}
    steps_this_run = 0
    model.train()
    while step < tcfg.train_steps:
        t0 = time.perf_counter()
        loop.zero_grads(model, optimizer)
        m = loop.run_microbatches(model, train.microbatches(step), forward_loss, METRICS, dist,
                                  source.model.seq_length, forward_only=False)
        ok, grad_norm = loop.optimizer_step(model, optimizer, scheduler)
        step += 1
        steps_this_run += 1
        progress.add_tokens(tokens_per_step)
        last = {"loss": m["lm_loss"], "lr": loop.current_lr(optimizer), "grad_norm": grad_norm,
                "response_tokens": m["count"], "step_time_s": time.perf_counter() - t0,
                "tokens_per_s": progress.tokens_per_s(), "update_skipped": float(not ok)}
        history.append({"step": step, "loss": m["lm_loss"]})
        if tcfg.eval_interval and step % tcfg.eval_interval == 0 and step < tcfg.train_steps:
            last["val_loss"] = evaluate()
        if step % tcfg.log_interval == 0 or step == tcfg.train_steps or "val_loss" in last:
            progress.print(step, last)
            logger.log_metrics(last, step)
            logger.log_system_metrics(step)
        last.pop("val_loss", None)
        if tcfg.save_interval and step % tcfg.save_interval == 0 and step < tcfg.train_steps:
            save(step)
        if job.stop_after_steps is not None and steps_this_run >= job.stop_after_steps and step < tcfg.train_steps:
            save(step)
            loop.log(dist, f"[sft] stopping after {steps_this_run} steps (stop_after_steps); resume continues at {step}")
            return _finish(dist, logger, run_dir, {"stopped_at_step": step})

    val_loss = evaluate()
    progress.print(step, {**last, "val_loss": val_loss})
    logger.log_metrics({"val_loss": val_loss}, step)
    save(step)
    meta = {
        "stage": "sft",
        "step": step,
        "model": to_dict(source.model),
        "vocab_size": source.vocab_size,
        "tokenizer": {"path": str(job.tokenizer), "fingerprint": tokenizer.fingerprint},
        "saved_with_parallel": to_dict(job.parallel),
        "metrics": {"val_loss": val_loss, "train_loss": last.get("loss")},
        "lineage": {
            **job.lineage,
            "parent": source.parent,
            "config_hash": config_hash(job),
            "mlflow_run_id": os.environ.get("MLFLOW_RUN_ID"),
        },
    }
    model_dir = checkpoint.save_model(run_dir / "model", model, meta)
    result = {"model_dir": str(model_dir), "step": step, "val_loss": val_loss, "train_loss": last.get("loss"),
              "tokens_per_s": last.get("tokens_per_s"), "history": history}
    return _finish(dist, logger, run_dir, result)


def _finish(dist, logger, run_dir: Path, result: dict) -> dict:
    if dist.is_logging_rank:
        (run_dir / "result.json").write_text(json.dumps(result, indent=2))
    logger.close()
    shutdown()
    return result


def _prune(run_dir: Path, keep: int, dist) -> None:
    if not dist.is_logging_rank or keep <= 0:
        return
    import shutil

    found = sorted((run_dir / "checkpoints").glob("iter_*"))
    for old in found[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="SFTJobConfig as JSON")
    args = parser.parse_args()
    job = from_dict(SFTJobConfig, json.loads(Path(args.config).read_text()))
    main(job)


if __name__ == "__main__":  # the torch_dist checkpoint saver spawns processes: the guard is required
    cli()
