"""Issue 30 item 6: retention of stored versions. Byte-identical files are stored once (hard links); ``keep_versions:
N`` keeps the newest N and every version a kept artifact's lineage (or a conf file) names; ``align-pipeline gc``
shows what would go with sizes and reasons (``--dry-run`` deletes nothing) and frees it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kedro.io import DataCatalog
from kedro.io.core import Version

from align_pipeline.datasets import CheckpointDataset
from align_pipeline.datasets.retention import gc_command

VERSIONS = [f"2026-12-0{d}T10.00.00.000Z" for d in range(1, 7)]
MODELS = Path("data/06_models")


def checkpoint(where: Path, weights: bytes, run_id: str, lineage: dict | None = None) -> str:
    """A checkpoint-shaped directory as a job leaves it (the dataset never looks inside the shards)."""
    where.mkdir(parents=True)
    meta = {"stage": "sft", "lineage": {"mlflow_run_id": run_id, **(lineage or {})}}
    (where / "meta.json").write_text(json.dumps(meta))
    (where / "__0_0.distcp").write_bytes(weights)
    (where / ".metadata").write_bytes(os.urandom(64))  # the DCP index: a per-save id
    (where / "metrics.jsonl").write_text(json.dumps({"run": run_id}) + "\n")
    return str(where)


def save(name: str, version: str, weights: bytes, keep: int | None = None, lineage: dict | None = None) -> Path:
    """Store a checkpoint as ``version`` of ``name`` through the catalog (``keep_versions: keep``)."""
    entry = {"type": "align_pipeline.datasets.CheckpointDataset", "filepath": str(MODELS / name), "versioned": True}
    if keep is not None:
        entry["keep_versions"] = keep
    catalog = DataCatalog.from_config({name: entry}, save_version=version)
    catalog.save(name, checkpoint(Path("runs") / f"{name}-{version}", weights, version, lineage))
    return (MODELS / name / version / name).resolve()


def versions(name: str) -> list[str]:
    return sorted(p.name for p in (MODELS / name).iterdir() if not p.name.startswith("."))


def disk_bytes(root: Path) -> int:
    """Bytes the files under ``root`` take (a hard-linked file once)."""
    seen = {}
    for p in root.rglob("*"):
        if p.is_file():
            st = p.lstat()
            seen[(st.st_dev, st.st_ino)] = st.st_size
    return sum(seen.values())


def test_identical_reruns_store_their_weights_once(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    weights = os.urandom(200_000)
    stored = [save("sft_policy", v, weights) for v in VERSIONS[:5]]  # 5 identical runs, each its own run id
    inodes = {(p / "__0_0.distcp").stat().st_ino for p in stored}
    assert len(inodes) == 1 and (stored[0] / "__0_0.distcp").stat().st_nlink == 5
    assert len({(p / "meta.json").stat().st_ino for p in stored}) == 5  # per-run files stay each version's own
    assert disk_bytes(MODELS) < 200_000 + 5 * 4096
    assert versions("sft_policy") == VERSIONS[:5]  # every version stays: lineage and MLflow tags may name it
    for p in stored:  # and each one is whole
        assert CheckpointDataset(str(MODELS / "sft_policy"), version=Version(p.parent.name, None)).load() == str(p)
    # a different model shares nothing
    other = save("sft_policy", VERSIONS[5], os.urandom(200_000))
    assert (other / "__0_0.distcp").stat().st_nlink == 1


def test_keep_versions_keeps_the_newest_and_every_version_a_lineage_names(tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(tmp_path)
    sft = [save("sft_policy", v, os.urandom(1000)) for v in VERSIONS[:3]]
    save("dpo_policy", VERSIONS[3], os.urandom(1000), lineage={"parent_checkpoint": str(sft[0])})
    caplog.set_level("INFO", logger="align_pipeline.datasets.retention")
    save("sft_policy", VERSIONS[4], os.urandom(1000), keep=2)
    # the newest 2 (V5, V3) stay; V2 goes; V1 stays because the kept dpo_policy was trained from it
    assert versions("sft_policy") == [VERSIONS[0], VERSIONS[2], VERSIONS[4]]
    assert f"sft_policy: kept version {VERSIONS[0]} (beyond the newest 2, but named by the lineage of " \
           f"dpo_policy/{VERSIONS[3]})" in caplog.messages
    assert any(m.startswith(f"sft_policy: removed version {VERSIONS[1]} (beyond the newest 2; keep_versions: 2;")
               for m in caplog.messages)
    assert CheckpointDataset(str(MODELS / "sft_policy"), version=Version(None, None)).load().endswith(VERSIONS[4] + "/sft_policy")


def test_gc_dry_run_shows_what_would_go_and_deletes_nothing_then_frees_it(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    sft = [save("sft_policy", v, os.urandom(50_000)) for v in VERSIONS[:4]]
    # dpo V5 names sft V1; dpo V6 (newest, kept) names sft V2: V1 goes with dpo V5, V2 stays
    save("dpo_policy", VERSIONS[4], os.urandom(50_000), lineage={"parent_checkpoint": str(sft[0])})
    save("dpo_policy", VERSIONS[5], os.urandom(50_000), lineage={"reference": f"{MODELS}/sft_policy/{VERSIONS[1]}/sft_policy"})
    (tmp_path / "conf" / "base").mkdir(parents=True)  # a version a parameter file names stays too
    (tmp_path / "conf" / "base" / "parameters_ppo.yml").write_text(
        f"ppo:\n  init_from: data/06_models/sft_policy/{VERSIONS[2]}/sft_policy\n")
    (MODELS / "sft_policy" / "2026-11-30T10.00.00.000Z" / "sft_policy").mkdir(parents=True)  # incomplete: no meta
    before = {p for p in MODELS.rglob("*")}

    assert gc_command(["--dry-run", "--keep", "1", f"root={MODELS}"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert {p for p in MODELS.rglob("*")} == before  # nothing deleted
    lines = {line.split()[1]: line for line in out if line.startswith(("remove", "keep"))}
    assert lines[f"sft_policy/{VERSIONS[0]}"].startswith("remove") and "beyond the newest 1" in lines[f"sft_policy/{VERSIONS[0]}"]
    assert lines[f"dpo_policy/{VERSIONS[4]}"].startswith("remove") and "MiB" in lines[f"dpo_policy/{VERSIONS[4]}"]
    assert lines[f"sft_policy/{VERSIONS[1]}"].startswith("keep") and \
        f"named by the lineage of dpo_policy/{VERSIONS[5]}" in lines[f"sft_policy/{VERSIONS[1]}"]
    assert lines[f"sft_policy/{VERSIONS[2]}"].startswith("keep") and \
        "named by conf/base/parameters_ppo.yml" in lines[f"sft_policy/{VERSIONS[2]}"]
    assert "incomplete (missing meta.json / config.json and manifest.json)" in lines["sft_policy/2026-11-30T10.00.00.000Z"]
    assert out[-1].startswith("dry run: would free 0.1 MiB (3 versions)") and out[-1].endswith("nothing deleted")

    assert gc_command(["--keep", "1", f"root={MODELS}"]) == 0
    assert versions("sft_policy") == VERSIONS[1:4] and versions("dpo_policy") == [VERSIONS[5]]
    assert capsys.readouterr().out.splitlines()[-1].startswith("freed 0.1 MiB (3 versions)")
    assert not [p for p in (MODELS / "sft_policy").iterdir() if p.name.startswith(".gc-")]


def test_gc_command_line_errors_are_one_line(tmp_path):
    code = "-m", "align_pipeline", "gc"  # the console command's module
    done = subprocess.run([sys.executable, *code, "--keep", "0"], cwd=tmp_path, capture_output=True, text=True,
                          check=False)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        ("align-pipeline gc: root=data/06_models: not a directory (run from the project directory, or name the "
         "directory of versioned artifacts)")]
    (tmp_path / "data" / "06_models").mkdir(parents=True)
    done = subprocess.run([sys.executable, *code, "--keep", "0"], cwd=tmp_path, capture_output=True, text=True,
                          check=False)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "align-pipeline gc: --keep 0: keep at least 1 version (omit --keep to keep all)"]
    done = subprocess.run([sys.executable, *code, "--dry-run"], cwd=tmp_path, capture_output=True, text=True,
                          check=False)
    assert done.returncode == 0 and "nothing deleted" in done.stdout
