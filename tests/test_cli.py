"""``kedro run``'s pipeline, node and tag names are checked against the project's registered pipelines before Kedro
starts a session (the real registry; the CLI itself: tests/faults/test_cli_errors.py)."""

from __future__ import annotations

import pytest

from align_pipeline.cli import check_selection
from align_pipeline.errors import UserError
from align_pipeline.pipeline_registry import register_pipelines


@pytest.fixture(scope="module")
def registry():
    return register_pipelines()


def _check(registry, pipelines=(), tags=(), **nodes):
    check_selection(registry, pipelines, {f"--{k.replace('_', '-')}": v for k, v in nodes.items()}, tags)


def test_known_names_pass(registry):
    _check(registry, ["data_prep", "sft"], tags=["sft"], nodes=["train_sft"], from_nodes=["fit_tokenizer"])
    _check(registry, ["__default__"], to_nodes=["train_dpo"])
    _check(registry, [], nodes=["train_dpo", "compute_reference_logps"])  # the default pipeline


@pytest.mark.parametrize(
    "pipelines, tags, nodes, message",
    [
        (["rlhff"], [], {}, "--pipelines: unknown pipeline 'rlhff' (did you mean 'rlhf'?); pipelines: data_prep, "),
        ([], [], {"from_nodes": ["train_dpo", "trian_sft"]},
         "--from-nodes: unknown node 'trian_sft' (did you mean 'train_sft'?); nodes of the default pipeline: "),
        (["sft"], [], {"to_nodes": ["train_dpo"]},
         ("--to-nodes: no node 'train_dpo' in pipeline sft; it is in pipelines dpo, dpo_evaluation, dpo_flow, "
          "__default__ (add --pipelines dpo)")),
        ([], [], {"nodes": ["export_sft_policy"]},
         ("--nodes: no node 'export_sft_policy' in the default pipeline; it is in pipeline export (add --pipelines "
          "export)")),
        ([], ["dpoo"], {},
         ("--tags: unknown tag 'dpoo' (did you mean 'dpo'?); tags of the default pipeline: data_prep, dpo, "
          "evaluation, ppo, reinforce, reward_model, sft")),
        (["sft", "dpo"], ["ppo"], {},
         "--tags: no tag 'ppo' in pipelines sft, dpo; it is in pipelines ppo, rlhf, __default__ (add --pipelines ppo)"),
    ],
)  # fmt: skip
def test_unknown_names_are_one_line_with_the_closest_ones(registry, pipelines, tags, nodes, message):
    with pytest.raises(UserError) as excinfo:
        _check(registry, pipelines, tags, **nodes)
    assert str(excinfo.value).startswith(message) and "\n" not in str(excinfo.value)


def _align(*args: str, cwd=None):
    import os
    import subprocess
    import sys

    env = {**os.environ, "KEDRO_DISABLE_TELEMETRY": "true"}
    return subprocess.run([sys.executable, "-m", "align_pipeline", *args], capture_output=True, text=True,
                          check=False, env=env, cwd=cwd, timeout=300)


def test_top_level_help_lists_every_command(tmp_path):
    from align_pipeline.__main__ import COMMANDS
    from align_pipeline.kedro.commands import COMMANDS as functions

    assert set(COMMANDS) == set(functions)  # one list of commands, each described
    done = _align("--help", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    listed = [line.split()[0] for line in done.stdout.split("commands:\n", 1)[1].splitlines() if line.startswith("  ")]
    assert listed == list(COMMANDS)
    assert "align-pipeline run --help" in done.stdout


def test_a_mistyped_command_gets_one_line_with_the_closest_command(tmp_path):
    done = _align("comapre", "--last", "2", cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        ("align-pipeline: unknown command 'comapre' (did you mean 'compare'?); commands: export, import, compare, "
        "sweep, mlflow-log, worker, gc (--help lists them)")]
    assert done.stdout == ""


def test_run_is_kedro_run(tmp_path):
    done = _align("run", "--help", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "--pipelines" in done.stdout and "--params" in done.stdout


def test_a_failed_rank_0_is_not_printed_twice(tmp_path):
    """Rank 0's log streams to the console while the job runs: the final error names it instead of repeating its
    tail; another rank's tail (never streamed) is kept."""
    from align_pipeline.cli import _without_streamed_tail
    from align_pipeline.launch.torchrun import LaunchError

    log = tmp_path / "rank0.log"
    body = f"torchrun job 'sft' failed: rank {{}} exited with code 1 (ValueError: boom)\nlast 2 lines of rank {{}}'s " \
           f"log {log}:\nTraceback (most recent call last):\nValueError: boom"
    streamed = LaunchError(body.format(0, 0), rank=0, log_path=log)
    assert _without_streamed_tail(streamed) == (
        "torchrun job 'sft' failed: rank 0 exited with code 1 (ValueError: boom)\n"
        f"(rank 0's log, streamed above: {log})")
    other = LaunchError(body.format(1, 1), rank=1, log_path=tmp_path / "rank1.log")
    assert _without_streamed_tail(other) == str(other)
    assert _without_streamed_tail(ValueError("x\ny")) == "x\ny"
