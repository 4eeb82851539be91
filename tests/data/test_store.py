"""Ragged storage of tokenized sequences: hand-computed rows, sample selection, memory-mapping, the older padded
layout still loading."""

import numpy as np
import pytest

from align_pipeline.data.formats import save_npz
from align_pipeline.data.store import as_rows, load_rows, load_sequences, mmap_npz, num_samples, ragged, select

SAMPLES = [([1, 10, 11, 2], [False, False, True, True]), ([1, 20, 2], [False, True, True]), ([1, 30], [False, True])]


def test_ragged_arrays_and_the_rows_they_stand_for():
    a = ragged(SAMPLES)
    assert a["tokens"].dtype == np.int32 and a["response"].dtype == np.uint8 and a["offsets"].dtype == np.int64
    assert a["tokens"].tolist() == [1, 10, 11, 2, 1, 20, 2, 1, 30] and a["offsets"].tolist() == [0, 4, 7, 9]
    rows = as_rows({**a, "reward": np.array([0.5, 1.5, 2.5], np.float32)}, seq_length=5, pad_id=0)
    assert rows["input_ids"].tolist() == [[1, 10, 11, 2, 0], [1, 20, 2, 0, 0], [1, 30, 0, 0, 0]]
    assert rows["labels"].tolist() == [[10, 11, 2, 0, 0], [20, 2, 0, 0, 0], [30, 0, 0, 0, 0]]  # shifted, pad after
    assert rows["loss_mask"].tolist() == [[0, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0]]  # label is a response
    assert rows["reward"].tolist() == [0.5, 1.5, 2.5] and set(rows) == {"input_ids", "labels", "loss_mask", "reward"}
    with pytest.raises(ValueError, match="4 tokens > seq_length 3"):
        as_rows(a, seq_length=3, pad_id=0)


def test_select_keeps_pairs_and_per_sample_arrays_together():
    pairs = {**ragged(SAMPLES, "chosen_"), **ragged(SAMPLES[::-1], "rejected_"),
             "chosen_reward": np.array([1.0, 2.0, 3.0], np.float32)}
    picked = select(pairs, [2, 0])
    assert num_samples(picked) == 2 and picked["chosen_reward"].tolist() == [3.0, 1.0]
    rows = as_rows(picked, seq_length=4, pad_id=0)
    assert rows["chosen_input_ids"].tolist() == [[1, 30, 0, 0], [1, 10, 11, 2]]
    assert rows["rejected_input_ids"].tolist() == [[1, 10, 11, 2], [1, 30, 0, 0]]


def test_files_are_memory_mapped_and_views_pad_per_batch(tmp_path):
    path = tmp_path / "sft.npz"
    save_npz(path, {**ragged(SAMPLES), "extra": np.arange(3.0)}, {"seq_length": 6, "pad_id": 0})
    raw = mmap_npz(path)
    assert all(isinstance(v, np.memmap) for v in raw.values())  # nothing read until touched
    with np.load(path) as z:
        assert all(np.array_equal(raw[k], z[k]) for k in z.files)
    arrays = load_sequences(path)
    assert len(arrays["input_ids"]) == 3 and arrays["input_ids"].shape == (3, 6)
    assert arrays["input_ids"][np.array([1])].tolist() == [[1, 20, 2, 0, 0, 0]]
    assert arrays.lengths().tolist() == [4, 3, 2]
    assert load_rows(path)["loss_mask"].sum() == 5  # 2 + 2 + 1 response labels


def test_the_older_padded_layout_loads_as_it_is(tmp_path):
    path = tmp_path / "old.npz"
    padded = {"input_ids": np.array([[1, 5, 2, 0]]), "labels": np.array([[5, 2, 0, 0]]),
              "loss_mask": np.array([[0, 1, 0, 0]], np.float32)}
    save_npz(path, padded, {"seq_length": 4})
    arrays = load_sequences(path)
    assert not arrays.rows and all(np.array_equal(arrays[k], v) for k, v in padded.items())
