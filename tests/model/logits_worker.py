"""torchrun worker for tests: load a model checkpoint at some TP/PP and write its logits on fixed tokens.

    {"run_dir": ..., "checkpoint": ..., "parallel": {...}, "tokens": [[...]], "head"?: "lm" | "value"}  ->  run_dir/result.json {"logits": ...}
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from align_pipeline.config import ModelConfig, ParallelConfig, from_dict
from align_pipeline.model import init
from align_pipeline.model.sequences import position_ids
from align_pipeline.train.core.distributed import init_distributed, shutdown


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    cfg = json.loads(Path(parser.parse_args().config).read_text())
    parallel = from_dict(ParallelConfig, cfg["parallel"])
    dist = init_distributed(parallel, seed=0)
    source = init.resolve(cfg["checkpoint"], ModelConfig(), tokenizer_vocab_size=0)
    model = init.build_model(source, parallel, dist, head=cfg.get("head", "lm"))
    model.eval()
    tokens = torch.tensor(cfg["tokens"], dtype=torch.long)
    assert dist.pp_size == 1, "this worker runs PP=1 only"
    with torch.no_grad():
        logits = model(tokens, position_ids(tokens), None, runtime_gather_output=True)  # [b, s, V]
    if dist.rank == 0:
        out = {"logits": logits[..., : source.vocab_size].tolist()}
        (Path(cfg["run_dir"]) / "result.json").write_text(json.dumps(out))
    shutdown()


if __name__ == "__main__":
    main()
