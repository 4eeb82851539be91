"""torchrun worker of the scaling benchmark: load a model checkpoint unsharded (TP=1 PP=1, one process) and write its
token-mean validation loss over the first ``eval_samples`` samples, the same reduction as the trainer's evaluation.

    {"run_dir", "checkpoint", "val_data", "bf16", "eval_samples", "micro_batch_size"}  ->  run_dir/result.json {"val_loss"}
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from align_pipeline.config import ModelConfig, ParallelConfig
from align_pipeline.model import init
from align_pipeline.model.sequences import nll_forward
from align_pipeline.train.core.distributed import init_distributed, shutdown
from align_pipeline.train.core.optimizer import build_frozen
from align_pipeline.train.core.schedule import per_sample


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    cfg = json.loads(Path(parser.parse_args().config).read_text())
    parallel = ParallelConfig(bf16=cfg["bf16"])
    dist = init_distributed(parallel, seed=0)
    assert dist.world_size == 1, "the reshard check loads the checkpoint on one process"
    source = init.resolve(cfg["checkpoint"], ModelConfig(), tokenizer_vocab_size=0)
    model = build_frozen(source, parallel, dist)
    val = {k: v[: cfg["eval_samples"]] for k, v in np.load(cfg["val_data"]).items()}
    stats = per_sample(model, val, nll_forward(source.vocab_size, 0), cfg["micro_batch_size"], dist)  # [n, 2]
    val_loss = float(stats[:, 0].sum() / stats[:, 1].sum())  # token mean, as the trainer's evaluation
    (Path(cfg["run_dir"]) / "result.json").write_text(json.dumps({"val_loss": val_loss}))
    shutdown()


if __name__ == "__main__":
    main()
