"""DPO-family entry point: direct preference optimisation against cached reference log-probs.

    torchrun --nproc_per_node 2 -m align_pipeline.train.dpo --config run/config.json

The policy starts from ``init_from`` (normally ``sft_policy``); the reference log-probs come precomputed from
``align_pipeline.train.reference_logps`` (no reference forward pass here). The loss is the function the config names in
:data:`align_pipeline.losses.preference.PREFERENCE_LOSSES` (dpo, ipo, rpo, simpo, hinge), optionally mixed with an SFT
term on the chosen response.
"""

from __future__ import annotations

import functools

import numpy as np

from align_pipeline.config import DPOJobConfig
from align_pipeline.losses.preference import REFERENCE_FREE_LOSSES, PreferenceLogps, combine, get_preference_loss
from align_pipeline.model.logprobs import token_nll
from align_pipeline.train import loop, trainer
from align_pipeline.train.reward_model import pair_batch


def with_reference(arrays: dict[str, np.ndarray], ref: np.lib.npyio.NpzFile | None, split: str) -> dict:
    """Attach the cached reference log-probs of ``split`` as per-sample arrays (indexed like the pairs)."""
    if ref is None:
        return arrays
    n = len(arrays["chosen_input_ids"])
    extra = {"ref_chosen_logps": ref[f"{split}_chosen_logps"].astype(np.float32),
             "ref_rejected_logps": ref[f"{split}_rejected_logps"].astype(np.float32)}
    for value in extra.values():
        if len(value) != n:
            raise ValueError(f"reference log-probs for {split} have {len(value)} rows, the data has {n}")
    return {**arrays, **extra}


def make_forward_loss(job: DPOJobConfig, vocab_size: int, tp_rank: int):
    loss = functools.partial(get_preference_loss(job.loss.name), beta=job.loss.beta, **job.loss.options)

    def forward_loss(module, batch):
        ids, labels, mask = pair_batch(batch)  # [2b, s]
        logits = module(ids, loop.position_ids_like(ids), None)  # [2b, s, V/tp]

        def loss_fn(logits):
            nll = token_nll(logits, labels, vocab_size, tp_rank) * mask  # [2b, s]
            logps = -nll.sum(-1)  # [2b]
            tokens = mask.sum(-1)  # [2b]
            (pc, pr), (tc, tr) = logps.chunk(2), tokens.chunk(2)
            pairs = PreferenceLogps(
                policy_chosen=pc, policy_rejected=pr,
                ref_chosen=batch.get("ref_chosen_logps"), ref_rejected=batch.get("ref_rejected_logps"),
                chosen_tokens=tc, rejected_tokens=tr,
                chosen_reward=batch["chosen_reward"], rejected_reward=batch["rejected_reward"],
            )
            out = loss(pairs)
            if job.loss.sft_weight:
                out = combine(out, -pc, tc, weight=job.loss.sft_weight)
            return out

        return logits, loss_fn

    return forward_loss


def main(job: DPOJobConfig) -> dict:
    if job.reference_logps is None and job.loss.name not in REFERENCE_FREE_LOSSES:
        raise ValueError(f"loss {job.loss.name!r} needs reference log-probs (reference_logps is None)")
    ref = np.load(job.reference_logps) if job.reference_logps else None
    p = trainer.prepare(job, "dpo", with_arrays=lambda arrays, split: with_reference(arrays, ref, split))
    name = job.loss.name
    metrics = [f"{name}_loss", "accuracy", "rewards_chosen", "rewards_rejected", "rewards_margin", "logps_chosen",
               "logps_rejected"] + (["sft_loss", "loss"] if job.loss.sft_weight else [])
    spec = trainer.StageSpec(
        name="dpo", forward_loss=make_forward_loss(job, p.source.vocab_size, p.dist.tp_rank), metrics=metrics,
        loss_metric="loss" if job.loss.sft_weight else f"{name}_loss",
        extra_meta={"preference_loss": {"name": name, "beta": job.loss.beta, "sft_weight": job.loss.sft_weight,
                                        **job.loss.options}},
    )
    return trainer.fit(job, spec, p)


if __name__ == "__main__":  # the torch_dist checkpoint saver spawns processes: the guard is required
    loop.cli(DPOJobConfig, main, __doc__)
