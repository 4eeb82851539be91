"""Export node: a model artifact's path (or "" when the project has none) -> the path of its HF directory."""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path

from align_pipeline.config.base import from_dict
from align_pipeline.config.common import ExportConfig
from align_pipeline.data.formats import checkpoint_meta
from align_pipeline.launch import model_jobs
from align_pipeline.model.export_check import export_tokenizer

log = logging.getLogger(__name__)


def export_artifact(checkpoint: str, export: dict, *, name: str) -> tuple[str, dict[str, float]]:
    """Write the checkpoint ``name`` as an HF directory (in a one-process job); returns (its path, metrics).

    An absent artifact ("" from an optional catalog entry) exports nothing: ("", {}). The export packs the
    checkpoint's own tokenizer: one whose fingerprint differs from its meta.json's (the recorded path rewritten by
    another env's data_prep) stops the node before launch (:class:`~align_pipeline.model.export_check.ExportRefused`).
    """
    cfg = from_dict(ExportConfig, export, "params:export")
    if not checkpoint:
        log.info("export: no %s in the catalog, nothing to export", name)
        return "", {}
    export_tokenizer(checkpoint, checkpoint_meta(checkpoint))  # refused here, before launching, with one line
    Path(cfg.work_dir).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=cfg.work_dir)).resolve()
    out = work / f"{name}_hf"  # the catalog moves it into its version
    summary = model_jobs.export(checkpoint, str(out), cfg, work / "job")
    shutil.rmtree(work / "job", ignore_errors=True)
    log.info("export: %s -> %s (%s, %d files, %.1f MB, %.1f s)", name, out, summary["architecture"],
             summary["files"], summary["bytes"] / 1e6, summary["seconds"])
    metrics = {"seconds": float(summary["seconds"]), "bytes": float(summary["bytes"])}
    if "max_abs_logit_diff" in summary:
        metrics["max_abs_logit_diff"] = float(summary["max_abs_logit_diff"])
    if "check_failed" in summary:
        metrics["check_failed"] = float(summary["check_failed"])
    return str(out), metrics
