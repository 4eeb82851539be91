"""Bad data in the formats users hold (OpenAI/TRL messages in parquet and jsonl, ``datasets`` ``save_to_disk``
directories) through the Kedro catalog into ``data_prep`` (a real KedroSession on a temp project): one message that
names the file, the row or line and the field, and nothing written under the project's data outputs (no tokenizer,
no tokenized arrays, no prompts artifacts). One project is shared by the cases; each writes its raw files, catalog
entries and tokenizer choice, and starts from empty output folders."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from chat_tokenizers import make_chat_tokenizer_dir
from projects import copy_project, enter_project, run_kedro

from align_pipeline.data.errors import DataValidationError

pytestmark = pytest.mark.slow  # a KedroSession per case


def _user(text: str) -> dict:
    return {"role": "user", "content": text}


def _assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


SFT = [{"messages": [_user(f"q{i}"), _assistant(f"a{i}")]} for i in range(20)]
PREFERENCE = [{"prompt": [_user(f"q{i}")], "chosen": [_assistant("x")], "rejected": [_assistant("y")]}
              for i in range(20)]
PROMPTS = [{"prompt": [_user(f"q{i}")], "answer": "1"} for i in range(20)]


def _parquet(path: Path, rows: list[dict]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)


def _jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _wrong_role(raw: Path) -> dict[str, str]:
    _parquet(raw / "sft.parquet", [*SFT[:7], {"messages": [{"role": "human", "content": "q"}, _assistant("a")]},
                                   *SFT[7:]])
    return {"sft": "sft.parquet"}


def _not_alternating(raw: Path) -> dict[str, str]:
    _parquet(raw / "sft.parquet", [*SFT[:3], {"messages": [_user("a"), _user("b"), _assistant("c")]}, *SFT[3:]])
    return {"sft": "sft.parquet"}


def _missing_content(raw: Path) -> dict[str, str]:
    _jsonl(raw / "sft.jsonl", [*SFT[:4], {"messages": [_user("q"), {"role": "assistant"}]}, *SFT[4:]])
    return {"sft": "sft.jsonl"}


def _int_content(raw: Path) -> dict[str, str]:  # the column itself is int64 (one parquet schema for every row)
    _parquet(raw / "sft.parquet", [{"messages": [{"role": "user", "content": i}, {"role": "assistant", "content": 6}]}
                                   for i in range(10)])
    return {"sft": "sft.parquet"}


def _empty_dataset_dir(raw: Path) -> dict[str, str]:
    (raw / "preference_hf").mkdir()
    return {"preference": "preference_hf"}


def _mixed_layouts(raw: Path) -> dict[str, str]:
    _jsonl(raw / "prompts.jsonl", [*PROMPTS[:5], {"prompt": "a plain string", "answer": "1"}, *PROMPTS[5:]])
    return {"prompts": "prompts.jsonl"}


CASES = {
    # name: (writer of the bad file(s), chat template, the one message)
    "wrong role in a parquet": (
        _wrong_role, "chatml_tools",
        ("data/01_raw/sft.parquet row 8: field \"messages[0].role\": expected one of system, user, assistant, tool, "
         "got 'human'")),
    "turns not alternating": (
        _not_alternating, "mistral",
        ("data/01_raw/sft.parquet row 4: field \"messages\": chat template in {tokenizer}/chat_template.jinja: line 1: "
         "Conversation roles must alternate user/assistant/user/assistant/...")),
    "message without content": (
        _missing_content, "chatml_tools",
        'data/01_raw/sft.jsonl line 5: field "messages[1].content": missing (required)'),
    "int content column": (
        _int_content, "chatml_tools",
        'data/01_raw/sft.parquet row 1: field "messages[0].content": expected a string, got int'),
    "empty save_to_disk directory": (
        _empty_dataset_dir, "chatml_tools",
        ("data/01_raw/preference_hf: empty directory: expected one written by datasets' Dataset.save_to_disk "
         "(dataset_info.json, state.json, *.arrow)")),
    "jsonl mixing layouts": (
        _mixed_layouts, "chatml_tools",
        ("data/01_raw/prompts.jsonl line 6: mixes layouts: this record is in the prompt layout, the file's first "
         "record (line 1) in the prompt_messages layout")),
}  # fmt: skip


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """The project and the two tokenizers (ChatML, and Mistral whose template needs alternating turns)."""
    base = tmp_path_factory.mktemp("format-errors")
    root = copy_project(base / "proj", raw=False)
    tokenizers = {style: make_chat_tokenizer_dir(base / f"tok_{style}", style) for style in ("chatml_tools", "mistral")}
    return root, tokenizers


@pytest.fixture
def project(shared, monkeypatch):
    """The shared project with good raw files of every kind (the case replaces one) and no outputs."""
    root, tokenizers = shared
    for d in (root / "data").iterdir() if (root / "data").exists() else ():
        shutil.rmtree(d)
    raw = root / "data" / "01_raw"
    raw.mkdir(parents=True)
    _jsonl(raw / "sft.jsonl", SFT)
    _jsonl(raw / "preference.jsonl", PREFERENCE)
    _jsonl(raw / "prompts.jsonl", PROMPTS)
    return enter_project(monkeypatch, root, "test-format-errors"), tokenizers


def _written(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in (root / "data").rglob("*")
                  if p.is_file() and "01_raw" not in p.relative_to(root).parts)


@pytest.mark.parametrize("case", list(CASES))
def test_bad_data_in_the_new_formats_fails_in_one_message_and_writes_nothing(project, case):
    root, tokenizers = project
    writer, style, message = CASES[case]
    files = {"sft": "sft.jsonl", "preference": "preference.jsonl", "prompts": "prompts.jsonl",
             **writer(root / "data" / "01_raw")}
    catalog = {f"raw_{kind}": {"type": "align_pipeline.datasets.RawDataset", "filepath": f"data/01_raw/{name}",
                               "kind": kind} for kind, name in files.items()}
    (root / "conf" / "test" / "catalog_errors.yml").write_text(yaml.safe_dump(catalog))
    params = {"model": {"seq_length": 64}, "data_prep": {"tokenizer": {"hf_model_dir": str(tokenizers[style])}}}
    (root / "conf" / "test" / "parameters_errors.yml").write_text(yaml.safe_dump(params))

    with pytest.raises(Exception) as excinfo:
        run_kedro(root, "data_prep")
    err = excinfo.value
    while err is not None and not isinstance(err, DataValidationError):
        err = err.__cause__ or err.__context__
    assert err is not None, f"expected a DataValidationError, got {excinfo.value!r}"
    assert str(err) == message.format(tokenizer=tokenizers[style]), str(err)
    assert _written(root) == []
