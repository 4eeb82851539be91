"""Opening a checkpoint runs no code from it (issue 29, item 2), and a failed HF import names logs that still exist
(item 6).

A real SFT job writes a checkpoint (model + a training checkpoint); copies of it are then made hostile: the DCP
``.metadata`` replaced by a pickle whose ``__reduce__`` runs ``os.system`` / ``open(marker, "w")``, a ``ShardedObject``
item of a ``.distcp`` file pointed at such a pickle, pickled Transformer Engine extra state, a crafted ``common.pt``.
Each is opened through the real paths — ``align-pipeline export`` (exit 2), a stage's ``init_from``, a stage's resume —
and must be refused with the file and the refused class named, the marker file never created.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from jobs import make_sft_data, run_sft, sft_job

from align_pipeline.errors import UserError
from align_pipeline.launch import LaunchError
from align_pipeline.model import safe_pickle
from align_pipeline.model.hf_export import HFExportError, export_hf

pytestmark = pytest.mark.slow  # launches torchrun jobs


class _System:
    """Runs ``touch <marker>`` when unpickled (pickled as ``posix.system``)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class _Open:
    """Creates ``<marker>`` when unpickled (pickled as ``io.open``)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A real SFT run (one rank): its model checkpoint and training checkpoints (steps 1 and 2)."""
    root = tmp_path_factory.mktemp("safe_ckpt")
    data = make_sft_data(root / "data")
    job = sft_job(data, root / "sft", training={"train_steps": 2, "save_interval": 1})
    result = run_sft(job)
    assert (root / "sft" / "checkpoints" / "iter_0000001" / ".metadata").is_file()
    return root, data, Path(result["model_dir"])


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _point_object_at(checkpoint: Path, blob: bytes) -> tuple[str, str]:
    """Point the first ``*._extra_state`` object of ``checkpoint`` at ``blob`` (appended to its ``.distcp`` file);
    the ``.metadata`` stays legitimate. Returns that item's key and its shard file's name."""
    metadata = safe_pickle.load_metadata(checkpoint / ".metadata")
    index = next(i for i in metadata.storage_data if i.fqn.endswith("_extra_state") or "_extra_state/" in i.fqn)
    info = metadata.storage_data[index]
    shard = checkpoint / info.relative_path
    offset = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(blob)
    info.offset, info.length = offset, len(blob)
    with open(checkpoint / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    return index.fqn, info.relative_path


def _torch_saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def test_the_allowlist_is_what_our_checkpoints_need(base):
    """Every global the project's own checkpoints name (model + training checkpoint) is allowed, and they load."""
    root, _, model_dir = base
    asked = set()

    class Recorder(pickle.Unpickler):
        def find_class(self, module, name):
            asked.add((module, name))
            return super().find_class(module, name)

    files = [model_dir / ".metadata", root / "sft" / "checkpoints" / "iter_0000001" / ".metadata"]
    for path in files:
        with open(path, "rb") as f:
            Recorder(f).load()
        safe_pickle.load_metadata(path)
    dtypes = {("torch", d) for d in safe_pickle.TORCH_DTYPES}
    assert asked <= safe_pickle.METADATA_GLOBALS | dtypes
    assert ("torch.distributed.checkpoint.metadata", "Metadata") in asked


@pytest.mark.parametrize("payload", [_System, _Open])
def test_export_cli_refuses_a_crafted_metadata_and_runs_nothing(base, tmp_path, payload):
    _, _, model_dir = base
    crafted = _copy(model_dir, tmp_path / "crafted")
    marker = tmp_path / "pwned"
    with open(crafted / ".metadata", "wb") as f:
        pickle.dump(payload(marker), f)
    done = subprocess.run([sys.executable, "-m", "align_pipeline", "export", str(crafted), str(tmp_path / "hf")],
                          capture_output=True, text=True, check=False)
    refused = {_System: "posix.system", _Open: "io.open"}[payload]
    assert done.returncode == 2, done.stderr
    assert not marker.exists()
    assert done.stderr.strip().splitlines()[-1] == (
        f"align-pipeline export: checkpoint {crafted / '.metadata'}: refused to unpickle {refused} (only torch "
        "checkpoint metadata classes may be loaded); a checkpoint from elsewhere cannot run code")
    assert not (tmp_path / "hf").exists() and not (tmp_path / ".tmp-hf").exists()


def test_export_still_writes_a_legitimate_checkpoint(base, tmp_path):
    _, _, model_dir = base
    assert export_hf(model_dir, tmp_path / "hf")["files"] == 1


def test_a_crafted_metadata_is_refused_in_process(base, tmp_path):
    _, _, model_dir = base
    crafted = _copy(model_dir, tmp_path / "crafted")
    marker = tmp_path / "pwned"
    with open(crafted / ".metadata", "wb") as f:
        pickle.dump({"state_dict_metadata": eval}, f)  # names builtins.eval
    with pytest.raises(HFExportError, match=r"refused to unpickle builtins\.eval") as info:
        export_hf(crafted, tmp_path / "hf")
    assert isinstance(info.value, UserError)
    with open(crafted / ".metadata", "wb") as f:
        pickle.dump(_System(marker), f)
    with pytest.raises(safe_pickle.UnsafeCheckpoint, match=re.escape(f"{crafted / '.metadata'}: refused to unpickle "
                                                                     "posix.system")):
        safe_pickle.load_metadata(crafted / ".metadata")
    assert not marker.exists()


def _job_refused(base, tmp_path, init_from: Path) -> LaunchError:
    _, data, _ = base
    with pytest.raises(LaunchError) as info:
        run_sft(sft_job(data, tmp_path / "run", init_from=str(init_from)))
    assert isinstance(info.value, UserError)  # kedro run / align-pipeline: the message alone, exit code 2
    return info.value


def test_init_from_a_crafted_metadata_runs_nothing(base, tmp_path):
    _, _, model_dir = base
    crafted = _copy(model_dir, tmp_path / "crafted")
    marker = tmp_path / "pwned"
    with open(crafted / ".metadata", "wb") as f:
        pickle.dump(_System(marker), f)
    error = _job_refused(base, tmp_path, crafted)
    assert not marker.exists()
    head = str(error).splitlines()[0]
    assert (f"(UnsafeCheckpoint: checkpoint {crafted / '.metadata'}: refused to unpickle posix.system (only torch "
            "checkpoint metadata classes may be loaded)") in head, head


def test_init_from_a_crafted_object_in_the_shards_runs_nothing(base, tmp_path):
    """DCP reads a ShardedObject's bytes with ``torch.load(weights_only=False)``; ours reads them weights-only."""
    _, _, model_dir = base
    crafted = _copy(model_dir, tmp_path / "crafted")
    marker = tmp_path / "pwned"
    key, shard = _point_object_at(crafted, _torch_saved([_Open(marker)]))
    error = _job_refused(base, tmp_path, crafted)
    assert not marker.exists()
    head = str(error).splitlines()[0]
    assert f"checkpoint {crafted}/{shard} (item {key}): refused to unpickle io.open" in head, head


def test_init_from_pickled_transformer_engine_state_is_refused(base, tmp_path):
    """Transformer Engine ``pickle.loads`` a non-empty ``_extra_state`` tensor; such a tensor is refused before any
    module sees it."""
    _, _, model_dir = base
    crafted = _copy(model_dir, tmp_path / "crafted")
    payload = torch.frombuffer(bytearray(pickle.dumps(_System(tmp_path / "pwned"))), dtype=torch.uint8)
    _point_object_at(crafted, _torch_saved([payload]))
    error = _job_refused(base, tmp_path, crafted)
    head = str(error).splitlines()[0]
    assert re.search(rf"checkpoint {re.escape(str(crafted))}: refused to load \S+\._extra_state \(Tensor: pickled "
                     "Transformer Engine FP8 state", head), head
    assert not (tmp_path / "pwned").exists()


def test_resume_from_a_crafted_common_pt_runs_nothing(base, tmp_path):
    root, data, _ = base
    run_dir = _copy(root / "sft", tmp_path / "sft")
    shutil.rmtree(run_dir / "model")
    step = max((run_dir / "checkpoints").glob("iter_*"))  # the one a resume loads
    marker = tmp_path / "pwned"
    common = torch.load(step / "common.pt", weights_only=True)
    torch.save({**common, "train_state": _System(marker)}, step / "common.pt")
    with pytest.raises(LaunchError) as info:
        run_sft(sft_job(data, run_dir, training={"train_steps": 2, "save_interval": 1}))
    assert not marker.exists()
    head = str(info.value).splitlines()[0]
    assert f"checkpoint {step / 'common.pt'}: refused to unpickle posix.system" in head, head


def test_resume_from_a_crafted_training_metadata_runs_nothing(base, tmp_path):
    root, data, _ = base
    run_dir = _copy(root / "sft", tmp_path / "sft")
    shutil.rmtree(run_dir / "model")
    step = max((run_dir / "checkpoints").glob("iter_*"))  # the one a resume loads
    marker = tmp_path / "pwned"
    with open(step / ".metadata", "wb") as f:
        pickle.dump(_Open(marker), f)
    with pytest.raises(LaunchError) as info:
        run_sft(sft_job(data, run_dir, training={"train_steps": 2, "save_interval": 1}))
    assert not marker.exists()
    assert f"checkpoint {step / '.metadata'}: refused to unpickle io.open" in str(info.value).splitlines()[0]


def test_a_failed_import_names_logs_that_exist(tmp_path):
    """`align-pipeline import` of an HF directory whose weights file is corrupt: exit 2, and the logs its error names
    are still there (the job's temporary directory is kept after a failure)."""
    from hf_models import tiny_family_models

    hf_dir = tmp_path / "hf"
    tiny_family_models()["llama"].save_pretrained(str(hf_dir))
    (hf_dir / "model.safetensors").write_bytes(b"not a safetensors file")
    done = subprocess.run([sys.executable, "-m", "align_pipeline", "import", str(hf_dir), str(tmp_path / "ckpt")],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 2, done.stderr
    logs = re.search(r"\(all logs: (\S+)\)", done.stderr)
    assert logs, done.stderr
    log_dir = Path(logs.group(1))
    try:
        assert log_dir.is_dir() and (log_dir / "rank0.log").is_file()
        assert "safetensors" in (log_dir / "rank0.log").read_text().lower()
        assert not (tmp_path / "ckpt").exists()
        assert json.loads((log_dir.parent / "config.json").read_text())["hf_dir"] == str(hf_dir)
    finally:
        shutil.rmtree(log_dir.parent.parent, ignore_errors=True)
