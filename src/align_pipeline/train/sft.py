"""Supervised fine-tuning (SFT) entry point.

    torchrun --nproc_per_node 2 -m align_pipeline.train.sft --config run/config.json     # any world size
    python -m align_pipeline.train.sft --config run/config.json                          # single process

The config is an :class:`align_pipeline.config.SFTJobConfig` as JSON. Loss: next-token cross-entropy on response
tokens only (``loss_mask``). Resumes from the latest checkpoint in ``run_dir`` when one exists. Writes the final model
checkpoint to ``run_dir/model`` and a summary to ``run_dir/result.json`` (rank 0).
"""

from __future__ import annotations

from align_pipeline.config import SFTJobConfig
from align_pipeline.losses.sft import masked_token_loss
from align_pipeline.model.logprobs import token_nll
from align_pipeline.train import loop, trainer


def make_forward_loss(vocab_size: int, tp_rank: int):
    def forward_loss(module, batch):
        # input_ids/labels/loss_mask: [b, s]; the last stage returns this rank's vocab shard of the logits.
        logits = module(batch["input_ids"], loop.position_ids_like(batch["input_ids"]), None)  # [b, s, V/tp]
        return logits, lambda logits: masked_token_loss(
            token_nll(logits, batch["labels"], vocab_size, tp_rank), batch["loss_mask"]
        )

    return forward_loss


def main(job: SFTJobConfig) -> dict:
    p = trainer.prepare(job, "sft")
    spec = trainer.StageSpec(name="sft", forward_loss=make_forward_loss(p.source.vocab_size, p.dist.tp_rank),
                             metrics=["lm_loss"], loss_metric="lm_loss")
    return trainer.fit(job, spec, p)


if __name__ == "__main__":  # the torch_dist checkpoint saver spawns processes: the guard is required
    loop.cli(SFTJobConfig, main, __doc__)
