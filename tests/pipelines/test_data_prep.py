"""The data_prep pipeline through a real KedroSession on a temp copy of the project.

Bad raw data fails with a message naming file, line and field, and writes nothing; good data produces every
artifact with its sidecar, deterministically.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from projects import copy_project

from align_pipeline.data.demo_task import make_demo_datasets
from align_pipeline.data.schemas import DataValidationError

pytestmark = pytest.mark.slow  # launches torchrun jobs or a KedroSession

OUTPUT_DIRS = ("02_intermediate", "03_primary", "05_model_input", "06_models")
OUTPUTS = ("sft_train.npz", "sft_val.npz", "pref_train.npz", "pref_val.npz", "prompts_train.jsonl", "prompts_val.jsonl")


@pytest.fixture(scope="module")
def mlflow_uri(tmp_path_factory):
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


@pytest.fixture
def project(tmp_path, monkeypatch, mlflow_uri):
    """A copy of the project (conf/base, pyproject.toml, data/01_raw) with empty output folders."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_uri)
    monkeypatch.setenv("KEDRO_DISABLE_TELEMETRY", "true")
    copy_project(tmp_path)
    for d in OUTPUT_DIRS:
        (tmp_path / "data" / d).mkdir()
    return tmp_path


def _write_small_raw(project: Path) -> dict[str, list[dict]]:
    data = make_demo_datasets(n_sft=40, n_preference=20, n_prompts=10, seed=1)
    for kind, recs in data.items():
        _write_lines(project / "data" / "01_raw" / f"{kind}.jsonl", [json.dumps(r) for r in recs])
    return data


def _write_lines(path: Path, lines: list[str]) -> None:
    path.write_text("".join(line + "\n" for line in lines))


def _run(project: Path):
    from kedro.framework.session import KedroSession
    from kedro.framework.startup import bootstrap_project

    bootstrap_project(project)
    with KedroSession.create(project_path=project) as session:
        return session.run(pipeline_names=["data_prep"])


def _find(exc: BaseException, cls: type) -> BaseException | None:
    while exc is not None:
        if isinstance(exc, cls):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def _outputs_written(project: Path) -> list[str]:
    return sorted(str(p.relative_to(project)) for d in OUTPUT_DIRS for p in (project / "data" / d).rglob("*"))


BAD_CASES = {
    # name: (file, line index to replace (None = whole file), replacement line(s), expected message parts)
    "invalid_json": ("sft", 6, '{"input": "add: 1+2\\n", "output": "3"', ["sft.jsonl line 7", "invalid JSON"]),
    "missing_field": (
        "preference",
        2,
        '{"prompt": "add: 1+2\\n", "chosen_response": "3"}',
        ["preference.jsonl line 3", 'field "rejected_response"', "missing"],
    ),
    "wrong_type": (
        "sft",
        16,
        '{"input": "add: 1+2\\n", "output": 3}',
        ["sft.jsonl line 17", 'field "output"', "expected a string, got int"],
    ),
    "extra_field": (
        "preference",
        4,
        '{"prompt": "add: 1+2\\n", "chosen_response": "3", "rejected_response": "4", "difficulty": 1}',
        ["preference.jsonl line 5", 'field "difficulty"', "unknown field"],
    ),
    "empty_file": ("prompts", None, [], ["prompts.jsonl", "file is empty"]),
    "too_long": (
        "sft",
        9,
        json.dumps({"input": "reverse: " + "ab" * 20 + "\n", "output": "ba" * 20}),
        ["sft.jsonl line 10", 'field "output"', "is 92 tokens", "longer than model.seq_length = 32"],
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_input_fails_clearly_and_writes_nothing(project, case):
    kind, index, replacement, expected = BAD_CASES[case]
    data = _write_small_raw(project)
    path = project / "data" / "01_raw" / f"{kind}.jsonl"
    if index is None:
        _write_lines(path, replacement)
    else:
        lines = [json.dumps(r) for r in data[kind]]
        lines[index] = replacement
        _write_lines(path, lines)

    with pytest.raises(Exception) as excinfo:
        _run(project)
    err = _find(excinfo.value, DataValidationError)
    assert err is not None, f"expected a DataValidationError, got {excinfo.value!r}"
    for part in expected:
        assert part in str(err), f"{part!r} not in {err}"
    assert _outputs_written(project) == []


def test_bad_parameters_fail_before_anything_runs(project):
    from align_pipeline.config import ConfigError

    params = project / "conf" / "base" / "parameters_data_prep.yml"
    params.write_text(params.read_text().replace("val_fraction: 0.1", "val_fraction: 1.5"))
    with pytest.raises(Exception) as excinfo:
        _run(project)
    assert _find(excinfo.value, ConfigError) is not None and "val_fraction" in str(excinfo.value)
    assert _outputs_written(project) == []


def test_prompts_lacking_a_field_a_reward_function_needs_fail_at_data_prep(project):
    """math_answer (reinforce) and demo_task (the shipped ppo and evaluation reward) need ``answer``: a prompt without
    one fails here, naming file, line, field and each stage's key, not mid-rollout; with the reward model alone (no
    functions) the same prompts pass."""
    data = _write_small_raw(project)
    lines = [json.dumps(r) for r in data["prompts"]]
    lines[2] = json.dumps({"prompt": "What is 2 + 2?", "category": "math"})
    _write_lines(project / "data" / "01_raw" / "prompts.jsonl", lines)
    params = project / "conf" / "base" / "parameters_reinforce.yml"
    original = params.read_text()
    params.write_text(original.replace("align_pipeline.rewards:demo_task", "align_pipeline.rewards:math_answer"))
    with pytest.raises(Exception) as excinfo:
        _run(project)
    err = _find(excinfo.value, DataValidationError)
    assert err is not None and 'prompts.jsonl line 3: field "answer": missing' in str(err), excinfo.value
    assert "align_pipeline.rewards:demo_task (params:ppo.reward.functions[0])" in str(err)
    assert "align_pipeline.rewards:math_answer (params:reinforce.reward.functions[0])" in str(err)
    assert _outputs_written(project) == []

    import yaml

    for name in ("ppo", "reinforce", "evaluation"):  # RM-only reward everywhere: no function needs an answer
        path = project / "conf" / "base" / f"parameters_{name}.yml"
        values = yaml.safe_load(path.read_text())
        values[name]["reward"]["functions"] = []
        if name != "evaluation":
            values[name]["reward"]["reward_model_weight"] = 1.0
        path.write_text(yaml.safe_dump(values))
    _run(project)
    assert sorted(_outputs_written(project))


def test_good_run_on_shipped_data(project):
    from align_pipeline.data.formats import load_jsonl
    from align_pipeline.data.store import load_rows
    from align_pipeline.data.tokenizer import load_tokenizer

    result = _run(project)
    out = project / "data" / "05_model_input"
    for name in OUTPUTS:
        assert (out / name).is_file() and (out / f"{name}.meta.json").is_file(), name
    tok_dir = project / "data" / "03_primary" / "tokenizer"
    assert (tok_dir / "tokenizer.json").is_file() and (tok_dir / "align_tokenizer.json").is_file()
    tok = load_tokenizer(tok_dir)

    sft = load_rows(out / "sft_train.npz")
    meta = json.loads((out / "sft_train.npz.meta.json").read_text())
    n_train = meta["num_samples"]
    n_val = json.loads((out / "sft_val.npz.meta.json").read_text())["num_samples"]
    assert n_train + n_val == 3738 and 330 <= n_val <= 420  # 10 % of the distinct prompts, with their repeats
    assert sft["input_ids"].shape == (n_train, 32) and meta["seq_length"] == 32
    assert meta["tokenizer_fingerprint"] == tok.fingerprint and meta["source"].endswith("sft.jsonl")
    assert np.array_equal(sft["labels"][:, :-1], sft["input_ids"][:, 1:])
    assert (sft["input_ids"][:, 0] == tok.bos_id).all()
    pref = load_rows(out / "pref_val.npz")
    assert pref["chosen_input_ids"].shape == (200, 32) and np.isnan(pref["chosen_reward"]).any()
    prompts = load_jsonl(out / "prompts_val.jsonl")
    assert len(prompts) == 200 and all(p["prompt_ids"][0] == tok.bos_id and p["answer"] for p in prompts)

    metrics = result["data_prep_metrics"].load()  # free outputs come back from session.run
    assert metrics["sft_train_samples"] == n_train and metrics["prompts_val_samples"] == 200
    assert metrics["sft_max_tokens"] <= 24 and metrics["tokenizer_fingerprint"] == tok.fingerprint

    # The catalog hands training nodes Artifacts (paths + fingerprints), never arrays.
    from kedro.framework.session import KedroSession

    with KedroSession.create(project_path=project) as session:
        catalog = session.load_context().catalog
        art = catalog.load("sft_train")
        assert art.path == str(out / "sft_train.npz") and art.fingerprint == meta["fingerprint"]
        assert catalog.load("tokenizer").fingerprint == tok.fingerprint

    # A second run gives the same content.
    fingerprints = {n: json.loads((out / f"{n}.meta.json").read_text())["fingerprint"] for n in OUTPUTS}
    _run(project)
    assert fingerprints == {n: json.loads((out / f"{n}.meta.json").read_text())["fingerprint"] for n in OUTPUTS}
    assert load_tokenizer(tok_dir).fingerprint == tok.fingerprint
    leftovers = [p.name for p in (project / "data").rglob(".*") if p.name != ".gitkeep"]
    assert leftovers == []  # no temp files
