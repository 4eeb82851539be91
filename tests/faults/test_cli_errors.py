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
    return copy_project(tmp_path / "proj", store=False)  # a refused run must create no store


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


def _one_error(done: subprocess.CompletedProcess, message: str, max_lines: int = 60) -> None:
    """Exit code 2, ``message`` printed once as the one error line, nothing of a traceback (Python's or rich's), at
    most ``max_lines`` lines in all (the run's own log lines included)."""
    out = done.stdout + done.stderr
    assert done.returncode == 2, out
    assert out.count(message) == 1, out
    assert "Traceback" not in out and "╭" not in out, out
    errors = [line for line in done.stderr.splitlines() if line.startswith("Error")]
    assert len(errors) == 1 and errors[0].endswith(message), done.stderr
    assert len(out.splitlines()) <= max_lines, out


def test_unknown_pipeline_and_node_end_with_one_line_and_the_closest_names(project):
    done = _kedro(project, "--pipelines", "data_prep,dpoo")
    _one_error(done, "--pipelines: unknown pipeline 'dpoo' (did you mean 'dpo' or 'dpo_flow'?); pipelines: data_prep, "
                     "data_prep_prompts, distill, distill_evaluation, distill_from_path, dpo, dpo_evaluation, "
                     "dpo_flow, evaluation, export, ppo, reasoning, "
                     "regression_data, reinforce, reinforce_rm, reward_model, rlhf, sft, steerlm_reward_model",
               max_lines=4)  # fmt: skip
    assert not (project / "mlflow.db").exists()  # refused before Kedro opened a session (and the MLflow hook a run)

    done = _kedro(project, "--nodes", "train_dp")
    _one_error(done, "--nodes: unknown node 'train_dp' (did you mean 'train_dpo' or 'train_ppo' or 'train_sft'?); "
                     "nodes of the default pipeline: compute_reference_logps, evaluate_policies, fit_tokenizer, "
                     "tokenize_and_split, train_dpo, train_ppo, train_reinforce, train_reward_model, train_sft, "
                     "validate_raw_data", max_lines=4)  # fmt: skip


def test_chat_template_that_does_not_compile_names_file_key_and_line(project):
    (project / "templates").mkdir()
    (project / "templates" / "chat.jinja").write_text(
        "{% for m in messages %}\n{{ m.role }}: {{ m.content }}\n{{ m.content | shout }}\n{% endfor %}"
    )
    (project / "conf" / "local" / "parameters_data_prep.yml").write_text(
        "data_prep:\n  tokenizer:\n    chat_template: templates/chat.jinja\n"
    )
    done = _kedro(project, "--pipelines", "data_prep")
    _one_error(done, "chat template in templates/chat.jinja (params:data_prep.tokenizer.chat_template): line 3: "
                     "No filter named 'shout'.")  # fmt: skip

    # One that compiles but raises while rendering a record: the record's file, line and field, then the template's.
    (project / "templates" / "chat.jinja").write_text(
        "{% for m in messages %}\n{{ m.content }}\n"
        "{% if 'Z' in m.content %}{{ raise_exception('no Z in a message') }}{% endif %}{% endfor %}"
    )
    sft = project / "data" / "01_raw" / "sft.jsonl"
    lines = sft.read_text().splitlines()
    lines[2] = '{"input": "add: 1+1\\n", "output": "Z"}'
    sft.write_text("\n".join(lines) + "\n")
    done = _kedro(project, "--pipelines", "data_prep")
    _one_error(done, 'data/01_raw/sft.jsonl line 3: field "output": chat template in templates/chat.jinja: line 3: '
                     "no Z in a message")  # fmt: skip


def test_lone_surrogate_in_the_data_is_refused_naming_file_line_and_field(project):
    sft = project / "data" / "01_raw" / "sft.jsonl"
    lines = sft.read_text().splitlines()
    lines[6] = '{"input": "add: 1+1\\n", "output": "2\\ud800"}'  # the JSON escape of a lone surrogate, as written
    sft.write_text("\n".join(lines) + "\n")
    done = _kedro(project, "--pipelines", "data_prep")
    _one_error(done, 'data/01_raw/sft.jsonl line 7: field "output": invalid Unicode (lone surrogate U+D800)')


def test_a_sweep_checks_every_point_before_running_any(project):
    """`align-pipeline sweep` resolves and validates each grid point first: bad values and unknown keys are named
    point by point, exit 2, and nothing ran (no data prepared, no store, no run directory)."""
    env = {**os.environ, "KEDRO_DISABLE_TELEMETRY": "true"}
    done = subprocess.run([sys.executable, "-m", "align_pipeline", "sweep", "--pipelines", "dpo", "--grid",
                           "dpo.loss.beta=0.1,-3,abc", "--params", "dpo.training.train_steps=2"],
                          cwd=project, env=env, capture_output=True, text=True, check=False, timeout=300)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.splitlines() == [
        "align-pipeline sweep: point 2/3 (dpo.loss.beta=-3): params:dpo.loss.beta=-3.0 must be > 0",
        "align-pipeline sweep: point 3/3 (dpo.loss.beta=abc): params:dpo.loss.beta: expected a number, got 'abc'",
        "align-pipeline sweep: 2 of 3 points fail their parameter checks; nothing was run",
    ]
    assert "[sweep" not in done.stdout  # no point started
    assert not (project / "mlflow.db").exists() and not list((project / "data").glob("0[2-8]_*/*"))
    typo = subprocess.run([sys.executable, "-m", "align_pipeline", "sweep", "--pipelines", "dpo", "--grid",
                           "dpo.loss.betta=0.1"], cwd=project, env=env, capture_output=True, text=True, check=False,
                          timeout=300)
    assert typo.returncode == 2 and "params:dpo.loss: unknown key(s) ['betta']" in typo.stderr
