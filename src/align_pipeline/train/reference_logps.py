"""Reference log-probs entry point: sequence log-probs of a frozen model on preference pairs, computed once.

    torchrun --nproc_per_node 2 -m align_pipeline.train.reference_logps --config run/config.json

For each split and pair: ``log pi_ref(y_c | x)`` and ``log pi_ref(y_r | x)`` (sums over response tokens) and the
response token counts. DPO then needs no reference forward pass. Output: one .npz (rank 0).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from align_pipeline.config import ReferenceLogpsJobConfig
from align_pipeline.data.formats import atomic_open
from align_pipeline.model import init
from align_pipeline.model.logprobs import token_nll
from align_pipeline.train import loop
from align_pipeline.train.distributed import init_distributed, shutdown
from align_pipeline.train.reward_model import pair_batch


def sequence_logps(module, batches: list[dict[str, torch.Tensor]], n: int, vocab_size: int, dist) -> dict:
    """Per-sample chosen/rejected log-prob sums and token counts for ``n`` samples (in order), on every rank."""

    def forward(module, batch):
        ids, labels, mask = pair_batch(batch)  # [2b, s]
        logits = module(ids, loop.position_ids_like(ids), None)  # [2b, s, V/tp]

        def per_sample(logits):
            logp = -(token_nll(logits, labels, vocab_size, dist.tp_rank) * mask).sum(-1)  # [2b]
            chosen, rejected = logp.chunk(2)
            tc, tr = mask.sum(-1).chunk(2)
            return torch.stack([chosen, rejected, tc, tr], dim=-1)  # [b, 4]

        return logits, per_sample

    values = loop.collect_per_sample(module, batches, forward, dist)  # [n_local_padded, 4] on the last stage
    return loop.gather_by_index(values, batches, n, dist)  # [n, 4] everywhere


def main(job: ReferenceLogpsJobConfig) -> dict:
    dist = init_distributed(job.parallel, seed=0)
    source = init.resolve(job.checkpoint, init.ModelConfig(), tokenizer_vocab_size=0)
    model = init.build_model(source, job.parallel, dist)
    model.eval()
    out: dict[str, np.ndarray] = {}
    for split, path in job.data.items():
        arrays = dict(np.load(path))
        n = len(arrays["chosen_input_ids"])
        batches = loop.ArrayBatches(arrays, job.micro_batch_size * dist.dp_size, job.micro_batch_size, dist,
                                    seed=0, shuffle=False).eval_microbatches(with_index=True)
        with torch.no_grad():
            v = sequence_logps(model, batches, n, source.vocab_size, dist).cpu().numpy()
        out.update({f"{split}_chosen_logps": v[:, 0], f"{split}_rejected_logps": v[:, 1],
                    f"{split}_chosen_tokens": v[:, 2], f"{split}_rejected_tokens": v[:, 3]})
        loop.log(dist, f"[reference_logps] {split}: {n} pairs, mean chosen {v[:, 0].mean():.3f}, "
                       f"rejected {v[:, 1].mean():.3f}")
    if dist.is_logging_rank:
        Path(job.output).parent.mkdir(parents=True, exist_ok=True)
        with atomic_open(job.output) as f:
            np.savez(f, **out)
        (Path(job.run_dir) / "result.json").write_text(json.dumps({"output": job.output, "splits": list(job.data)}))
    shutdown()
    return {"output": job.output}


if __name__ == "__main__":
    loop.cli(ReferenceLogpsJobConfig, main, __doc__)
