"""An HF export packs the tokenizer its checkpoint was trained with, and ``--check`` checks the whole export.

The reproduction of issue 30: another env's data_prep rewrote the tokenizer path a checkpoint's meta.json records
(a 44-token demo checkpoint, then a several-hundred-token HF tokenizer at that path), and the export packed it
silently; ``--check`` (random-id logits only) passed. Now the export is refused before anything is written, and
``--check`` verifies vocabulary, fingerprint, special tokens, chat template, prompt ids, logits and a greedy
generation through ``transformers``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from chat_tokenizers import make_chat_tokenizer_dir

from align_pipeline.data.tokenizer import load_tokenizer
from align_pipeline.launch.model_jobs import checkpoint_outputs
from align_pipeline.model.export_check import CHECK_FILE, ExportRefused, check_export, read_status
from align_pipeline.model.hf_export import export_hf

pytestmark = pytest.mark.slow  # launches torchrun jobs


def _ours(work):
    """Our side of the check from a one-rank job of train/jobs/logits (as `export --check` runs it)."""
    return lambda request: checkpoint_outputs(request, work)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "align_pipeline", "export", "--json", *map(str, args)], capture_output=True,
                          text=True, check=False)


@pytest.fixture(scope="module")
def foreign(tmp_path_factory) -> Path:
    """An HF model's tokenizer (ChatML, byte-level BPE: hundreds of tokens), as hf_example's data_prep saves it."""
    root = tmp_path_factory.mktemp("foreign")
    hf = make_chat_tokenizer_dir(root / "hf", "chatml")
    load_tokenizer(hf).save(root / "saved")
    return root / "saved"


def _relocated(checkpoint: str, tokenizer: str, root: Path) -> Path:
    """A copy of ``checkpoint`` whose meta.json records a copy of its tokenizer at a path a test may rewrite (as a
    checkpoint that carries no ``tokenizer/`` of its own does)."""
    ckpt = root / "ckpt"
    shutil.copytree(checkpoint, ckpt)
    shutil.rmtree(ckpt / "tokenizer", ignore_errors=True)
    shutil.copytree(tokenizer, root / "tokenizer")
    meta = json.loads((ckpt / "meta.json").read_text())
    meta["tokenizer"]["path"] = str(root / "tokenizer")
    (ckpt / "meta.json").write_text(json.dumps(meta))
    return ckpt


def test_export_refuses_a_tokenizer_the_checkpoint_was_not_trained_with(tiny_models, foreign, tmp_path):
    """`--tokenizer` of another model, and the recorded path rewritten by another env's data_prep (the issue's
    reproduction, through the export pipeline's node too): one line naming both fingerprints and paths, exit 2,
    nothing written."""
    from align_pipeline.pipelines.export.nodes import export_artifact

    ours = load_tokenizer(tiny_models["tokenizer"]).fingerprint
    theirs = load_tokenizer(foreign).fingerprint
    done = _cli(tiny_models["sft"], tmp_path / "out", "--tokenizer", foreign)
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert ours in line and theirs in line and str(foreign) in line and "meta.json" in line
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".tmp-*"))

    ckpt = _relocated(tiny_models["sft"], tiny_models["tokenizer"], tmp_path / "moved")
    shutil.rmtree(tmp_path / "moved" / "tokenizer")
    shutil.copytree(foreign, tmp_path / "moved" / "tokenizer")  # `kedro run -e hf_example` rewrote it
    with pytest.raises(ExportRefused, match=f"records tokenizer {ours} .* now holds tokenizer {theirs}"):
        export_hf(ckpt, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".tmp-*"))
    with pytest.raises(ExportRefused, match=f"now holds tokenizer {theirs}"):  # before the export job is launched
        export_artifact(str(ckpt), {"work_dir": str(tmp_path / "runs")}, name="sft_policy")
    assert not (tmp_path / "runs").exists()


def test_check_passes_on_a_good_export_and_names_what_a_broken_one_breaks(tiny_models, foreign, tmp_path):
    """`export --check` on the demo SFT policy: every check passes, greedy generation through transformers equal
    to ours token for token, recorded as passed in the export. Then the export's tokenizer files swapped for
    another model's, and its embedding cut to fewer rows than the tokenizer: the checks name what is broken."""
    out = tmp_path / "hf"
    done = _cli(tiny_models["sft"], out, "--check")
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    names = ["vocab", "fingerprint", "special_tokens", "chat_template", "prompt_ids", "logits", "greedy"]
    assert summary["checks"] == {n: True for n in names} and summary["check"] == "passed"
    for name in names:
        assert f"check {name}: ok" in done.stderr
    assert "transformers' generate equals ours token for token" in done.stderr
    assert summary["max_abs_logit_diff"] <= 1e-4 and read_status(out) == "passed"
    packed = load_tokenizer(out / "align_tokenizer")  # the checkpoint's tokenizer, byte for byte
    assert packed.fingerprint == json.loads(Path(tiny_models["sft"], "meta.json").read_text())["tokenizer"][
        "fingerprint"]

    swapped = tmp_path / "swapped"  # tokenizer files swapped after export
    shutil.copytree(out, swapped)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (foreign / name).exists():
            shutil.copy(foreign / name, swapped / name)
    checks = {c.name: c for c in check_export(tiny_models["sft"], swapped, 1e-4, our_side=_ours(tmp_path / "work1"))}
    assert checks["vocab"].ok is False and "embedding rows" in checks["vocab"].detail
    assert checks["fingerprint"].ok is False and "differs from the packed one's" in checks["fingerprint"].detail
    assert checks["special_tokens"].ok is False and checks["chat_template"].ok is False
    assert checks["logits"].ok is True  # what the old --check looked at alone

    cut = tmp_path / "cut"  # the embedding (and the LM head) cut to 40 rows: 44 tokens no longer fit
    shutil.copytree(out, cut)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(cut / "model.safetensors"))
    for key in ("model.embed_tokens.weight", "lm_head.weight"):
        if key in tensors:
            tensors[key] = tensors[key][:40].contiguous()
    save_file(tensors, str(cut / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((cut / "config.json").read_text())
    (cut / "config.json").write_text(json.dumps({**config, "vocab_size": 40}))
    checks = {c.name: c for c in check_export(tiny_models["sft"], cut, 1e-4, our_side=_ours(tmp_path / "work2"))}
    assert checks["vocab"].ok is False and "44 tokens" in checks["vocab"].detail and "40 embedding" in \
        checks["vocab"].detail
    assert checks["logits"].ok is False and "IndexError" in checks["logits"].detail  # as `generate` failed
    assert (out / CHECK_FILE).is_file()
