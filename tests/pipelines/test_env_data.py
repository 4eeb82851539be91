"""Issue 30, item 3: envs do not share data. A run with ``-e <env>`` writes under ``data/<env>/`` (its own tokenizer,
tokenized data, models, run directories), so it never replaces what a plain ``kedro run`` made, and the plain run
afterwards reads its own artifacts again. A real KedroSession on a temp copy of the project; data_prep only (the
mechanism is the catalog's and the parameters' paths, the same for every stage)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from chat_tokenizers import make_chat_tokenizer_dir
from projects import copy_project, enter_project, run_kedro

pytestmark = pytest.mark.slow  # launches a KedroSession

SMALL = "model:\n  seq_length: 256\n"


def _digests(root: Path) -> dict[str, tuple[str, int]]:
    """sha256 and mtime of every file under ``root``."""
    return {str(p.relative_to(root)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_an_env_writes_under_its_own_data_root(tmp_path, monkeypatch):
    root = enter_project(monkeypatch, copy_project(tmp_path / "proj"), "test-env-data")
    (root / "conf" / "local" / "parameters.yml").write_text(SMALL)
    run_kedro(root, "data_prep", env=None)  # the default env: data/
    plain = {d: _digests(root / "data" / d) for d in ("03_primary", "05_model_input")}
    assert plain["03_primary"] and plain["05_model_input"]

    hf_tok = make_chat_tokenizer_dir(tmp_path / "hf_tok", "chatml")
    (root / "conf" / "hf").mkdir()
    (root / "conf" / "hf" / "parameters.yml").write_text(
        SMALL + f"data_prep:\n  tokenizer:\n    hf_model_dir: {hf_tok}\n")
    run_kedro(root, "data_prep", env="hf")

    # the env's outputs are under data/hf/, tokenized with its own tokenizer ...
    env_tok = root / "data" / "hf" / "03_primary" / "tokenizer"
    vocab = {d: json.loads((d / "tokenizer.json").read_text())["model"]["vocab"] for d in (env_tok, hf_tok)}
    assert vocab[env_tok] == vocab[hf_tok]
    assert (root / "data" / "hf" / "05_model_input" / "sft_train.npz").is_file()
    # ... and the plain run's are exactly as they were (content and mtime)
    assert {d: _digests(root / "data" / d) for d in plain} == plain
    # the raw inputs are shared, not copied
    assert not (root / "data" / "hf" / "01_raw").exists()


def test_an_env_with_its_own_globals_keeps_its_data_root(tmp_path):
    from align_pipeline.kedro.config_loader import ProjectConfigLoader
    from align_pipeline.settings import CONFIG_LOADER_ARGS

    root = copy_project(tmp_path / "proj", raw=False)
    for env, globals_yml in (("gpu2", None), ("shared", "data_root: data\n"), ("elsewhere", "data_root: /scratch/x\n")):
        (root / "conf" / env).mkdir()
        if globals_yml:
            (root / "conf" / env / "globals.yml").write_text(globals_yml)
    catalog, runs = {}, {}
    for env in (None, "local", "gpu2", "shared", "elsewhere"):  # one at a time: the globals resolver is process-wide
        loader = ProjectConfigLoader(str(root / "conf"), env=env, **CONFIG_LOADER_ARGS)
        catalog[env] = loader["catalog"]["sft_policy"]["filepath"]
        runs[env] = loader["parameters"]["dpo"]["reference_cache_dir"]
    assert catalog == {None: "data/06_models/sft_policy", "local": "data/06_models/sft_policy",
                       "gpu2": "data/gpu2/06_models/sft_policy", "shared": "data/06_models/sft_policy",
                       "elsewhere": "/scratch/x/06_models/sft_policy"}
    assert runs["gpu2"] == "data/gpu2/07_model_output/reference_logps"
