"""data_prep's nodes over a generated parquet file of SFT conversations, in a process of its own; prints one JSON
line: rows, the text's size, the process's peak resident memory (``VmHWM``) and the peak of what data_prep held
(Python's heap, traced by ``tracemalloc``, plus Arrow's memory pool: allocations, not the allocators' retained pages).

    python tests/data/streaming_worker.py OUT_DIR ROWS CHARS_PER_ROW [ROW_GROUP_ROWS [CHUNK_BYTES]]

Used by test_streaming.py (small sizes, to show memory does not grow with the data) and by hand at larger sizes
(the figures in the notes). ``CHUNK_BYTES`` sets ``store.CHUNK_BYTES`` and ``store.SPILL_BUFFER`` (fixed-size buffers,
16 and 4 MiB by default) in the measured process: a file whose arrays are smaller than a buffer does not fill it, so
comparing two sizes below and above it measures the buffer, not growth with the file."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _peak_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def write_parquet(path: Path, rows: int, chars: int, row_group: int) -> int:
    """``rows`` SFT conversations of about ``chars`` characters each (deterministic, varied text), written a row
    group at a time; returns the characters written."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz    ", dtype=np.uint8)
    schema = pa.schema([("messages", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())])))])
    total = 0
    with pq.ParquetWriter(path, schema) as writer:
        for start in range(0, rows, row_group):
            batch = []
            for _ in range(min(row_group, rows - start)):
                text = letters[rng.integers(0, len(letters), chars)].tobytes().decode()
                cut = chars // 4
                batch.append([{"role": "user", "content": text[:cut]}, {"role": "assistant", "content": text[cut:]}])
                total += chars
            writer.write_table(pa.table({"messages": batch}, schema=schema), row_group_size=row_group)
    return total


def main(out: Path, rows: int, chars: int, row_group: int, chunk_bytes: int | None = None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    source = out / "sft.parquet"
    text = write_parquet(source, rows, chars, row_group)
    # The measured process reads what the catalog would give (an Artifact of the file), nothing generated here.
    import subprocess

    code = f"""
import json, sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
from streaming_worker import _peak_rss_mib, run_data_prep
print(json.dumps(run_data_prep({str(out)!r}, {chunk_bytes!r})))
"""
    result = json.loads(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                                       text=True).stdout.strip().splitlines()[-1])
    print(json.dumps({"rows": rows, "text_mib": text / 2**20, "parquet_mib": source.stat().st_size / 2**20,
                      **result}))


def run_data_prep(out: str, chunk_bytes: int | None = None) -> dict:
    """validate -> fit (char tokenizer) -> tokenize and split -> save, as ``kedro run --pipelines data_prep``'s nodes
    run them; the preference and prompts files (the node needs all three) are two lines each. ``chunk_bytes``: the
    size of data_prep's spill and read-back buffers (its defaults when None)."""
    from align_pipeline.data import store
    from align_pipeline.datasets import PromptsJsonlDataset, RawDataset, TokenizedNpzDataset
    from align_pipeline.pipelines.data_prep.nodes import fit_tokenizer, tokenize_and_split, validate_raw_data

    if chunk_bytes is not None:
        store.CHUNK_BYTES = store.SPILL_BUFFER = chunk_bytes

    base = _peak_rss_mib()
    import tracemalloc

    import pyarrow as pa

    tracemalloc.start()  # after the imports: what data_prep allocates, not the modules
    prompts = Path(out) / "prompts.jsonl"
    prompts.write_text('{"prompt": "add: 1+2", "answer": "3"}\n{"prompt": "add: 2+2", "answer": "4"}\n')
    pref = Path(out) / "pref.jsonl"
    pref.write_text('{"prompt": "a", "chosen_response": "b", "rejected_response": "c"}\n'
                    '{"prompt": "d", "chosen_response": "e", "rejected_response": "f"}\n')
    params = {"tokenizer": {"kind": "char", "vocab_size": 64}, "val_fraction": 0.05}
    raw, dubious = validate_raw_data(RawDataset(str(Path(out) / "sft.parquet")).load(),
                                     RawDataset(str(pref)).load(),
                                     RawDataset(str(prompts)).load(), params, {}, {}, {})
    tok = fit_tokenizer(raw, params)
    outputs = tokenize_and_split(raw, tok, dubious, params, {"seq_length": 1 << 16})
    _, sft_train, sft_val, _, _, prompts_train, _, metrics = outputs
    TokenizedNpzDataset(str(Path(out) / "sft_train.npz")).save(sft_train)
    TokenizedNpzDataset(str(Path(out) / "sft_val.npz")).save(sft_val)
    PromptsJsonlDataset(str(Path(out) / "prompts_train.jsonl")).save(prompts_train)
    held = tracemalloc.get_traced_memory()[1] + pa.default_memory_pool().max_memory()
    return {"base_rss_mib": base, "peak_rss_mib": _peak_rss_mib(), "peak_held_mib": held / 2**20,
            "sft_train_samples": metrics["sft_train_samples"], "sft_val_samples": metrics["sft_val_samples"], "npz_mib": (Path(out) / "sft_train.npz").stat().st_size / 2**20}


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]) if len(sys.argv) > 4 else 1024,
         int(sys.argv[5]) if len(sys.argv) > 5 else None)
