"""``align-pipeline`` / ``python -m align_pipeline``: ``kedro run`` for this project, plus commands for users outside
Kedro.

    align-pipeline [kedro run options]                       # the pipeline, as `kedro run` (also: `run ...`)
    align-pipeline --help                                    # the commands
    align-pipeline export CHECKPOINT_DIR HF_DIR [--tokenizer DIR] [--dtype float32|bfloat16|float16] [--check]
    align-pipeline export LORA_CHECKPOINT_DIR PEFT_DIR --peft [--base-model BASE_HF_DIR]
    align-pipeline import HF_DIR CHECKPOINT_DIR [--tp N] [--pp N] [--seq-length N] [--check]
    align-pipeline mlflow-log CHECKPOINT_OR_RUN_DIR [--run-id ID | --experiment NAME] [--tracking-uri URI]
    align-pipeline compare [RUN_OR_VERSION ...] [--last N] [--filter "MLFLOW FILTER"] [--out DIR] [--no-log]
    align-pipeline sweep --pipelines dpo --grid dpo.loss.beta=0.03,0.1,0.3 [--grid ...] [--env ENV]
    align-pipeline worker --master-addr NODE0 --master-port PORT          # the other nodes of a multi-node run
    align-pipeline gc [--dry-run] [--keep N] [root=PATH ...]              # free stored versions retention removes
"""

import os
import sys
from pathlib import Path

COMMANDS = {
    "export": "a checkpoint -> a Hugging Face directory (or a PEFT adapter); --check verifies it",
    "import": "a Hugging Face directory -> a checkpoint any stage can start from",
    "compare": "a report over kedro runs: params, metrics, curves, lineage (logged to MLflow)",
    "sweep": "one kedro run per grid point, then compare over them",
    "mlflow-log": "log a run directory's metrics and checkpoint to MLflow after the fact",
    "worker": "join node 0's multi-node run from another node",
    "gc": "remove the stored versions retention does not keep",
}
"""The commands (:mod:`align_pipeline.kedro.commands`) and one line on each; options go to ``kedro run``."""


def usage() -> str:
    """``align-pipeline --help``: the commands, then how the pipeline itself runs."""
    width = max(map(len, COMMANDS))
    lines = ["usage: align-pipeline [KEDRO RUN OPTIONS]      run the pipelines (as `kedro run`)",
             "       align-pipeline COMMAND [ARGS]           one of the commands below", "", "commands:"]
    lines += [f"  {name:{width}}  {text}" for name, text in COMMANDS.items()]
    lines += ["", "`align-pipeline COMMAND --help` describes a command; `align-pipeline run --help` lists the kedro run",
              "options (--pipelines, --params, --env, --nodes, ...)."]
    return "\n".join(lines)


def unknown_command(name: str) -> str:
    """The one line for a first argument that is neither a command nor an option."""
    import difflib

    close = difflib.get_close_matches(name, [*COMMANDS, "run"], n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"align-pipeline: unknown command {name!r}{hint}; commands: {', '.join(COMMANDS)} (--help lists them)"


def main(*args, **kwargs):
    if not args and len(sys.argv) > 1:
        first = sys.argv[1]
        if first in COMMANDS:
            from align_pipeline.kedro.commands import COMMANDS as commands

            sys.exit(commands[first](sys.argv[2:]))
        if first in ("-h", "--help", "help"):
            print(usage())
            sys.exit(0)
        if first == "run":  # `align-pipeline run ...` is `kedro run ...`, as the usage says
            sys.argv = [sys.argv[0], *sys.argv[2:]]
        elif not first.startswith("-"):  # kedro run takes no positional argument: a mistyped command
            print(unknown_command(first), file=sys.stderr)
            sys.exit(2)

    from kedro.framework.cli.utils import find_run_command
    from kedro.framework.project import configure_project

    os.environ.setdefault("KEDRO_DISABLE_TELEMETRY", "true")
    package_name = Path(__file__).parent.name
    configure_project(package_name)
    interactive = hasattr(sys, "ps1")
    kwargs["standalone_mode"] = not interactive
    run = find_run_command(package_name)
    return run(*args, **kwargs)


if __name__ == "__main__":
    main()
