"""All-or-nothing writes: StagedWrites on its own, the datasets' commit_group, and the hook under a real Kedro runner.

Failures are real: a file where a directory must go (fails even for root), ``chattr +i`` for a rename that fails
half-way through a commit (skipped where the filesystem or user cannot set it).
"""

from __future__ import annotations

import logging
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from align_pipeline.data.formats import ArrayBundle, RecordBundle, load_artifact, load_npz, save_npz, sidecar_path
from align_pipeline.data.staging import OutputsNotWritten, StagedWrites, close_group, current_group, open_group
from align_pipeline.data.tokenizer import load_tokenizer, train_tokenizer


def _hidden(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob(".*"))


def _stage_text(staging: StagedWrites, final: Path, text: str) -> None:
    staged = staging.staged_path(final)
    staging.stage([(staged, final)], lambda: staged.write_text(text))


@pytest.fixture
def immutable():
    """``immutable(path)`` sets ``chattr +i`` (undone at teardown); skips where that is not possible."""
    done = []

    def make(path: Path) -> None:
        proc = subprocess.run(["chattr", "+i", str(path)], check=False, capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"chattr +i not possible here: {proc.stderr.strip()}")
        done.append(path)

    yield make
    for path in done:
        subprocess.run(["chattr", "-i", str(path)], check=False)


def test_nothing_visible_until_commit_then_all_in_place(tmp_path):
    a, b = tmp_path / "x" / "a.txt", tmp_path / "y" / "b.txt"
    a.parent.mkdir()
    a.write_text("old a")
    tok_dir = tmp_path / "tok"
    train_tokenizer(["abc"]).save(tok_dir)
    new_tok = train_tokenizer(["abcdef"])

    staging = StagedWrites("test outputs")
    _stage_text(staging, a, "new a")
    _stage_text(staging, b, "new b")
    staged_tok = staging.staged_path(tok_dir)
    staging.stage([(staged_tok, tok_dir)], lambda: new_tok.save(staged_tok), last=True)
    assert a.read_text() == "old a" and not b.exists()  # staged only
    assert load_tokenizer(tok_dir).fingerprint != new_tok.fingerprint
    assert len(_hidden(tmp_path)) == 3

    staging.commit()
    assert staging.state == "committed"
    assert a.read_text() == "new a" and b.read_text() == "new b"
    assert load_tokenizer(tok_dir).fingerprint == new_tok.fingerprint
    assert _hidden(tmp_path) == []  # no staged files, no backups


def test_failed_write_aborts_the_whole_set(tmp_path):
    a = tmp_path / "a.txt"
    a.write_text("old a")
    (tmp_path / "blocker").write_text("a file where a directory must go")
    staging = StagedWrites("test outputs")
    _stage_text(staging, a, "new a")
    with pytest.raises(OutputsNotWritten) as excinfo:
        _stage_text(staging, tmp_path / "blocker" / "b.txt", "new b")
    msg = str(excinfo.value)
    assert "blocker/b.txt: cannot write" in msg and "the previous ones are unchanged" in msg
    assert staging.state == "aborted" and a.read_text() == "old a" and _hidden(tmp_path) == []
    with pytest.raises(OutputsNotWritten, match="blocker/b.txt: cannot write"):  # later writes: the first failure
        _stage_text(staging, a, "again")
    with pytest.raises(OutputsNotWritten, match="cannot commit"):
        staging.commit()


def test_write_that_produces_nothing_is_a_failure(tmp_path):
    staging = StagedWrites("test outputs")
    final = tmp_path / "a.txt"
    with pytest.raises(OutputsNotWritten, match="did not produce"):
        staging.stage([(staging.staged_path(final), final)], lambda: None)


def test_rename_failing_half_way_restores_previous_set(tmp_path, immutable):
    finals = [tmp_path / f"{n}.txt" for n in "abcd"]
    for f in finals[:3]:
        f.write_text(f"old {f.stem}")  # d.txt is new in this set
    staging = StagedWrites("test outputs")
    for f in finals:
        _stage_text(staging, f, f"new {f.stem}")
    immutable(finals[2])  # c.txt cannot be renamed away: a and b are already replaced by then
    with pytest.raises(OutputsNotWritten) as excinfo:
        staging.commit()
    assert "c.txt: cannot put the new version in place" in str(excinfo.value)
    assert "the previous ones were restored" in str(excinfo.value)
    assert [f.read_text() for f in finals[:3]] == ["old a", "old b", "old c"] and not finals[3].exists()
    assert staging.state == "aborted" and _hidden(tmp_path) == []


def _leftover_names(final: str, ident: str) -> list[str]:
    """What a writer ``ident`` killed while staging / committing ``final`` (with its sidecar) leaves, named as
    StagedWrites, atomic_open (formats.py) and TextTokenizer.save name them."""
    return [
        f".{final}.{ident}.staged",  # a staged write
        f".{final}.{ident}.staged.meta.json",  # its sidecar
        f"..{final}.{ident}.staged.k3j_9x0q.tmp",  # atomic_open's temp file of the staged write
        f"..{final}.{ident}.staged.meta.json.q1w2e3r4.tmp",  # ... of the staged sidecar
        f".{final}.{ident}.old",  # commit's backup of the previous version
        f".{final}.meta.json.{ident}.old",  # ... of its sidecar
    ]


def test_leftovers_of_gone_writers_are_removed_and_live_ones_kept(tmp_path):
    final = tmp_path / "a.npz"
    final.write_text("old")
    sleeper = subprocess.Popen(["sleep", "60"])  # a live writer (another process)
    try:
        gone = {"dead": f"{_dead_pid()}-0000abcd", "reused": f"{os.getpid()}-0000beef"}  # reused: this pid, not our id
        live = f"{sleeper.pid}-1111abcd"
        for ident in [*gone.values(), live]:
            for name in _leftover_names("a.npz", ident):
                (tmp_path / name).write_text("x")
        unrelated = [".a.npz.notes", f".b.npz.{gone['dead']}.old", "a.npz.meta.json.bak"]
        for name in unrelated:
            (tmp_path / name).write_text("x")

        staging = StagedWrites("test outputs")
        staged = staging.staged_path(final)
        pairs = [(staged, final), (sidecar_path(staged), sidecar_path(final))]
        staging.stage(pairs, lambda: [p.write_text("new") for p, _ in pairs])
        backups = {f".a.npz.{i}.old" for i in gone.values()} | {f".a.npz.meta.json.{i}.old" for i in gone.values()}
        # staging removes staged writes and temp files; backups stay until a new version is in place
        assert {p.name for p in tmp_path.iterdir() if gone["dead"] in p.name or gone["reused"] in p.name} == backups | {
            f".b.npz.{gone['dead']}.old"
        }
        staging.commit()
        assert final.read_text() == "new" and sidecar_path(final).read_text() == "new"
        left = sorted(p.name for p in tmp_path.iterdir())
        assert left == sorted(["a.npz", "a.npz.meta.json", *unrelated, *_leftover_names("a.npz", live)])
    finally:
        sleeper.kill()
        sleeper.wait()


def test_tokenizer_save_removes_leftovers_of_a_killed_save(tmp_path):
    tok_dir = tmp_path / "tok"
    train_tokenizer(["abc"]).save(tok_dir)
    dead = f"{_dead_pid()}-0000abcd"
    for name in (f".tok.{dead}.tmp", f".tok.{dead}.old", f"..tok.{dead}.staged.{dead}.tmp"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "tokenizer.json").write_text("{}")
    train_tokenizer(["abcd"]).save(tok_dir)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tok"]
    assert load_tokenizer(tok_dir).vocab_size == train_tokenizer(["abcd"]).vocab_size


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


# ---------------------------------------------------------------------------------------------------------------
# Datasets with commit_group
# ---------------------------------------------------------------------------------------------------------------


def _bundle(seed: int, tok_fp: str = "t") -> ArrayBundle:
    rng = np.random.default_rng(seed)
    return ArrayBundle(arrays={"input_ids": rng.integers(0, 9, (2, 4))}, meta={"tokenizer_fingerprint": tok_fp})


def test_datasets_stage_into_the_open_group(tmp_path):
    from align_pipeline.datasets import PromptsJsonlDataset, TokenizedNpzDataset, TokenizerDirDataset

    npz = TokenizedNpzDataset(filepath=str(tmp_path / "m" / "x.npz"), commit_group="g")
    jsonl = PromptsJsonlDataset(filepath=str(tmp_path / "m" / "p.jsonl"), commit_group="g")
    tok_ds = TokenizerDirDataset(path=str(tmp_path / "t" / "tok"), commit_group="g")
    tok = train_tokenizer(["abc"])
    staging = open_group("g")
    try:
        assert current_group("g") is staging
        npz.save(_bundle(0))
        jsonl.save(RecordBundle(records=[{"prompt": "a"}], meta={"num_samples": 1}))
        tok_ds.save(tok)
        assert not npz.exists() and not jsonl.exists() and not tok_ds.exists()
        staging.commit()
    finally:
        close_group("g", staging)
    assert current_group("g") is None
    assert npz.exists() and jsonl.exists() and tok_ds.load().fingerprint == tok.fingerprint
    assert load_artifact(tmp_path / "m" / "x.npz", verify=True).meta["tokenizer_fingerprint"] == "t"
    assert _hidden(tmp_path) == []


def test_without_open_group_datasets_write_at_once_and_warn(tmp_path, caplog):
    from align_pipeline.datasets import TokenizedNpzDataset

    ds = TokenizedNpzDataset(filepath=str(tmp_path / "x.npz"), commit_group="no-hook-group")
    with caplog.at_level(logging.WARNING):
        ds.save(_bundle(0))
        ds.save(_bundle(1))
    assert ds.exists()
    warnings = [r.getMessage() for r in caplog.records if "no-hook-group" in r.getMessage()]
    assert len(warnings) == 1 and "StagedOutputsHook" in warnings[0]


# ---------------------------------------------------------------------------------------------------------------
# The hook under Kedro's own runner (no session, no project)
# ---------------------------------------------------------------------------------------------------------------


def _run_node(catalog_dir: Path, seed: int, blocked: bool = False, is_async: bool = False) -> None:
    """One node, three outputs of commit_group ``g`` saved by Kedro's SequentialRunner with the hook registered
    (``is_async``: the outputs are saved concurrently, from a thread pool)."""
    from kedro.framework.hooks.manager import _create_hook_manager
    from kedro.io import DataCatalog
    from kedro.pipeline import Node, Pipeline
    from kedro.runner import SequentialRunner

    from align_pipeline.datasets import TokenizedNpzDataset, TokenizerDirDataset
    from align_pipeline.kedro.staged_outputs import StagedOutputsHook

    last_dir = catalog_dir / ("blocker" if blocked else "out")  # a file where the directory must go: saving fails
    catalog = DataCatalog(
        datasets={
            "tok": TokenizerDirDataset(path=str(catalog_dir / "tok"), commit_group="g"),
            "first": TokenizedNpzDataset(filepath=str(catalog_dir / "out" / "first.npz"), commit_group="g"),
            "second": TokenizedNpzDataset(filepath=str(last_dir / "second.npz"), commit_group="g"),
        }
    )
    tok = train_tokenizer(["abcdefgh"[: 2 + seed]])  # a different vocabulary per seed

    def make():
        return tok, _bundle(seed, tok.fingerprint), _bundle(seed + 100, tok.fingerprint)

    hooks = _create_hook_manager()
    hooks.register(StagedOutputsHook())
    pipeline = Pipeline([Node(make, inputs=None, outputs=["tok", "first", "second"], name="make")])
    SequentialRunner(is_async=is_async).run(pipeline, catalog, hooks)


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
def test_hook_commits_after_the_last_output_and_failures_keep_the_previous_set(tmp_path, is_async):
    _run_node(tmp_path, seed=1, is_async=is_async)
    first = load_npz(tmp_path / "out" / "first.npz")
    tok_fp = load_tokenizer(tmp_path / "tok").fingerprint
    assert load_artifact(tmp_path / "out" / "second.npz").meta["tokenizer_fingerprint"] == tok_fp

    (tmp_path / "blocker").write_text("not a directory")
    with pytest.raises(Exception) as excinfo:
        _run_node(tmp_path, seed=2, blocked=True, is_async=is_async)  # tok and first staged, second fails
    err = excinfo.value
    while err is not None and not isinstance(err, OutputsNotWritten):
        err = err.__cause__ or err.__context__
    assert err is not None and "blocker/second.npz: cannot write" in str(err)
    assert load_tokenizer(tmp_path / "tok").fingerprint == tok_fp
    assert np.array_equal(load_npz(tmp_path / "out" / "first.npz")["input_ids"], first["input_ids"])
    assert _hidden(tmp_path) == [] and current_group("g") is None

    _run_node(tmp_path, seed=3, is_async=is_async)
    assert load_tokenizer(tmp_path / "tok").fingerprint != tok_fp
    assert (
        load_artifact(tmp_path / "out" / "first.npz").meta["tokenizer_fingerprint"]
        == load_tokenizer(tmp_path / "tok").fingerprint
    )


def test_npz_staging_keeps_sidecar_with_its_data(tmp_path):
    """The staged sidecar is renamed to the final sidecar (not left under its staged name)."""
    final = tmp_path / "x.npz"
    save_npz(final, _bundle(0).arrays, {"tokenizer_fingerprint": "old"})
    from align_pipeline.datasets import TokenizedNpzDataset

    staging = open_group("sidecar-test")
    try:
        TokenizedNpzDataset(filepath=str(final), commit_group="sidecar-test").save(_bundle(1, "new"))
        assert load_artifact(final).meta["tokenizer_fingerprint"] == "old"
        staging.commit()
    finally:
        close_group("sidecar-test", staging)
    art = load_artifact(final, verify=True)
    assert art.meta["tokenizer_fingerprint"] == "new" and sorted(os.listdir(tmp_path)) == ["x.npz", "x.npz.meta.json"]
