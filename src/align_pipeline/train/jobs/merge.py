"""A torchrun entry point: a LoRA artifact of adapters alone -> a plain model checkpoint (base + adapters merged).

    {"run_dir": ..., "checkpoint": ..., "out": ...}  ->  out/ (torch_dist shards + meta.json), run_dir/result.json

The HF export reads checkpoint files directly, without building a model; an adapters-only artifact
(``<stage>.lora.store: adapters``) is first materialised by this job: the model is built and filled by
:func:`align_pipeline.model.init.resolve` (the base's weights, the adapters merged in) and saved with the artifact's
own meta.json (stage, metrics, lineage), ``lora.storage`` now ``merged``, and a copy of its tokenizer.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from align_pipeline.config.common import ModelConfig, ParallelConfig
from align_pipeline.model import checkpoint as checkpoint_io
from align_pipeline.model import init
from align_pipeline.train.core.distributed import Dist, init_distributed, shutdown


def merge(checkpoint: str | Path, out: str | Path, dist: Dist) -> Path:
    """The adapters-only artifact ``checkpoint`` merged into its base, saved as ``out`` (``dist``: one rank)."""
    source = init.resolve(str(checkpoint), ModelConfig(), tokenizer_vocab_size=0)
    model = init.build_model(source, ParallelConfig(), dist, head=source.head, num_outputs=source.num_outputs)
    meta = {k: v for k, v in checkpoint_io.read_meta(checkpoint).items() if k not in ("format", "kind")}
    meta["lora"] = {**meta["lora"], "storage": "merged", "merged": True, "materialized_from": str(checkpoint)}
    own = (meta.get("tokenizer") or {}).get("path")
    if own and not Path(own).is_absolute():  # the artifact's own copy: the merged checkpoint carries it too
        meta["tokenizer"] = {**meta["tokenizer"], "path": str((Path(checkpoint) / own).resolve())}
    checkpoint_io.save_model(out, model, meta)
    return Path(out).resolve()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    cfg = json.loads(Path(parser.parse_args().config).read_text())
    dist = init_distributed(ParallelConfig(), seed=0)
    out = merge(cfg["checkpoint"], cfg["out"], dist)
    if dist.rank == 0:
        (Path(cfg["run_dir"]) / "result.json").write_text(json.dumps({"out": str(out)}))
    shutdown()


if __name__ == "__main__":  # torchrun runs the module; importing it runs nothing
    main()
