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
    result = {"logits": out.tolist()}
    if cfg.get("generate"):
        from align_pipeline.model.generate import generate

        spec = cfg["generate"]
        with torch.no_grad():
            result["generated"] = generate(model, [spec["prompt"]], max_new_tokens=int(spec["max_new_tokens"]),
                                           eos_id=spec["eos_id"], pad_id=int(spec["pad_id"]),
                                           vocab_size=source.vocab_size, greedy=True).tokens[0]
    if dist.rank == 0:
        (Path(cfg["run_dir"]) / "result.json").write_text(json.dumps(result))
    shutdown()


if __name__ == "__main__":  # torchrun runs the module; importing it runs nothing
    main()
