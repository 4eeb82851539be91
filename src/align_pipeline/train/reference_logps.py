"""Reference log-probs: sequence log-probs of a frozen model on preference pairs, computed once per cache key.

    torchrun --nproc_per_node 2 -m align_pipeline.train.reference_logps --config run/config.json

For each split and pair: ``log pi_ref(y_c | x)`` and ``log pi_ref(y_r | x)`` (sums over response tokens) and the
response token counts. DPO then needs no reference forward pass. Output: one .npz (rank 0), written atomically, then
its sidecar with the file's sha256 (:mod:`align_pipeline.data.reference_cache`).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from align_pipeline.config.common import ModelConfig
from align_pipeline.config.dpo import ReferenceLogpsJob
from align_pipeline.data.reference_cache import write_cache
from align_pipeline.data.store import load_sequences
from align_pipeline.model import init
from align_pipeline.model.sequences import pair_logps_forward
from align_pipeline.train.core.cli import cli
from align_pipeline.train.core.distributed import init_distributed, shutdown
from align_pipeline.train.core.optimizer import build_frozen
from align_pipeline.train.core.progress import log
from align_pipeline.train.core.schedule import per_sample


def main(job: ReferenceLogpsJob) -> dict:
    dist = init_distributed(job.parallel, seed=0)
    source = init.resolve(job.checkpoint, ModelConfig(), tokenizer_vocab_size=0)
    reference = build_frozen(source, job.parallel, dist)
    forward = pair_logps_forward(source.vocab_size, dist.tp_rank)
    out: dict[str, np.ndarray] = {}
    for split, path in job.data.items():
        v = per_sample(reference, load_sequences(path), forward, job.micro_batch_size, dist)  # [n, 4]
        out.update({f"{split}_chosen_logps": v[:, 0], f"{split}_rejected_logps": v[:, 1],
                    f"{split}_chosen_tokens": v[:, 2], f"{split}_rejected_tokens": v[:, 3]})
        log(dist, f"[reference_logps] {split}: {len(v)} pairs, mean chosen {v[:, 0].mean():.3f}, "
                  f"rejected {v[:, 1].mean():.3f}")
    if dist.is_logging_rank:
        write_cache(job.output, out)
        (Path(job.run_dir) / "result.json").write_text(json.dumps({"output": job.output, "splits": list(job.data)}))
    shutdown()
    return {"output": job.output}


if __name__ == "__main__":
    cli(ReferenceLogpsJob, main, __doc__)
