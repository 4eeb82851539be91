"""A torchrun entry point: a model checkpoint's outputs on fixed tokens (the Megatron side of ``--check``).

    {"run_dir": ..., "checkpoint": ..., "tokens": [[...]], "parallel"?: {...}}
        ->  run_dir/result.json {"logits": [b][s][vocab]} (LM head) or [b][s][outputs] (value head)

fp32, any TP (PP=1): the reference an HF export or import is compared with.
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
    parallel = from_dict(ParallelConfig, cfg.get("parallel") or {})
    if parallel.pipeline_model_parallel_size != 1:
        raise ValueError("logits_job runs PP=1 only")
    dist = init_distributed(parallel, seed=0)
    source = init.resolve(cfg["checkpoint"], ModelConfig(), tokenizer_vocab_size=0)
    model = init.build_model(source, parallel, dist, head=source.head)
    model.eval()
    tokens = torch.tensor(cfg["tokens"], dtype=torch.long, device=dist.device)
    with torch.no_grad():
        out = model(tokens, position_ids(tokens), None, runtime_gather_output=True)  # [b, s, V padded] or [b, s, A]
    out = out.float().cpu()
    if source.head == "lm":
        out = out[..., : source.vocab_size]
    if dist.rank == 0:
        (Path(cfg["run_dir"]) / "result.json").write_text(json.dumps({"logits": out.tolist()}))
    shutdown()


if __name__ == "__main__":  # torchrun runs the module; importing it runs nothing
    main()
