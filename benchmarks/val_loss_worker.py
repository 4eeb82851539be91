"""torchrun worker of the scaling benchmark: load a model checkpoint unsharded (TP=1 PP=1, one process) and write its
token-mean validation loss over the first ``eval_samples`` samples, the same reduction as the trainer's evaluation.

    {"run_dir", "checkpoint", "val_data", "bf16", "eval_samples", "micro_batch_size"}  ->  run_dir/result.json {"val_loss"}
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from align_pipeline.config import ModelConfig, ParallelConfig
from align_pipeline.losses.sft import masked_token_loss
from align_pipeline.model import init
from align_pipeline.model.logprobs import token_nll
from align_pipeline.train import loop
from align_pipeline.train.distributed import init_distributed, shutdown


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    cfg = json.loads(Path(parser.parse_args().config).read_text())
    parallel = ParallelConfig(bf16=cfg["bf16"])
    dist = init_distributed(parallel, seed=0)
    assert dist.world_size == 1, "the reshard check loads the checkpoint on one process"
    source = init.resolve(cfg["checkpoint"], ModelConfig(), tokenizer_vocab_size=0)
    model = init.build_model(source, parallel, dist).eval()
    val = dict(np.load(cfg["val_data"]))
    n, mb = min(cfg["eval_samples"], len(val["input_ids"])), cfg["micro_batch_size"]
    loss_sum, tokens = 0.0, 0
    with torch.no_grad():
        for start in range(0, n, mb):
            batch = {k: torch.from_numpy(v[start:min(start + mb, n)]).to(dist.device) for k, v in val.items()}
            logits = model(batch["input_ids"], loop.position_ids_like(batch["input_ids"]), None)  # [b, s, V]
            s, c, _ = masked_token_loss(token_nll(logits, batch["labels"], source.vocab_size, 0), batch["loss_mask"])
            loss_sum, tokens = loss_sum + float(s), tokens + int(c)
    (Path(cfg["run_dir"]) / "result.json").write_text(json.dumps({"val_loss": loss_sum / tokens}))
    shutdown()


if __name__ == "__main__":
    main()
