"""data_prep faults through a real KedroSession on a temp copy of the project.

* A save that fails half-way (a read-only ``data/05_model_input``; a rename refused half-way through the commit)
  leaves the previous complete set – tokenizer and arrays with matching fingerprints – or, on a first run, nothing.
* A mixed set (a tokenizer from one run, arrays from another: what the old one-by-one saving left behind) is refused
  by ``check_tokenized_with``.
* Dubious records are counted in data_prep_metrics, and ``dubious: refuse`` stops the run before anything is written.
* A data_prep process SIGKILLed while staging or mid-commit leaves temp files, staged writes and ``.old`` backups; the
  next run's commit removes them all.

Failures are real, as root: a read-only bind mount (``mount -o remount,ro,bind``; chmod does not stop root) or, where
mounting is not allowed, ``chattr +i`` on the directory; ``chattr +i`` on one output file for the rename. Tests skip
with the reason when neither is possible.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from projects import copy_project

from align_pipeline.data.demo_task import make_demo_datasets
from align_pipeline.data.formats import check_tokenized_with, content_fingerprint
from align_pipeline.data.schemas import DataValidationError
from align_pipeline.data.staging import OutputsNotWritten
from align_pipeline.data.tokenizer import load_tokenizer

pytestmark = pytest.mark.slow  # launches a KedroSession

OUTPUT_DIRS = ("02_intermediate", "03_primary", "05_model_input", "06_models")
NAMES = {
    "sft_train": "sft_train.npz",
    "sft_val": "sft_val.npz",
    "pref_train": "pref_train.npz",
    "pref_val": "pref_val.npz",
    "prompts_train": "prompts_train.jsonl",
    "prompts_val": "prompts_val.jsonl",
}


@pytest.fixture(scope="module")
def mlflow_uri(tmp_path_factory):
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


@pytest.fixture
def project(tmp_path, monkeypatch, mlflow_uri):
    """A copy of the project (conf/base, pyproject.toml) with small raw data and empty output folders."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_uri)
    monkeypatch.setenv("KEDRO_DISABLE_TELEMETRY", "true")
    copy_project(tmp_path, raw=False)
    (tmp_path / "data" / "01_raw").mkdir(parents=True)
    for kind, records in make_demo_datasets(n_sft=40, n_preference=20, n_prompts=10, seed=1).items():
        _write_jsonl(tmp_path / "data" / "01_raw" / f"{kind}.jsonl", records)
    for d in OUTPUT_DIRS:
        (tmp_path / "data" / d).mkdir()
    return tmp_path


def _write_jsonl(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _append_sft(project: Path, record: dict) -> None:
    with open(project / "data" / "01_raw" / "sft.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


def _session(project: Path):
    from kedro.framework.session import KedroSession
    from kedro.framework.startup import bootstrap_project

    from align_pipeline.kedro.staged_outputs import StagedOutputsHook

    bootstrap_project(project)
    session = KedroSession.create(project_path=project)
    hooks = session._hook_manager  # the hook belongs in settings.HOOKS; register it here if it is not (yet) there
    if not any(isinstance(p, StagedOutputsHook) for p in hooks.get_plugins()):
        hooks.register(StagedOutputsHook())
    return session


def _run(project: Path):
    with _session(project) as session:
        return session.run(pipeline_names=["data_prep"])


def _catalog_artifacts(project: Path):
    """(tokenizer, {name: artifact}) as a training stage gets them from the catalog."""
    with _session(project) as session:
        catalog = session.load_context().catalog
        return catalog.load("tokenizer"), {name: catalog.load(name) for name in NAMES}


def _state(project: Path) -> dict[str, str]:
    """What identifies the current outputs: tokenizer fingerprint (recomputed from its files), each artifact's sidecar
    fingerprint and tokenizer_fingerprint, and its content fingerprint recomputed from the data file."""
    out = project / "data" / "05_model_input"
    state = {"tokenizer": load_tokenizer(project / "data" / "03_primary" / "tokenizer").fingerprint}
    for name, file in NAMES.items():
        meta = json.loads((out / f"{file}.meta.json").read_text())
        state[f"{name}.sidecar"] = meta["fingerprint"]
        state[f"{name}.tokenizer"] = meta["tokenizer_fingerprint"]
        state[f"{name}.content"] = content_fingerprint(out / file)
    return state


def _find(exc: BaseException | None, cls: type) -> BaseException | None:
    while exc is not None and not isinstance(exc, cls):
        exc = exc.__cause__ or exc.__context__
    return exc


def _files(project: Path) -> list[str]:
    """Every file or directory under the output folders, hidden ones included."""
    return sorted(str(p.relative_to(project)) for d in OUTPUT_DIRS for p in (project / "data" / d).rglob("*"))


def _chattr(flag: str, path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["chattr", flag, str(path)], check=False, capture_output=True, text=True)


@contextlib.contextmanager
def read_only(directory: Path):
    """``directory`` refuses new files, even to root: a read-only bind mount, else ``chattr +i``; else skip."""

    def ok(*cmd: str) -> bool:
        return subprocess.run(cmd, check=False, capture_output=True).returncode == 0

    undo = None
    if ok("mount", "--bind", str(directory), str(directory)):
        if ok("mount", "-o", "remount,ro,bind", str(directory)):
            undo = ["umount", str(directory)]
        else:
            ok("umount", str(directory))
    if undo is None and _chattr("+i", directory).returncode == 0:
        undo = ["chattr", "-i", str(directory)]
    if undo is None:
        pytest.skip("cannot make a directory read-only for this user (no bind mount, no chattr +i)")
    try:
        probe = directory / "probe"
        with contextlib.suppress(OSError):
            probe.write_text("x")
            probe.unlink()
            pytest.skip(f"{' '.join(undo)}: the directory still accepts files")
        yield
    finally:
        subprocess.run(undo, check=False)


def test_failed_save_keeps_previous_set_and_mixed_set_is_refused(project, tmp_path_factory):
    _run(project)
    before = _state(project)
    assert all(v == before["tokenizer"] for k, v in before.items() if k.endswith(".tokenizer"))

    # New raw data with a character the old tokenizer lacks: the next data_prep has another tokenizer.
    _append_sft(project, {"input": "reverse: Zq\n", "output": "qZ"})
    with read_only(project / "data" / "05_model_input"), pytest.raises(Exception) as excinfo:
        _run(project)
    err = _find(excinfo.value, OutputsNotWritten)
    assert err is not None, f"expected OutputsNotWritten, got {excinfo.value!r}"
    assert "05_model_input/sft_train.npz: cannot write" in str(err) and "previous ones are unchanged" in str(err)
    assert _state(project) == before  # tokenizer and arrays: the previous run's, all of them
    tokenizer, arts = _catalog_artifacts(project)
    check_tokenized_with(tokenizer, **arts)
    assert not [f for f in _files(project) if Path(f).name.startswith(".")]  # no staged files left

    # The state the old one-by-one saving left behind: the new tokenizer next to the previous arrays.
    old = tmp_path_factory.mktemp("old_arrays")
    for file in (project / "data" / "05_model_input").iterdir():
        shutil.copy(file, old / file.name)
    _run(project)
    after = _state(project)
    assert after["tokenizer"] != before["tokenizer"] and after["sft_train.content"] != before["sft_train.content"]
    assert all(v == after["tokenizer"] for k, v in after.items() if k.endswith(".tokenizer"))
    for name in ("sft_val", "pref_train"):
        for suffix in ("", ".meta.json"):
            shutil.copy(old / f"{NAMES[name]}{suffix}", project / "data" / "05_model_input" / f"{NAMES[name]}{suffix}")
    tokenizer, arts = _catalog_artifacts(project)
    with pytest.raises(DataValidationError) as excinfo:
        check_tokenized_with(tokenizer, **arts)
    msg = str(excinfo.value)
    assert msg.startswith("sft_val, pref_train were not tokenized with the tokenizer")
    assert f"(fingerprint {after['tokenizer']})" in msg and f"tokenizer {before['tokenizer']}" in msg
    assert "sft_train" not in msg and "rerun `kedro run --pipelines data_prep`" in msg

    # Every stage checks the same before it launches anything: SFT on the mixed set stops with that message.
    with _session(project) as session, pytest.raises(DataValidationError, match=r"^sft_val\.npz was not tokenized"):
        session.run(pipeline_names=["sft"])
    assert not list((project / "data").rglob("rank0.log"))  # no job was started


def test_rename_refused_half_way_through_the_commit_restores_previous_set(project):
    _run(project)
    before = _state(project)
    _append_sft(project, {"input": "reverse: Zq\n", "output": "qZ"})
    # The last artifact's sidecar cannot be renamed away: by then the other artifacts are already replaced.
    blocked = project / "data" / "05_model_input" / "prompts_val.jsonl.meta.json"
    proc = _chattr("+i", blocked)
    if proc.returncode != 0:
        pytest.skip(f"chattr +i not possible here: {proc.stderr.strip()}")
    try:
        with pytest.raises(Exception) as excinfo:
            _run(project)
    finally:
        _chattr("-i", blocked)
    err = _find(excinfo.value, OutputsNotWritten)
    assert err is not None, f"expected OutputsNotWritten, got {excinfo.value!r}"
    assert "prompts_val.jsonl.meta.json: cannot put the new version in place" in str(err)
    assert "the previous ones were restored" in str(err)
    assert _state(project) == before
    assert not [f for f in _files(project) if Path(f).name.startswith(".")]  # no staged files, no backups


def test_failed_first_run_leaves_nothing(project):
    with read_only(project / "data" / "05_model_input"), pytest.raises(Exception) as excinfo:
        _run(project)
    assert _find(excinfo.value, OutputsNotWritten) is not None
    assert _files(project) == []  # no tokenizer, no arrays, no staged files


def test_dubious_counted_by_default_and_refused_on_request(project):
    _append_sft(project, {"input": "add: 1+1\n", "output": " "})  # line 41: empty answer
    pref = project / "data" / "01_raw" / "preference.jsonl"
    lines = pref.read_text().splitlines()
    first = json.loads(lines[0])
    lines[2] = json.dumps({**first, "rejected_response": first["chosen_response"]})  # line 3: chosen == rejected
    lines.append(lines[0])  # line 21: duplicate of line 1
    pref.write_text("\n".join(lines) + "\n")

    metrics = _run(project)["data_prep_metrics"].load()
    assert {k: v for k, v in metrics.items() if "_dubious_" in k} == {
        "sft_dubious_duplicates": 0,
        "sft_dubious_empty_answers": 1,
        "preference_dubious_duplicates": 1,
        "preference_dubious_empty_answers": 0,
        "preference_dubious_chosen_equals_rejected": 1,
        "prompts_dubious_duplicates": 0,
        "prompts_dubious_empty_answers": 0,
    }

    for d in OUTPUT_DIRS:  # start again from empty outputs
        shutil.rmtree(project / "data" / d)
        (project / "data" / d).mkdir()
    params = project / "conf" / "base" / "parameters_data_prep.yml"
    params.write_text(params.read_text().replace("dubious: warn", "dubious: refuse"))
    with pytest.raises(Exception) as excinfo:
        _run(project)
    err = _find(excinfo.value, DataValidationError)
    assert err is not None, f"expected DataValidationError, got {excinfo.value!r}"
    msg = str(err)
    assert "sft.jsonl line 41: empty or whitespace-only answer" in msg
    assert "preference.jsonl line 21 (= line 1): exact duplicate of an earlier line" in msg
    assert "preference.jsonl line 3: chosen_response is identical to rejected_response" in msg
    assert _files(project) == []


# A data_prep run in its own process, SIGKILLed (a real kill -9, as the OOM killer sends it) at the k-th rename of
# one phase: "stage" = a temp file/directory becoming a staged write (killed just before it: the temp is left),
# "commit" = a staged write becoming the final output (killed after the final was moved to its .old backup).
KILLED_RUN = """
import os, signal, sys
from pathlib import Path

phase, k = sys.argv[1], int(sys.argv[2])
real_replace, seen = os.replace, [0]


def replace(src, dst, *args, **kwargs):
    src_name, dst_name = Path(src).name, Path(dst).name
    if phase == "stage":
        hit = src_name.endswith(".tmp") and ".staged" in dst_name
    else:
        hit = ".staged" in src_name and not dst_name.startswith(".")
    seen[0] += hit
    if hit and seen[0] == k:
        os.kill(os.getpid(), signal.SIGKILL)
    return real_replace(src, dst, *args, **kwargs)


os.replace = replace
from kedro.framework.session import KedroSession
from kedro.framework.startup import bootstrap_project

bootstrap_project(Path.cwd())
with KedroSession.create(project_path=Path.cwd()) as session:
    session.run(pipeline_names=["data_prep"])
"""


def _killed_run(project: Path, phase: str, k: int) -> list[str]:
    """Run data_prep in a child process SIGKILLed at the ``k``-th rename of ``phase``; returns the hidden files left."""
    done = subprocess.run([sys.executable, "-c", KILLED_RUN, phase, str(k)], cwd=project, capture_output=True,
                          text=True, timeout=300, check=False)  # fmt: skip
    assert done.returncode == -signal.SIGKILL, done.stdout + done.stderr
    return [f for f in _files(project) if Path(f).name.startswith(".")]


def test_leftovers_of_a_data_prep_killed_mid_write_are_removed_by_the_next_run(project):
    _run(project)
    staged = _killed_run(project, "stage", 3)  # killed while writing the third staged file
    assert any(Path(f).name.endswith(".tmp") and ".staged" in f for f in staged), staged
    committing = _killed_run(project, "commit", 3)  # killed mid-commit: two outputs replaced, the third moved away
    assert any(Path(f).name.endswith(".old") for f in committing), committing
    assert not (project / "data" / "05_model_input" / "sft_val.npz").exists()  # its previous version: a backup

    _run(project)
    assert [f for f in _files(project) if Path(f).name.startswith(".")] == []
    state = _state(project)
    assert all(v == state["tokenizer"] for k, v in state.items() if k.endswith(".tokenizer"))
    tokenizer, arts = _catalog_artifacts(project)
    check_tokenized_with(tokenizer, **arts)
