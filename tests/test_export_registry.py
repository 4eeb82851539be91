"""MLflow's model registry takes an HF export only when its recorded check passed, or was skipped by the user
(``export.check: false``, tagged ``export.check=skipped``); a failed or unrecorded check registers nothing."""

from __future__ import annotations

import json

from align_pipeline.kedro.model_registry import register
from align_pipeline.kedro.tracking_store import TrackingStore
from align_pipeline.model.export_check import CHECK_FILE


def test_only_checked_or_opted_out_exports_are_registered(tmp_path):
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    run = client.create_run(client.create_experiment("e"), tags={"lineage.sft_policy": "v1"}).info.run_id
    store = TrackingStore()
    store.uri = uri
    for status in ("passed", "skipped", "failed", None):
        export = tmp_path / f"export_{status}"
        export.mkdir()
        if status is not None:
            (export / CHECK_FILE).write_text(json.dumps({"status": status, "checks": []}))
        register(store, "sft_policy_hf", f"version_{status}", str(export), run)
    registered = {v.tags["lineage.out.sft_policy_hf"]: v.tags for v in
                  client.search_model_versions("name = 'sft_policy_hf'")}
    assert sorted(registered) == ["version_passed", "version_skipped"]
    assert registered["version_passed"]["export.check"] == "passed"
    assert registered["version_skipped"]["export.check"] == "skipped"
    assert registered["version_passed"]["lineage.sft_policy"] == "v1"
