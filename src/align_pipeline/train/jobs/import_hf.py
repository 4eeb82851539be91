"""A torchrun entry point: an HF model directory -> a model checkpoint of ours (``align-pipeline import``).

    {"run_dir": ..., "hf_dir": ..., "out": ..., "parallel": {...}, "seq_length": int}
        ->  out/ (torch_dist shards + meta.json), run_dir/result.json {"out": ..., "model": {...}, "vocab_size": ...}

Every rank builds its TP/PP piece of the GPT, fills it from the HF tensors of its own stage
(:func:`align_pipeline.model.hf.load_hf_weights`) and writes it; the checkpoint loads at any other layout.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from align_pipeline.config.base import from_dict, to_dict
from align_pipeline.config.common import ModelConfig, ParallelConfig
from align_pipeline.model import checkpoint, init
from align_pipeline.train.core.distributed import init_distributed, shutdown


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    cfg = json.loads(Path(parser.parse_args().config).read_text())
    parallel = from_dict(ParallelConfig, cfg.get("parallel") or {})
    dist = init_distributed(parallel, seed=0)
    hf_dir = Path(cfg["hf_dir"]).resolve()
    source = init.resolve(str(hf_dir), ModelConfig(seq_length=int(cfg["seq_length"])), tokenizer_vocab_size=0)
    model = init.build_model(source, parallel, dist)
    has_tokenizer = (hf_dir / "tokenizer_config.json").is_file()
    meta = {
        "stage": "import",
        "step": 0,
        "model": to_dict(source.model),
        "head": "lm",
        "num_outputs": 1,
        "vocab_size": source.vocab_size,
        "tokenizer": {"path": str(hf_dir)} if has_tokenizer else None,
        "lineage": {"parent": {"kind": "nemo", "path": cfg["source"]} if cfg.get("source") else source.parent},
        "import": {"tensor_model_parallel_size": dist.tp_size, "pipeline_model_parallel_size": dist.pp_size,
                   "expert_model_parallel_size": dist.ep_size},
    }
    checkpoint.save_model(cfg["out"], model, meta)
    if dist.rank == 0:
        result = {"out": str(Path(cfg["out"]).resolve()), "model": meta["model"], "vocab_size": source.vocab_size}
        (Path(cfg["run_dir"]) / "result.json").write_text(json.dumps(result))
    shutdown()


if __name__ == "__main__":  # torchrun runs the module; importing it runs nothing
    main()
