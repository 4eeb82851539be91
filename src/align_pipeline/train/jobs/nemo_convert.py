"""A job: a NeMo 1.x ``.nemo`` -> its HF directory in the conversion cache (:func:`align_pipeline.model.nemo.hf_dir_for`).

    {"run_dir": ..., "nemo": ...}  ->  run_dir/result.json {"hf_dir": ...}

Launched by :func:`align_pipeline.launch.model_jobs.nemo_hf_dir` for the Kedro side, which imports no torch.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from align_pipeline.model.nemo import hf_dir_for


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    cfg = json.loads(Path(parser.parse_args().config).read_text())
    out = hf_dir_for(cfg["nemo"])
    (Path(cfg["run_dir"]) / "result.json").write_text(json.dumps({"hf_dir": str(out)}))


if __name__ == "__main__":  # torchrun runs the module; importing it runs nothing
    main()
