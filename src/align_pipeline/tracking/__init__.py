"""Rank-0 MLflow logging (and its metrics.jsonl), the tracking-store probe, bounded calls to the store (a server that
dies costs seconds once per process), closing runs left RUNNING, system/GPU metrics and lineage tags for torchrun
entry points (no Kedro imports)."""

from align_pipeline import lazy_exports

_EXPORTS = {
    "METRICS_FILE": "metrics_file",
    "MetricsFile": "metrics_file",
    "RunLogger": "mlflow_logger",
    "SystemMetrics": "system_metrics",
    "child_run_env": "mlflow_logger",
    "default_tracking_uri": "mlflow_logger",
    "flatten": "mlflow_logger",
    "git_commit": "lineage",
    "git_dirty": "lineage",
    "git_tags": "lineage",
    "lineage_tags": "lineage",
    "numeric_items": "mlflow_logger",
    "relog": "metrics_file",
    "unreachable": "probe",
}
"""Re-exported name -> the submodule that defines it (imported when the name is first read; sorted)."""

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = list(_EXPORTS)
