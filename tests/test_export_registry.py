"""MLflow's model registry: an HF export whose recorded check passed (or was skipped by the user, tagged
``export.check=skipped``) is logged as a real MLflow ``transformers`` model and registered; MLflow serves it back by
``models:/`` URI (``mlflow.transformers`` and ``mlflow.pyfunc`` load it, with the same logits as the directory); the
promoted policy's version gets the ``champion`` alias (one in the registry) and every evaluated version its gate
results as tags."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from chat_tokenizers import make_chat_tokenizer_dir

from align_pipeline.kedro.model_registry import CHAMPION, promote, register
from align_pipeline.kedro.tracking_store import TrackingStore
from align_pipeline.model.export_check import CHECK_FILE


@pytest.fixture(scope="module")
def hf_export(tmp_path_factory) -> Path:
    """A tiny Llama export with its tokenizer (chat template included) and our records, as the export job writes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = make_chat_tokenizer_dir(tmp_path_factory.mktemp("export") / "dpo_policy_hf", "chatml")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=400, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    LlamaForCausalLM(config).save_pretrained(str(path))
    (path / "align_pipeline_meta.json").write_text(json.dumps({"stage": "dpo"}))
    (path / "align_tokenizer").mkdir()
    (path / "align_tokenizer" / "tokenizer.json").write_text("{}")
    return path


def _copy(src: Path, dst: Path, status: str | None) -> Path:
    shutil.copytree(src, dst)
    if status is not None:
        (dst / CHECK_FILE).write_text(json.dumps({"status": status, "checks": []}))
    return dst


@pytest.fixture
def store(tmp_path):
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    experiment = client.create_experiment("e", artifact_location=(tmp_path / "mlruns").as_uri())
    store = TrackingStore()
    store.uri = uri
    store.experiment = experiment
    return store


def _export_run(store: TrackingStore, **lineage: str) -> str:
    return store.client().create_run(store.experiment, tags={f"lineage.{k}": v for k, v in lineage.items()}).info.run_id


def test_only_checked_or_opted_out_exports_are_registered(tmp_path, store, hf_export):
    client = store.client()
    run = _export_run(store, dpo_policy="v1")
    for status in ("passed", "skipped", "failed", None):
        export = _copy(hf_export, tmp_path / f"v_{status}" / "dpo_policy_hf", status)
        register(store, "dpo_policy_hf", f"version_{status}", str(export), run)
    registered = {v.tags["lineage.out.dpo_policy_hf"]: v for v in
                  client.search_model_versions("name = 'dpo_policy_hf'")}
    assert sorted(registered) == ["version_passed", "version_skipped"]
    assert registered["version_passed"].tags["export.check"] == "passed"
    assert registered["version_skipped"].tags["export.check"] == "skipped"
    assert registered["version_passed"].tags["lineage.dpo_policy"] == "v1"
    # a real logged model, not a path on this machine: its source is models:/<model_id>, in the artifact store
    # the run's logged models (MLflow 3), in the artifact store; each version's source is one of them
    logged = [client.get_logged_model(m.model_id) for m in client.get_run(run).outputs.model_outputs]
    assert [m.name for m in logged] == ["dpo_policy_hf", "dpo_policy_hf"]
    assert all(m.source_run_id == run and str(m.status) == "READY" for m in logged)
    assert sorted(v.source for v in registered.values()) == sorted(m.artifact_location for m in logged)
    assert all(m.artifact_location.startswith((tmp_path / "mlruns").as_uri()) for m in logged)


@pytest.fixture
def tracking_uri(store):
    """MLflow's process-wide tracking URI set to the test's store (as a user's session would), then restored."""
    import mlflow

    before = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(store.uri)
    yield store.uri
    mlflow.set_tracking_uri(before)


def test_mlflow_serves_the_registered_export_with_the_directory_s_logits(tmp_path, store, hf_export, tracking_uri):
    import mlflow
    from transformers import AutoModelForCausalLM, AutoTokenizer

    export = _copy(hf_export, tmp_path / "v" / "dpo_policy_hf", "passed")
    number = register(store, "dpo_policy_hf", "v", str(export), _export_run(store, dpo_policy="c1"))
    shutil.rmtree(export)  # MLflow must not need the directory it was exported to
    uri = f"models:/dpo_policy_hf/{number}"
    components = mlflow.transformers.load_model(uri, return_type="components")
    ids = torch.tensor([[5, 17, 42, 99, 3]])
    expected = AutoModelForCausalLM.from_pretrained(str(hf_export)).eval()(ids).logits
    assert torch.equal(components["model"].eval()(ids).logits, expected)
    tokenizer = AutoTokenizer.from_pretrained(str(hf_export))
    assert components["tokenizer"].chat_template == tokenizer.chat_template
    assert components["tokenizer"].encode("Solve: 3 * 4") == tokenizer.encode("Solve: 3 * 4")
    # the python_function flavor: MLflow's generic serving interface
    generated = mlflow.pyfunc.load_model(uri).predict(["Solve: 3 * 4"], params={"max_new_tokens": 3})
    assert isinstance(generated[0], str)
    local = Path(mlflow.artifacts.download_artifacts(uri))
    assert json.loads((local / "align" / "align_pipeline_meta.json").read_text()) == {"stage": "dpo"}
    assert (local / "align" / CHECK_FILE).exists() and (local / "model" / "model.safetensors").exists()


def _entry(promoted: str | None, versions: dict[str, str], gain: dict[str, float]) -> dict:
    gates = {p: [{"gate": "evaluation.gate.min_gain_over_sft", "threshold": 0.05, "value": g, "passed": g >= 0.05}]
             for p, g in gain.items()}
    return {"policy": promoted, "dataset": f"{promoted}_policy" if promoted else None,
            "version": versions.get(f"{promoted}_policy"), "versions": versions, "gates": gates,
            "passed": {p: g >= 0.05 for p, g in gain.items()}}


def test_the_promoted_policy_is_the_one_champion_and_versions_carry_their_gate_results(tmp_path, store, hf_export):
    client = store.client()
    for name, version in (("sft", "s1"), ("dpo", "d1"), ("ppo", "p1")):
        export = _copy(hf_export, tmp_path / name / f"{name}_policy_hf", "passed")
        register(store, f"{name}_policy_hf", f"hf_{version}", str(export), _export_run(store, **{f"{name}_policy": version}))
    versions = {"sft_policy": "s1", "dpo_policy": "d1", "ppo_policy": "p1"}
    assert promote(store, _entry("ppo", versions, {"dpo": 0.02, "ppo": 0.0875})) == f"models:/ppo_policy_hf@{CHAMPION}"
    assert str(client.get_model_version_by_alias("ppo_policy_hf", CHAMPION).version) == "1"
    tags = {n: client.get_model_version(f"{n}_policy_hf", "1").tags for n in ("sft", "dpo", "ppo")}
    assert tags["ppo"]["gate.min_gain_over_sft"] == "pass (0.0875 vs 0.05)"
    assert tags["ppo"]["gates.passed"] == "true" and tags["ppo"]["evaluation.promoted"] == "true"
    assert tags["dpo"]["gate.min_gain_over_sft"] == "fail (0.02 vs 0.05)"
    assert tags["dpo"]["gates.passed"] == "false" and tags["dpo"]["evaluation.promoted"] == "false"
    assert tags["sft"]["gates.passed"] == "reference (not gated)"
    # a later evaluation of a new DPO version promotes it: the alias moves there, and only there
    export = _copy(hf_export, tmp_path / "dpo2" / "dpo_policy_hf", "passed")
    later = _entry("dpo", {"sft_policy": "s1", "dpo_policy": "d2"}, {"dpo": 0.1})
    register(store, "dpo_policy_hf", "hf_d2", str(export), _export_run(store, dpo_policy="d2"), promoted=later)
    assert str(client.get_model_version_by_alias("dpo_policy_hf", CHAMPION).version) == "2"
    holders = [m.name for m in client.search_registered_models() if CHAMPION in m.aliases]
    assert holders == ["dpo_policy_hf"]
    # a promoted checkpoint with no registered export yet: no alias anywhere changes
    assert promote(store, _entry("ppo", {"ppo_policy": "p9"}, {"ppo": 0.2})) is None
    assert str(client.get_model_version_by_alias("dpo_policy_hf", CHAMPION).version) == "2"


def test_an_unknown_architecture_is_not_logged_as_a_model(tmp_path, store, hf_export, caplog):
    export = _copy(hf_export, tmp_path / "odd" / "dpo_policy_hf", "passed")
    config = json.loads((export / "config.json").read_text())
    (export / "config.json").write_text(json.dumps({**config, "architectures": ["EvilRemoteCode"]}))
    assert register(store, "dpo_policy_hf", "v", str(export), _export_run(store)) is None
    assert "architecture is not one align-pipeline exports" in caplog.text
    assert store.client().search_model_versions("name = 'dpo_policy_hf'") == []
