"""Supervised fine-tuning (SFT) entry point.

    torchrun --nproc_per_node 2 -m align_pipeline.train.sft --config run/config.json     # any world size
    python -m align_pipeline.train.sft --config run/config.json                          # single process

The config is an :class:`align_pipeline.config.SFTJobConfig` as JSON. Loss: next-token cross-entropy on response
tokens only (``loss_mask``). Resumes from the latest checkpoint in ``run_dir`` when one exists. Writes the final model
checkpoint to ``run_dir/model`` and a summary to ``run_dir/result.json`` (rank 0).
"""

from __future__ import annotations

import numpy as np

from align_pipeline.config import SFTJobConfig
from align_pipeline.data.tokenizer import load_tokenizer
from align_pipeline.losses.sft import masked_token_loss
from align_pipeline.model import init
from align_pipeline.model.logprobs import token_nll
from align_pipeline.tracking import RunLogger
from align_pipeline.train import loop, trainer
from align_pipeline.train.distributed import init_distributed


def make_forward_loss(vocab_size: int, tp_rank: int):
    def forward_loss(module, batch):
        # input_ids/labels/loss_mask: [b, s]; the last stage returns this rank's vocab shard of the logits.
        logits = module(batch["input_ids"], loop.position_ids_like(batch["input_ids"]), None)  # [b, s, V/tp]
        return logits, lambda logits: masked_token_loss(
            token_nll(logits, batch["labels"], vocab_size, tp_rank), batch["loss_mask"]
        )

    return forward_loss


def main(job: SFTJobConfig) -> dict:
    tcfg = job.training
    dist = init_distributed(job.parallel, tcfg.seed)
    tokenizer = load_tokenizer(job.tokenizer)
    source = init.resolve(job.init_from, job.model, tokenizer.vocab_size)
    loop.log(dist, f"[sft] world={dist.world_size} tp={dist.tp_size} pp={dist.pp_size} dp={dist.dp_size} "
                   f"backend={dist.backend} init={source.parent['kind']}")
    model, optimizer, scheduler = loop.build_model_and_optimizer(source, job.parallel, tcfg, dist)
    train = loop.ArrayBatches(dict(np.load(job.train_data)), tcfg.global_batch_size, tcfg.micro_batch_size, dist,
                              seed=tcfg.seed)
    val = loop.ArrayBatches(dict(np.load(job.val_data)), tcfg.global_batch_size, tcfg.micro_batch_size, dist,
                            seed=tcfg.seed, shuffle=False)
    spec = trainer.StageSpec(name="sft", forward_loss=make_forward_loss(source.vocab_size, dist.tp_rank),
                             metrics=["lm_loss"], loss_metric="lm_loss")
    return trainer.fit(job, spec, dist, RunLogger(rank=dist.rank), source, model, optimizer, scheduler, train, val,
                       tokenizer)


if __name__ == "__main__":  # the torch_dist checkpoint saver spawns processes: the guard is required
    loop.cli(SFTJobConfig, main, __doc__)
