"""The commands of ``align-pipeline`` besides ``kedro run`` (dispatched by :mod:`align_pipeline.__main__`): export,
import, mlflow-log, compare, sweep, worker, gc. Each parses its own arguments, imports what it needs when it runs,
and returns the process's exit code (0 done, 1 a check failed, 2 a user error, printed in one line). A result
prints as a table, or as one JSON line with ``--json`` (:mod:`align_pipeline.tracking.command_output`)."""

import os
import sys
from pathlib import Path

from align_pipeline.tracking.command_output import add_json_flag, print_result


def export_command(argv: list[str]) -> int:
    """``export``: a model checkpoint -> an HF model directory (see :mod:`align_pipeline.model.hf_export`)."""
    import argparse
    import time

    parser = argparse.ArgumentParser(prog="align-pipeline export",
                                     description="Write a model checkpoint (a stage's policy or reward model, any "
                                     "TP/PP layout) as a Hugging Face model directory that transformers and vLLM "
                                     "load.")
    parser.add_argument("checkpoint", help="model checkpoint directory (with meta.json), e.g. "
                        "data/06_models/dpo_policy/<version>/dpo_policy")
    parser.add_argument("hf_dir", help="output directory (must not exist)")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer directory to include (default: the checkpoint's own, as its meta.json "
                        "records it); one whose fingerprint differs from the recorded one is refused (exit 2)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--max-shard-gb", type=float, default=2.0, help="size of one safetensors file")
    parser.add_argument("--check", action="store_true",
                        help="check the whole export: tokenizer vocabulary <= embedding rows, the packed tokenizer's "
                        "fingerprint, special tokens / EOS / chat template round-trip, logits on fixed tokens "
                        "(max |dlogit| <= --tol) and a greedy generation through transformers equal to ours; one "
                        "line per check, exit 1 when any fails")
    parser.add_argument("--tol", type=float, default=None,
                        help="--check tolerance (default 1e-4 for a float32 export, 5e-2 for bfloat16/float16)")
    parser.add_argument("--peft", action="store_true",
                        help="write the checkpoint's LoRA adapters as a PEFT adapter directory (adapter_config.json + "
                        "adapter_model.safetensors) for the HF export of its base model, instead of the merged model")
    parser.add_argument("--base-model", default=None,
                        help="--peft: base_model_name_or_path to record (default: the base checkpoint's path)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing export at HF_DIR (as save_pretrained does): the new one is written "
                        "beside it and takes its place only when complete; a directory that is not an HF export "
                        "(no config.json / adapter_config.json) is refused")
    add_json_flag(parser)
    args = parser.parse_args(argv)

    from align_pipeline.errors import UserError
    from align_pipeline.launch import model_jobs
    from align_pipeline.model.hf_export import export_hf, export_peft, progress_printer

    final = None  # --overwrite: the existing export, replaced once the new one (written beside it) is complete
    if args.overwrite and os.path.lexists(args.hf_dir):
        try:
            final, args.hf_dir = args.hf_dir, _staging_dir(args.hf_dir)
        except UserError as exc:
            print(f"align-pipeline export: {exc}", file=sys.stderr)
            return 2
    if args.peft:
        try:
            summary = export_peft(args.checkpoint, args.hf_dir, base_model=args.base_model)
        except (UserError, FileNotFoundError) as exc:  # HFExportError and a refused checkpoint are UserErrors
            print(f"align-pipeline export: {exc}", file=sys.stderr)
            return 2
        if final is not None:
            summary["out_dir"] = args.hf_dir = _replace(final, args.hf_dir)
        if args.json:
            print_result(summary, True)
        else:
            print(f"align-pipeline export: PEFT adapter ({', '.join(summary['target_modules'])}; "
                  f"{summary['params']:,} parameters) -> {summary['out_dir']}; load it onto the HF export of "
                  f"{summary['base_model'] or 'the base'} with peft.PeftModel.from_pretrained")
        return 0

    t0 = time.perf_counter()
    try:
        summary = export_hf(args.checkpoint, args.hf_dir, tokenizer=args.tokenizer, dtype=args.dtype,
                            max_shard_bytes=int(args.max_shard_gb * 1024**3),
                            progress=progress_printer("align-pipeline export"),
                            merge=lambda artifact, out: model_jobs.materialize(artifact, out, out.parent / "job"))
    except (UserError, FileNotFoundError) as exc:
        print(f"align-pipeline export: {exc}", file=sys.stderr)
        return 2
    if final is not None:
        summary["out_dir"] = args.hf_dir = _replace(final, args.hf_dir)
    summary["seconds"] = round(time.perf_counter() - t0, 2)
    summary["peak_rss_gib"] = _peak_rss_gib()
    tol = args.tol if args.tol is not None else (1e-4 if args.dtype == "float32" else 5e-2)
    if not args.check:
        print_result(summary, args.json)
        return 0
    return _check_export(summary, args.checkpoint, args.hf_dir, tol, args.json)


def _staging_dir(existing: str) -> str:
    """Where ``export --overwrite`` writes before replacing ``existing`` (an HF export, or an empty directory)."""
    from align_pipeline.errors import UserError

    path = Path(existing)
    if path.is_symlink() or not path.is_dir():
        raise UserError(f"{existing} exists and is not a directory; --overwrite replaces an export directory only")
    markers = ("config.json", "adapter_config.json")
    if any(path.iterdir()) and not any((path / m).is_file() for m in markers):
        raise UserError(f"{existing} is not a Hugging Face export (no config.json or adapter_config.json); "
                        "--overwrite leaves it alone: remove it or choose another directory")
    staging = path.parent / f".overwrite-{path.name}"
    if staging.exists():  # a previous --overwrite that was stopped
        import shutil

        shutil.rmtree(staging)
    return str(staging)


def _replace(final: str, staging: str) -> str:
    """The complete export at ``staging`` takes the place of ``final``: the old one is renamed aside, then removed."""
    import shutil

    old = Path(final).parent / f".replaced-{Path(final).name}"
    shutil.rmtree(old, ignore_errors=True)
    os.replace(final, old)
    os.replace(staging, final)
    shutil.rmtree(old, ignore_errors=True)
    return str(Path(final))


def _check_export(summary: dict, checkpoint: str, hf_dir: str, tol: float, as_json: bool) -> int:
    """``export --check``: every check of :func:`align_pipeline.model.export_check.check_export`, one line each on
    stderr, recorded in the export (``align_export_check.json``); the summary (with ``checks``) as the result;
    exit 1 when any check failed."""
    import shutil
    import tempfile

    from align_pipeline.errors import UserError
    from align_pipeline.launch.model_jobs import checkpoint_outputs
    from align_pipeline.model.export_check import check_export, write_result

    work = tempfile.mkdtemp(prefix="align-check-")
    try:
        checks = check_export(checkpoint, hf_dir, tol, our_side=lambda request: checkpoint_outputs(request, work))
    except UserError as exc:  # our side's job failed: its logs stay in `work`, which the error names
        print(f"align-pipeline --check: {exc}", file=sys.stderr)
        return 2
    shutil.rmtree(work, ignore_errors=True)
    failed = [c.name for c in checks if c.ok is False]
    write_result(hf_dir, "failed" if failed else "passed", checks)
    for check in checks:
        print(check.line(), file=sys.stderr)
    logits = next((c.value for c in checks if c.name == "logits" and c.value is not None), None)
    summary |= {"max_abs_logit_diff": logits, "tolerance": tol, "checks": {c.name: c.ok for c in checks},
                "check": "failed" if failed else "passed"}
    print_result(summary, as_json)
    if failed:
        print(f"align-pipeline export --check: {hf_dir} FAILED {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def _peak_rss_gib() -> float | None:
    """This process's own peak resident memory (Linux ``VmHWM``; unlike ``ru_maxrss`` it does not inherit the peak of
    a large parent that forked it)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024**2, 3)  # kB -> GiB
    except OSError:
        pass
    return None


def _report(summary: dict, checkpoint: str, hf_dir: str, tol: float | None, as_json: bool) -> int:
    """Print the summary (:func:`print_result`); with a tolerance, first run the parity check (exit 1 above it)."""
    import shutil
    import tempfile

    if tol is None:
        print_result(summary, as_json)
        return 0
    from align_pipeline.launch.model_jobs import check_parity
    from align_pipeline.launch.torchrun import LaunchError
    from align_pipeline.model.hf_export import HFExportError

    work = tempfile.mkdtemp(prefix="align-check-")
    try:
        summary["max_abs_logit_diff"] = check_parity(checkpoint, hf_dir, work)
    except (LaunchError, HFExportError) as exc:  # the job's logs stay in `work`, which the error names
        print(f"align-pipeline --check: {exc}", file=sys.stderr)
        return 2
    shutil.rmtree(work, ignore_errors=True)
    summary["tolerance"] = tol
    print_result(summary, as_json)
    print(f"max |dlogit| = {summary['max_abs_logit_diff']:.3g} (tolerance {tol:g})", file=sys.stderr)
    return 0 if summary["max_abs_logit_diff"] <= tol else 1


def import_command(argv: list[str]) -> int:
    """``import``: an HF model directory or a NeMo ``.nemo`` -> a model checkpoint (see
    :func:`align_pipeline.launch.model_jobs.import_hf` and :mod:`align_pipeline.model.nemo`)."""
    import argparse
    import tempfile
    import time

    parser = argparse.ArgumentParser(prog="align-pipeline import",
                                     description="Convert a Hugging Face Llama / Qwen2 / Qwen3 / Mistral / "
                                     "Qwen3-MoE / Mixtral directory, "
                                     "or a NeMo 1.x Megatron GPT .nemo (NeMo-Aligner), into a model checkpoint any "
                                     "stage can start from (init_from), written at TP x PP by a torchrun job.")
    parser.add_argument("hf_dir", help="HF model directory (config.json + safetensors or pytorch_model.bin), or a "
                        ".nemo archive (or its unpacked directory)")
    parser.add_argument("checkpoint", help="output checkpoint directory (must not exist)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the conversion job")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size of the conversion job")
    parser.add_argument("--ep", type=int, default=1,
                        help="expert-parallel size of the conversion job (MoE models; the job runs TP x PP x EP ranks)")
    parser.add_argument("--seq-length", type=int, default=None,
                        help="training length recorded in the checkpoint (default: the model's context, <= 4096)")
    parser.add_argument("--check", action="store_true",
                        help="run the checkpoint (Megatron) and the HF model (transformers; for a .nemo, its HF "
                        "conversion) on the same fixed tokens, print max |dlogit| and exit 1 above --tol")
    parser.add_argument("--tol", type=float, default=1e-4, help="--check tolerance (fp32)")
    add_json_flag(parser)
    args = parser.parse_args(argv)

    from align_pipeline.errors import UserError
    from align_pipeline.launch.model_jobs import import_hf
    from align_pipeline.launch.torchrun import LaunchError
    from align_pipeline.model.hf import HFConversionError
    from align_pipeline.model.nemo import convert, is_nemo

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="align-nemo-hf-") as scratch:
        try:
            hf_dir, nemo = args.hf_dir, None
            if is_nemo(args.hf_dir):
                nemo = convert(args.hf_dir, Path(scratch) / "hf")
                hf_dir = nemo["hf_dir"]
            result = import_hf(hf_dir, args.checkpoint, tp=args.tp, pp=args.pp, seq_length=args.seq_length,
                               source=str(Path(args.hf_dir).resolve()) if nemo else None, ep=args.ep)
        except (UserError, HFConversionError, FileNotFoundError, LaunchError) as exc:
            print(f"align-pipeline import: {exc}", file=sys.stderr)
            return 2
        summary = {"out_dir": result["out"], "family": result["model"]["hf_family"],
                   "vocab_size": result["vocab_size"], "tp": args.tp, "pp": args.pp, "ep": args.ep,
                   "seconds": round(time.perf_counter() - t0, 2)}
        if nemo:
            summary["nemo"] = str(Path(args.hf_dir).resolve())
            if nemo["tokenizer_note"]:
                summary["tokenizer"] = nemo["tokenizer_note"]
        return _report(summary, args.checkpoint, hf_dir, args.tol if args.check else None, args.json)


def mlflow_log_command(argv: list[str]) -> int:
    """``mlflow-log``: a job's ``metrics.jsonl`` -> MLflow (see :func:`align_pipeline.tracking.metrics_file.relog`);
    then the runs the job was logging into that were left RUNNING are closed as KILLED
    (:func:`align_pipeline.tracking.stale.close_runs_left_running`)."""
    import argparse

    parser = argparse.ArgumentParser(prog="align-pipeline mlflow-log",
                                     description="Log the metrics.jsonl a training job kept (params, step metrics, "
                                     "final metrics) into MLflow, with its steps and timestamps: for a run trained "
                                     "while MLflow was unreachable. Points the run already has are skipped, so it can "
                                     "be repeated. The runs the job was logging into when MLflow went away, if still "
                                     "RUNNING, are then marked KILLED with the last step the job logged (tag "
                                     "align.last_step), and their kedro run too once its process has ended.")
    parser.add_argument("source", help="a model checkpoint (data/06_models/<model>/<version>/<model>), a run "
                        "directory, or a metrics.jsonl file")
    target = parser.add_mutually_exclusive_group()
    target.add_argument("--run-id", default=None, help="log into this existing run")
    target.add_argument("--experiment", default=None,
                        help="log into a new run of this experiment, created if needed (default: "
                        "$MLFLOW_EXPERIMENT_NAME, else align-pipeline); a repeated re-log of the same file reuses "
                        "the run it made")
    parser.add_argument("--run-name", default=None, help="name of a new run (default: relog:<directory name>)")
    parser.add_argument("--tracking-uri", default=None,
                        help="the store (default: $MLFLOW_TRACKING_URI, else sqlite:///<cwd>/mlflow.db, the project's "
                        "default when run from the project directory)")
    add_json_flag(parser)
    args = parser.parse_args(argv)

    from align_pipeline.tracking import bounded
    from align_pipeline.tracking.metrics_file import read_records, relog, resolve
    from align_pipeline.tracking.mlflow_logger import default_tracking_uri
    from align_pipeline.tracking.probe import unreachable
    from align_pipeline.tracking.stale import close_runs_left_running

    uri = args.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or default_tracking_uri(Path.cwd())
    try:
        source = resolve(args.source)
    except FileNotFoundError as exc:
        print(f"align-pipeline mlflow-log: {exc}", file=sys.stderr)
        return 2
    reason = unreachable(uri)
    if reason is not None:
        print(f"align-pipeline mlflow-log: MLflow at {uri} is unreachable ({reason})", file=sys.stderr)
        return 2
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    experiment = None if args.run_id else (args.experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME")
                                           or "align-pipeline")
    bounded.describe_kept(str(source), str(source))  # the store dying now: one line, then exit 2
    client = MlflowClient(tracking_uri=uri)
    try:
        summary = relog(source, bounded.BoundedClient(client), run_id=args.run_id, experiment=experiment,
                        run_name=args.run_name)
        summary["closed_runs"] = close_runs_left_running(uri, client, read_records(source), str(source))
    except bounded.TrackingOff:
        return 2
    except MlflowException as exc:
        print(f"align-pipeline mlflow-log: {exc}", file=sys.stderr)
        return 2
    print_result({"tracking_uri": uri, **summary}, args.json)
    return 0


def _store_args(parser) -> None:
    parser.add_argument("--experiment", default=None,
                        help="MLflow experiment (default: $MLFLOW_EXPERIMENT_NAME, else align-pipeline)")
    parser.add_argument("--tracking-uri", default=None,
                        help="the store (default: $MLFLOW_TRACKING_URI, else sqlite:///<cwd>/mlflow.db, the project's "
                        "default when run from the project directory)")


def compare_command(argv: list[str]) -> int:
    """``compare``: a report over kedro runs (see :mod:`align_pipeline.tracking.compare`)."""
    from align_pipeline.tracking.compare import main

    return main(argv, _store_args)


def sweep_command(argv: list[str]) -> int:
    """``sweep``: one ``kedro run`` per grid point, then ``compare`` over them (see :mod:`align_pipeline.kedro.sweep`)."""
    from align_pipeline.kedro.sweep import main

    return main(argv, _store_args)


def worker_command(argv: list[str]) -> int:
    """``worker``: a node of a multi-node run other than node 0 (see :mod:`align_pipeline.launch.multinode`)."""
    import argparse

    parser = argparse.ArgumentParser(prog="align-pipeline worker",
                                     description="Join node 0's `kedro run` (launch.nnodes > 1) as one of its other "
                                     "nodes: run each stage's torchrun here until node 0's run ends.")
    parser.add_argument("--master-addr", required=True, help="node 0's address (its launch.master_addr)")
    parser.add_argument("--master-port", type=int, required=True, help="node 0's launch.master_port")
    parser.add_argument("--connect-timeout", type=float, default=3600.0,
                        help="seconds to wait for node 0's job board and its secret file ($ALIGN_BOARD_SECRET_FILE; "
                        "both appear with node 0's first multi-node stage, after data preparation)")
    args = parser.parse_args(argv)

    from align_pipeline.launch.worker import run_worker

    return run_worker(args.master_addr, args.master_port, args.connect_timeout)


def gc_command(argv: list[str]) -> int:
    """``gc``: see :func:`align_pipeline.datasets.retention.gc_command`."""
    from align_pipeline.datasets.retention import gc_command as run_gc

    return run_gc(argv)


COMMANDS = {"export": export_command, "import": import_command, "mlflow-log": mlflow_log_command,
            "compare": compare_command, "sweep": sweep_command, "worker": worker_command, "gc": gc_command}
"""``align-pipeline <name>`` -> its function."""
