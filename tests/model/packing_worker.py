"""torchrun worker for tests: per-sample NLL of the same SFT samples, padded rows vs one packed sequence.

    {"run_dir": ..., "checkpoint": ..., "parallel": {...}, "data": "sft_val.npz", "samples": [i, ...],
     "pairs": "pref_val.npz" | null, "reward_model": checkpoint}
      ->  run_dir/result.json {"padded": [nll sum per sample], "packed": [...], "tokens": [loss tokens per sample],
                               "padded_loss": mean, "packed_loss": mean, "rows": packed rows, "segments": n,
                               "pair_logps_padded" / "_packed", "pair_tokens_*", "pair_reward_{mean,last}_*": [2n]
                               (chosen of every sample, then rejected), "pair_rows": packed rows}
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
from align_pipeline.model.attention import flex_attention_available
from align_pipeline.model.logprobs import token_nll
from align_pipeline.model.sequences import pair_batch, per_sequence_sum, run, sequence_rewards
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
        batch = {k: torch.from_numpy(v).to(dist.device) for k, v in rows.take(idx).items()}  # [n, S] right-padded
        nll = token_nll(run(model, batch["input_ids"]), batch["labels"], V, dist.tp_rank)  # [n, S]
        padded = (nll * batch["loss_mask"]).sum(-1)  # [n]
        padded_loss = masked_token_loss(nll, batch["loss_mask"])

        packs = pack(rows.lengths, idx, S)
        mb = {k: torch.from_numpy(v).to(dist.device) for k, v in packed_microbatch([rows], packs, S, rows.pad_id).items()}
        nll_p = token_nll(run(model, mb["input_ids"], mb), mb["labels"], V, dist.tp_rank)[0]  # [T]
        packed_loss = masked_token_loss(nll_p[None], mb["loss_mask"])
        starts = {}
        for r, samples in enumerate(packs):  # where each sample sits in the packed sequence
            at = r * S
            for i in samples:
                starts[i] = at
                at += int(rows.lengths[i])
        packed = [float((nll_p * mb["loss_mask"][0])[starts[i] : starts[i] + int(rows.lengths[i])].sum().cpu())
                  for i in idx.tolist()]
    result = {"padded": padded.tolist(), "packed": packed, "tokens": batch["loss_mask"].sum(-1).tolist(),
              "padded_loss": [float(padded_loss[0]), float(padded_loss[1])],
              "packed_loss": [float(packed_loss[0]), float(packed_loss[1])],
              "rows": len(packs), "segments": len(mb["cu_seqlens"]) - 1,
              "flex_attention": bool(torch.cuda.is_available() and flex_attention_available())}
    if cfg.get("pairs"):
        result.update(pairs(model, cfg, parallel, dist, idx, V))
    if dist.rank == 0:
        (Path(cfg["run_dir"]) / "result.json").write_text(json.dumps(result))
    shutdown()


def pairs(policy, cfg: dict, parallel, dist, idx: np.ndarray, V: int) -> dict:
    """Preference pairs padded (stacked chosen over rejected) vs packed (chosen and rejected side by side):
    the policy's per-sequence log-probs and token counts (DPO), the reward model's pooled rewards (mean, last)."""
    arrays = load_sequences(cfg["pairs"])
    groups = [arrays.rows["chosen_"], arrays.rows["rejected_"]]
    S = groups[0].seq_length
    padded = {f"{side}_{k}": torch.from_numpy(v).to(dist.device) for side, rows in zip(("chosen", "rejected"), groups)
              for k, v in rows.take(idx).items()}
    row = 3 * S  # the demo's pairs fill most of its seq_length: longer rows so that several share one
    packs = pack(groups[0].lengths + groups[1].lengths, idx, row)
    packed = {k: torch.from_numpy(v).to(dist.device)
              for k, v in packed_microbatch(groups, packs, row, groups[0].pad_id).items()}
    order = packed["sample_index"].tolist()  # the packed micro-batch's sample order
    pos = [order.index(i) for i in idx.tolist()]  # where sample idx[j] sits in the packed numbering
    k = len(order)
    out = {}
    rm_source = init.resolve(cfg["reward_model"], ModelConfig(attention_backend="sdpa"), tokenizer_vocab_size=0)
    rm = build_frozen(rm_source, parallel, dist, head="value")
    with torch.no_grad():
        for name, b in (("padded", padded), ("packed", packed)):
            ids, labels, mask = pair_batch(b)
            nll = token_nll(run(policy, ids, b), labels, V, dist.tp_rank)
            logps = -per_sequence_sum(nll * mask, b)  # [2n]
            tokens = per_sequence_sum(mask, b)
            values = run(rm, ids, b)
            rewards = {p: sequence_rewards(values, mask, p, b) for p in ("mean", "last")}
            if name == "packed":  # into idx order: sequence j of the padded stack = sample idx[j]
                sel = torch.tensor(pos + [k + p for p in pos], device=logps.device)
                logps, tokens = logps[sel], tokens[sel]
                rewards = {p: r[sel] for p, r in rewards.items()}
            out[f"pair_logps_{name}"] = logps.tolist()
            out[f"pair_tokens_{name}"] = tokens.tolist()
            out.update({f"pair_reward_{p}_{name}": r.tolist() for p, r in rewards.items()})
    out["pair_rows"] = len(packs)
    return out


if __name__ == "__main__":
    main()
