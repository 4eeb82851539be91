"""A tiny torchrun entry point for the launcher tests (importable through PYTHONPATH=tests/launch).

    python -m torch.distributed.run --nproc-per-node 2 -m toy_entry --config cfg.json

config: run_dir, mode ("ok" | "fail" | "hang" | "no_result" | "fill"), steps, fail_rank, fork_child (each rank forks
a child that sleeps, as a checkpoint writer would, and names it in ``child<rank>``), fail_after_fork (the failing
rank forks its child first). ``fill`` writes to the run
directory until the disk is full.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from align_pipeline.tracking import RunLogger


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    cfg = json.loads(Path(parser.parse_args().config).read_text())
    run_dir = Path(cfg["run_dir"])
    mode, steps = cfg.get("mode", "ok"), cfg.get("steps", 3)

    dist.init_process_group(os.environ.get("ALIGN_BACKEND") or ("nccl" if torch.cuda.is_available() else "gloo"))
    rank, world = dist.get_rank(), dist.get_world_size()
    (run_dir / f"pid{rank}").write_text(str(os.getpid()))
    print(f"rank {rank} on stderr", file=sys.stderr)
    failing = mode == "fail" and rank == cfg.get("fail_rank", 1)
    if failing and not cfg.get("fail_after_fork"):
        raise ValueError(f"boom from rank {rank}")
    if cfg.get("fork_child"):
        child = os.fork()
        if child == 0:  # a forked helper: sleeps until killed, never runs the training code
            while True:
                time.sleep(1)
        (run_dir / f"child{rank}").write_text(str(child))
    if failing:
        raise ValueError(f"boom from rank {rank}")
    if mode == "fill":
        with open(run_dir / f"filler{rank}", "wb") as f:
            while True:
                f.write(b"x" * (1 << 20))
                f.flush()

    log = RunLogger(rank, system_metrics=True)
    log.log_params({"toy": {"steps": steps, "mode": mode}})
    x = torch.ones(1)
    for step in range(1, steps + 1):
        dist.all_reduce(x)  # all ranks in lock step; a dead peer fails this
        loss = 1.0 / step
        log.log_metrics({"loss": loss}, step=step)
        if rank == 0:
            print(f"step {step}/{steps} | loss {loss:.3f} | lr 1.0e-03 | 100 tok/s | eta 0:00:01")
        if mode == "hang":
            time.sleep(0.2)
    log.log_system_metrics(step=steps)
    log.close()
    if rank == 0 and mode != "no_result":
        result = {
            "final_loss": 1.0 / steps,
            "world_size": world,
            "allreduced": x.item(),
            "env": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "ALIGN_BACKEND", "NCCL_NVLS_ENABLE", "TOY")},
        }
        (run_dir / "result.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
