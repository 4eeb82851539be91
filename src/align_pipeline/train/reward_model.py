"""Reward-model entry point: a Bradley-Terry reward model on preference pairs (or a SteerLM-style regression RM).

    torchrun --nproc_per_node 2 -m align_pipeline.train.reward_model --config run/config.json

Starts from ``init_from`` (normally ``sft_policy``) with the LM head replaced by a scalar value head; the reward of a
sequence is the value at its last response token (or the mean over response tokens). Loss: ``-log sigma(r_c - r_r
- margin)`` (:func:`align_pipeline.losses.reward.bradley_terry_loss`); with ``reward.loss: regression`` one value per
attribute regressed onto the labels present (:func:`~align_pipeline.losses.reward.regression_reward_loss`). Output:
``run_dir/model`` (head "value").
"""

from __future__ import annotations

import numpy as np
import torch

from align_pipeline.config import RewardModelJobConfig
from align_pipeline.losses.reward import bradley_terry_loss, regression_reward_loss
from align_pipeline.train import loop, trainer


def pair_batch(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stack chosen over rejected: input_ids/labels/loss_mask [2b, s] (rows 0..b-1 chosen, b..2b-1 rejected)."""
    cat = lambda key: torch.cat([batch[f"chosen_{key}"], batch[f"rejected_{key}"]])
    return cat("input_ids"), cat("labels"), cat("loss_mask")


def sequence_rewards(values: torch.Tensor, loss_mask: torch.Tensor, pooling: str) -> torch.Tensor:
    """values [n, s, 1] at each *input* position -> rewards [n].

    ``loss_mask[:, t] = 1`` marks label t (= input token t+1) as a response token, so the response occupies input
    positions t+1; "last" reads the value at the final one (the EOS token, which has seen the whole sequence).
    """
    values = values[..., 0].float()  # [n, s]
    response = torch.zeros_like(loss_mask, dtype=torch.bool)  # [n, s] response tokens as inputs
    response[:, 1:] = loss_mask[:, :-1] > 0
    if pooling == "mean":
        return (values * response).sum(-1) / response.sum(-1).clamp(min=1)
    positions = torch.arange(values.shape[1], device=values.device).expand_as(values)  # [n, s]
    last = torch.where(response, positions, torch.zeros_like(positions)).max(-1).values  # [n]
    return values.gather(1, last.unsqueeze(1)).squeeze(1)


def regression_forward_loss(pooling: str):
    """SteerLM-style: one value per attribute, regressed onto the labels present (NaN = missing)."""

    def forward_loss(module, batch):
        ids, mask = batch["input_ids"], batch["loss_mask"]  # [b, s]
        values = module(ids, loop.position_ids_like(ids), None)  # [b, s, A]

        def loss_fn(values):
            per_attr = [sequence_rewards(values[..., a : a + 1], mask, pooling) for a in range(values.shape[-1])]
            predicted = torch.stack(per_attr, dim=-1)  # [b, A]
            labels = batch["reward_labels"]  # [b, A]
            present = ~torch.isnan(labels)
            return regression_reward_loss(predicted, torch.nan_to_num(labels), present.float())

        return values, loss_fn

    return forward_loss


def make_forward_loss(job: RewardModelJobConfig):
    if job.reward.loss == "regression":
        return regression_forward_loss(job.reward.pooling)

    def forward_loss(module, batch):
        ids, _, mask = pair_batch(batch)
        values = module(ids, loop.position_ids_like(ids), None)  # [2b, s, 1] on the last stage

        def loss_fn(values):
            rewards = sequence_rewards(values, mask, job.reward.pooling)  # [2b]
            r_c, r_r = rewards.chunk(2)  # [b], [b]
            gap = batch["chosen_reward"] - batch["rejected_reward"]  # [b], NaN where the data has no rewards
            margin = job.reward.margin_scale * torch.nan_to_num(gap, nan=0.0) if job.reward.margin_scale else None
            return bradley_terry_loss(r_c, r_r, margin)

        return values, loss_fn

    return forward_loss


def main(job: RewardModelJobConfig) -> dict:
    regression = job.reward.loss == "regression"
    num_outputs = np.load(job.train_data)["reward_labels"].shape[1] if regression else 1
    p = trainer.prepare(job, "reward_model", head="value", num_outputs=num_outputs)
    metrics = ["rm_loss", "abs_error"] if regression else [
        "rm_loss", "accuracy", "reward_chosen", "reward_rejected", "reward_margin"]
    spec = trainer.StageSpec(
        name="reward_model", forward_loss=make_forward_loss(job), metrics=metrics, loss_metric="rm_loss",
        head="value", extra_meta={"reward": {"pooling": job.reward.pooling, "loss": job.reward.loss},
                                  "num_outputs": num_outputs},
    )
    return trainer.fit(job, spec, p)


if __name__ == "__main__":  # the torch_dist checkpoint saver spawns processes: the guard is required
    loop.cli(RewardModelJobConfig, main, __doc__)
