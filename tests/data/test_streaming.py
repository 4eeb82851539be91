"""data_prep streams its input: raw records are read again on each pass (never all held), tokens and prompt records
are spilled to disk and written into their artifacts a chunk at a time. Checked here: peak memory does not grow
with the file (a real parquet file through data_prep's nodes, in processes of their own), the spilled path writes
exactly what the in-memory one does, and a source that changes between passes is refused."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from align_pipeline.data.errors import DataValidationError
from align_pipeline.data.formats import arrays_fingerprint, load_jsonl, records_fingerprint, save_jsonl, save_npz
from align_pipeline.data.schemas import StreamedRecords, parse_jsonl_bytes
from align_pipeline.data.sources import read_raw_path
from align_pipeline.data.store import RaggedBuilder, SpilledRecords, TakenArray, load_rows, ragged, select

WORKER = Path(__file__).with_name("streaming_worker.py")
SAMPLES = [([1, 10, 11, 2], [False, False, True, True]), ([1, 20, 2], [False, True, True]), ([1, 30], [False, True])]


BUFFER_BYTES = 1 << 20
"""data_prep's spill and read-back buffers in the measured processes: both files fill them (at the defaults, 16 MiB,
the small file's 5.4 MiB response-flag array did not, and the large one's peak was ~10 MiB higher for that alone)."""


def _measure(tmp_path: Path, rows: int, row_group: int) -> dict:
    out = subprocess.run([sys.executable, str(WORKER), str(tmp_path / f"r{rows}"), str(rows), "4000", str(row_group),
                          str(BUFFER_BYTES)], check=True, capture_output=True, text=True, timeout=600)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_peak_memory_does_not_grow_with_the_parquet_file(tmp_path):
    """4x the rows (5.7 -> 22.9 MiB of text, row groups of 1,024 rows in both files) adds almost nothing to what
    data_prep holds: the peak of Python's heap (tracemalloc, numpy arrays included) plus Arrow's pool grew 2.57 MiB
    in repeated runs (limit 0.25x the extra text, 4.3 MiB); reading the file whole (``pyarrow.parquet.read_table``)
    instead of a batch at a time grows it 58 MiB. Peak RSS is checked too, loosely: the C allocators keep freed
    pages, so it grew 12.7-13.5 MiB here and varied by several MiB between machines (streamed: limit 2x the extra
    text; read whole: +79 MiB). A row group is read whole, so memory does grow with the row group's size."""
    small, large = _measure(tmp_path, 1500, 1024), _measure(tmp_path, 6000, 1024)
    assert large["sft_train_samples"] + large["sft_val_samples"] == 6000
    extra_text = large["text_mib"] - small["text_mib"]
    assert large["peak_held_mib"] - small["peak_held_mib"] < 0.25 * extra_text, (small, large)
    assert large["peak_rss_mib"] - small["peak_rss_mib"] < 2 * extra_text, (small, large)


def test_spilled_arrays_write_what_in_memory_arrays_do(tmp_path):
    builder = RaggedBuilder()
    for sample in SAMPLES:
        builder.append(sample)
    spilled, memory = builder.arrays(), ragged(SAMPLES)
    assert {k: np.asarray(v).tolist() for k, v in spilled.items()} == {k: v.tolist() for k, v in memory.items()}
    picked, picked_memory = select(spilled, [2, 0]), select(memory, [2, 0])
    assert isinstance(picked["tokens"], TakenArray) and np.asarray(picked["tokens"]).tolist() == [1, 30, 1, 10, 11, 2]
    assert arrays_fingerprint(picked) == arrays_fingerprint(picked_memory)
    save_npz(tmp_path / "lazy.npz", picked, {"seq_length": 5, "pad_id": 0})
    save_npz(tmp_path / "eager.npz", picked_memory, {"seq_length": 5, "pad_id": 0})
    lazy, eager = load_rows(tmp_path / "lazy.npz"), load_rows(tmp_path / "eager.npz")
    assert {k: v.tolist() for k, v in lazy.items()} == {k: v.tolist() for k, v in eager.items()}
    assert lazy["input_ids"].tolist() == [[1, 30, 0, 0, 0], [1, 10, 11, 2, 0]]
    with np.load(tmp_path / "lazy.npz") as z:  # numpy's own reader agrees
        assert z["tokens"].tolist() == [1, 30, 1, 10, 11, 2] and z["offsets"].tolist() == [0, 2, 6]


def test_spilled_records_write_their_canonical_lines(tmp_path):
    records = [{"prompt": "ä", "answer": None, "prompt_ids": [1, 2]}, {"b": 1, "a": [1.5]}, {"prompt": "x"}]
    spilled = SpilledRecords()
    for r in records:
        spilled.append(r)
    assert list(spilled) == records and spilled[1] == records[1] and len(spilled) == 3
    taken = spilled.take([2, 0])
    assert taken == [records[2], records[0]] and records_fingerprint(taken) == records_fingerprint(taken[:])
    assert save_jsonl(tmp_path / "a.jsonl", taken).fingerprint == save_jsonl(tmp_path / "b.jsonl", taken[:]).fingerprint
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    assert load_jsonl(tmp_path / "a.jsonl") == [records[2], records[0]]


def test_streamed_records_equal_the_in_memory_ones_and_are_shared_by_copies(tmp_path):
    lines = [{"text": "User: add 1+2\nAssistant: 3"}, {"text": "User: add 1+2\nAssistant: 4"},
             {"text": "Q: hi\nA: yo"}, {"text": "Q: hi\nA: no"}]
    blob = "".join(json.dumps(r) + "\n" for r in lines).encode()
    (tmp_path / "rm.jsonl").write_bytes(blob)
    streamed, memory = read_raw_path(tmp_path / "rm.jsonl", "preference"), parse_jsonl_bytes(blob, "preference", "x")
    assert isinstance(streamed.records, StreamedRecords) and list(streamed.lines) == [1, 3] == memory.lines
    assert streamed.records == memory.records and len(streamed) == len(memory) == 2
    assert streamed.records[1] == {"prompt": "Q: hi\nA: ", "chosen_response": "yo", "rejected_response": "no"}
    assert copy.deepcopy(streamed).records is streamed.records  # Kedro's MemoryDataset copies; the source is shared


def test_a_file_changed_after_validation_is_refused(tmp_path):
    path = tmp_path / "sft.jsonl"
    path.write_text('{"input": "a", "output": "b"}\n{"input": "c", "output": "d"}\n')
    raw = read_raw_path(path, "sft")
    path.write_text('{"input": "a", "output": "b"}\n{"input": "c", "output": 4}\n')
    with pytest.raises(DataValidationError, match=r'line 2: field "output": .*changed after data_prep validated it'):
        list(raw.records)
    path.write_text('{"input": "a", "output": "b"}\n')
    with pytest.raises(DataValidationError, match="changed while data_prep read it: 1 records now, 2 when"):
        list(raw.records)
