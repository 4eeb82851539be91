"""``align-pipeline`` / ``python -m align_pipeline``: ``kedro run`` for this project, plus commands for users outside
Kedro.

    align-pipeline [kedro run options]                       # the pipeline, as `kedro run`
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

COMMANDS = ("export", "import", "mlflow-log", "compare", "sweep", "worker", "gc")
"""The commands (:mod:`align_pipeline.kedro.commands`); anything else goes to ``kedro run``."""


def main(*args, **kwargs):
    if not args and len(sys.argv) > 1 and sys.argv[1] in COMMANDS:
        from align_pipeline.kedro.commands import COMMANDS as commands

        sys.exit(commands[sys.argv[1]](sys.argv[2:]))

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
