"""A command's result: an aligned two-column table for people, one JSON line with ``--json``."""

from __future__ import annotations

import argparse
import json

from align_pipeline.tracking.command_output import add_json_flag, print_result


def test_a_result_prints_as_a_table_or_as_one_json_line(capsys):
    summary = {"report": "/p/report.md", "mlflow_run_id": None, "compared": ["beta=0.1", "beta=0.3"],
               "checks": {"vocab": True, "greedy": None}, "max_abs_logit_diff": 1.234567e-05, "failed": []}
    print_result(summary, as_json=False)
    assert capsys.readouterr().out.splitlines() == [
        "report              /p/report.md",
        "mlflow_run_id       -",
        "compared            beta=0.1, beta=0.3",
        "checks.vocab        True",
        "checks.greedy       -",
        "max_abs_logit_diff  1.23457e-05",
        "failed              -",
    ]
    print_result(summary, as_json=True)
    (line,) = capsys.readouterr().out.splitlines()
    assert json.loads(line) == summary
    parser = argparse.ArgumentParser()
    add_json_flag(parser)
    assert parser.parse_args(["--json"]).json and not parser.parse_args([]).json
