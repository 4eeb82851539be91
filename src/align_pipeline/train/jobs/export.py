"""A one-process job: a model checkpoint -> a Hugging Face directory (the Kedro side of export; torch stays out of
the Kedro process).

    {"run_dir": ..., "checkpoint": ..., "out": ..., "dtype": ..., "max_shard_gb": ..., "check": bool,
     "tolerance": float | None}  ->  out/ (config.json, safetensors, tokenizer), run_dir/result.json {summary}

Everything runs in this one process: an adapters-only LoRA artifact on an HF base is merged first
(:func:`align_pipeline.train.jobs.merge.merge`), and with ``check`` our side of every check of
:func:`align_pipeline.model.export_check.check_export` (tokenizer vocabulary and fingerprint, special tokens / chat
template round-trip, logits, greedy generation) comes from :func:`align_pipeline.train.jobs.logits.outputs`. The job
fails when a check fails, removing the export. The result is recorded in the export (``align_export_check.json``:
passed, or skipped without ``check``), which MLflow's model registry reads.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from align_pipeline.config.common import ParallelConfig
from align_pipeline.model.export_check import check_export, write_result
from align_pipeline.model.hf_export import export_hf, progress_printer
from align_pipeline.train.core.distributed import Dist, init_distributed, shutdown
from align_pipeline.train.jobs.logits import outputs
from align_pipeline.train.jobs.merge import merge


class _OneRank:
    """The process group, initialised the first time a model has to be built (a plain export never builds one)."""

    def __init__(self) -> None:
        self.dist: Dist | None = None

    def __call__(self) -> Dist:
        if self.dist is None:
            self.dist = init_distributed(ParallelConfig(), seed=0)
        return self.dist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    cfg = json.loads(Path(parser.parse_args().config).read_text())
    rank = _OneRank()
    t0 = time.perf_counter()
    summary = export_hf(cfg["checkpoint"], cfg["out"], dtype=cfg["dtype"],
                        max_shard_bytes=int(cfg["max_shard_gb"] * 1024**3),
                        progress=progress_printer(f"export {Path(cfg['checkpoint']).name}", sys.stdout),
                        merge=lambda artifact, out: merge(artifact, out, rank()))
    summary["seconds"] = round(time.perf_counter() - t0, 2)
    if cfg["check"]:
        tol = cfg["tolerance"] if cfg["tolerance"] is not None else (1e-4 if cfg["dtype"] == "float32" else 5e-2)
        checks = check_export(cfg["checkpoint"], cfg["out"], tol, our_side=lambda request: outputs(request, rank()))
        for check in checks:
            print(check.line(), flush=True)
        failed = [c.name for c in checks if c.ok is False]
        logits = next((c.value for c in checks if c.name == "logits" and c.value is not None), None)
        summary |= {"tolerance": tol, "check_failed": len(failed)}
        if logits is not None:
            summary["max_abs_logit_diff"] = logits
        if failed:
            shutil.rmtree(cfg["out"], ignore_errors=True)
            raise SystemExit(f"export {cfg['checkpoint']}: the check failed ({', '.join(failed)}: see the lines "
                             "above); the export was removed")
        write_result(cfg["out"], "passed", checks)
    else:
        write_result(cfg["out"], "skipped", [])
    (Path(cfg["run_dir"]) / "result.json").write_text(json.dumps(summary))
    if rank.dist is not None:
        shutdown()


if __name__ == "__main__":  # torchrun runs the module; importing it runs nothing
    main()
