"""torchrun worker for the MoE tests: each rank generates greedily for its own prompts (its own count, lengths and
budget, so expert-parallel ranks run different numbers of forwards) from an HF model directory at some layout.

    {"run_dir": ..., "hf_dir": ..., "parallel": {...}, "work": [{"prompts": [[...]], "max_new_tokens": n,
     "max_rows": r, "use_cache": true}, ...] (one entry per rank; a world of one runs every entry in turn)}
      ->  run_dir/result.json {"tokens": [[tokens of each prompt] per entry]}
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch.distributed as tdist

from align_pipeline.config import ModelConfig, ParallelConfig, from_dict
from align_pipeline.model import init
from align_pipeline.model.generate import generate
from align_pipeline.train.core.distributed import init_distributed, shutdown


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    cfg = json.loads(Path(parser.parse_args().config).read_text())
    parallel = from_dict(ParallelConfig, cfg["parallel"])
    dist = init_distributed(parallel, seed=0)
    source = init.resolve(cfg["hf_dir"], ModelConfig(seq_length=64, attention_backend="sdpa"), tokenizer_vocab_size=0)
    model = init.build_model(source, parallel, dist)
    entries = cfg["work"] if dist.world_size == 1 else [cfg["work"][dist.rank]]
    results = []
    for entry in entries:
        gen = generate(model, entry["prompts"], max_new_tokens=entry["max_new_tokens"], eos_id=None, pad_id=0,
                       vocab_size=source.vocab_size, greedy=True, max_rows=entry["max_rows"],
                       use_cache=entry.get("use_cache", True))
        results.append(gen.tokens)
    gathered = [None] * dist.world_size
    tdist.all_gather_object(gathered, results)
    if dist.rank == 0:
        flat = [r for rank_results in gathered for r in rank_results]
        (Path(cfg["run_dir"]) / "result.json").write_text(json.dumps({"tokens": flat}))
    shutdown()


if __name__ == "__main__":
    main()
