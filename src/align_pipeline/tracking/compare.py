"""Compare ``kedro run``s in MLflow: resolve them (through lineage, not only the kedro run id), then write a report —
Markdown + PNGs — with overlaid training curves per stage, evaluation metrics side by side with deltas, the params
diff and the lineage diff.

    experiments = resolve(client, experiment_ids, ["2026-12-04T10.55.12.345Z", "dpo_policy:2026-12-04T11.02.40.001Z"])
    report = write_report(client, experiments, out_dir)      # out_dir/report.md, *.png, comparison.json

A reference (``RUN_OR_VERSION``) is any of: an MLflow run id (a parent run, or a child run: its kedro run is taken),
a kedro run id (the session id, the ``kedro.run_id`` tag), a catalog version a run saved (``lineage.out.*``), or
``<dataset>:<version>``. A kedro run that only trained is linked to the evaluation runs — of any later kedro run —
that scored the versions it saved (their ``lineage.<dataset>`` tags), so ``kedro run --pipelines dpo`` followed by
``kedro run --pipelines evaluation`` compares as one experiment.

Works offline on the sqlite store: only the MLflow client is used. Nothing here imports Kedro.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from align_pipeline.tracking.command_output import add_json_flag, print_result

COMPARE_TAG = "align.compare"
"""Set on the MLflow runs that hold a comparison report (they are never compared themselves)."""
EVALUATION_NODE = "evaluate_policies"


def _scores_or_exports(node: str) -> bool:
    """A node that scores or exports what another run trained (``evaluate_policies``, ``export_<artifact>``): a kedro
    run of only these is not an experiment of its own (``--last N`` counts the others; its evaluation is linked to
    the run whose outputs it scored)."""
    return node == EVALUATION_NODE or node.startswith("export_")


# Curves drawn per training stage, in this order (others with a history follow, up to MAX_CURVES per stage).
PREFERRED_CURVES = ("loss", "val_loss", "val_accuracy", "val_rewards/accuracies", "val_rewards/margins", "rollout/rewards_mean",
                    "rollout/init_policy_kl", "val/greedy_accuracy", "train/policy_loss", "train/pg_loss",
                    "critic/value_loss")
MAX_CURVES = 6
_NOT_COMPARED = re.compile(r"^(system/|timing/|throughput/)")


class CompareError(ValueError):
    """A reference that matches no run, or nothing to compare."""


@dataclass
class Experiment:
    """One compared kedro run: its parent run, its children by node, and the children of other kedro runs linked to
    it through lineage (an evaluation that scored a version it saved)."""

    parent: Any
    children: dict[str, Any] = field(default_factory=dict)
    linked: dict[str, Any] = field(default_factory=dict)
    label: str = ""

    @property
    def run_id(self) -> str:
        return self.parent.info.run_id

    @property
    def outputs(self) -> dict[str, str]:
        """Catalog versions this kedro run saved: ``{dataset: version}``."""
        return {k.removeprefix("lineage.out."): v for k, v in self.parent.data.tags.items()
                if k.startswith("lineage.out.")}

    def runs(self) -> dict[str, Any]:
        """Node -> run, its own children first, then the linked ones for nodes it did not run."""
        return {**self.linked, **self.children}

    def params(self) -> dict[str, str]:
        """The parent's overrides and every child's params (Kedro parameter names: ``dpo.loss.beta``)."""
        out: dict[str, str] = {}
        for run in self.runs().values():
            out.update(run.data.params)
        out.update({k: v for k, v in self.parent.data.params.items() if not k.startswith("kedro.")})
        return out

    def overrides(self) -> dict[str, Any]:
        """The ``--params`` the kedro run was given (its ``kedro.overrides`` tag; {} for runs made before it)."""
        try:
            value = json.loads(self.parent.data.tags.get("kedro.overrides") or "{}")
        except ValueError:
            return {}
        return value if isinstance(value, dict) else {}

    def lineage(self) -> dict[str, str]:
        """``<node> lineage.<key>`` -> value over its runs."""
        return {f"{node} {k}": v for node, run in sorted(self.runs().items()) for k, v in run.data.tags.items()
                if k.startswith("lineage.")}


def _all_runs(client, experiment_ids: list[str]) -> list[Any]:
    runs, token = [], None
    while True:
        page = client.search_runs(experiment_ids, max_results=1000, page_token=token)
        runs += list(page)
        token = page.token
        if not token:
            return runs


def _is_kedro_parent(run) -> bool:
    tags = run.data.tags
    return "mlflow.parentRunId" not in tags and "kedro.run_id" in tags and COMPARE_TAG not in tags


def resolve(client, experiment_ids: list[str], refs: Iterable[str] = (), *, last: int = 0,
            filter_string: str | None = None) -> list[Experiment]:
    """The kedro runs named by ``refs`` (see the module docstring), the ``last`` most recent ones, and those with a run
    matching ``filter_string`` (an MLflow filter, e.g. ``params.`dpo.loss.beta` = '0.3'``), oldest first, each with
    its children and linked evaluation runs. Raises :class:`CompareError` for a reference that matches nothing."""
    runs = _all_runs(client, experiment_ids)
    by_id = {r.info.run_id: r for r in runs}
    parents = {r.info.run_id: r for r in runs if _is_kedro_parent(r)}

    def parent_of(run) -> Any | None:
        while run is not None and run.info.run_id not in parents:
            run = by_id.get(run.data.tags.get("mlflow.parentRunId", ""))
        return run

    chosen: list[str] = []
    for ref in refs:
        found = _match(ref, runs, by_id, parents, parent_of)
        if not found:
            raise CompareError(f"no kedro run, MLflow run or catalog version matches {ref!r} in experiment(s) "
                               f"{', '.join(experiment_ids)}")
        chosen += found
    if last:  # experiments: kedro runs that trained something; the evaluations that scored them come linked
        children_of: dict[str, set[str]] = {}
        for r in runs:
            if "kedro.node" in r.data.tags and r.data.tags.get("mlflow.parentRunId") in parents:
                children_of.setdefault(r.data.tags["mlflow.parentRunId"], set()).add(r.data.tags["kedro.node"])
        trained = [r for r in parents.values()
                   if any(not _scores_or_exports(n) for n in children_of.get(r.info.run_id, ()))]
        recent = sorted(trained, key=lambda r: r.info.start_time, reverse=True)
        chosen += [r.info.run_id for r in recent[:last]]
    if filter_string:
        matched = client.search_runs(experiment_ids, filter_string=filter_string, max_results=1000)
        chosen += [p.info.run_id for p in (parent_of(by_id.get(r.info.run_id, r)) for r in matched) if p is not None]
    unique = sorted(dict.fromkeys(chosen), key=lambda i: parents[i].info.start_time)
    experiments = []
    for run_id in unique:
        e = Experiment(parents[run_id])
        e.children = {r.data.tags["kedro.node"]: r for r in runs
                      if r.data.tags.get("mlflow.parentRunId") == run_id and "kedro.node" in r.data.tags}
        e.linked = _linked(e, runs)
        experiments.append(e)
    _label(experiments)
    return experiments


def _match(ref: str, runs, by_id, parents, parent_of) -> list[str]:
    if ref in by_id:
        parent = parent_of(by_id[ref])
        return [parent.info.run_id] if parent is not None else []
    found = [r.info.run_id for r in parents.values() if r.data.tags.get("kedro.run_id") == ref]
    if found:
        return found
    name, _, version = ref.rpartition(":")  # "<dataset>:<version>", or a bare version (no ":" in Kedro versions)
    keys = [f"lineage.out.{name}"] if name else None
    hits = []
    for run in runs:
        tags = run.data.tags
        if any(v == version and k.startswith("lineage.out.") and (keys is None or k in keys) for k, v in tags.items()):
            parent = parent_of(run)
            if parent is not None:
                hits.append(parent.info.run_id)
    return list(dict.fromkeys(hits))


def _linked(e: Experiment, runs) -> dict[str, Any]:
    """Children of other kedro runs whose lineage names a version this run saved (the latest per node)."""
    outputs = e.outputs
    linked: dict[str, Any] = {}
    for run in sorted(runs, key=lambda r: r.info.start_time):
        tags = run.data.tags
        node = tags.get("kedro.node")
        if node is None or node in e.children or tags.get("mlflow.parentRunId") == e.run_id:
            continue
        if any(tags.get(f"lineage.{name}") == version for name, version in outputs.items()):
            linked[node] = run
    return linked


def _label(experiments: list[Experiment]) -> None:
    """Each experiment's label: the params that differ between the experiments (up to three; those every experiment
    logged first: a reused stage logs no ``world_size`` or ``resumed_from_step``), else its version."""
    differing = params_diff(experiments)
    everywhere = [k for k, values in differing.items() if "—" not in values]
    keys = everywhere or list(differing)
    for i, e in enumerate(experiments):
        params = e.params()
        parts = [f"{k}={params.get(k, '—')}" for k in keys[:3]]
        version = next(iter(e.outputs.values()), None) or e.parent.data.tags.get("kedro.run_id", e.run_id[:8])
        e.label = ", ".join(parts) if parts else f"{chr(65 + i) if i < 26 else i} @{version}"


def params_diff(experiments: list[Experiment]) -> dict[str, list[str]]:
    """Param name -> its value per experiment ("—" where absent), for the params whose values differ."""
    all_params = [e.params() for e in experiments]
    keys = sorted({k for p in all_params for k in p})
    out = {}
    for key in keys:
        values = [p.get(key, "—") for p in all_params]
        if len(set(values)) > 1:
            out[key] = values
    return out


def shared_overrides(experiments: list[Experiment]) -> dict[str, Any]:
    """The ``--params`` overrides every experiment's kedro run was given with the same value (a sweep's ``--params``,
    the settings a comparison holds fixed)."""
    first, *rest = [e.overrides() for e in experiments]
    return {k: v for k, v in sorted(first.items()) if all(k in o and o[k] == v for o in rest)}


def lineage_diff(experiments: list[Experiment]) -> dict[str, list[str]]:
    """``<node> lineage.<key>`` -> value per experiment, where the values differ."""
    all_lineage = [e.lineage() for e in experiments]
    keys = sorted({k for x in all_lineage for k in x})
    return {k: [x.get(k, "—") for x in all_lineage] for k in keys if len({x.get(k, "—") for x in all_lineage}) > 1}


def evaluation_metrics(experiments: list[Experiment]) -> dict[str, list[float | None]]:
    """The evaluation run's metrics (``<policy>/accuracy``, ``reward_model/accuracy``, ...) per experiment: its own
    evaluation, else the latest linked one."""
    per = [dict(e.runs()[EVALUATION_NODE].data.metrics) if EVALUATION_NODE in e.runs() else {} for e in experiments]
    keys = sorted({k for m in per for k in m if not _NOT_COMPARED.match(k)})
    return {k: [m.get(k) for m in per] for k in keys}


def gates(experiments: list[Experiment]) -> dict[str, list[str]]:
    """Gate results per experiment: the evaluation's ``gate.<policy>.<gate>`` and ``promoted`` tags, and a stopped
    node's ``gate.failed``."""
    per = []
    for e in experiments:
        tags = {f"{node}: {k}": v for node, run in e.runs().items() for k, v in run.data.tags.items()
                if k.startswith("gate.") or k == "promoted"}
        per.append(tags)
    keys = sorted({k for t in per for k in t})
    return {k: [t.get(k, "—") for t in per] for k in keys}


def final_metrics(experiments: list[Experiment]) -> dict[str, dict[str, list[float | None]]]:
    """Training node -> metric -> its latest value per experiment (system, timing and throughput metrics left out)."""
    nodes = sorted({n for e in experiments for n in e.runs() if n != EVALUATION_NODE})
    out = {}
    for node in nodes:
        per = [dict(e.runs()[node].data.metrics) if node in e.runs() else {} for e in experiments]
        keys = sorted({k for m in per for k in m if not _NOT_COMPARED.match(k)})
        if keys:
            out[node] = {k: [m.get(k) for m in per] for k in keys}
    return out


def curves(client, experiments: list[Experiment]) -> dict[str, dict[str, list[list[tuple[int, float]]]]]:
    """Training node -> metric -> per experiment its (step, value) history, for up to MAX_CURVES metrics with a
    history of more than one point (PREFERRED_CURVES first)."""
    out: dict[str, dict[str, list[list[tuple[int, float]]]]] = {}
    for node, metrics in final_metrics(experiments).items():
        runs = [e.runs().get(node) for e in experiments]
        histories: dict[str, list[list[tuple[int, float]]]] = {}
        ordered = [k for k in PREFERRED_CURVES if k in metrics] + [k for k in metrics if k not in PREFERRED_CURVES]
        for key in ordered:
            series = [sorted((m.step, m.value) for m in client.get_metric_history(r.info.run_id, key))
                      if r is not None and key in r.data.metrics else [] for r in runs]
            if any(len(s) > 1 for s in series):
                histories[key] = series
            if len(histories) == MAX_CURVES:
                break
        if histories:
            out[node] = histories
    return out


def _fmt(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return f"{value:.4g}"
    return str(value)


def _delta(values: list[float | None]) -> list[str]:
    base = values[0]
    return ["" if i == 0 else ("—" if v is None or base is None else f"{v - base:+.4g}") for i, v in
            enumerate(values)]


_HIGHER = re.compile(r"(accuracy|accuracies|score|reward|margin|ended_with_eos)")
_LOWER = re.compile(r"(^rank$|kl_to_reference|perplexity|loss)")


def direction(metric: str) -> str:
    """``↑`` higher is better, ``↓`` lower is better, ``""`` neither (lengths, counts)."""
    name = metric.rsplit("/", 1)[-1]
    if _LOWER.search(name):
        return "↓"
    return "↑" if _HIGHER.search(name) else ""


def _sample_count(metric: str, row: dict[str, list[float | None]], i: int) -> float | None:
    """How many samples the proportion ``metric`` of experiment ``i`` is a mean of, when the evaluation says so:
    ``<policy>/accuracy`` over ``<policy>/samples`` sampled responses, ``<policy>/greedy_accuracy`` over
    ``<policy>/prompts``, ``reward_model/accuracy`` over ``reward_model/pairs``."""
    owner, _, name = metric.rpartition("/")
    count = {"accuracy": "samples", "greedy_accuracy": "prompts"}.get(name)
    if owner == "reward_model" and name == "accuracy":
        count = "pairs"
    values = row.get(f"{owner}/{count}") if count else None
    return values[i] if values else None


def verdict(metric: str, values: list[float | None], evaluation: dict[str, list[float | None]],
            labels: list[str]) -> str:
    """Which experiment is better on ``metric``, stated only when it clears the noise: for a proportion p over n
    samples, the standard error sqrt(p(1-p)/n); the best beats the runner-up when their gap exceeds twice the
    standard error of the difference (~95 %). Other metrics get no noise estimate and no winner."""
    arrow = direction(metric)
    known = [(v, i) for i, v in enumerate(values) if v is not None and not math.isnan(v)]
    if not arrow or len(known) < 2:
        return ""
    if len({v for v, _ in known}) == 1:
        return "same"
    ranked = sorted(known, reverse=arrow == "↑")
    (best, b), (second, r) = ranked[0], ranked[1]
    n_b, n_r = _sample_count(metric, evaluation, b), _sample_count(metric, evaluation, r)
    if not n_b or not n_r or not 0 <= best <= 1 or not 0 <= second <= 1:
        return "no noise estimate"
    noise = 2 * math.sqrt(best * (1 - best) / n_b + second * (1 - second) / n_r)
    if abs(best - second) > noise:
        return f"{labels[b]} (gap {abs(best - second):.3g} > 2σ {noise:.3g})"
    return f"within noise (gap {abs(best - second):.3g} ≤ 2σ {noise:.3g})"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    clean = [[c.replace("|", "\\|") for c in row] for row in rows]
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in clean)]


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_")


def plot_curves(data: dict[str, dict[str, list[list[tuple[int, float]]]]], labels: list[str], out_dir: Path
                ) -> dict[str, dict[str, str]]:
    """One PNG per (node, metric), one line per experiment -> node -> metric -> file name."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files: dict[str, dict[str, str]] = {}
    for node, metrics in data.items():
        for key, series in metrics.items():
            fig, ax = plt.subplots(figsize=(6, 3.6))
            for label, points in zip(labels, series):
                if points:
                    ax.plot([s for s, _ in points], [v for _, v in points], marker="." if len(points) < 30 else None,
                            label=label)
            ax.set_title(f"{node}: {key}")
            ax.set_xlabel("step / iteration")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
            fig.tight_layout()
            name = f"{_slug(node)}__{_slug(key)}.png"
            fig.savefig(out_dir / name, dpi=100)
            plt.close(fig)
            files.setdefault(node, {})[key] = name
    return files


def write_report(client, experiments: list[Experiment], out_dir: str | Path) -> dict[str, Any]:
    """Write ``report.md``, one PNG per overlaid curve and ``comparison.json`` into ``out_dir``; returns the JSON."""
    if not experiments:
        raise CompareError("nothing to compare: no kedro run matched")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    labels = [e.label for e in experiments]
    differing = params_diff(experiments)
    # only values every run has are compared: a stage one run did not run has no params there (not a difference)
    params = {k: v for k, v in differing.items() if "—" not in v}
    partial = sorted(set(differing) - set(params))
    lineage = lineage_diff(experiments)
    evaluation = evaluation_metrics(experiments)
    finals = final_metrics(experiments)
    pictures = plot_curves(curves(client, experiments), labels, out_dir)
    summary = {
        "experiments": [{"label": e.label, "parent_run_id": e.run_id, "run_name": e.parent.info.run_name,
                         "kedro_run_id": e.parent.data.tags.get("kedro.run_id"),
                         "pipeline": e.parent.data.tags.get("kedro.pipeline"), "status": e.parent.info.status,
                         "outputs": e.outputs, "runs": {n: r.info.run_id for n, r in e.runs().items()},
                         "linked": {n: r.info.run_id for n, r in e.linked.items()}} for e in experiments],
        "params_diff": params, "params_in_some_runs": partial, "lineage_diff": lineage, "evaluation": evaluation, "final_metrics": finals,
        "curves": pictures,
    }
    lines = [f"# Comparison of {len(experiments)} kedro runs", ""]
    lines += _table(["", "kedro run", "pipeline", "status", "saved versions", "evaluation from"],
                    [[e.label, e.parent.data.tags.get("kedro.run_id", ""), e.parent.data.tags.get("kedro.pipeline", ""),
                      e.parent.info.status, ", ".join(f"{k}@{v}" for k, v in sorted(e.outputs.items())) or "—",
                      ("this run" if EVALUATION_NODE in e.children else
                       (e.linked[EVALUATION_NODE].info.run_name if EVALUATION_NODE in e.linked else "—"))]
                     for e in experiments])
    lines += ["", "## Evaluation (Δ against the first run)", ""]
    if evaluation:
        verdicts = {k: verdict(k, v, evaluation, labels) for k, v in evaluation.items()}
        summary["verdicts"] = verdicts
        lines += _table(["metric", *labels, *(f"Δ {label}" for label in labels[1:]), "better"],
                        [[f"{k} {direction(k)}".rstrip(), *map(_fmt, v), *_delta(v)[1:], verdicts[k]]
                         for k, v in evaluation.items()])
        lines += ["", ("↑ higher is better, ↓ lower is better. `<policy>/accuracy` is task accuracy: the share of "
                  "sampled responses the accuracy function scores correct (`greedy_accuracy`: greedy responses); "
                  "`reward_model/accuracy` is preference accuracy: the share of held-out pairs the reward model "
                  "ranks as labelled. \"better\" names a run only when its gap to the runner-up exceeds twice the "
                  "binomial standard error of the difference (proportions with a known sample count).")]
    else:
        lines.append("No evaluation run scored these runs' policies (run `kedro run --pipelines evaluation`).")
    gate_rows = gates(experiments)
    summary["gates"] = gate_rows
    lines += ["", "## Gates", ""]
    lines += (_table(["node: gate", *labels], [[k, *v] for k, v in gate_rows.items()]) if gate_rows
              else ["No gate results (evaluation.gate, <stage>.gate.* unset)."])
    lines += ["", "## Params that differ", ""]
    lines += _table(["param", *labels], [[k, *v] for k, v in params.items()]) if params else ["None."]
    if partial:
        sections = sorted({k.split(".", 1)[0] for k in partial})
        named = ", ".join(f"`{s}`" for s in sections)
        note = (f"Not compared: {len(partial)} params that only some of these runs have (sections {named}: stages "
                "the other runs did not run).")
        lines += ["", note]
    shared = shared_overrides(experiments)
    summary["shared_overrides"] = shared
    lines += ["", "## Overrides every run shares", ""]
    given = ",".join(f"{k}={v}" for k, v in shared.items())
    lines.append(f"`--params {given}`: set on every run's command line, so these runs compare at those values, not "
                 "at the defaults." if shared else "None: no `--params` value is common to all of these runs.")
    lines += ["", "## Final training metrics", ""]
    for node, metrics in finals.items():
        lines += [f"### {node}", ""]
        lines += _table(["metric", *labels, *(f"Δ {label}" for label in labels[1:])],
                        [[k, *map(_fmt, v), *_delta(v)[1:]] for k, v in metrics.items()])
        lines.append("")
    lines += ["## Training curves", ""]
    betas = [k for k in params if k.endswith("loss.beta")]
    scaled = [f"{node} {key}" for node, metrics in pictures.items() for key in metrics
              if "reward" in key and ("margin" in key or "chosen" in key or "rejected" in key)]
    if betas and scaled:
        note = (f"Note: {', '.join(scaled)} are β-scaled log-ratios (DPO's implicit rewards), and "
                f"{', '.join(betas)} differs between these runs: their curves differ in scale by construction; "
                "compare accuracies, or each run's curve with itself.")
        lines += [note, ""]
        summary["notes"] = [note]
    for node, metrics in pictures.items():
        lines += [f"### {node}", ""] + [f"![{node} {key}]({name})" for key, name in metrics.items()] + [""]
    lines += ["## Lineage that differs", ""]
    lines += _table(["run / tag", *labels], [[k, *v] for k, v in lineage.items()]) if lineage else ["None."]
    (out_dir / "report.md").write_text("\n".join(lines) + "\n")
    (out_dir / "comparison.json").write_text(json.dumps(summary, indent=1, default=str))
    return summary


def log_report(client, experiment_id: str, experiments: list[Experiment], out_dir: str | Path) -> str:
    """Log the report directory as the artifacts of a new run ``compare <labels>`` (tag ``align.compare``, the
    compared parent runs in ``align.compared``); returns its run id."""
    name = "compare " + " vs ".join(e.label for e in experiments)
    run = client.create_run(experiment_id, run_name=name[:250],
                            tags={COMPARE_TAG: "true",
                                  "align.compared": ",".join(e.run_id for e in experiments)[:8000]})
    client.log_artifacts(run.info.run_id, str(out_dir), "comparison")
    client.set_terminated(run.info.run_id, "FINISHED")
    return run.info.run_id


def store(tracking_uri: str | None, experiment: str | None) -> tuple[Any, str, str]:
    """(client, experiment id, uri) of ``tracking_uri`` (default: ``$MLFLOW_TRACKING_URI``, else the project store in
    the working directory) and ``experiment`` (default: ``$MLFLOW_EXPERIMENT_NAME``, else align-pipeline)."""
    import os

    from mlflow.tracking import MlflowClient

    from align_pipeline.tracking.mlflow_logger import default_tracking_uri
    from align_pipeline.tracking.probe import unreachable

    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or default_tracking_uri(Path.cwd())
    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).is_file():  # MLflow would create it
        raise CompareError(f"no MLflow store at {uri.removeprefix('sqlite:///')}: run from the project directory or "
                           "pass --tracking-uri")
    reason = unreachable(uri)
    if reason is not None:
        raise CompareError(f"MLflow at {uri} is unreachable ({reason})")
    name = experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "align-pipeline"
    client = MlflowClient(tracking_uri=uri)
    found = client.get_experiment_by_name(name)
    if found is None:
        raise CompareError(f"no MLflow experiment {name!r} in {uri}")
    return client, found.experiment_id, uri


def default_out_dir() -> Path:
    """``data/08_reporting/comparisons/<UTC timestamp>`` under the working directory (the project)."""
    import datetime

    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H.%M.%S.%fZ")
    return Path("data") / "08_reporting" / "comparisons" / stamp


def main(argv: list[str], store_args=None) -> int:
    """``align-pipeline compare``: resolve, write the report, log it to MLflow; prints where (a table, or JSON with
    ``--json``)."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(
        prog="align-pipeline compare",
        description="Compare kedro runs: overlaid training curves per stage, evaluation metrics side by side with "
        "deltas, the params and lineage that differ. Written as Markdown + PNGs under "
        "data/08_reporting/comparisons/<timestamp>/ and logged to MLflow.")
    parser.add_argument("refs", nargs="*", metavar="RUN_OR_VERSION",
                        help="an MLflow run id (parent or child), a kedro run id, a catalog version a run saved, or "
                        "<dataset>:<version>")
    parser.add_argument("--last", type=int, default=0,
                        help="also the N most recent experiments: kedro runs that trained something, each with the "
                        "evaluation runs that scored its outputs (an evaluation-only run is not counted)")
    parser.add_argument("--filter", default=None, dest="filter_string",
                        help="also the kedro runs with a run matching this MLflow filter, e.g. "
                        "\"params.`dpo.loss.beta` = '0.3'\"")
    parser.add_argument("--out", type=Path, default=None, help="report directory (default: "
                        "data/08_reporting/comparisons/<timestamp>)")
    parser.add_argument("--no-log", action="store_true", help="do not log the report to MLflow")
    add_json_flag(parser)
    if store_args is not None:
        store_args(parser)
    args = parser.parse_args(argv)
    if not (args.refs or args.last or args.filter_string):
        parser.error("name runs to compare (RUN_OR_VERSION ...), or use --last N / --filter")
    try:
        client, experiment_id, uri = store(getattr(args, "tracking_uri", None), getattr(args, "experiment", None))
        experiments = resolve(client, [experiment_id], args.refs, last=args.last, filter_string=args.filter_string)
        out = args.out or default_out_dir()
        summary = write_report(client, experiments, out)
    except CompareError as exc:
        print(f"align-pipeline compare: {exc}", file=sys.stderr)
        return 2
    run_id = None if args.no_log else log_report(client, experiment_id, experiments, out)
    print_result({"report": str(Path(out).resolve() / "report.md"), "mlflow_run_id": run_id, "tracking_uri": uri,
                  "compared": [e["label"] for e in summary["experiments"]]}, args.json)
    return 0


__all__ = ["COMPARE_TAG", "CompareError", "Experiment", "log_report", "main", "resolve", "store", "write_report"]
