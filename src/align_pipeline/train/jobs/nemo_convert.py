"""A job: a NeMo 1.x ``.nemo`` -> its HF directory in the conversion cache (:func:`align_pipeline.model.nemo.hf_dir_for`).

    {"run_dir": ..., "nemo": ...}  ->  run_dir/result.json {"hf_dir": ...}

Launched by :func:`align_pipeline.launch.model_jobs.nemo_hf_dir` for the Kedro side, which imports no torch. An
archive the conversion refuses (a :class:`~align_pipeline.errors.UserError`: the file and what is wrong) is not a
crash: its message goes to ``run_dir/refused.json`` ``{"error": ...}`` and to the log as one line (no traceback), and
the job exits 1; the launcher raises that message alone.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from align_pipeline.errors import UserError
from align_pipeline.model.nemo import hf_dir_for


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    cfg = json.loads(Path(parser.parse_args().config).read_text())
    try:
        out = hf_dir_for(cfg["nemo"])
    except UserError as exc:
        (Path(cfg["run_dir"]) / "refused.json").write_text(json.dumps({"error": str(exc)}))
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    (Path(cfg["run_dir"]) / "result.json").write_text(json.dumps({"hf_dir": str(out)}))


if __name__ == "__main__":  # torchrun runs the module; importing it runs nothing
    main()
