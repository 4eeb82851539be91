"""The embedded default `kedro run` as a new user meets it: wall time per stage, and the report over seed sets.

    python benchmarks/default_run.py --seeds 0 1 2 3 --out /tmp/default_run
    python benchmarks/default_run.py --seeds 0 1 2 3 --distill --out /tmp/default_run   # + on-policy distillation

For each seed set, a fresh copy of this checkout's tracked files (+ untracked, not ignored; no data beyond
``data/01_raw``) gets a ``conf/local/parameters.yml`` that moves every stage's seed (seed set 0 = the shipped config,
nothing written), and ``kedro run`` runs in it with this interpreter's environment. Recorded per run: wall time of the
whole command, each stage's "<stage>: finished in N s" from the launcher's log lines, the Kedro start + data_prep time
(before the first stage), and the evaluation report (sampled / greedy accuracy per policy, RM accuracy).

With ``--distill``, each seed set then runs ``kedro run --pipelines distill_evaluation``: the seed set's
reinforce_policy (the teacher) distilled into its sft_policy (the student) with the shipped ``params:distill``, and
the three evaluated: teacher, student before (sft) and after (distill), and the share of the teacher's gain over SFT
the student recovered.

Writes ``<out>/default_run.json`` and ``<out>/default_run.md`` (command, date, machine, per-stage table, margins over
SFT per seed). Run it on an otherwise idle machine: the times are wall-clock.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STAGE_DONE = re.compile(r"(\w+): finished in ([\d.]+) s")
# A log line's time: "2026-12-04 11:05:18 INFO ..." (piped: align_pipeline.kedro.console's plain records), or rich's
# "[12/04/26 11:05:18]" (a terminal)
_TIME = r"^(?:\[\d\d/\d\d/\d\d |\d{4}-\d\d-\d\d )(\d\d:\d\d:\d\d)"
FIRST_LAUNCH = re.compile(_TIME + r".*torchrun \d+ node", re.MULTILINE)
STAMP = re.compile(_TIME, re.MULTILINE)


def seed_overrides(x: int) -> str:
    """conf/local parameters moving every stage's seeds (data split unchanged: the held-out prompts stay the same)."""
    return "\n".join([
        f"sft: {{training: {{seed: {100 + x}}}}}",
        f"reward_model: {{training: {{seed: {200 + x}}}}}",
        f"dpo: {{training: {{seed: {300 + x}}}}}",
        f"ppo: {{rl: {{seed: {400 + x}}}, generation: {{seed: {400 + x}}}}}",
        f"reinforce: {{rl: {{seed: {500 + x}}}, generation: {{seed: {500 + x}}}}}",
        f"distill: {{rl: {{seed: {600 + x}}}, generation: {{seed: {600 + x}}}}}",
        f"evaluation: {{generation: {{seed: {x}}}}}",
    ]) + "\n"


def fresh_copy(dest: Path) -> None:
    """The checkout's files as a clone would have them (plus untracked, not ignored), without generated data."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, check=True,
                           capture_output=True, text=True).stdout.split("\n")
    dest.mkdir(parents=True)
    for name in files:
        if name and not re.match(r"data/0[2-8]", name) and (REPO / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, dest / name)


def seconds(stamp: str) -> int:
    h, m, s = (int(v) for v in stamp.split(":"))
    return h * 3600 + m * 60 + s


def newest_report(project: Path) -> dict:
    newest = max((project / "data" / "08_reporting" / "eval_report").iterdir())
    return json.loads((newest / "eval_report" / "report.json").read_text())


def run_distill(project: Path, env: dict, kedro: str, seed: int | None = None) -> dict:
    """``kedro run --pipelines distill_evaluation`` in a project that has run the default: teacher (reinforce),
    student before (sft) and after (distill), sampled and greedy accuracy, and the distill stage's time. ``seed``:
    the distillation's seeds moved (``--params``) as a seed set moves them."""
    params = [] if not seed else ["--params", f"distill.rl.seed={600 + seed},distill.generation.seed={600 + seed}"]
    proc = subprocess.run([kedro, "run", "--pipelines", "distill_evaluation", *params], cwd=project, env=env,
                          capture_output=True, text=True, check=False)
    log = proc.stdout + proc.stderr
    (project / "distill.log").write_text(log)
    if proc.returncode:
        raise SystemExit(f"{project}: distill_evaluation exited {proc.returncode}; log: {project / 'distill.log'}")
    policies = newest_report(project)["policies"]
    found = {role: {"accuracy": policies[name]["accuracy"], "greedy_accuracy": policies[name].get("greedy_accuracy")}
             for role, name in (("teacher", "reinforce"), ("before", "sft"), ("after", "distill"))}
    gain = found["teacher"]["accuracy"] - found["before"]["accuracy"]
    found["recovered"] = (found["after"]["accuracy"] - found["before"]["accuracy"]) / gain if gain else None
    found["distill_s"] = dict(STAGE_DONE.findall(log)).get("distill")
    return found


def run_once(x: int, workdir: Path, distill: bool = False) -> dict:
    project = workdir / f"seed{x}"
    if project.exists():
        shutil.rmtree(project)
    fresh_copy(project)
    if x:
        (project / "conf" / "local" / "parameters.yml").write_text(seed_overrides(x))
    env = {**os.environ, "KEDRO_DISABLE_TELEMETRY": "true", "COLUMNS": "200"}
    env.pop("MLFLOW_TRACKING_URI", None)
    kedro = shutil.which("kedro", path=str(Path(sys.executable).parent)) or "kedro"
    t0 = time.perf_counter()
    proc = subprocess.run([kedro, "run"], cwd=project, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    log = proc.stdout + proc.stderr
    (project / "run.log").write_text(log)
    if proc.returncode:
        raise SystemExit(f"seed set {x}: kedro run exited {proc.returncode}; log: {project / 'run.log'}")
    stages = {name: float(s) for name, s in STAGE_DONE.findall(log)}
    stamps, first = STAMP.findall(log), FIRST_LAUNCH.search(log)
    start = seconds(first.group(1)) - seconds(stamps[0]) if first and stamps else None
    (report_dir,) = (project / "data" / "08_reporting" / "eval_report").iterdir()
    report = json.loads((report_dir / "eval_report" / "report.json").read_text())
    policies = {name: {"accuracy": p["accuracy"], "greedy_accuracy": p.get("greedy_accuracy")}
                for name, p in report["policies"].items()}
    found = {"seed_set": x, "wall_s": round(wall, 1), "start_and_data_prep_s": start, "stages_s": stages,
             "policies": policies, "rm_accuracy": report.get("reward_model", {}).get("accuracy")}
    if distill:
        found["distill"] = run_distill(project, env, kedro)
    return found


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def markdown(runs: list[dict], command: str) -> str:
    stages = list(runs[0]["stages_s"])
    lines = [(f"Command: `{command}`; {datetime.date.today().isoformat()}; {os.cpu_count()} cores ({cpu_model()}), "
              f"Python {platform.python_version()}."), "",
             "| seed set | wall s | start + data_prep s | " + " | ".join(stages) + " |",
             "|---" * (3 + len(stages)) + "|"]
    for r in runs:
        lines.append(f"| {r['seed_set']} | {r['wall_s']:.0f} | {r['start_and_data_prep_s']} | "
                     + " | ".join(f"{r['stages_s'].get(s, float('nan')):.1f}" for s in stages) + " |")
    names = [n for n in runs[0]["policies"] if n != "sft"]
    lines += ["", "| seed set | sft | " + " | ".join(f"{n} (over sft)" for n in names) + " | RM accuracy |",
              "|---" * (3 + len(names)) + "|"]
    for r in runs:
        sft = r["policies"]["sft"]["accuracy"]
        cells = [f"{r['policies'][n]['accuracy']:.3f} ({r['policies'][n]['accuracy'] - sft:+.3f})" for n in names]
        lines.append(f"| {r['seed_set']} | {sft:.3f} | " + " | ".join(cells) + f" | {r['rm_accuracy']:.3f} |")
    if "distill" in runs[0]:
        lines += [""] + distill_table(runs)
    return "\n".join(lines) + "\n"


def distill_table(runs: list[dict]) -> list[str]:
    lines = ["On-policy distillation (`kedro run --pipelines distill_evaluation`), sampled (greedy) accuracy:", "",
             "| seed | teacher (reinforce) | student before (sft) | student after (distill) | recovered | distill s |",
             "|---" * 6 + "|"]
    for r in runs:
        d = r["distill"]
        cells = [f"{d[k]['accuracy']:.3f} ({d[k]['greedy_accuracy']:.3f})" for k in ("teacher", "before", "after")]
        lines.append(f"| {r['seed_set']} | " + " | ".join(cells) + f" | {d['recovered']:.0%} | {d['distill_s']} |")
    return lines


def distill_markdown(runs: list[dict], command: str) -> str:
    head = (f"Command: `{command}`; {datetime.date.today().isoformat()}; {os.cpu_count()} cores ({cpu_model()}), "
            f"Python {platform.python_version()}.")
    return "\n".join([head, "", *distill_table(runs)]) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0], help="seed sets (0 = the shipped config)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--workdir", type=Path, default=None, help="where the project copies go (default: <out>/runs)")
    ap.add_argument("--distill", action="store_true", help="then distill_evaluation in each seed set's project")
    ap.add_argument("--distill-in", type=Path, default=None, metavar="PROJECT",
                    help="only distill_evaluation, in PROJECT (which has run the default), once per seed: the "
                         "teacher and the student's start stay, the distillation's seeds move")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    workdir = args.workdir or args.out / "runs"
    runs = []
    if args.distill_in is not None:
        env = {**os.environ, "KEDRO_DISABLE_TELEMETRY": "true", "COLUMNS": "200"}
        kedro = shutil.which("kedro", path=str(Path(sys.executable).parent)) or "kedro"
        for x in args.seeds:
            runs.append({"seed_set": x, "distill": run_distill(args.distill_in.resolve(), env, kedro, x)})
            print(json.dumps(runs[-1]), flush=True)
        command = "python benchmarks/default_run.py " + " ".join(sys.argv[1:])
        (args.out / "distill.json").write_text(json.dumps(runs, indent=2))
        (args.out / "distill.md").write_text(distill_markdown(runs, command))
        print(distill_markdown(runs, command))
        return
    for x in args.seeds:
        runs.append(run_once(x, workdir, args.distill))
        print(json.dumps(runs[-1]), flush=True)
    command = "python benchmarks/default_run.py " + " ".join(sys.argv[1:])
    (args.out / "default_run.json").write_text(json.dumps(runs, indent=2))
    (args.out / "default_run.md").write_text(markdown(runs, command))
    print(markdown(runs, command))


if __name__ == "__main__":
    main()
