"""The DPO reference log-probs cache through a real KedroSession on a temp project (issue 29, items 5 and 10):
a corrupt cache is recomputed with one warning; Kedro's own partial runs (``--nodes train_dpo``, ``--from-nodes
train_dpo``) find ``dpo_reference_logps`` on disk, and never train on the log-probs of another sft_policy."""

from __future__ import annotations

import json
import logging
import shutil
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from projects import copy_project, enter_project

from align_pipeline.data.formats import sidecar_path
from align_pipeline.data.reference_cache import cache_problem

pytestmark = pytest.mark.slow

TINY = {"training": {"train_steps": 2, "global_batch_size": 8, "micro_batch_size": 8, "log_interval": 1,
                     "eval_interval": 0, "eval_samples": 8, "save_interval": 0}}
FAST = {
    "model": {"num_layers": 1, "hidden_size": 32, "num_attention_heads": 2, "num_query_groups": 1,
              "ffn_hidden_size": 64},
    "sft": TINY,
    "dpo": TINY,
}
CACHE = Path("data/07_model_output/reference_logps")


def _run(root: Path, **kwargs):
    """``kedro run --env test`` with ``kwargs`` (pipeline_names, node_names, from_nodes, load_versions)."""
    from kedro.framework.session import KedroSession
    from kedro.framework.startup import bootstrap_project

    bootstrap_project(root)
    with KedroSession.create(project_path=root, env="test") as session:
        return session.run(**kwargs)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """data_prep + sft (2 steps) + compute_reference_logps once: a project with an sft_policy, dpo_reference_logps and
    its cache, and a pristine copy of it."""
    base = tmp_path_factory.mktemp("dpo_cache")
    with pytest.MonkeyPatch.context() as mp:
        root = enter_project(mp, copy_project(base / "proj", params={"test/fast": FAST}), "test-dpo-cache")
        _run(root, pipeline_names=["data_prep", "sft"])
        _run(root, node_names=["compute_reference_logps"])
    shutil.copytree(root, base / "pristine")
    return root


@pytest.fixture
def project(trained, tmp_path, monkeypatch):
    """The trained project, restored from its pristine copy at the same path (the cache key holds the sft_policy's
    absolute path: a project moved elsewhere computes its own), with an MLflow store of the test's own (MLflow keeps
    the engine of a store path open: the restored file would be read-only for it)."""
    shutil.rmtree(trained)
    shutil.copytree(trained.parent / "pristine", trained)
    enter_project(monkeypatch, trained, "test-dpo-cache")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    return trained


def _cache(root: Path) -> Path:
    (cache,) = (root / CACHE).glob("*.npz")
    return cache.resolve()


def _versions(root: Path, name: str) -> list[Path]:
    return sorted((root / "data" / "06_models" / name).iterdir())


def _cache_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "reference log-probs cache" in r.getMessage()]


def _splits(root: Path) -> dict[str, int]:
    from align_pipeline.data.reference_cache import npz_pairs

    return {s: npz_pairs(root / "data" / "05_model_input" / f"pref_{s}.npz") for s in ("train", "val")}


def test_a_truncated_reference_cache_is_recomputed_with_one_warning(project, caplog):
    cache = _cache(project)
    assert cache_problem(cache, _splits(project)) is None and sidecar_path(cache).is_file()
    data = cache.read_bytes()
    cache.write_bytes(data[: len(data) // 2])  # a truncated file: BadZipFile on every rerun before the fix
    with caplog.at_level(logging.INFO):
        _run(project, pipeline_names=["dpo"])
    assert _cache_lines(caplog) == [f"reference log-probs cache {cache} is corrupt (sha256 mismatch); recomputing"]
    assert [r.levelname for r in caplog.records if "is corrupt" in r.getMessage()] == ["WARNING"]
    assert cache_problem(cache, _splits(project)) is None  # rewritten, with a sidecar that matches
    assert len(_versions(project, "dpo_policy")) == 1  # and DPO trained on it


def test_a_cache_from_an_older_version_is_adopted_if_sound_else_recomputed(project, caplog):
    """No sidecar (written before sidecars existed): read in full, adopted (sidecar written, not recomputed) when it
    has the expected arrays; recomputed with the warning when it does not open."""
    cache = _cache(project)
    sidecar_path(cache).unlink()
    data, mtime = cache.read_bytes(), cache.stat().st_mtime_ns
    with caplog.at_level(logging.INFO):
        _run(project, node_names=["compute_reference_logps"])
    assert cache.stat().st_mtime_ns == mtime and cache.read_bytes() == data  # reused, not recomputed
    assert sidecar_path(cache).is_file() and cache_problem(cache, _splits(project), adopt=False) is None
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "reference log-probs" in r.getMessage()]

    sidecar_path(cache).unlink()
    cache.write_bytes(data[:-100])  # truncated, no sidecar
    caplog.clear()
    with caplog.at_level(logging.INFO):
        _run(project, node_names=["compute_reference_logps"])
    why = "no sidecar and it does not open: BadZipFile: File is not a zip file"
    assert _cache_lines(caplog) == [f"reference log-probs cache {cache} is corrupt ({why}); recomputing"]
    assert cache_problem(cache, _splits(project), adopt=False) is None


def test_kedro_partial_runs_of_train_dpo_use_the_cache_on_disk(project):
    """`kedro run --nodes train_dpo` and `kedro run --pipelines dpo --from-nodes train_dpo` (Kedro's resume commands)
    on a project where dpo_reference_logps exists; the second without its JSON record (a project from before the
    catalog entry): train_dpo finds the cache of its key."""
    assert (project / "data" / "07_model_output" / "dpo_reference_logps.json").is_file()
    _run(project, node_names=["train_dpo"])
    assert len(_versions(project, "dpo_policy")) == 1
    (project / "data" / "07_model_output" / "dpo_reference_logps.json").unlink()
    _run(project, pipeline_names=["dpo"], from_nodes=["train_dpo"])
    assert len(_versions(project, "dpo_policy")) == 2


def test_train_dpo_alone_refuses_the_reference_logps_of_another_sft_policy(project):
    """A newer sft_policy version than the one dpo_reference_logps was computed for: `--nodes train_dpo` fails with
    one line before any job starts; computing them for it (`--nodes compute_reference_logps,train_dpo`) runs."""
    from align_pipeline.errors import UserError

    (old,) = _versions(project, "sft_policy")
    stamp = datetime.strptime(old.name, "%Y-%m-%dT%H.%M.%S.%fZ") + timedelta(seconds=1)
    new = old.parent / (stamp.strftime("%Y-%m-%dT%H.%M.%S.%f")[:-3] + "Z")
    shutil.copytree(old, new)  # a later version of another model (its reuse key differs): another reference key
    record = new / "sft_policy" / "reuse.json"
    body = json.loads(record.read_text())
    body["key"] = body["key"][::-1]
    record.write_text(json.dumps(body, indent=1, sort_keys=True))
    runs = project / "data" / "06_models" / "_runs"
    before = sorted(p.name for p in runs.rglob("*"))
    with pytest.raises(UserError) as err:
        _run(project, node_names=["train_dpo"])
    message = str(err.value)
    assert "\n" not in message and message.startswith(
        f"dpo_reference_logps was computed for sft_policy {old / 'sft_policy'} (key ")
    assert f"not for sft_policy {new / 'sft_policy'} with the current preference data and tokenizer" in message
    assert message.endswith("; run `kedro run --nodes compute_reference_logps,train_dpo`")
    assert not (project / "data" / "06_models" / "dpo_policy").exists()
    assert sorted(p.name for p in runs.rglob("*")) == before  # no job started

    _run(project, node_names=["compute_reference_logps", "train_dpo"])
    assert len(_versions(project, "dpo_policy")) == 1 and len(list((project / CACHE).glob("*.npz"))) == 2
