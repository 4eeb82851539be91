"""A torchrun entry point: a model checkpoint's outputs on fixed tokens (the Megatron side of ``--check``).

    {"run_dir": ..., "checkpoint": ..., "tokens": [[...]], "parallel"?: {...},
     "generate"?: {"prompt": [...], "max_new_tokens": n, "eos_id": [...], "pad_id": p}}
        ->  run_dir/result.json {"logits": [b][s][vocab]} (LM head) or [b][s][outputs] (value head),
                                "generated": [...] (with "generate": the greedy continuation of "prompt")

fp32, any TP (PP=1): the reference an HF export or import is compared with.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from align_pipeline.config.base import from_dict
from align_pipeline.config.common import ModelConfig, ParallelConfig
from align_pipeline.model import init
from align_pipeline.model.generate import generate
from align_pipeline.model.sequences import position_ids
from align_pipeline.train.core.distributed import Dist, init_distributed, shutdown


def outputs(request: dict[str, Any], dist: Dist, parallel: ParallelConfig | None = None) -> dict[str, Any]:
    """The outputs ``request`` asks for (``checkpoint``, ``tokens``, ``generate``?), with ``dist`` initialised (this
    job's, or the export job's own process: :mod:`align_pipeline.train.jobs.export`)."""
    source = init.resolve(request["checkpoint"], ModelConfig(), tokenizer_vocab_size=0)
    model = init.build_model(source, parallel or ParallelConfig(), dist, head=source.head)
    model.eval()
    tokens = torch.tensor(request["tokens"], dtype=torch.long, device=dist.device)
    with torch.no_grad():
        out = model(tokens, position_ids(tokens), None, runtime_gather_output=True)  # [b, s, V padded] or [b, s, A]
    out = out.float().cpu()
    if source.head == "lm":
        out = out[..., : source.vocab_size]
    result: dict[str, Any] = {"logits": out.tolist()}
    if request.get("generate"):
        spec = request["generate"]
        with torch.no_grad():
            result["generated"] = generate(model, [spec["prompt"]], max_new_tokens=int(spec["max_new_tokens"]),
                                           eos_id=spec["eos_id"], pad_id=int(spec["pad_id"]),
                                           vocab_size=source.vocab_size, greedy=True).tokens[0]
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    cfg = json.loads(Path(parser.parse_args().config).read_text())
    parallel = from_dict(ParallelConfig, cfg.get("parallel") or {})
    if parallel.pipeline_model_parallel_size != 1:
        raise ValueError("the logits job runs PP=1 only")
    dist = init_distributed(parallel, seed=0)
    result = outputs(cfg, dist, parallel)
    if dist.rank == 0:
        (Path(cfg["run_dir"]) / "result.json").write_text(json.dumps(result))
    shutdown()


if __name__ == "__main__":  # torchrun runs the module; importing it runs nothing
    main()
