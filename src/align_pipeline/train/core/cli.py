"""The command line of every entry point: ``python -m align_pipeline.train.<stage> --config job.json``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from align_pipeline.config.base import from_dict


def cli(job_cls, main, doc: str | None) -> None:
    """``--config <json>`` -> ``main(from_dict(job_cls, json))`` (unknown keys and wrong types fail first)."""
    parser = argparse.ArgumentParser(description=(doc or "").strip().splitlines()[0] if doc else None)
    parser.add_argument("--config", required=True, help=f"{job_cls.__name__} as JSON")
    args = parser.parse_args()
    main(from_dict(job_cls, json.loads(Path(args.config).read_text())))
