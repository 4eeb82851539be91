"""Issue 30 item 4: every stored version has a manifest (files, sizes, sha256); a load checks it and refuses, by
name, a version that is incomplete or fails it (or skips it with ``load_version: latest_complete``).

The dataset tests store tiny stand-in checkpoint directories through the real dataset (it never looks inside the
shards); the last test stores a real SFT checkpoint through a real KedroSession and refuses a truncated shard before
the DPO job is launched."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
from kedro.io import DataCatalog
from kedro.io.core import DatasetError, Version

from align_pipeline.datasets import CheckpointDataset, HFModelDataset
from align_pipeline.datasets.manifest import MANIFEST_FILE, read_manifest, write_manifest

V1, V2, V3 = "2026-12-01T10.00.00.000Z", "2026-12-02T10.00.00.000Z", "2026-12-03T10.00.00.000Z"


def fake_checkpoint(where: Path, weights: bytes = b"w" * 1000, run_id: str = "run-a", marker: str = "meta.json") -> str:
    """A checkpoint-shaped directory as a job leaves it: meta.json (or an HF config.json), two shards, an index."""
    where.mkdir(parents=True)
    (where / marker).write_text(json.dumps({"stage": "sft", "lineage": {"mlflow_run_id": run_id}}))
    (where / "__0_0.distcp").write_bytes(weights)
    (where / "__0_1.distcp").write_bytes(weights[::-1] + b"tail")
    (where / ".metadata").write_bytes(run_id.encode())
    return str(where)


def store(tmp_path: Path, version: str, cls=CheckpointDataset, name: str = "sft_policy", **kwargs) -> Path:
    """Save a fresh stand-in checkpoint as ``version`` through the dataset; returns the stored artifact dir."""
    marker = "config.json" if cls is HFModelDataset else "meta.json"
    src = fake_checkpoint(tmp_path / "runs" / f"{name}-{version}", weights=(version.encode() * 50)[:1000], run_id=version,
                          marker=marker)
    cls(str(tmp_path / "data" / "06_models" / name), version=Version(None, version), **kwargs).save(src)
    return tmp_path / "data" / "06_models" / name / version / name


def loader(tmp_path: Path, pinned: str | None = None, cls=CheckpointDataset, name: str = "sft_policy", **kwargs):
    return cls(str(tmp_path / "data" / "06_models" / name), version=Version(pinned, None), **kwargs)


def test_save_writes_a_manifest_and_hidden_temp_dirs_are_no_versions(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    stored = store(tmp_path, V1)
    entries = read_manifest(stored)
    assert set(entries) == {"meta.json", "__0_0.distcp", "__0_1.distcp", ".metadata"}
    assert entries["__0_0.distcp"].size == 1000 and len(entries["__0_0.distcp"].sha256) == 64
    assert not (tmp_path / "runs" / f"sft_policy-{V1}").exists()  # moved, not copied
    # an interrupted save (only the hidden temp dir) and a half-deleted version are not versions: V1 still loads
    (tmp_path / "data" / "06_models" / "sft_policy" / V2 / ".tmp-sft_policy").mkdir(parents=True)
    (tmp_path / "data" / "06_models" / "sft_policy" / f".gc-{V3}" / "sft_policy").mkdir(parents=True)
    assert loader(tmp_path).load() == str(stored)


def test_truncated_shard_is_refused_with_the_file_named(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    store(tmp_path, V1)
    newest = store(tmp_path, V2)
    shard = newest / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:333])
    with pytest.raises(DatasetError) as err:
        loader(tmp_path).load()
    assert str(err.value) == (
        f"sft_policy version {V2} failed its manifest check (shard __0_0.distcp has 333 bytes, the manifest says "
        f"1000) in data/06_models/sft_policy; delete it, pin another with --load-versions sft_policy:<version> "
        f"({V1} is complete), or set load_version: latest_complete in its catalog entry")
    (newest / "__0_1.distcp").unlink()
    shard.write_bytes(b"x" * 1000)
    with pytest.raises(DatasetError, match=rf"sft_policy version {V2} is incomplete \(shard __0_1.distcp is missing\)"):
        loader(tmp_path).load()


def test_missing_meta_is_refused_by_name_unless_latest_complete_skips_it(tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(tmp_path)
    first = store(tmp_path, V1)
    (store(tmp_path, V2) / "meta.json").unlink()
    with pytest.raises(DatasetError) as err:
        loader(tmp_path).load()
    assert str(err.value).startswith(
        f"sft_policy version {V2} is incomplete (missing meta.json) in data/06_models/sft_policy; delete it, pin "
        f"another with --load-versions sft_policy:<version> ({V1} is complete), or set load_version: latest_complete")
    assert "\n" not in str(err.value)
    # the option, through Kedro's own catalog config
    catalog = DataCatalog.from_config({"sft_policy": {
        "type": "align_pipeline.datasets.CheckpointDataset", "filepath": "data/06_models/sft_policy",
        "versioned": True, "load_version": "latest_complete"}})
    with caplog.at_level(logging.WARNING, logger="align_pipeline.datasets.checkpoint"):
        assert catalog.load("sft_policy") == str(first)
    assert f"sft_policy: skipped version {V2} (is incomplete: missing meta.json) (load_version: latest_complete); " \
           f"loading {V1}" in caplog.messages
    # a pinned version is checked too, and refused with the pin's way out
    with pytest.raises(DatasetError, match=rf"^sft_policy version {V2} is incomplete \(missing meta.json\) in "
                                           r"data/06_models/sft_policy; delete it or pin another"):
        loader(tmp_path, pinned=V2).load()


def test_full_verify_catches_a_same_size_corruption(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    stored = store(tmp_path, V1)
    data = bytearray((stored / "__0_1.distcp").read_bytes())
    data[10] ^= 0xFF
    (stored / "__0_1.distcp").write_bytes(bytes(data))
    assert loader(tmp_path).load() == str(stored)  # default for checkpoints: sizes only
    with pytest.raises(DatasetError, match=r"shard __0_1.distcp does not match its sha256 in the manifest"):
        loader(tmp_path, verify="full").load()
    # HF exports verify every byte by default
    export = store(tmp_path, V1, cls=HFModelDataset, name="sft_policy_hf")
    assert loader(tmp_path, cls=HFModelDataset, name="sft_policy_hf").load() == str(export)
    (export / "__0_0.distcp").write_bytes(b"Z" * (export / "__0_0.distcp").stat().st_size)
    with pytest.raises(DatasetError, match=rf"^sft_policy_hf version {V1} failed its manifest check \(shard "
                                           r"__0_0.distcp does not match its sha256"):
        loader(tmp_path, cls=HFModelDataset, name="sft_policy_hf").load()
    with pytest.raises(DatasetError, match=r"sft_policy: verify must be one of sizes, full, got 'quick'"):
        loader(tmp_path, verify="quick")


def test_a_removed_manifest_is_refused_but_versions_stored_before_manifests_load(tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(tmp_path)
    legacy = tmp_path / "data" / "06_models" / "sft_policy" / V1 / "sft_policy"
    fake_checkpoint(legacy)  # stored by the old code: meta.json, no manifest
    with caplog.at_level(logging.WARNING, logger="align_pipeline.datasets.checkpoint"):
        assert loader(tmp_path).load() == str(legacy)
    assert f"sft_policy version {V1} has no manifest.json (stored before manifests): its files are not verified" \
           in caplog.messages
    (store(tmp_path, V2) / MANIFEST_FILE).unlink()  # stored with one, which was then removed
    with pytest.raises(DatasetError, match=rf"^sft_policy version {V2} is incomplete \(missing manifest.json\)"):
        loader(tmp_path).load()
    third = store(tmp_path, V3)
    (third / MANIFEST_FILE).write_text('{"format": 1}')
    with pytest.raises(DatasetError, match=r"manifest.json is not a format-1 manifest"):
        loader(tmp_path).load()
    # a manifest edited to match a truncated shard is not the one the save wrote
    (third / "__0_0.distcp").write_bytes(b"short")
    manifest = write_manifest(third)
    assert manifest["__0_0.distcp"].size == 5
    with pytest.raises(DatasetError, match=rf"^sft_policy version {V3} failed its manifest check \(manifest.json is "
                                           r"not the one written when it was stored\)"):
        loader(tmp_path).load()


def test_optional_entry_without_versions_loads_empty_but_refuses_a_broken_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert loader(tmp_path, optional=True).load() == ""
    (store(tmp_path, V1) / "meta.json").unlink()
    with pytest.raises(DatasetError, match=rf"sft_policy version {V1} is incomplete \(missing meta.json\)"):
        loader(tmp_path, optional=True).load()


def test_a_failed_save_gives_the_checkpoint_back(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    src = Path(fake_checkpoint(tmp_path / "runs" / "model"))
    target = tmp_path / "data" / "06_models" / "sft_policy" / V1
    target.mkdir(parents=True)
    (target / "sft_policy").write_text("in the way")  # the final rename cannot replace a file with a directory
    with pytest.raises(DatasetError):
        CheckpointDataset(str(tmp_path / "data" / "06_models" / "sft_policy"), version=Version(None, V1)).save(str(src))
    assert (src / "meta.json").is_file() and (src / "__0_0.distcp").stat().st_size == 1000
    assert not (src / MANIFEST_FILE).exists()


@pytest.mark.slow
def test_kedro_run_refuses_a_truncated_or_incomplete_sft_policy_before_launching_dpo(tmp_path, monkeypatch):
    """A real SFT checkpoint, stored by a real KedroSession (data_prep + sft, 2 steps): a truncated shard or a
    missing meta.json of the latest version stops `kedro run --pipelines dpo` with one line, before any job."""
    from kedro.framework.session import KedroSession
    from kedro.framework.startup import bootstrap_project
    from projects import copy_project, enter_project

    tiny = {"training": {"train_steps": 2, "global_batch_size": 8, "micro_batch_size": 8, "log_interval": 1,
                         "eval_interval": 0, "eval_samples": 8, "save_interval": 0}}
    fast = {"model": {"num_layers": 1, "hidden_size": 32, "num_attention_heads": 2, "num_query_groups": 1,
                      "ffn_hidden_size": 64}, "sft": tiny, "dpo": tiny}
    root = enter_project(monkeypatch, copy_project(tmp_path / "proj", params={"test/fast": fast}), "test-manifest")
    bootstrap_project(root)

    def run(*pipelines: str):
        with KedroSession.create(project_path=root, env="test") as session:
            return session.run(pipeline_names=list(pipelines))

    run("data_prep", "sft")
    (version,) = (p.name for p in (root / "data" / "06_models" / "sft_policy").iterdir())
    stored = root / "data" / "06_models" / "sft_policy" / version / "sft_policy"
    entries = read_manifest(stored)
    assert {"meta.json", ".metadata", "__0_0.distcp"} <= set(entries)
    shard = stored / "__0_0.distcp"
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[: size // 2])
    with pytest.raises(DatasetError) as err:
        run("dpo")
    assert "\n" not in str(err.value) and str(err.value).endswith(  # Kedro's session may prefix "sft_policy: "
        f"sft_policy version {version} failed its manifest check (shard __0_0.distcp has {size // 2} bytes, the "
        f"manifest says {size}) in data/06_models/sft_policy; delete it, pin another with --load-versions "
        f"sft_policy:<version>, or set load_version: latest_complete in its catalog entry")
    assert not (root / "data" / "06_models" / "_runs" / "dpo").exists()  # nothing was launched
    shutil.copyfile(stored / "__0_1.distcp", shard) if entries["__0_1.distcp"].size == size else None
    (stored / "meta.json").unlink()
    with pytest.raises(DatasetError, match=rf"sft_policy version {version} is incomplete \(missing meta.json\)"):
        run("dpo")
    assert not (root / "data" / "06_models" / "_runs" / "dpo").exists()
