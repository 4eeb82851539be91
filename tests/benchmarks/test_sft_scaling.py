"""The scaling benchmark script end to end on CPU (gloo, fp32, tiny preset): every layout starts from the same HF
init, so TP=2 and PP=2 reproduce the one-process loss curve, and their checkpoints load at TP=1 PP=1 with the same
validation loss. (Throughput figures on CPU mean nothing and are not checked.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # launches torchrun jobs or a KedroSession

REPO = Path(__file__).resolve().parents[2]


def test_scaling_script_tp2_pp2_match_one_process_and_reshard(tmp_path):
    cmd = [sys.executable, str(REPO / "benchmarks" / "sft_scaling.py"), "--preset", "tiny",
           "--layouts", "1x1x1,2x1x1,1x2x1", "--steps", "6", "--warmup", "1", "--global-batch", "8",
           "--micro-batch", "2", "--eval-samples", "16", "--lr", "3e-3", "--out", str(tmp_path)]
    out = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads((tmp_path / "scaling.json").read_text())
    rows = {r["layout"]: r for r in report["rows"]}
    assert list(rows) == ["1x1x1", "2x1x1", "1x2x1"] and report["failures"] == []
    base = rows["1x1x1"]["losses"]
    assert len(base) == 6 and base[-1] < base[0] - 0.2, base  # the copy task is being learned
    for layout in ("2x1x1", "1x2x1"):
        assert rows[layout]["max_loss_diff"] <= 1e-4, rows[layout]
        assert rows[layout]["reshard_val_loss_diff"] <= 1e-4, rows[layout]
    table = (tmp_path / "scaling.md").read_text()
    assert "| strong | 2x1x1 | 2 | 8 |" in table and "| strong | 1x2x1 | 2 | 8 |" in table
