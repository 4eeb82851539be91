"""A one-process job: a model checkpoint -> a Hugging Face directory (the Kedro side of export; torch stays out of
the Kedro process).

    {"run_dir": ..., "checkpoint": ..., "out": ..., "dtype": ..., "max_shard_gb": ..., "check": bool,
     "tolerance": float | None}  ->  out/ (config.json, safetensors, tokenizer), run_dir/result.json {summary}

With ``check`` the parity figure is measured (:func:`align_pipeline.model.hf_export.check_parity`) and the job fails
above the tolerance, removing the export.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from align_pipeline.model.hf_export import check_parity, export_hf, progress_printer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    cfg = json.loads(Path(parser.parse_args().config).read_text())
    t0 = time.perf_counter()
    summary = export_hf(cfg["checkpoint"], cfg["out"], dtype=cfg["dtype"],
                        max_shard_bytes=int(cfg["max_shard_gb"] * 1024**3),
                        progress=progress_printer(f"export {Path(cfg['checkpoint']).name}", sys.stdout))
    summary["seconds"] = round(time.perf_counter() - t0, 2)
    if cfg["check"]:
        tol = cfg["tolerance"] if cfg["tolerance"] is not None else (1e-4 if cfg["dtype"] == "float32" else 5e-2)
        diff = check_parity(cfg["checkpoint"], cfg["out"], Path(cfg["run_dir"]) / "check")
        summary |= {"max_abs_logit_diff": diff, "tolerance": tol}
        print(f"max |dlogit| = {diff:.3g} (tolerance {tol:g})", flush=True)
        if diff > tol:
            shutil.rmtree(cfg["out"], ignore_errors=True)
            raise SystemExit(f"export {cfg['checkpoint']}: max |dlogit| = {diff:.3g} exceeds the tolerance {tol:g}; "
                             "the export was removed")
    (Path(cfg["run_dir"]) / "result.json").write_text(json.dumps(summary))


if __name__ == "__main__":
    main()
