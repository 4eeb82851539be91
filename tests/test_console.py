"""The console of `kedro run`: plain one-line records when piped (rich kept on a terminal), known third-party warnings
filtered out of the jobs."""

from __future__ import annotations

import io
import logging
import subprocess
import sys

from rich.console import Console

from align_pipeline.kedro.console import ParameterLoads, plain_logging_when_piped
from align_pipeline.launch.env import KNOWN_WARNINGS, job_warning_filters


def _logger(name: str, terminal: bool) -> tuple[logging.Logger, io.StringIO]:
    from kedro.logging import RichHandler

    stream = io.StringIO()
    logger = logging.getLogger(name)
    logger.handlers.clear()
    logger.propagate = False
    logger.addHandler(RichHandler(console=Console(file=stream, force_terminal=terminal, width=80)))
    logger.setLevel(logging.INFO)
    return logger, stream


def test_a_piped_console_gets_one_unwrapped_line_per_record():
    logger, stream = _logger("align_test_piped", terminal=False)
    assert plain_logging_when_piped(logger) == 1
    message = "[ppo] iter 170/300 | " + "reward 0.412 | " * 20  # far beyond 80 columns
    logger.info(message)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].endswith(" INFO align_test_piped: " + message)


def test_a_terminal_keeps_rich():
    logger, _ = _logger("align_test_tty", terminal=True)
    assert plain_logging_when_piped(logger) == 0
    assert type(logger.handlers[0]).__name__ == "RichHandler"


def test_jobs_ignore_the_known_warnings_and_keep_the_users_filters():
    value = job_warning_filters("error::DeprecationWarning")
    assert value.startswith("error::DeprecationWarning,ignore:")
    lines, messages, narrow = ["import warnings"], [], []
    for entry in KNOWN_WARNINGS:
        message, _, where = entry.partition(":")
        messages.append(message)
        if where:  # message:category:module - ignored only where that module warns it
            category, module = where.split(":")
            lines.append(f"warnings.warn_explicit({message + ' (rest)'!r}, {category}, 'x.py', 1, module={module!r})")
            lines.append(f"warnings.warn({message + ' (from elsewhere)'!r}, {category})")
            narrow.append(message + " (from elsewhere)")
        else:
            lines.append(f"warnings.warn({message + ' (rest of the message)'!r}, FutureWarning)")
    lines.append("warnings.warn('something else', UserWarning)")
    proc = subprocess.run([sys.executable, "-c", "\n".join(lines)], env={"PYTHONWARNINGS": job_warning_filters()},
                          capture_output=True, text=True, check=True)
    assert "something else" in proc.stderr
    assert narrow and all(m in proc.stderr for m in narrow), proc.stderr  # the same words from our code still show
    shown = proc.stderr
    for m in narrow:
        shown = shown.replace(m, "")
    assert not any(m in shown for m in messages), proc.stderr


def test_parameter_loads_are_dropped_and_dataset_loads_kept():
    catalog = logging.getLogger("kedro.io.data_catalog")
    records = [catalog.makeRecord(catalog.name, logging.INFO, __file__, 1, "Loading data from %s (%s)...", (name, kind),
                                  None) for name, kind in [("params:dpo", "MemoryDataset"),
                                                           ("parameters", "MemoryDataset"),
                                                           ("sft_policy", "CheckpointDataset")]]
    records.append(catalog.makeRecord(catalog.name, logging.INFO, __file__, 1, "Saving data to %s (%s)...",
                                      ("params:x", "MemoryDataset"), None))
    kept = [r.args[0] for r in records if ParameterLoads().filter(r)]
    assert kept == ["sft_policy", "params:x"]


def test_tensor_parallel_jobs_get_megatrons_cuda_connection_setting_unless_the_user_set_it(monkeypatch):
    from align_pipeline.launch.env import parallel_env

    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    assert parallel_env({"parallel": {"tensor_model_parallel_size": 2}}) == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    assert parallel_env({"parallel": {"tensor_model_parallel_size": 1}}) == {}
    assert parallel_env({"checkpoint": "x"}) == {}  # a model job's config without a parallel section
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")
    assert parallel_env({"parallel": {"tensor_model_parallel_size": 2}}) == {}
