"""The generated ``slurm_job.sh`` with hostile values, without Slurm: every Slurm field with a control character is
refused when the parameters are loaded (naming the key); a space, ``$(...)``, backticks or quotes in the interpreter's
path, the run directory or a Slurm field stay inside their word. The script is run by a real bash with stand-ins for
``scontrol`` and ``srun`` (which records the words it gets), so what is checked is what bash does with it."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from align_pipeline.config import ConfigError, LaunchConfig, from_dict
from align_pipeline.launch import slurm

HOSTILE = "x $(touch marker-dollar) `touch marker-tick` ';touch marker-quote;' \"$HOME\" *"
"""Shell syntax that runs ``touch`` if anything in the script is unquoted (and a glob and a variable)."""


@pytest.mark.parametrize(("slurm_section", "key", "what"), [
    ({"partition": "gpu\ntouch /tmp/pwned"}, "partition", "a newline"),
    ({"account": "acct\rtouch /tmp/pwned"}, "account", "a carriage return"),
    ({"time": "04:00:00\x00"}, "time", "a NUL byte"),
    ({"partition": "gpu\tcpu"}, "partition", "a tab"),
    ({"account": "a\x1b[2Jb"}, "account", r"the control character '\\x1b'"),
    ({"time": "1:00\x7f"}, "time", r"the control character '\\x7f'"),
    ({"sbatch_lines": ["--qos=high", "--exclusive\ntouch /tmp/pwned"]}, r"sbatch_lines\[1\]", "a newline"),
])
def test_a_control_character_in_a_slurm_field_is_refused_naming_the_key(slurm_section, key, what):
    with pytest.raises(ConfigError, match=rf"^params:launch\.slurm\.{key} contains {what}; Slurm fields must be one "
                                          r"line$"):
        from_dict(LaunchConfig, {"backend": "slurm", "slurm": slurm_section}, "params:launch")


def test_printable_slurm_fields_pass():
    launch = from_dict(LaunchConfig, {"backend": "slurm", "slurm": {
        "partition": "gpu", "account": "proj-1", "time": "04:00:00", "sbatch_lines": ["--qos=high", "--exclusive"]}},
        "params:launch")
    assert launch.slurm.sbatch_lines == ["--qos=high", "--exclusive"]


def _fake_slurm(bin_dir: Path) -> None:
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text('#!/bin/bash\necho node-a\necho node-b\n')
    (bin_dir / "srun").write_text('#!/bin/bash\nprintf \'%s\\0\' "$@" > "$SRUN_ARGS"\n')  # each word, NUL-ended
    for f in bin_dir.iterdir():
        f.chmod(0o755)


def test_hostile_paths_and_fields_stay_single_words_when_bash_runs_the_script(tmp_path, monkeypatch):
    work = tmp_path / "cwd"
    work.mkdir()
    python = f"/opt/py {HOSTILE}/bin/python3"
    monkeypatch.setattr(sys, "executable", python)
    run_dir = tmp_path / f"runs {HOSTILE}" / "sft-1"
    log_dir, config_path = run_dir / "logs", run_dir / "config.json"
    launch = from_dict(LaunchConfig, {"nnodes": 2, "nproc_per_node": 3, "master_port": 29500, "backend": "slurm",
                                      "slurm": {"partition": f"gpu {HOSTILE}", "cpus_per_task": 4,
                                                "sbatch_lines": [f"--comment={HOSTILE}", "--exclusive"]}},
                       "params:launch")
    text = slurm.job_script("align_pipeline.train.sft", config_path, launch, log_dir, "train_sft $(x)",
                            "align_pipeline.launch._worker")
    script = tmp_path / "slurm_job.sh"
    script.write_text(text)

    # bash parses it; every #SBATCH line holds exactly one word, the option as written
    subprocess.run(["bash", "-n", str(script)], check=True)
    lines = text.splitlines()
    sbatch = [shlex.split(line.removeprefix("#SBATCH ")) for line in lines if line.startswith("#SBATCH ")]
    assert [f"--partition=gpu {HOSTILE}"] in sbatch and [f"--comment={HOSTILE}"] in sbatch
    assert [f"--output={log_dir / 'torchrun.log'}"] in sbatch and ["--job-name=align-train_sft___x_"] in sbatch
    assert all(len(words) == 1 for words in sbatch)
    code = [line for line in lines if not line.startswith("#")]
    assert code[:2] == ["set -euo pipefail", 'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)']
    assert len(code) == 3 and code[2].startswith("srun ") and text.endswith("\n")  # one srun line

    # run by bash: srun gets exactly these words, and nothing ran
    bin_dir, args = tmp_path / "bin", tmp_path / "srun.args"
    _fake_slurm(bin_dir)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_NODELIST": "node-[a-b]", "SRUN_ARGS": str(args),
           "HOME": "/home/nobody"}
    subprocess.run(["bash", str(script)], cwd=work, env=env, check=True, timeout=30)
    words = args.read_bytes().decode().split("\0")[:-1]
    assert words == [
        "--kill-on-bad-exit=1", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--cpus-per-task=4",
        python, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "3",
        "--rdzv-backend", "c10d", "--rdzv-id", slurm.rdzv_id(run_dir), "--max-restarts", "0",
        "--rdzv-endpoint", "node-a:29400",
        "-m", "align_pipeline.launch._worker", str(log_dir), "align_pipeline.train.sft", "--config", str(config_path),
    ]  # fmt: skip
    assert not list(tmp_path.rglob("marker*"))  # no $(...), `...` or ';...;' ran, here or in the script's cwd


def test_a_run_directory_with_a_newline_is_refused_before_the_script_is_written(tmp_path):
    run_dir = tmp_path / "runs\ntouch marker #" / "sft-1"
    launch = LaunchConfig(backend="slurm")
    with pytest.raises(ConfigError, match=r"^launch.backend=slurm: the run directory .* contains a newline; it "
                                          r"cannot be written into a line of slurm_job.sh$"):
        slurm.job_script("align_pipeline.train.sft", run_dir / "config.json", launch, run_dir / "logs", "train_sft",
                         "align_pipeline.launch._worker")


def test_an_interpreter_path_with_a_newline_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "executable", "/opt/py\ntouch marker/python")
    with pytest.raises(ConfigError, match=r"the Python interpreter's path \(sys.executable\) .* contains a newline"):
        slurm.job_script("align_pipeline.train.sft", tmp_path / "config.json", LaunchConfig(backend="slurm"),
                         tmp_path / "logs", "train_sft", "align_pipeline.launch._worker")
