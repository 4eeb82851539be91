"""torchrun worker for tests: load HF model dirs into our GPT at some TP/PP; write logits, parameters and load errors.

    {"run_dir": ..., "layouts": {layout: {parallel config}}, "seq_length": int, "tokens": [[...]],
     "models": {name: hf_dir}, "bad_dirs": {name: hf_dir}}
    ->  run_dir/result.json {layout: {"logits": {name: [...]} (PP=1 only), "errors": {name: message}}}
        run_dir/<layout>/params_<name>_rank<r>.pt: this rank's parameters, layer names global ("decoder.layers.<i>.")

Layouts run one after the other in the same processes (Megatron's groups are re-created for each), which saves a
torchrun start per layout.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import torch
from megatron.core import parallel_state

from align_pipeline.config import ModelConfig, ParallelConfig, from_dict
from align_pipeline.model import init
from align_pipeline.model.gpt import build_gpt
from align_pipeline.model.sequences import position_ids
from align_pipeline.train.core.distributed import init_distributed, shutdown


def _global_params(model) -> dict[str, torch.Tensor]:
    out = {}
    for name, param in model.named_parameters():
        if m := re.match(r"decoder\.layers\.(\d+)\.(.+)", name):
            name = f"decoder.layers.{model.decoder.layers[int(m.group(1))].layer_number - 1}.{m.group(2)}"
        out[name] = param.detach().clone()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    cfg = json.loads(Path(parser.parse_args().config).read_text())
    run_dir = Path(cfg["run_dir"])
    results = {}
    for layout, parallel_dict in cfg["layouts"].items():
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        (run_dir / layout).mkdir(exist_ok=True)
        results[layout] = run_layout(cfg, from_dict(ParallelConfig, parallel_dict), run_dir / layout)
    if torch.distributed.get_rank() == 0:
        (run_dir / "result.json").write_text(json.dumps(results))
    shutdown()


def run_layout(cfg: dict, parallel: ParallelConfig, out_dir: Path) -> dict:
    dist = init_distributed(parallel, seed=0)
    base = ModelConfig(seq_length=cfg["seq_length"], attention_backend="sdpa")
    tokens = torch.tensor(cfg["tokens"], dtype=torch.long)
    result = {"logits": {}, "errors": {}}

    def build(hf_dir: str):
        source = init.resolve(hf_dir, base, tokenizer_vocab_size=0)
        model = build_gpt(source.model, parallel, source.vocab_size, dist.pgs,
                          pre_process=dist.is_first_stage, post_process=dist.is_last_stage)
        return source, model

    for name, hf_dir in cfg.get("models", {}).items():
        source, model = build(hf_dir)
        source.load(model)
        model.eval()
        torch.save(_global_params(model), out_dir / f"params_{name}_rank{dist.rank}.pt")
        if dist.pp_size == 1:
            with torch.no_grad():
                logits = model(tokens, position_ids(tokens), None, runtime_gather_output=True)
            result["logits"][name] = logits[..., : source.vocab_size].tolist()

    for name, hf_dir in cfg.get("bad_dirs", {}).items():
        source, model = build(hf_dir)
        try:
            source.load(model)
        except Exception as exc:  # noqa: BLE001 — the test checks the message
            result["errors"][name] = f"{type(exc).__name__}: {exc}"
    return result


if __name__ == "__main__":
    main()
