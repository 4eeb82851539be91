"""``align-pipeline sweep``: one ``kedro run`` per grid point, one after the other on this machine, then the comparison
report over them (:mod:`align_pipeline.tracking.compare`).

    align-pipeline sweep --pipelines dpo --grid dpo.loss.beta=0.03,0.1,0.3 [--grid dpo.optimizer.lr=1e-6,5e-6]

Each point runs ``python -m align_pipeline --pipelines ... --params <point>`` in the working directory (the project),
with ``ALIGN_SWEEP`` / ``ALIGN_SWEEP_POINT`` in its environment: the MLflow hook tags the kedro run's parent run with
them (``align.sweep``, ``align.sweep.point``), and the report compares the runs of this sweep. A failing point is
reported and the sweep goes on; the exit code is then 1. Ctrl-C stops the sweep. Before the first point runs, every
point's parameters are resolved and validated (:func:`check_points`): one bad value stops the sweep with exit 2,
naming each failing point, before anything is trained.
"""

from __future__ import annotations

import datetime
import itertools
import os
import subprocess
import sys
from pathlib import Path

SWEEP_ENV, POINT_ENV = "ALIGN_SWEEP", "ALIGN_SWEEP_POINT"


def grid_points(grids: list[str]) -> list[dict[str, str]]:
    """``["a.b=1,2", "c=x,y"]`` -> the cartesian product ``[{"a.b": "1", "c": "x"}, {"a.b": "1", "c": "y"}, ...]``."""
    axes = []
    for grid in grids:
        key, sep, values = grid.partition("=")
        items = [v.strip() for v in values.split(",") if v.strip()]
        if not sep or not key.strip() or not items:
            raise ValueError(f"--grid {grid!r}: expected KEY=VALUE[,VALUE...], e.g. dpo.loss.beta=0.03,0.1,0.3")
        axes.append([(key.strip(), v) for v in items])
    return [dict(point) for point in itertools.product(*axes)]


def check_points(pipelines: str, points: list[dict[str, str]], shared: str | None, env: str | None,
                 project: Path) -> list[str]:
    """Resolve each point's parameters as its ``kedro run`` will (conf/base, the env, ``shared`` and the point as
    runtime params) and validate every section the pipelines read; one line per point that fails. An unknown
    pipeline name raises :class:`align_pipeline.errors.UserError`. Nothing is launched."""
    from kedro.pipeline import Pipeline
    from omegaconf import OmegaConf

    from align_pipeline.cli import check_selection
    from align_pipeline.errors import UserError
    from align_pipeline.kedro.params_hook import used_sections, validate_params
    from align_pipeline.pipeline_registry import register_pipelines
    from align_pipeline.settings import CONFIG_LOADER_ARGS, CONFIG_LOADER_CLASS

    registry = register_pipelines()
    names = [name.strip() for name in pipelines.split(",") if name.strip()]
    check_selection(registry, names, {}, [])
    pipeline = sum((registry[name] for name in names), Pipeline([]))
    used = used_sections(pipeline)
    problems = []
    for i, point in enumerate(points, 1):
        items = [*(item for item in (shared or "").split(",") if item.strip()), *(f"{k}={v}" for k, v in point.items())]
        label = ",".join(f"{k}={v}" for k, v in point.items())
        try:
            runtime = OmegaConf.to_container(OmegaConf.from_dotlist(items))
            loader = CONFIG_LOADER_CLASS(str(project / "conf"), env=env, runtime_params=runtime, **CONFIG_LOADER_ARGS)
            validate_params(loader["parameters"], used)
        except (UserError, ValueError) as exc:  # ConfigError is both
            problems.append(f"point {i}/{len(points)} ({label}): {exc}")
    return problems


def main(argv: list[str], store_args=None) -> int:
    import argparse

    from align_pipeline.tracking.command_output import add_json_flag, print_result
    from align_pipeline.tracking.compare import (
        CompareError,
        default_out_dir,
        log_report,
        resolve,
        store,
        write_report,
    )

    parser = argparse.ArgumentParser(
        prog="align-pipeline sweep",
        description="Run the pipelines once per grid point (sequentially), then write the comparison report over "
        "those runs (data/08_reporting/comparisons/<timestamp>/, logged to MLflow).")
    parser.add_argument("--pipelines", required=True, help="as for kedro run, e.g. dpo or dpo_flow")
    parser.add_argument("--grid", action="append", required=True, metavar="KEY=V1,V2,...",
                        help="a parameter and its values; several --grid make a cartesian product")
    parser.add_argument("--params", default=None, help="overrides every point shares, as for kedro run")
    parser.add_argument("--env", default=None, help="Kedro configuration environment")
    parser.add_argument("--out", type=Path, default=None, help="report directory")
    add_json_flag(parser)
    if store_args is not None:
        store_args(parser)
    args = parser.parse_args(argv)
    try:
        points = grid_points(args.grid)
    except ValueError as exc:
        parser.error(str(exc))
    from align_pipeline.errors import UserError

    try:  # every point is checked before the first one runs: a typo in the last value costs nothing
        problems = check_points(args.pipelines, points, args.params, args.env, Path.cwd())
    except UserError as exc:
        print(f"align-pipeline sweep: {exc}", file=sys.stderr)
        return 2
    if problems:
        for line in problems:
            print(f"align-pipeline sweep: {line}", file=sys.stderr)
        print(f"align-pipeline sweep: {len(problems)} of {len(points)} points fail their parameter checks; nothing "
              "was run", file=sys.stderr)
        return 2
    sweep_id = datetime.datetime.now(datetime.timezone.utc).strftime("sweep-%Y-%m-%dT%H.%M.%S.%fZ")
    env = dict(os.environ, **{SWEEP_ENV: sweep_id})
    env.setdefault("KEDRO_DISABLE_TELEMETRY", "true")
    if getattr(args, "tracking_uri", None):
        env["MLFLOW_TRACKING_URI"] = args.tracking_uri
    if getattr(args, "experiment", None):
        env["MLFLOW_EXPERIMENT_NAME"] = args.experiment
    failed = []
    for i, point in enumerate(points, 1):
        params = ",".join(f"{k}={v}" for k, v in point.items())
        if args.params:
            params = f"{args.params},{params}"
        print(f"[sweep {sweep_id}] {i}/{len(points)}: --params {params}", flush=True)
        cmd = [sys.executable, "-m", "align_pipeline", "--pipelines", args.pipelines, "--params", params]
        if args.env:
            cmd += ["--env", args.env]
        try:
            code = subprocess.run(cmd, env={**env, POINT_ENV: params}, check=False).returncode
        except KeyboardInterrupt:
            print(f"[sweep {sweep_id}] interrupted at point {i}/{len(points)}", file=sys.stderr)
            return 130
        if code != 0:
            print(f"[sweep {sweep_id}] point {i} ({params}) failed with exit code {code}", file=sys.stderr)
            failed.append(params)
    try:
        client, experiment_id, uri = store(env.get("MLFLOW_TRACKING_URI"), env.get("MLFLOW_EXPERIMENT_NAME"))
        experiments = resolve(client, [experiment_id], filter_string=f"tags.`align.sweep` = '{sweep_id}'")
        out = args.out or default_out_dir()
        write_report(client, experiments, out)
    except CompareError as exc:
        print(f"align-pipeline sweep: {exc}", file=sys.stderr)
        return 2
    run_id = log_report(client, experiment_id, experiments, out)
    print_result({"sweep": sweep_id, "points": len(points), "failed": failed, "tracking_uri": uri,
                  "report": str(Path(out).resolve() / "report.md"), "mlflow_run_id": run_id}, args.json)
    return 1 if failed else 0
