"""Lineage tags and git provenance."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from align_pipeline.tracking import git_commit, git_dirty, git_tags, lineage_tags


def test_lineage_tags_flatten_to_strings():
    tags = lineage_tags(
        {
            "parents": {"sft_policy": "2024-05-01T10.00.00.000Z", "reward_model": None},
            "dataset_fingerprints": ["abc", "def"],
            "config_hash": "0123abcd",
            "step": 300,
        }
    )
    assert tags == {
        "lineage.parents.sft_policy": "2024-05-01T10.00.00.000Z",
        "lineage.dataset_fingerprints": '["abc", "def"]',
        "lineage.config_hash": "0123abcd",
        "lineage.step": "300",
    }
    assert all(isinstance(v, str) for v in tags.values())
    assert len(lineage_tags({"big": "x" * 9000})["lineage.big"]) == 8000


def test_git_outside_a_repo(tmp_path):
    assert git_commit(tmp_path) is None
    assert git_dirty(tmp_path) is None
    assert git_tags(tmp_path) == {}


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_git_commit_and_dirty_flag(tmp_path):
    def git(*args):
        return subprocess.run(
            ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(tmp_path), *args],
            check=True, capture_output=True, text=True,
        ).stdout.strip()  # fmt: skip

    git("init", "-q")
    assert git_commit(tmp_path) is None  # no commit yet
    (tmp_path / "f.txt").write_text("a")
    git("add", "f.txt")
    git("commit", "-q", "-m", "first")
    sha = git("rev-parse", "HEAD")
    assert git_commit(tmp_path) == sha and len(sha) == 40
    assert git_tags(tmp_path) == {"git.commit": sha, "git.dirty": "false"}
    (tmp_path / "f.txt").write_text("b")
    assert git_dirty(tmp_path) is True
    assert git_tags(tmp_path)["git.dirty"] == "true"
