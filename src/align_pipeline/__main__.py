"""``python -m align_pipeline`` = ``kedro run`` for this project."""

import os
import sys
from pathlib import Path

from kedro.framework.cli.utils import find_run_command
from kedro.framework.project import configure_project


def main(*args, **kwargs):
    os.environ.setdefault("KEDRO_DISABLE_TELEMETRY", "true")
    package_name = Path(__file__).parent.name
    configure_project(package_name)
    interactive = hasattr(sys, "ps1")
    kwargs["standalone_mode"] = not interactive
    run = find_run_command(package_name)
    return run(*args, **kwargs)


if __name__ == "__main__":
    main()
