"""Launchers of the one-off model jobs (:mod:`align_pipeline.train.jobs`): what the Kedro nodes and the commands
call to import, export, merge or run a model in a torchrun job. The model library itself never launches anything.

    export(checkpoint, out, cfg, run_dir)          -> summary     (train.jobs.export: merge?, write, check)
    import_hf(hf_dir, checkpoint, tp, pp, ...)     -> summary     (train.jobs.import_hf, at TP x PP)
    materialize(artifact, out, run_dir)            -> out         (train.jobs.merge)
    checkpoint_outputs(request, work_dir)          -> outputs     (train.jobs.logits)
    check_parity(checkpoint, hf_dir, work_dir)     -> max |Δ|     (train.jobs.logits + transformers here)
    nemo_hf_dir(path)                              -> HF dir      (train.jobs.nemo_convert, once per content)

Imports of torch and transformers happen inside the functions that compare in this process (``check_parity``), so
a Kedro process importing this module stays free of them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from align_pipeline.config.base import from_dict, to_dict
from align_pipeline.config.common import ExportConfig, LaunchConfig, ModelConfig
from align_pipeline.data.formats import checkpoint_meta
from align_pipeline.launch.torchrun import run_torchrun

ONE = LaunchConfig(nproc_per_node=1)


def export(checkpoint: str, out: str, cfg: ExportConfig, run_dir: Path) -> dict[str, Any]:
    """Write the model checkpoint as an HF directory ``out`` in a one-process job; returns its summary (with the
    check's figures when ``cfg.check``)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_torchrun("align_pipeline.train.jobs.export", {"checkpoint": checkpoint, "out": out, **to_dict(cfg)},
                        ONE, run_dir, name=f"export {Path(checkpoint).name}")


def materialize(checkpoint: str | os.PathLike, out: str | os.PathLike, run_dir: str | os.PathLike) -> Path:
    """A LoRA artifact of adapters alone as a plain model checkpoint ``out`` (its base with the adapters merged)."""
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    result = run_torchrun("align_pipeline.train.jobs.merge", {"checkpoint": str(Path(checkpoint).resolve()),
                                                             "out": str(Path(out).resolve())},
                          ONE, run_dir, name=f"merge {Path(checkpoint).name}")
    return Path(result["out"])


def checkpoint_outputs(request: dict[str, Any], work_dir: str | os.PathLike) -> dict[str, Any]:
    """Our outputs for ``request`` (``{"checkpoint", "tokens", "generate"?}``: see
    :mod:`align_pipeline.train.jobs.logits`) from a one-rank job run in ``work_dir``."""
    Path(work_dir).mkdir(parents=True, exist_ok=True)
    return run_torchrun("align_pipeline.train.jobs.logits", request, ONE, Path(work_dir), name="--check")


def check_parity(checkpoint: str | os.PathLike, hf_dir: str | os.PathLike, work_dir: str | os.PathLike,
                 batch: int = 2, length: int = 16, seed: int = 0) -> float:
    """``max |Δ|`` between our checkpoint (Megatron, fp32, one rank, in a job) and an HF directory (``transformers``,
    fp32, in this process) on ``batch`` x ``length`` random ids of the real vocabulary (see
    :func:`align_pipeline.model.hf_export.parity`)."""
    import numpy as np

    from align_pipeline.model.hf_export import parity

    meta = checkpoint_meta(checkpoint)
    length = min(length, from_dict(ModelConfig, meta["model"], "meta.json model").seq_length)
    tokens = np.random.default_rng(seed).integers(0, int(meta["vocab_size"]), size=(batch, length)).tolist()
    ours = checkpoint_outputs({"checkpoint": str(checkpoint), "tokens": tokens}, work_dir)["logits"]
    return parity(ours, tokens, hf_dir, meta.get("head", "lm"))


def import_hf(hf_dir: str | os.PathLike, checkpoint: str | os.PathLike, tp: int = 1, pp: int = 1,
              seq_length: int | None = None, work_dir: str | os.PathLike | None = None,
              source: str | None = None, ep: int = 1) -> dict[str, Any]:
    """Convert the HF model in ``hf_dir`` into a model checkpoint at ``checkpoint`` (must not exist), written by a
    TP x PP x EP torchrun job (gloo on CPU, NCCL on GPUs; ``ep`` > 1: an MoE model's experts split over EP ranks). ``seq_length``: the training length recorded in the
    checkpoint (default: the model's context, at most 4096). Returns the job's summary. The job runs in ``work_dir``
    (default: a temporary directory, removed after a success and kept after a failure, whose error names its logs).
    ``source``: what ``hf_dir`` was converted from (a ``.nemo``), recorded as the checkpoint's parent.
    """
    from align_pipeline.model.hf import HFConversionError, model_config_from_hf, read_hf_config

    hf_dir, checkpoint = Path(hf_dir).resolve(), Path(checkpoint).resolve()
    if checkpoint.exists():
        raise HFConversionError(f"{checkpoint} exists; import into a new directory")
    context = read_hf_config(hf_dir).get("max_position_embeddings") or 4096
    seq_length = seq_length or min(int(context), 4096)
    model_config_from_hf(hf_dir, ModelConfig(seq_length=seq_length))  # refuse unsupported models before launching
    config = {"hf_dir": str(hf_dir), "out": str(checkpoint), "seq_length": seq_length, "source": source,
              "parallel": {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                           "expert_model_parallel_size": ep}}
    launch = LaunchConfig(nproc_per_node=tp * pp * ep)
    if work_dir:
        return run_torchrun("align_pipeline.train.jobs.import_hf", config, launch, Path(work_dir), name="import")
    with job_work_dir("align-import-") as work:
        return run_torchrun("align_pipeline.train.jobs.import_hf", config, launch, work / "job", name="import")


def nemo_hf_dir(path: str | os.PathLike) -> Path:
    """The HF conversion of a NeMo ``.nemo`` (:mod:`align_pipeline.model.nemo`): the cached one, or made by a
    one-process job (this process imports no torch). What the Kedro side resolves ``init_from`` and
    ``data_prep.tokenizer.hf_model_dir`` to; the jobs then find it in the cache. An archive the conversion refuses:
    a one-line :class:`~align_pipeline.model.nemo.NemoConversionError`, the job's own message (file and what is
    wrong) and its log; any other failure of the job: its :class:`~align_pipeline.launch.torchrun.LaunchError`."""
    import json

    from align_pipeline.launch.torchrun import LaunchError
    from align_pipeline.model.nemo import NemoConversionError, cache_target

    target = cache_target(path)
    if (target / "config.json").is_file():
        return target
    with job_work_dir("align-nemo-") as work:
        try:
            result = run_torchrun("align_pipeline.train.jobs.nemo_convert", {"nemo": str(Path(path).resolve())},
                                  ONE, work / "job", name=f"convert {Path(path).name}")
        except LaunchError as exc:
            refused = work / "job" / "refused.json"  # written by the job for a UserError, before it exits 1
            if not refused.is_file():
                raise
            message = json.loads(refused.read_text())["error"]
            raise NemoConversionError(f"{message} (conversion log: {exc.log_path})") from None
    return Path(result["hf_dir"])


@contextlib.contextmanager
def job_work_dir(prefix: str, parent: Path | None = None):
    """A fresh temporary directory for a conversion job (its run directory: ``<work>/job``), removed when the block
    succeeds. When it fails, the job's run directory (config, ``logs/``: the error names them) is kept and the rest
    (a partial checkpoint) removed."""
    work = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    try:
        yield work
    except BaseException:
        for child in work.iterdir():
            if child.name != "job":
                shutil.rmtree(child, ignore_errors=True) if child.is_dir() else child.unlink(missing_ok=True)
        raise
    shutil.rmtree(work, ignore_errors=True)
