"""Content-keyed stage reuse through real KedroSessions on a temp project (real Megatron jobs, a real sqlite MLflow
store): a node whose inputs, config and code equal those of a stored version hands that version on."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import yaml
from projects import copy_project, enter_project

pytestmark = pytest.mark.slow

TINY = {"training": {"train_steps": 4, "global_batch_size": 8, "micro_batch_size": 8, "log_interval": 2,
                     "eval_interval": 0, "eval_samples": 16, "save_interval": 0}}
FAST = {
    "model": {"num_layers": 1, "hidden_size": 32, "num_attention_heads": 2, "num_query_groups": 1,
              "ffn_hidden_size": 64},
    "sft": {"training": {**TINY["training"], "train_steps": 8}},
    "dpo": TINY,
    "evaluation": {"generation": {"samples_per_prompt": 1, "max_new_tokens": 8}, "greedy": False},
}


@pytest.fixture
def project(tmp_path, monkeypatch):
    root = copy_project(tmp_path / "proj", params={"test/fast": FAST})
    return enter_project(monkeypatch, root, "test-reuse")


def _run(root: Path, *pipelines: str, params: dict | None = None, log: _Lines | None = None):
    from kedro.framework.session import KedroSession
    from kedro.framework.startup import bootstrap_project

    bootstrap_project(root)
    with KedroSession.create(project_path=root, env="test", runtime_params=params) as session:
        if log is not None:  # after the session configured logging (which resets the loggers' handlers)
            for name in LOGGERS:
                logging.getLogger(name).addHandler(log)
        return session.run(pipeline_names=list(pipelines))


class _Lines(logging.Handler):
    """The records of the reuse loggers (attached to them directly: Kedro's logging config owns the parents)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


LOGGERS = ("align_pipeline.pipelines.reuse", "align_pipeline.datasets.stored", "align_pipeline.launch")


@pytest.fixture
def reuse_log():
    handler = _Lines()
    yield handler
    for name in LOGGERS:
        logging.getLogger(name).removeHandler(handler)


def _versions(root: Path, artifact: str, where: str = "06_models") -> list[Path]:
    return [v / artifact for v in sorted((root / "data" / where / artifact).iterdir())]


def _record(artifact: Path) -> dict:
    return json.loads((artifact / "reuse.json").read_text())


def _node_runs(experiment: str, node: str) -> list:
    """The node's MLflow runs, oldest first."""
    import mlflow
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=mlflow.get_tracking_uri())
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id],
                              f"tags.`kedro.node` = '{node}'")
    return sorted(runs, key=lambda r: r.info.start_time)


def test_a_second_identical_run_trains_nothing_and_reports_the_same_evaluation(project, reuse_log):
    """dpo_flow twice: the second run reuses sft_policy, dpo_policy and the evaluation (reused_from=<version> in the
    console, on the node's MLflow run and in the new version's reuse.json), with the same metrics and report; the
    weights are stored once (hard links). A DPO parameter change then retrains DPO and evaluates again but still
    reuses SFT; ``--params sft.reuse=false`` retrains SFT."""
    _run(project, "dpo_flow")
    (sft1,), (dpo1,), (report1,) = (_versions(project, "sft_policy"), _versions(project, "dpo_policy"),
                                     _versions(project, "eval_report", "08_reporting"))
    for artifact in (sft1, dpo1, report1):
        assert "reused_from" not in _record(artifact)

    reuse_log.lines.clear()
    second = _run(project, "dpo_flow", log=reuse_log)
    sft2, dpo2, report2 = (_versions(project, "sft_policy")[1], _versions(project, "dpo_policy")[1],
                           _versions(project, "eval_report", "08_reporting")[1])
    for new, old in ((sft2, sft1), (dpo2, dpo1), (report2, report1)):
        record = _record(new)
        assert record["reused_from"]["version"] == old.parent.name and record["key"] == _record(old)["key"]
        assert record["metrics"] == _record(old)["metrics"]
        assert f"reused_from={old.parent.name}" in reuse_log.text
    assert (report2 / "report.json").read_text() == (report1 / "report.json").read_text()  # the same evaluation
    promoted = second["promoted_policy"].load()
    assert promoted["path"] is None or Path(promoted["path"]).parent.name in (sft2.parent.name, dpo2.parent.name)
    shard = "__0_0.distcp"
    assert os.stat(sft2 / shard).st_ino == os.stat(sft1 / shard).st_ino  # stored once
    assert "torchrun" not in reuse_log.text  # no job launched
    for node, version in (("train_sft", sft1), ("train_dpo", dpo1), ("evaluate_policies", report1)):
        runs = _node_runs("test-reuse", node)
        assert len(runs) == 2 and "reused_from" not in runs[0].data.tags
        assert runs[1].data.tags["reused_from"] == version.parent.name
        assert runs[1].data.tags["reuse.key"] == runs[0].data.tags["reuse.key"]
    train_metrics = [r.data.metrics for r in _node_runs("test-reuse", "train_dpo")]
    assert train_metrics[1]["val_loss"] == train_metrics[0]["val_loss"]

    reuse_log.lines.clear()
    _run(project, "dpo_flow", params={"dpo": {"loss": {"beta": 0.3}}}, log=reuse_log)  # a sweep point: SFT is not retrained
    assert _record(_versions(project, "sft_policy")[2])["trained_in"]["version"] == sft1.parent.name
    dpo3 = _versions(project, "dpo_policy")[2]
    assert "reused_from" not in _record(dpo3) and _record(dpo3)["key"] != _record(dpo1)["key"]
    assert "reused_from" not in _record(_versions(project, "eval_report", "08_reporting")[2])

    _run(project, "sft", params={"sft": {"reuse": False}}, log=reuse_log)
    sft4 = _versions(project, "sft_policy")[3]
    assert "reused_from" not in _record(sft4) and _record(sft4)["key"] == _record(sft1)["key"]
    assert "sft.reuse is false: training" in reuse_log.text


def test_a_stored_version_that_fails_its_check_is_not_reused(project, reuse_log):
    """A version with the same key whose shard was truncated is skipped with a warning naming it; the stage trains."""
    _run(project, "data_prep", "sft")
    (sft1,) = _versions(project, "sft_policy")
    shard = sft1 / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-10])
    _run(project, "sft", log=reuse_log)
    sft2 = _versions(project, "sft_policy")[1]
    assert "reused_from" not in _record(sft2)
    assert (f"sft_policy version {sft1.parent.name} was made with the same inputs and config but failed its "
            "manifest check (shard __0_0.distcp has") in reuse_log.text


def test_a_changed_reward_function_source_changes_the_key(tmp_path, monkeypatch):
    """The key covers the source of a user's reward function module (not only its name)."""
    from align_pipeline.config import ReinforceConfig, from_dict
    from align_pipeline.pipelines.reuse import content_key

    (tmp_path / "my_rewards.py").write_text("def score(prompt, response, record):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    section = {"reward": {"functions": [{"name": "my_rewards:score"}]}, "generation": {"samples_per_prompt": 4}}
    cfg = from_dict(ReinforceConfig, section, "params:reinforce")
    before = content_key("reinforce", {"data": {"train": "a"}}, {"reinforce": cfg})
    assert before == content_key("reinforce", {"data": {"train": "a"}}, {"reinforce": cfg})
    (tmp_path / "my_rewards.py").write_text("def score(prompt, response, record):\n    return 0.0\n")
    assert content_key("reinforce", {"data": {"train": "a"}}, {"reinforce": cfg}) != before
    assert content_key("reinforce", {"data": {"train": "b"}}, {"reinforce": cfg}) != before
    relocated = from_dict(ReinforceConfig, {**section, "reuse": False, "runs_dir": str(tmp_path / "elsewhere")},
                          "params:reinforce")
    assert content_key("reinforce", {"data": {"train": "b"}}, {"reinforce": relocated}) == \
        content_key("reinforce", {"data": {"train": "b"}}, {"reinforce": cfg})  # fields that change no result


def test_the_stored_versions_are_catalog_entries_of_every_training_node():
    """Every node that stores a model or a report consults its output's stored versions (``<artifact>_stored``)."""
    from align_pipeline.pipeline_registry import register_pipelines

    for name, pipe in register_pipelines().items():
        for node in pipe.nodes:
            stored = sorted(i.removesuffix("_stored") for i in node.inputs if i.endswith("_stored"))
            kept = sorted(o for o in node.outputs if o.endswith(("_policy", "_critic", "reward_model", "eval_report"))
                          and o != "promoted_policy")
            assert stored == kept, (name, node.name, stored, kept)
    text = yaml.safe_load((Path(__file__).resolve().parents[2] / "conf" / "base" /
                           "catalog_models.yml").read_text())
    assert text["{artifact}_stored"]["type"] == "align_pipeline.datasets.StoredVersionsDataset"
