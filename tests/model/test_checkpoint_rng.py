"""Training checkpoints keep each rank's RNG state in a form ``torch.load(weights_only=True)`` reads (issue 13,
item 11): restoring it replays the same random numbers, and a file that holds anything else is refused, not
unpickled."""

from __future__ import annotations

import os
import pickle
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from align_pipeline.model import checkpoint


def _draw() -> tuple:
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def test_rng_state_round_trips_through_a_weights_only_load(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    torch.save(checkpoint._rng_state(), tmp_path / "rank_00000.pt")
    expected = _draw()
    _draw()  # move every generator on
    checkpoint._set_rng_state(torch.load(tmp_path / "rank_00000.pt", weights_only=True))
    assert _draw() == expected


class _Payload:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_a_tampered_rng_file_is_refused_not_unpickled(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    torch.save({"python": _Payload()}, tmp_path / "rank_00000.pt")
    with pytest.raises(pickle.UnpicklingError):
        torch.load(tmp_path / "rank_00000.pt", weights_only=True)
    assert not (tmp_path / "pwned").exists()
    assert "safe_pickle.weights_only_load(rng_file)" in Path(checkpoint.__file__).read_text().split(
        "def load_training", 1)[1]  # torch.load(weights_only=True), the refusal naming the file
