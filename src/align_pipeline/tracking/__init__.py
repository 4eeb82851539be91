"""Rank-0 MLflow logging (and its metrics.jsonl), the tracking-store probe, bounded calls to the store (a server that
dies costs seconds once per process), closing runs left RUNNING, system/GPU metrics and lineage tags for torchrun
entry points (no Kedro imports)."""

from align_pipeline.tracking.lineage import git_commit, git_dirty, git_tags, lineage_tags
from align_pipeline.tracking.metrics_file import METRICS_FILE, MetricsFile, relog
from align_pipeline.tracking.mlflow_logger import (
    RunLogger,
    child_run_env,
    default_tracking_uri,
    flatten,
    numeric_items,
)
from align_pipeline.tracking.probe import unreachable
from align_pipeline.tracking.system_metrics import SystemMetrics

__all__ = [
    "METRICS_FILE",
    "MetricsFile",
    "RunLogger",
    "SystemMetrics",
    "child_run_env",
    "default_tracking_uri",
    "flatten",
    "git_commit",
    "git_dirty",
    "git_tags",
    "lineage_tags",
    "numeric_items",
    "relog",
    "unreachable",
]
