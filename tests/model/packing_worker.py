"""torchrun worker for tests: per-sample NLL of the same SFT samples, padded rows vs one packed sequence.

    {"run_dir": ..., "checkpoint": ..., "parallel": {...}, "data": "sft_val.npz", "samples": [i, ...]}
      ->  run_dir/result.json {"padded": [nll sum per sample], "packed": [...], "tokens": [loss tokens per sample],
                               "padded_loss": mean, "packed_loss": mean, "rows": packed rows, "segments": n}
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from align_pipeline.config import ModelConfig, ParallelConfig, from_dict
from align_pipeline.data.packing import pack, packed_microbatch
from align_pipeline.data.store import load_sequences
from align_pipeline.losses.sft import masked_token_loss
from align_pipeline.model import init
from align_pipeline.model.logprobs import token_nll
from align_pipeline.model.sequences import run
from align_pipeline.train.core.distributed import init_distributed, shutdown
from align_pipeline.train.core.optimizer import build_frozen


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    cfg = json.loads(Path(parser.parse_args().config).read_text())
    parallel = from_dict(ParallelConfig, cfg["parallel"], "parallel")
    dist = init_distributed(parallel, seed=0)
    source = init.resolve(cfg["checkpoint"], ModelConfig(attention_backend="sdpa"), tokenizer_vocab_size=0)
    model = build_frozen(source, parallel, dist)
    rows = load_sequences(cfg["data"]).rows[""]
    idx = np.asarray(cfg["samples"], dtype=np.int64)
    S, V = rows.seq_length, source.vocab_size

    with torch.no_grad():
        batch = {k: torch.from_numpy(v) for k, v in rows.take(idx).items()}  # [n, S] right-padded
        nll = token_nll(run(model, batch["input_ids"]), batch["labels"], V, dist.tp_rank)  # [n, S]
        padded = (nll * batch["loss_mask"]).sum(-1)  # [n]
        padded_loss = masked_token_loss(nll, batch["loss_mask"])

        packs = pack(rows.lengths, idx, S)
        mb = {k: torch.from_numpy(v) for k, v in packed_microbatch(rows, packs, S, rows.pad_id).items()}
        nll_p = token_nll(run(model, mb["input_ids"], mb), mb["labels"], V, dist.tp_rank)[0]  # [T]
        packed_loss = masked_token_loss(nll_p[None], mb["loss_mask"])
        starts = {}
        for r, samples in enumerate(packs):  # where each sample sits in the packed sequence
            at = r * S
            for i in samples:
                starts[i] = at
                at += int(rows.lengths[i])
        packed = [float((nll_p * mb["loss_mask"][0])[starts[i] : starts[i] + int(rows.lengths[i])].sum())
                  for i in idx.tolist()]
    if dist.rank == 0:
        (Path(cfg["run_dir"]) / "result.json").write_text(json.dumps({
            "padded": padded.tolist(), "packed": packed, "tokens": batch["loss_mask"].sum(-1).tolist(),
            "padded_loss": [float(padded_loss[0]), float(padded_loss[1])],
            "packed_loss": [float(packed_loss[0]), float(packed_loss[1])],
            "rows": len(packs), "segments": len(mb["cu_seqlens"]) - 1}))
    shutdown()


if __name__ == "__main__":
    main()
