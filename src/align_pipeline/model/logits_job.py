"""A torchrun entry point: a model checkpoint's logits on fixed tokens (the Megatron side of ``export --check``).

    {"run_dir": ..., "checkpoint": ..., "tokens": [[...]]}  ->  run_dir/result.json {"logits": [b][s][vocab]}

One rank, TP=1 PP=1, fp32: the reference the exported HF model is compared with.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from align_pipeline.config import ModelConfig, ParallelConfig
from align_pipeline.model import init
from align_pipeline.model.sequences import position_ids
from align_pipeline.train.core.distributed import init_distributed, shutdown


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    cfg = json.loads(Path(parser.parse_args().config).read_text())
    parallel = ParallelConfig()
    dist = init_distributed(parallel, seed=0)
    source = init.resolve(cfg["checkpoint"], ModelConfig(), tokenizer_vocab_size=0)
    model = init.build_model(source, parallel, dist)
    model.eval()
    tokens = torch.tensor(cfg["tokens"], dtype=torch.long)
    with torch.no_grad():
        logits = model(tokens, position_ids(tokens), None, runtime_gather_output=True)  # [b, s, V padded]
    if dist.rank == 0:
        (Path(cfg["run_dir"]) / "result.json").write_text(json.dumps({"logits": logits[..., : source.vocab_size].tolist()}))
    shutdown()


if __name__ == "__main__":  # torchrun runs the module; importing it runs nothing
    main()
