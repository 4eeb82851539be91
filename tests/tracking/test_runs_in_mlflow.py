"""What a user sees in MLflow after `kedro run`s, through real KedroSessions of a tiny project with the sqlite store:
run names that differ, one key per metric with no final value re-logged at step 0, lineage tags that search finds,
data inputs in MLflow's dataset API, parent runs that carry the overrides and the headline results, and
`align-pipeline compare` over them.

The project's flow is the README's: `kedro run` trains (twice, train.lr 0.1 and 0.3), then two more `kedro run
--pipelines evaluate` score each trained version (pinned with load_versions): training and evaluation are different
kedro runs, related only through lineage."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from mlflow.tracking import MlflowClient

from align_pipeline.tracking import default_tracking_uri

pytestmark = pytest.mark.slow

PIPELINE = """
import json, tempfile
from pathlib import Path

from kedro.pipeline import Pipeline, node
from mlflow.tracking import MlflowClient

from align_pipeline.data.formats import Artifact
from align_pipeline.tracking import child_run_env


def prepare(train):
    return Artifact(path="/data/train.npz", fingerprint="fp-" + str(train["data_seed"]))


def fit(data, train):
    # what a training job does: log its history into the node's child run (steps 1..4, the final value included)
    env = child_run_env()
    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    for step in range(1, 5):
        client.log_metric(env["MLFLOW_RUN_ID"], "val_loss", 1.0 / step + train["lr"], step=step)
    ckpt = Path(tempfile.mkdtemp()) / "policy"
    ckpt.mkdir()
    (ckpt / "meta.json").write_text(json.dumps({"stage": "fit", "lr": train["lr"]}))
    final = {"val_loss": 0.25 + train["lr"], "val_accuracy": 0.5, "first_train_loss": 2.0, "steps": 4}
    return str(ckpt), final


def evaluate(policy, train):
    lr = json.loads((Path(policy) / "meta.json").read_text())["lr"]
    return {"policy/accuracy": 0.5 + lr, "policy/kl_to_reference": 2 * lr}


def register_pipelines():
    train = Pipeline([
        node(prepare, "params:train", "train_data", name="prepare"),
        node(fit, ["train_data", "params:train"], ["policy", "fit_metrics"], name="fit"),
    ])
    evaluation = Pipeline([node(evaluate, ["policy", "params:train"], "evaluation_metrics", name="evaluate_policies")])
    return {"__default__": train, "evaluate": evaluation}
"""

CATALOG = """
policy:
  type: align_pipeline.datasets.CheckpointDataset
  filepath: data/06_models/policy
  versioned: true
"""

RUNS = """
import sys
from pathlib import Path
from kedro.framework.session import KedroSession
from kedro.framework.startup import bootstrap_project

project = Path(sys.argv[1])
bootstrap_project(project)
for lr in (0.1, 0.3):
    with KedroSession.create(project_path=project, runtime_params={"train": {"lr": lr, "data_seed": 7}}) as session:
        session.run()
for version in sorted(p.name for p in (project / "data" / "06_models" / "policy").iterdir()):
    with KedroSession.create(project_path=project) as session:
        session.run(pipeline_names=["evaluate"], load_versions={"policy": version})
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two training `kedro run --params train.lr=...,train.data_seed=7` of a project with a versioned checkpoint entry, then one
    evaluation run per version -> (client, parents oldest first, {parent run id: {node: child run}}, versions,
    project)."""
    project = tmp_path_factory.mktemp("runs_project")
    package = "runstoy_" + project.name.replace("-", "_")
    src = project / "src" / package
    src.mkdir(parents=True)
    (project / "pyproject.toml").write_text(textwrap.dedent(f"""
        [tool.kedro]
        package_name = "{package}"
        project_name = "runstoy"
        kedro_init_version = "1.7.0"
        source_dir = "src"
    """))
    for env in ("base", "local"):
        (project / "conf" / env).mkdir(parents=True)
    (project / "conf" / "base" / "parameters.yml").write_text("train:\n  lr: 0.1\n  data_seed: 7\n")
    (project / "conf" / "base" / "catalog.yml").write_text(CATALOG)
    (src / "__init__.py").write_text("")
    (src / "settings.py").write_text("from align_pipeline.kedro.mlflow_hook import MlflowHook\nHOOKS = (MlflowHook(),)\n")
    (src / "pipeline_registry.py").write_text(PIPELINE)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env["KEDRO_DISABLE_TELEMETRY"] = "true"
    proc = subprocess.run([sys.executable, "-c", RUNS, str(project)], cwd=project, env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    client = MlflowClient(default_tracking_uri(project))
    found = client.search_runs([client.get_experiment_by_name("align-pipeline").experiment_id])
    parents = sorted((r for r in found if "mlflow.parentRunId" not in r.data.tags), key=lambda r: r.info.start_time)
    children = {p.info.run_id: {r.data.tags["kedro.node"]: r for r in found
                                if r.data.tags.get("mlflow.parentRunId") == p.info.run_id} for p in parents}
    versions = sorted(d.name for d in (project / "data" / "06_models" / "policy").iterdir())
    return client, parents, children, versions, project


def test_no_final_value_at_step_0_and_one_key_per_metric(runs):
    client, parents, children, *_ = runs
    fit = children[parents[0].info.run_id]["fit"]
    history = client.get_metric_history(fit.info.run_id, "val_loss")
    assert [m.step for m in history] == [1, 2, 3, 4]  # the job's series only: the node's final value not re-logged
    assert history[-1].value == pytest.approx(0.25 + 0.1)
    # keys the job did not log come from the node's output, at its last step
    assert [(m.step, m.value) for m in client.get_metric_history(fit.info.run_id, "val_accuracy")] == [(4, 0.5)]
    # how far it went is a tag; a copy of a point of the job's loss series is no metric of its own
    assert set(fit.data.metrics) == {"val_loss", "val_accuracy"} and fit.data.tags["align.steps"] == "4"


def test_run_names_tell_runs_apart(runs):
    _, parents, children, versions, _ = runs
    names = [p.info.run_name for p in parents[:2]]
    assert names == [f"kedro:__default__ train.data_seed=7 train.lr={lr} @{v}" for lr, v in zip((0.1, 0.3), versions)]
    fits = [children[p.info.run_id]["fit"].info.run_name for p in parents[:2]]
    assert fits == [f"fit train.data_seed=7 train.lr={lr} @{v}" for lr, v in zip((0.1, 0.3), versions)]


def test_parent_runs_carry_overrides_env_and_headline_results(runs):
    _, parents, *_ = runs
    for parent, lr in zip(parents, (0.1, 0.3)):
        assert parent.data.params["train.lr"] == str(lr)
        assert parent.data.params["kedro.env"] == "local"
        assert parent.data.metrics["fit/val_loss"] == pytest.approx(0.25 + lr)
    for parent, lr in zip(parents[2:], (0.1, 0.3)):  # the evaluation runs: headline results on the parent
        assert parent.data.metrics["evaluation/policy/accuracy"] == pytest.approx(0.5 + lr)


def test_lineage_tags_are_searchable_and_data_is_an_mlflow_dataset(runs):
    client, parents, children, versions, _ = runs
    experiment = parents[0].info.experiment_id
    for parent, evaluation, version in zip(parents[:2], parents[2:], versions):
        runs_of = children[parent.info.run_id]
        assert runs_of["fit"].data.tags["lineage.out.policy"] == version
        assert parent.data.tags["lineage.out.policy"] == version
        scored = children[evaluation.info.run_id]["evaluate_policies"]
        assert scored.data.tags["lineage.policy"] == version  # which checkpoint version it scored
        assert runs_of["fit"].data.tags["lineage.data.train_data"] == "fp-7"
        found = client.search_runs([experiment], filter_string=f"tags.`lineage.policy` = '{version}'")
        assert [r.info.run_id for r in found] == [scored.info.run_id]
        (dataset,) = runs_of["fit"].inputs.dataset_inputs
        assert (dataset.dataset.name, dataset.dataset.digest) == ("train_data", "fp-7")
    hashes = {children[p.info.run_id]["fit"].data.tags["lineage.config_hash"] for p in parents[:2]}
    assert len(hashes) == 2  # lr differs


def test_compare_resolves_versions_through_lineage_and_writes_the_report(runs, tmp_path):
    from align_pipeline.tracking.compare import resolve, write_report

    client, parents, _, versions, _ = runs
    experiments = resolve(client, [parents[0].info.experiment_id], [versions[0], f"policy:{versions[1]}"])
    assert [e.run_id for e in experiments] == [p.info.run_id for p in parents[:2]]
    assert [e.label for e in experiments] == ["train.lr=0.1", "train.lr=0.3"]  # the params that differ
    # the evaluations ran in other kedro runs: linked through lineage.policy
    assert [e.linked["evaluate_policies"].data.tags["lineage.policy"] for e in experiments] == versions
    summary = write_report(client, experiments, tmp_path / "report")
    assert summary["params_diff"]["train.lr"] == ["0.1", "0.3"]
    assert summary["shared_overrides"] == {"train.data_seed": 7}  # both runs were given it: held fixed
    assert "`--params train.data_seed=7`: set on every run's command line" in (tmp_path / "report" / "report.md").read_text()
    assert summary["evaluation"]["policy/accuracy"] == pytest.approx([0.6, 0.8])
    assert "fit lineage.config_hash" in summary["lineage_diff"]
    text = (tmp_path / "report" / "report.md").read_text()
    assert "| policy/accuracy ↑ | 0.6 | 0.8 | +0.2 | no noise estimate |" in text  # no sample count logged
    assert "| train.lr | 0.1 | 0.3 |" in text
    assert summary["curves"]["fit"]["val_loss"] == "fit__val_loss.png"
    assert (tmp_path / "report" / "fit__val_loss.png").stat().st_size > 1000
    assert "![fit val_loss](fit__val_loss.png)" in text


def test_last_n_means_the_last_n_experiments_with_the_evaluations_that_scored_them(runs):
    """The README's flow: train at one setting, train at another, evaluate: `compare --last 2` is the two trainings
    (the evaluation-only kedro runs, the most recent here, are linked to them, not counted)."""
    from align_pipeline.tracking.compare import resolve

    client, parents, _, versions, _ = runs
    experiments = resolve(client, [parents[0].info.experiment_id], last=2)
    assert [e.run_id for e in experiments] == [p.info.run_id for p in parents[:2]]
    assert [e.label for e in experiments] == ["train.lr=0.1", "train.lr=0.3"]
    assert [e.linked["evaluate_policies"].data.tags["lineage.policy"] for e in experiments] == versions
    assert [e.run_id for e in resolve(client, [parents[0].info.experiment_id], last=1)] == [parents[1].info.run_id]


def test_compare_command_by_filter_and_version_logs_the_report(runs, tmp_path):
    client, _, _, versions, project = runs
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    cmd = [sys.executable, "-m", "align_pipeline", "compare", "--json", versions[0], "--filter", "params.`train.lr` = '0.3'",
           "--out", str(tmp_path / "cmp")]
    proc = subprocess.run(cmd, cwd=project, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["compared"] == ["train.lr=0.1", "train.lr=0.3"]
    run = client.get_run(out["mlflow_run_id"])
    assert run.data.tags["align.compare"] == "true" and run.info.run_name == "compare train.lr=0.1 vs train.lr=0.3"
    assert {"comparison/report.md", "comparison/fit__val_loss.png"} <= {
        a.path for a in client.list_artifacts(run.info.run_id, "comparison")}
    # a reference that matches nothing: one message, exit 2
    bad = subprocess.run([sys.executable, "-m", "align_pipeline", "compare", "no-such-version"], cwd=project, env=env,
                         capture_output=True, text=True, timeout=120, check=False)
    assert bad.returncode == 2 and "no kedro run, MLflow run or catalog version matches 'no-such-version'" in bad.stderr
    elsewhere = subprocess.run([sys.executable, "-m", "align_pipeline", "compare", "--last", "2"], cwd=tmp_path,
                               env=env, capture_output=True, text=True, timeout=120, check=False)
    assert elsewhere.returncode == 2 and "no MLflow store at" in elsewhere.stderr
    assert not (tmp_path / "mlflow.db").exists()  # not created by looking
