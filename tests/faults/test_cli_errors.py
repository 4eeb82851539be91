"""Item 10: ``kedro run`` ends a user error (bad data, bad config) with its message once and exit code 2, no
traceback; ``--traceback`` shows it. Real ``kedro`` CLI in a subprocess on a temp copy of the project."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from projects import copy_project

pytestmark = pytest.mark.slow  # starts the kedro CLI


@pytest.fixture
def project(tmp_path):
    return copy_project(tmp_path / "proj")


def _kedro(root: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "KEDRO_DISABLE_TELEMETRY": "true", "MLFLOW_TRACKING_URI": f"sqlite:///{root / 'mlflow.db'}",
           "COLUMNS": "200"}  # fmt: skip
    env.pop("ALIGN_TRACEBACK", None)
    kedro = [sys.executable, "-c", "from kedro.framework.cli import main; main()"]
    return subprocess.run([*kedro, "run", *args], check=False, cwd=root, env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip


def test_bad_data_ends_with_one_message_and_exit_code_2(project):
    sft = project / "data" / "01_raw" / "sft.jsonl"
    lines = sft.read_text().splitlines()
    lines[2] = '{"input": "add: 1+1\\n", "outptu": "2"}'
    sft.write_text("\n".join(lines) + "\n")

    done = _kedro(project, "--pipelines", "data_prep")
    out = done.stdout + done.stderr
    assert done.returncode == 2, out
    assert out.count('field "outptu": unknown field') == 1, out
    assert "Error (node validate_raw_data): data/01_raw/sft.jsonl line 3" in out
    assert "Traceback" not in out and "╭" not in out, out  # neither Python's nor rich's
    assert "register_new_resolver" not in out  # Kedro's own deprecation noise is filtered
    assert len(out.splitlines()) < 60, out

    verbose = _kedro(project, "--pipelines", "data_prep", "--traceback")
    assert verbose.returncode not in (0, 2)
    assert "DataValidationError" in verbose.stderr and "schemas.py" in verbose.stderr


def test_bad_parameter_ends_with_one_message_naming_the_key(project):
    done = _kedro(project, "--pipelines", "data_prep", "--params", "data_prep.seed=abc")
    out = done.stdout + done.stderr
    assert done.returncode == 2, out
    assert out.count("params:data_prep.seed: expected an integer, got 'abc'") == 1, out
    assert "Traceback" not in out and "╭" not in out, out
