"""Cached reference log-probs: equal to an independent forward pass; reused on the same key, rebuilt on a new one."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from align_pipeline.config import LaunchConfig
from align_pipeline.data.formats import Artifact, load_artifact, load_npz, save_npz
from align_pipeline.data.store import load_rows, num_samples, select
from align_pipeline.data.tokenizer import load_tokenizer
from align_pipeline.launch import run_torchrun
from align_pipeline.pipelines.dpo.nodes import compute_reference_logps

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def setup(tiny_models, tmp_path_factory):
    return tmp_path_factory.mktemp("ref"), tiny_models["sft"], tiny_models["pref"]


def _node(root, policy, pref, train, micro=8, nproc=1):
    tok = Artifact(pref["tokenizer_dir"], load_tokenizer(pref["tokenizer_dir"]).fingerprint)
    return compute_reference_logps(
        policy, tok, train, load_artifact(pref["val"]),
        parallel={}, launch={"nproc_per_node": nproc},
        dpo={"reference_cache_dir": str(root / "cache"), "runs_dir": str(root / "runs"),
             "reference_micro_batch_size": micro},
    )


def _independent_logps(policy: str, npz: str, rows: slice, run_dir: Path) -> tuple[np.ndarray, np.ndarray]:
    """log pi(y|x) from full logits (logits_worker) + a numpy log-softmax: no code shared with the cached path."""
    arrays = load_rows(npz)
    out = []
    for side in ("chosen", "rejected"):
        ids, labels, mask = (arrays[f"{side}_{k}"][rows] for k in ("input_ids", "labels", "loss_mask"))
        run_dir_side = run_dir / side
        run_dir_side.mkdir(parents=True)
        logits = np.asarray(run_torchrun("align_pipeline.train.jobs.logits", {"checkpoint": policy, "parallel": {},
                                                            "tokens": ids.tolist()},
                                         LaunchConfig(), run_dir_side)["logits"])  # [b, s, V]
        logits = logits - logits.max(-1, keepdims=True)
        logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        picked = np.take_along_axis(logp, labels[..., None], -1)[..., 0]
        out.append((picked * mask).sum(-1))
    return out[0], out[1]


def test_cached_logps_equal_an_independent_forward_and_are_reused(setup, tmp_path):
    root, policy, pref = setup
    train = load_artifact(pref["train"])
    first = _node(root, policy, pref, train)
    assert first.meta["reused"] is False
    cached = np.load(first.path)
    chosen, rejected = _independent_logps(policy, pref["train"], slice(0, 6), tmp_path)
    np.testing.assert_allclose(cached["train_chosen_logps"][:6], chosen, atol=1e-4)
    np.testing.assert_allclose(cached["train_rejected_logps"][:6], rejected, atol=1e-4)
    assert (cached["train_chosen_tokens"] > 0).all()

    mtime = os.path.getmtime(first.path)
    again = _node(root, policy, pref, train)  # same key
    assert again.meta["reused"] is True and again.path == first.path and os.path.getmtime(first.path) == mtime

    # Changed data -> new key -> recomputed, here at DP=2 with another micro-batch size: the same numbers.
    arrays = load_npz(pref["train"])
    changed = tmp_path / "pref_train_changed.npz"
    meta = load_artifact(pref["train"]).meta
    save_npz(changed, select(arrays, range(num_samples(arrays) - 3)),
             {"source": "test", **{k: meta[k] for k in ("tokenizer_fingerprint", "seq_length", "pad_id")}})
    rebuilt = _node(root, policy, pref, load_artifact(changed), micro=4, nproc=2)  # new key: data changed
    assert rebuilt.meta["reused"] is False and rebuilt.path != first.path
    fresh = np.load(rebuilt.path)
    np.testing.assert_allclose(fresh["train_chosen_logps"], cached["train_chosen_logps"][:-3], atol=1e-4)
    np.testing.assert_allclose(fresh["val_rejected_logps"], cached["val_rejected_logps"], atol=1e-4)
