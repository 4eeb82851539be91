"""Config faults through a real KedroSession on a temp copy of the project: a parallel layout, a model size or a
launch size that cannot work fails in ParamsValidationHook, before any node runs, with one ConfigError naming the
key: no torchrun job (no run directory, no rank log) and no MLflow run (the project's sqlite store stays empty)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml
from projects import fresh_mlflow_db

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # a KedroSession

FAULTS = {
    "tp3-4-heads": (
        {"parallel": {"tensor_model_parallel_size": 3}, "launch": {"nproc_per_node": 3}},
        r"params:parallel\.tensor_model_parallel_size=3 does not divide params:model\.num_attention_heads=4",
    ),
    "tp2-one-process": (
        {"parallel": {"tensor_model_parallel_size": 2}},
        (
            r"params:launch\.nproc_per_node=1 x params:launch\.nnodes=1 \(world size 1\) is not divisible by "
            r"params:parallel\.tensor_model_parallel_size=2"
        ),
    ),
    "tp-negative": (
        {"parallel": {"tensor_model_parallel_size": -2}},
        r"params:parallel\.tensor_model_parallel_size=-2 must be >= 1",
    ),
    "no-layers": ({"model": {"num_layers": 0}}, r"params:model\.num_layers=0 must be >= 1"),
    "no-processes": ({"launch": {"nproc_per_node": 0}}, r"params:launch\.nproc_per_node=0 must be >= 1"),
}


@pytest.fixture
def project(tmp_path, monkeypatch):
    """conf/ and pyproject.toml of the repository (no data: nothing may be read), an empty migrated sqlite store."""
    root = tmp_path / "proj"
    (root / "src").mkdir(parents=True)  # the package itself is installed; Kedro only needs the source dir to exist
    shutil.copytree(REPO / "conf", root / "conf", ignore=shutil.ignore_patterns("local"))
    (root / "conf" / "local").mkdir()
    (root / "conf" / "test").mkdir()
    (root / "conf" / "test" / "globals.yml").write_text("data_root: data\n")  # where the checks below look
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    monkeypatch.chdir(root)
    for var in ("MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_ID"):
        monkeypatch.delenv(var, raising=False)
    fresh_mlflow_db(root / "mlflow.db")  # "no run" below is read from a real store, not a missing file
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root / 'mlflow.db'}")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "test-config-faults")
    return root


@pytest.mark.parametrize("fault", FAULTS, ids=list(FAULTS))
def test_bad_layout_fails_before_any_node(project, fault):
    from kedro.framework.session import KedroSession
    from kedro.framework.startup import bootstrap_project
    from mlflow import MlflowClient

    from align_pipeline.config import ConfigError

    params, message = FAULTS[fault]
    (project / "conf" / "test" / "parameters_fault.yml").write_text(yaml.safe_dump(params))
    bootstrap_project(project)
    with KedroSession.create(project_path=project, env="test") as session, pytest.raises(ConfigError, match=message):
        session.run(pipeline_names=["sft"])

    assert not (project / "data" / "06_models" / "_runs").exists()  # no run directory: nothing was launched
    assert not list(project.rglob("rank*.log")) and not list(project.rglob("torchrun.log"))
    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    experiments = client.search_experiments()
    assert not client.search_runs([e.experiment_id for e in experiments])  # no parent run, no child run


RANGE_FAULTS = {  # --params overrides (as `kedro run --params` passes them) -> the pipeline run and its one line
    "ppo-clip-eps": ("ppo", {"ppo": {"loss": {"clip_eps": -1}}},
                     r"^params:ppo\.loss\.clip_eps=-1\.0 must be in \(0, 1\)$"),
    "ppo-kl-beta": ("ppo", {"ppo": {"kl": {"beta": -0.05}}}, r"^params:ppo\.kl\.beta=-0\.05 must be >= 0$"),
    "reinforce-lr": ("reinforce", {"reinforce": {"optimizer": {"lr": 0}}},
                     r"^params:reinforce\.optimizer\.lr=0\.0 must be > 0$"),
    "reinforce-top-p": ("reinforce", {"reinforce": {"generation": {"top_p": 1.5}}},
                        (r"^params:reinforce\.generation: need temperature >= 0 \(got 1\.0\) and 0 < top_p <= 1 "
                         r"\(got 1\.5\)$")),
    "reinforce-k1": ("reinforce", {"reinforce": {"kl": {"estimator": "k1"}}},
                     (r"^params:reinforce\.kl\.estimator=k1: REINFORCE adds beta x KL to the loss, and k1's gradient "
                      r"is zero in expectation as a loss term; use k3 \(or k2\)$")),
    "dpo-beta": ("dpo", {"dpo": {"loss": {"beta": 0}}}, r"^params:dpo\.loss\.beta=0\.0 must be > 0$"),
    "slurm-partition-newline": ("sft", {"launch": {"backend": "slurm", "slurm": {"partition": "gpu\ntouch /tmp/x"}}},
                                (r"^params:launch\.slurm\.partition contains a newline; Slurm fields must be one "
                                 r"line$")),
}


@pytest.mark.parametrize("fault", RANGE_FAULTS, ids=list(RANGE_FAULTS))
def test_a_bad_range_fails_before_any_node_naming_the_key(project, fault):
    """Ranges that the torchrun job used to find first (PPOLossConfig / KLConfig in the losses), the k1 refusal and
    the Slurm fields: one ConfigError line in ParamsValidationHook; no run directory, no rank log, no MLflow run."""
    from kedro.framework.session import KedroSession
    from kedro.framework.startup import bootstrap_project
    from mlflow import MlflowClient

    from align_pipeline.config import ConfigError

    pipeline, params, message = RANGE_FAULTS[fault]
    bootstrap_project(project)
    with (KedroSession.create(project_path=project, env="test", runtime_params=params) as session,
          pytest.raises(ConfigError, match=message)):
        session.run(pipeline_names=[pipeline])

    assert not (project / "data" / "06_models" / "_runs").exists()
    assert not list(project.rglob("rank*.log")) and not list(project.rglob("torchrun.log"))
    assert not list(project.rglob("slurm_job.sh"))
    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    assert not client.search_runs([e.experiment_id for e in client.search_experiments()])
