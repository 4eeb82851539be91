"""MlflowHook: one parent run per kedro run, one child per node, against a real sqlite store in tmp_path; a child ends
only once its node's outputs are stored, and so does the deferred clean-up of its run directory.

The hook methods are driven directly (fast), in the order Kedro 1.7 calls them, and once through a real KedroSession
on a tiny temporary project.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import mlflow
import pytest
from kedro.pipeline import Pipeline, node
from mlflow.tracking import MlflowClient
from projects import fresh_mlflow_db

from align_pipeline.kedro.jobs_hook import JobsHook
from align_pipeline.kedro.mlflow_hook import MlflowHook
from align_pipeline.kedro.run_dirs import RUN_DIR_CLEANUP
from align_pipeline.tracking import child_run_env, default_tracking_uri

pytestmark = pytest.mark.slow  # launches torchrun jobs or a KedroSession

MLFLOW_VARS = ("MLFLOW_RUN_ID", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID")


@pytest.fixture
def project(tmp_path, tmp_path_factory, monkeypatch):
    """A project dir with an empty store at the hook's default location; MLflow's globals restored afterwards."""
    for var in MLFLOW_VARS:
        monkeypatch.delenv(var, raising=False)
    fresh_mlflow_db(tmp_path / "mlflow.db")
    yield tmp_path
    while mlflow.active_run():
        mlflow.end_run()
    mlflow.set_tracking_uri(None)
    mlflow.tracking.fluent._active_experiment_id = None


def prepare(train):
    return [1, 2, 3]


def train(data, train):
    return {"loss": 0.5, "accuracy": 0.75, "per_task": {"add": 1.0}, "note": "not a number"}, "ckpt/path"


def evaluate(model):
    raise ValueError("evaluation exploded")


PIPELINE = Pipeline(
    [
        node(prepare, "params:train", "data", name="prepare"),
        node(train, ["data", "params:train"], ["train_metrics", "model"], name="train"),
    ]
)


def _runs(project):
    client = MlflowClient(default_tracking_uri(project))
    experiment = client.get_experiment_by_name("align-pipeline")
    runs = client.search_runs([experiment.experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = {r.data.tags["kedro.node"]: r for r in runs if "mlflow.parentRunId" in r.data.tags}
    return client, parents, children


def _save_outputs(hook, n, outputs, fail_on=None):
    """What a Kedro task does after ``after_node_run``: save each output, then ``after_dataset_saved``; a save of
    ``fail_on`` raises (no more hooks for the node)."""
    for name in outputs:
        if name == fail_on:
            raise OSError(f"[Errno 1] Operation not permitted: {name!r}")
        hook.after_dataset_saved(dataset_name=name, data=outputs[name], node=n)


def _drive(hook, project, pipeline, fail_node=None, session_id="2026-01-01T00.00.00.000Z", fail_save=None):
    """What a SequentialRunner does with the hooks; ``fail_node`` raises instead of finishing; saving the output
    ``fail_save`` fails."""
    hook.after_context_created(context=SimpleNamespace(project_path=project, env="local"))
    run_params = {
        "run_id": session_id,
        "project_path": str(project),
        "env": "local",
        "kedro_version": "1.7.0",
        "pipeline_names": None,
        "runner": "SequentialRunner",
        "runtime_params": {"train": {"lr": 0.5}},
    }
    hook.before_pipeline_run(run_params=run_params, pipeline=pipeline, catalog=None)
    seen_env = {}
    for n in pipeline.nodes:
        inputs = {"params:train": {"lr": 0.1, "optim": {"beta": 0.9}}} if "params:train" in n.inputs else {}
        hook.before_node_run(node=n, inputs=inputs)
        seen_env[n.name] = child_run_env()  # what run_torchrun would hand to the job
        if n.name == fail_node:
            error = ValueError(f"{n.name} exploded")
            hook.on_node_error(error=error, node=n)
            hook.on_pipeline_error(error=error)
            return seen_env
        outputs = dict(zip(n.outputs, train(None, None))) if n.name == "train" else {"data": [1, 2, 3]}
        hook.after_node_run(node=n, outputs=outputs)
        try:
            _save_outputs(hook, n, outputs, fail_on=fail_save)
        except OSError as error:
            hook.on_pipeline_error(error=error)
            return seen_env
    hook.after_pipeline_run()
    return seen_env


def test_one_parent_one_child_per_node_with_metrics(project, monkeypatch):
    seen_env = _drive(MlflowHook(), project, PIPELINE)
    assert os.environ["MLFLOW_TRACKING_URI"] == default_tracking_uri(project)  # exported for torchrun jobs

    _, parents, children = _runs(project)
    assert len(parents) == 1
    parent = parents[0]
    assert parent.info.status == "FINISHED"
    tags = parent.data.tags
    assert tags["kedro.pipeline"] == "__default__"
    assert tags["kedro.run_id"] == "2026-01-01T00.00.00.000Z"
    assert tags["kedro.env"] == "local"
    assert tags["kedro.version"] == "1.7.0"
    assert tags["kedro.nodes"] == "prepare,train"
    assert parent.data.params["train.lr"] == "0.5"  # the --params override, under the name a user types
    # every resolved value of the sections the nodes read, too (a key logged once: MLflow params are immutable)
    assert parent.data.params["train.optim.beta"] == "0.9"
    assert parent.info.run_name == "kedro:__default__ train.lr=0.5 @2026-01-01T00.00.00.000Z"
    assert parent.data.metrics == {"train/loss": 0.5, "train/accuracy": 0.75, "train/per_task.add": 1.0}

    assert set(children) == {"prepare", "train"}
    for name, child in children.items():
        assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert child.data.tags["kedro.run_id"] == "2026-01-01T00.00.00.000Z"
        # the overrides of the node's own params (both read params:train), the version of the run
        assert child.info.run_name == f"{name} train.lr=0.5 @2026-01-01T00.00.00.000Z"
        assert child.data.tags["lineage.config_hash"]
        assert child.info.status == "FINISHED"
        # the launcher inside this node would have attached the torchrun job to this child run
        assert seen_env[name] == {
            "MLFLOW_TRACKING_URI": default_tracking_uri(project),
            "MLFLOW_RUN_ID": child.info.run_id,
        }
    trained = children["train"]
    assert trained.data.metrics == {"loss": 0.5, "accuracy": 0.75, "per_task.add": 1.0}
    assert trained.data.tags["kedro.node.outputs"] == "model,train_metrics"
    assert trained.data.params["train.lr"] == "0.1" and trained.data.params["train.optim.beta"] == "0.9"
    assert children["prepare"].data.metrics == {}
    assert mlflow.active_run() is None


def test_failing_node_fails_child_and_parent(project):
    failing = PIPELINE + Pipeline([node(evaluate, "model", "eval_metrics", name="evaluate")])
    _drive(MlflowHook(), project, failing, fail_node="evaluate")
    _, parents, children = _runs(project)
    assert len(parents) == 1
    assert parents[0].info.status == "FAILED"
    assert parents[0].data.tags["kedro.failed_node"] == "evaluate"
    assert children["evaluate"].info.status == "FAILED"
    assert "evaluate exploded" in children["evaluate"].data.tags["kedro.error"]
    assert children["train"].info.status == "FINISHED"
    assert mlflow.active_run() is None


def test_failing_save_fails_child_and_parent_after_logging_metrics(project):
    """Kedro saves a node's outputs after ``after_node_run`` and calls no ``on_node_error`` when a save fails: the
    child stays open until its outputs are stored, so it ends FAILED (with the error) instead of FINISHED."""
    _drive(MlflowHook(), project, PIPELINE, fail_save="model")
    _, parents, children = _runs(project)
    assert parents[0].info.status == "FAILED"
    assert parents[0].data.tags["kedro.failed_node"] == "train"
    assert "Operation not permitted" in parents[0].data.tags["kedro.error"]
    assert children["prepare"].info.status == "FINISHED"
    trained = children["train"]
    assert trained.info.status == "FAILED"
    assert "OSError" in trained.data.tags["kedro.error"] and "'model'" in trained.data.tags["kedro.error"]
    assert trained.data.metrics == {"loss": 0.5, "accuracy": 0.75, "per_task.add": 1.0}  # logged all the same
    assert mlflow.active_run() is None


def test_child_finishes_only_when_its_last_output_is_stored(project):
    hook = MlflowHook()
    hook.after_context_created(context=SimpleNamespace(project_path=project, env="local"))
    hook.before_pipeline_run(run_params={"run_id": "s"}, pipeline=PIPELINE, catalog=None)
    n = PIPELINE.nodes[1]  # train -> train_metrics, model
    hook.before_node_run(node=n, inputs={})
    outputs = dict(zip(n.outputs, train(None, None)))
    hook.after_node_run(node=n, outputs=outputs)
    client, _, children = _runs(project)
    assert children["train"].info.status == "RUNNING"
    hook.after_dataset_saved(dataset_name="train_metrics", data=outputs["train_metrics"], node=n)
    assert client.get_run(children["train"].info.run_id).info.status == "RUNNING"
    hook.after_dataset_saved(dataset_name="model", data=outputs["model"], node=n)
    assert client.get_run(children["train"].info.run_id).info.status == "FINISHED"
    hook.after_pipeline_run()


def _train_node_deferring(run_dir: Path):
    """A node that, like ``launch_stage``, hands its run dir to the deferred clean-up."""

    def fit(data):
        run_dir.mkdir(parents=True, exist_ok=True)
        deferred = RUN_DIR_CLEANUP.defer(run_dir)
        if not deferred:
            shutil.rmtree(run_dir)
        return "ckpt", {"loss": 1.0}

    return node(fit, "data", ["model", "fit_metrics"], name="fit")


def test_run_dir_is_deleted_after_the_outputs_are_stored_and_kept_when_a_save_fails(tmp_path):
    """JobsHook alone (the clean-up does not depend on MLflow)."""
    run_dir = tmp_path / "runs" / "fit"
    n = _train_node_deferring(run_dir)
    for fail in (None, "model"):
        hook = JobsHook()
        hook.before_pipeline_run(run_params={"run_id": str(fail)}, pipeline=Pipeline([n]), catalog=None)
        hook.before_node_run(node=n, inputs={"data": 1})
        outputs = dict(zip(n.outputs, n.func(1)))
        hook.after_node_run(node=n, outputs=outputs)
        assert run_dir.is_dir()  # still there while the outputs are not stored
        try:
            _save_outputs(hook, n, outputs, fail_on=fail)
        except OSError as error:
            hook.on_pipeline_error(error=error)
            assert run_dir.is_dir()  # kept: a rerun resumes from it
        else:
            hook.after_pipeline_run()
            assert not run_dir.exists()
    assert RUN_DIR_CLEANUP.keep() == []  # nothing left registered
    n.func(1)  # called outside a session (no hook opened the node): deleted at once, as before
    assert not run_dir.exists()


def test_node_error_keeps_the_run_dir(tmp_path):
    run_dir = tmp_path / "runs" / "fit"
    n = _train_node_deferring(run_dir)
    hook = JobsHook()
    hook.before_pipeline_run(run_params={"run_id": "x"}, pipeline=Pipeline([n]), catalog=None)
    hook.before_node_run(node=n, inputs={"data": 1})
    n.func(1)
    error = RuntimeError("failed after registering")
    hook.on_node_error(error=error, node=n)
    hook.on_pipeline_error(error=error)
    assert run_dir.is_dir() and RUN_DIR_CLEANUP.keep() == []


def closed_port() -> int:
    """A localhost port nothing listens on (bound, then closed)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_store_turns_tracking_off_with_one_warning(project, monkeypatch, caplog):
    uri = f"http://127.0.0.1:{closed_port()}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    seen_env = _drive(MlflowHook(), project, PIPELINE)  # no MLflow retries: seconds, not minutes
    warnings = [r.getMessage() for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(warnings) == 1
    assert warnings[0].startswith(f"MLflow at {uri} is unreachable")
    assert "tracking off for this run" in warnings[0] and "metrics.jsonl" in warnings[0]
    assert "align-pipeline mlflow-log" in warnings[0]
    assert seen_env == {"prepare": {}, "train": {}}  # the jobs get no run id: they do not try either
    assert "MLflow tracking failed" not in caplog.text


@pytest.mark.timeout(90)  # MLflow's own retries would take ~4 minutes per call
def test_store_that_goes_away_during_the_run_turns_tracking_off_once(project, monkeypatch, caplog):
    hook = MlflowHook()
    hook.after_context_created(context=SimpleNamespace(project_path=project, env="local"))
    hook.before_pipeline_run(run_params={"run_id": "s"}, pipeline=PIPELINE, catalog=None)
    n = PIPELINE.nodes[1]
    hook.before_node_run(node=n, inputs={})
    down = f"http://127.0.0.1:{closed_port()}"
    monkeypatch.setattr(hook.store, "uri", down)  # the server goes away (MLflow's retries left at defaults)
    outputs = dict(zip(n.outputs, train(None, None)))
    hook.after_node_run(node=n, outputs=outputs)  # bounded, probes: tracking off
    _save_outputs(hook, n, outputs)
    hook.after_pipeline_run()
    hook._at_exit()
    assert [r.getMessage()[:40] for r in caplog.records if r.levelno >= 30] == [f"MLflow at {down} is unreachable"[:40]]
    assert not hook._enabled and hook._node_runs == {} and hook._parent_run_id is None


def test_sqlite_store_is_never_probed_over_the_network(project, monkeypatch):
    from align_pipeline.tracking import probe

    def no_network(*args, **kwargs):
        raise AssertionError("a local store must not be probed")

    monkeypatch.setattr(probe, "_http_unreachable", no_network)
    monkeypatch.setattr(probe.socket, "create_connection", no_network)
    _drive(MlflowHook(), project, PIPELINE)
    _, parents, _ = _runs(project)
    assert [p.info.status for p in parents] == ["FINISHED"]


def test_runs_left_open_by_an_interrupted_run_are_closed(project):
    hook = MlflowHook()
    hook.after_context_created(context=SimpleNamespace(project_path=project, env="local"))
    hook.before_pipeline_run(run_params={"run_id": "first"}, pipeline=PIPELINE, catalog=None)
    hook.before_node_run(node=PIPELINE.nodes[0], inputs={})  # ... and then Ctrl-C: no more hooks
    _drive(MlflowHook(), project, PIPELINE, session_id="second")  # a new hook in the same process

    _, parents, _ = _runs(project)
    status = {p.data.tags["kedro.run_id"]: p.info.status for p in parents}
    assert status == {"first": "KILLED", "second": "FINISHED"}  # not nested under the stale run
    hook._at_exit()  # nothing left to end: no error


def test_store_and_experiment_from_environment(project, tmp_path_factory, monkeypatch):
    other = project / "elsewhere" / "mlflow.db"
    fresh_mlflow_db(other)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", default_tracking_uri(other.parent))
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "custom")
    _drive(MlflowHook(), project, PIPELINE)
    client = MlflowClient(default_tracking_uri(other.parent))
    experiment = client.get_experiment_by_name("custom")
    assert len(client.search_runs([experiment.experiment_id])) == 3
    # a training experiment in MLflow's UI, not a GenAI app's; a kind the user picks there is kept
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    client.set_experiment_tag(experiment.experiment_id, "mlflow.experimentKind", "finetuning")
    _drive(MlflowHook(), project, PIPELINE)
    assert client.get_experiment_by_name("custom").tags["mlflow.experimentKind"] == "finetuning"


def test_broken_store_never_fails_the_run(project, monkeypatch, caplog):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:////dev/null/not-a-dir/mlflow.db")
    _drive(MlflowHook(), project, PIPELINE)  # warnings only
    assert "MLflow tracking failed" in caplog.text


SESSION_SCRIPT = """
import sys
from pathlib import Path
from kedro.framework.session import KedroSession
from kedro.framework.startup import bootstrap_project

project = Path(sys.argv[1])
bootstrap_project(project)
with KedroSession.create(project_path=project) as session:
    session.run()
with KedroSession.create(project_path=project, runtime_params={"train": {"fail": True}}) as session:
    try:
        session.run()
    except ValueError as exc:
        print("second run failed as asked:", exc)
    else:
        sys.exit("the second run should have failed")
"""


def test_real_kedro_session(project, tmp_path):
    """Two `kedro run`s of a tiny project whose settings register MlflowHook: one succeeds, one fails in a node."""
    package = "hooktoy_" + tmp_path.name.replace("-", "_")
    src = project / "src" / package
    src.mkdir(parents=True)
    (project / "pyproject.toml").write_text(
        textwrap.dedent(f"""
        [tool.kedro]
        package_name = "{package}"
        project_name = "hooktoy"
        kedro_init_version = "1.7.0"
        source_dir = "src"
    """)
    )
    (project / "conf" / "base").mkdir(parents=True)
    (project / "conf" / "local").mkdir()
    (project / "conf" / "base" / "parameters.yml").write_text("train:\n  lr: 0.1\n  fail: false\n")
    (project / "conf" / "base" / "catalog.yml").write_text("{}\n")  # everything in memory
    (src / "__init__.py").write_text("")
    (src / "settings.py").write_text("from align_pipeline.kedro.mlflow_hook import MlflowHook\nHOOKS = (MlflowHook(),)\n")
    (src / "pipeline_registry.py").write_text(
        textwrap.dedent("""
        from kedro.pipeline import Pipeline, node

        def prepare(train):
            return [1, 2, 3]

        def fit(data, train):
            if train["fail"]:
                raise ValueError("fit failed on purpose")
            return {"loss": 0.25, "n": len(data)}

        def register_pipelines():
            return {"__default__": Pipeline([
                node(prepare, "params:train", "data", name="prepare"),
                node(fit, ["data", "params:train"], "fit_metrics", name="fit"),
            ])}
    """)
    )
    env = {k: v for k, v in os.environ.items() if k not in MLFLOW_VARS}
    env["KEDRO_DISABLE_TELEMETRY"] = "true"
    proc = subprocess.run(
        [sys.executable, "-c", SESSION_SCRIPT, str(project)],
        cwd=project, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "second run failed as asked" in proc.stdout

    client = MlflowClient(default_tracking_uri(project))
    runs = client.search_runs([client.get_experiment_by_name("align-pipeline").experiment_id])
    parents = sorted((r for r in runs if "mlflow.parentRunId" not in r.data.tags), key=lambda r: r.info.start_time)
    assert [p.info.status for p in parents] == ["FINISHED", "FAILED"]
    for parent in parents:
        children = {r.data.tags["kedro.node"]: r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id}
        assert set(children) == {"prepare", "fit"}
        assert parent.data.tags["kedro.pipeline"] == "__default__"
        assert parent.data.tags["kedro.run_id"]
        assert parent.data.tags["kedro.env"] == "local"  # the default run env
        assert parent.data.tags["kedro.runner"] == "SequentialRunner"
    ok_children = {r.data.tags["kedro.node"]: r for r in runs if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id}
    assert ok_children["fit"].info.status == "FINISHED"
    assert ok_children["fit"].data.metrics == {"loss": 0.25, "n": 3.0}
    assert ok_children["fit"].data.params["train.lr"] == "0.1"
    bad_children = {r.data.tags["kedro.node"]: r for r in runs if r.data.tags.get("mlflow.parentRunId") == parents[1].info.run_id}
    assert bad_children["fit"].info.status == "FAILED"
    assert bad_children["prepare"].info.status == "FINISHED"


def test_a_failed_gate_is_tagged_on_the_node_and_the_parent(project):
    from align_pipeline.evaluation.gates import GateFailed

    hook = MlflowHook()
    hook.after_context_created(context=SimpleNamespace(project_path=project, env="local"))
    ppo = node(evaluate, "model", "ppo_metrics", name="train_ppo")
    hook.before_pipeline_run(run_params={"run_id": "s"}, pipeline=Pipeline([ppo]), catalog=None)
    hook.before_node_run(node=ppo, inputs={})
    error = GateFailed("ppo.gate.min_reward_model_accuracy", 0.7, 0.645, "the held-out accuracy of reward model v1")
    hook.on_node_error(error=error, node=ppo)
    hook.on_pipeline_error(error=error)
    _, (parent,), children = _runs(project)
    for run in (parent, children["train_ppo"]):
        assert run.info.status == "FAILED"
        assert run.data.tags["gate.failed"] == "ppo.gate.min_reward_model_accuracy"
        assert run.data.tags["gate.ppo.gate.min_reward_model_accuracy"] == "fail: 0.645 vs threshold 0.7"
    assert "gate ppo.gate.min_reward_model_accuracy failed" in children["train_ppo"].data.tags["kedro.error"]


OWNER_SCRIPT = """
import os, signal, sys
from pathlib import Path
from types import SimpleNamespace
from kedro.pipeline import Pipeline, node
from align_pipeline.kedro.mlflow_hook import MlflowHook

project, session, end = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
work = node(len, "data", "n", name="work")
hook = MlflowHook()
hook.after_context_created(context=SimpleNamespace(project_path=project, env="local"))
hook.before_pipeline_run(run_params={"run_id": session}, pipeline=Pipeline([work]), catalog=None)
hook.before_node_run(node=work, inputs={})
print("started", flush=True)
if end == "sigkill":
    os.kill(os.getpid(), signal.SIGKILL)
sys.stdin.read()  # alive until the test lets go
"""


def test_next_run_marks_the_runs_of_an_ended_process_killed(project, monkeypatch):
    """A kedro run SIGKILLed (a real second process) leaves its parent and node runs RUNNING; the next kedro run of
    the project marks them KILLED. Runs of a process still alive, and of another project, are left alone."""
    store = default_tracking_uri(project)
    env = {**{k: v for k, v in os.environ.items() if k not in MLFLOW_VARS}, "MLFLOW_TRACKING_URI": store}
    other = project / "other"
    other.mkdir()

    def owner(root: Path, session: str, end: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", OWNER_SCRIPT, str(root), session, end], env=env,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    owners = {"killed": owner(project, "killed", "sigkill"), "alive": owner(project, "alive", "wait"),
              "other project": owner(other, "other project", "sigkill")}  # fmt: skip
    try:
        for name, proc in owners.items():
            assert proc.stdout.readline().strip() == "started", name + ": " + proc.stdout.read()
        for name in ("killed", "other project"):
            assert owners[name].wait(timeout=60) == -9
        client = MlflowClient(store)
        experiment = client.get_experiment_by_name("align-pipeline").experiment_id
        assert {r.info.status for r in client.search_runs([experiment])} == {"RUNNING"}

        _drive(MlflowHook(), project, PIPELINE, session_id="next")  # the next kedro run of the project
        status: dict[str, list[str]] = {}
        for run in client.search_runs([experiment]):
            session = run.data.tags["kedro.run_id"]
            status.setdefault(session, []).append(run.info.status)
            if session == "killed":
                assert "which has ended" in run.data.tags["align.closed_by"]
                assert "kedro run next" in run.data.tags["align.closed_by"]
        assert status == {"killed": ["KILLED"] * 2, "alive": ["RUNNING"] * 2, "other project": ["RUNNING"] * 2,
                          "next": ["FINISHED"] * 3}  # fmt: skip
    finally:
        for proc in owners.values():
            proc.kill()
            proc.communicate()
