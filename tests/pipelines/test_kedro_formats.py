"""Data as TRL / OpenAI / veRL users hold it, through the Kedro catalog, into data_prep and on into sft, dpo and
reinforce (a real KedroSession on a temp project with a real sqlite MLflow store):

* SFT: OpenAI messages with tool calls and a record-level ``tools`` list, in a parquet file (``RawDataset``);
* preference: TRL's explicit-prompt messages, in a ``datasets`` ``save_to_disk`` directory (``RawDataset``), then
  TRL's implicit-prompt messages read by kedro-datasets' own ``pandas.ParquetDataset``, then TRL's implicit-prompt
  plain strings (jsonl): each form on into dpo;
* prompts: veRL's parquet layout (``reward_model.ground_truth``, ``data_source``, ``extra_info``), scored by a reward
  function that reads ``extra_info``;
* the same files through kedro-datasets' table datasets: polars' ``EagerPolarsDataset`` (SFT) and
  ``LazyPolarsDataset`` (prompts), ``pandas.ParquetDataset`` (TRL's implicit-prompt pairs): the same samples;
* then jsonl files (``RawDataset``): TRL's implicit-prompt pairs as plain strings (tokenized verbatim, the prompt
  their shared text cut at a space) into dpo, and prompts as chat messages with extra fields into reinforce; last
  the same string pairs in TRL's explicit-prompt form: the same tokens.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import numpy as np
import pytest
import yaml
from chat_tokenizers import make_chat_tokenizer_dir
from projects import copy_project, enter_project, run_kedro

pytestmark = pytest.mark.slow

SYSTEM = "You are a helpful assistant."
TINY = {"training": {"train_steps": 2, "global_batch_size": 8, "micro_batch_size": 4, "log_interval": 1,
                     "eval_interval": 0, "eval_samples": 8, "save_interval": 0}}
TINY_RL = {"rl": {"iterations": 1, "prompts_per_iteration": 4, "epochs": 1, "minibatches": 1, "micro_batch_size": 4,
                  "log_interval": 1, "eval_interval": 0, "eval_prompts": 4, "save_interval": 0},
           "generation": {"max_new_tokens": 8, "samples_per_prompt": 2},
           "reward": {"reward_model_weight": 0.0, "functions": [{"name": "formats_reward:by_source", "weight": 1.0}]}}
REWARD_MODULE = '''
def by_source(prompt, response, record):
    """1 when the response holds the answer (veRL's ground truth); the record's extra_info and data_source must
    arrive."""
    assert isinstance(prompt, list) and prompt[-1]["role"] == "user", prompt
    assert record["data_source"] == "demo/add" and record["extra_info"]["index"] >= 0, record
    return float(record["answer"] in response)


by_source.required_fields = ("answer", "extra_info")
'''


def _calls(a: int, b: int) -> list[dict]:
    call = {"type": "function", "id": "c1",
            "function": {"name": "add", "arguments": json.dumps({"a": a, "b": b})}}
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"What is {a} + {b}?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": str(a + b)},
            {"role": "assistant", "content": f"The answer is {a + b}."}]


TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]


def _write(raw: Path) -> None:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(0)
    pairs = [(rng.randint(10, 60), rng.randint(1, 9)) for _ in range(96)]
    sft = [{"messages": _calls(a, b), "tools": TOOLS} if i % 2 else
           {"messages": [{"role": "user", "content": f"What is {a} + {b}?"},
                         {"role": "assistant", "content": f"The answer is {a + b}."}]}
           for i, (a, b) in enumerate(pairs)]
    # parquet needs one schema: the record-level tools column is null where a record has none
    pq.write_table(pa.Table.from_pylist([{**r, "tools": r.get("tools")} for r in sft]), raw / "sft.parquet")
    explicit = [{"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}],
                 "chosen": [{"role": "assistant", "content": f"The answer is {a + b}."}],
                 "rejected": [{"role": "assistant", "content": f"The answer is {a + b + 1}."}],
                 "score_chosen": 8.0, "score_rejected": 3.0} for a, b in pairs]
    datasets.Dataset.from_list(explicit).save_to_disk(str(raw / "preference_hf"))
    implicit = [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]} for r in explicit]
    pq.write_table(pa.Table.from_pylist(implicit), raw / "preference_implicit.parquet")
    verl = [{"data_source": "demo/add", "prompt": [{"role": "user", "content": f"What is {a} + {b}?"}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(a + b)},
             "extra_info": {"split": "train", "index": i}} for i, (a, b) in enumerate(pairs[:32])]
    pq.write_table(pa.Table.from_pylist(verl), raw / "prompts.parquet")
    # jsonl: TRL's string pairs (tokenized verbatim) implicit and explicit (the same pairs), prompts as messages
    strings = [{"chosen": f"Q: What is {a} + {b}?\nA: {a + b}", "rejected": f"Q: What is {a} + {b}?\nA: {a + b + 1}"}
               for a, b in pairs]
    (raw / "preference_implicit_strings.jsonl").write_text("".join(json.dumps(r) + "\n" for r in strings))
    strings = [{"prompt": f"Q: What is {a} + {b}?\nA: ", "chosen": f"{a + b}", "rejected": f"{a + b + 1}"}
               for a, b in pairs]
    (raw / "preference_strings.jsonl").write_text("".join(json.dumps(r) + "\n" for r in strings))
    messages = [{"prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"What is {a} + {b}?"}],
                 "answer": str(a + b), "data_source": "demo/add", "extra_info": {"index": i}}
                for i, (a, b) in enumerate(pairs[:32])]
    (raw / "prompts_messages.jsonl").write_text("".join(json.dumps(r) + "\n" for r in messages))


@pytest.fixture
def project(tmp_path, monkeypatch):
    root = copy_project(tmp_path / "proj", raw=False)
    raw = root / "data" / "01_raw"
    raw.mkdir(parents=True)
    _write(raw)
    (root / "formats_reward.py").write_text(REWARD_MODULE)
    monkeypatch.syspath_prepend(str(root))
    tokenizer = make_chat_tokenizer_dir(root / "chat_tokenizer", "chatml_tools")
    catalog = {
        "raw_sft": {"type": "align_pipeline.datasets.RawDataset", "filepath": "data/01_raw/sft.parquet",
                    "kind": "sft"},
        "raw_preference": {"type": "align_pipeline.datasets.RawDataset", "filepath": "data/01_raw/preference_hf",
                           "kind": "preference"},
        "raw_prompts": {"type": "align_pipeline.datasets.RawDataset", "filepath": "data/01_raw/prompts.parquet",
                        "kind": "prompts"},
    }
    (root / "conf" / "test" / "catalog_formats.yml").write_text(yaml.safe_dump(catalog))
    params = {
        "model": {"num_layers": 1, "hidden_size": 32, "num_attention_heads": 2, "num_query_groups": 1,
                  "ffn_hidden_size": 64, "seq_length": 256},
        "data_prep": {"tokenizer": {"hf_model_dir": str(tokenizer)}, "val_fraction": 0.1,
                      "prompts_val_fraction": 0.25},
        "sft": TINY, "dpo": TINY, "reinforce": TINY_RL,
    }
    (root / "conf" / "test" / "parameters_formats.yml").write_text(yaml.safe_dump(params))
    return enter_project(monkeypatch, root, "test-formats")


def _pair(path: Path, tok, row: int = 0) -> dict[str, tuple[str, str]]:
    """``{side: (prompt, trained-on tokens)}`` of a tokenized pair, decoded from its stored tokens and response flags."""
    from align_pipeline.data.store import mmap_npz

    arrays, out = mmap_npz(path), {}
    for side in ("chosen", "rejected"):
        start, end = arrays[f"{side}_offsets"][row : row + 2]
        ids, response = arrays[f"{side}_tokens"][start:end], arrays[f"{side}_response"][start:end]
        first = int(np.argmax(response == 1))  # the prompt: every token before the first trained-on one
        out[side] = tuple(tok.decode(part, skip_special_tokens=False) for part in (ids[:first], ids[response == 1]))
    return out


def _dpo_trained_on(project: Path, versions: int) -> dict:
    """The newest dpo_policy (one of ``versions``): trained, not reused, on the current pref_train.npz."""
    from align_pipeline.data.formats import checkpoint_meta

    found = sorted((project / "data" / "06_models" / "dpo_policy").iterdir())
    assert len(found) == versions, found
    assert "reused_from" not in json.loads((found[-1] / "dpo_policy" / "reuse.json").read_text())
    meta = checkpoint_meta(found[-1] / "dpo_policy")
    sidecar = json.loads((project / "data" / "05_model_input" / "pref_train.npz.meta.json").read_text())
    assert meta["stage"] == "dpo" and meta["lineage"]["data"]["train"] == sidecar["fingerprint"], meta["lineage"]
    return meta


def test_trl_openai_verl_data_through_the_catalog_into_sft_dpo_reinforce(project):
    from align_pipeline.data.formats import checkpoint_meta, load_jsonl
    from align_pipeline.data.store import load_rows, mmap_npz
    from align_pipeline.data.tokenizer import load_tokenizer

    outputs = run_kedro(project, "data_prep", "sft", "dpo", "reinforce")
    data = project / "data" / "05_model_input"
    tok = load_tokenizer(project / "data" / "03_primary" / "tokenizer")
    sft = load_rows(data / "sft_train.npz")
    texts = [tok.decode(sft["input_ids"][i], skip_special_tokens=False) for i in range(len(sft["input_ids"]))]
    with_tools = [i for i, t in enumerate(texts) if "# Tools" in t]
    assert with_tools and len(with_tools) < len(texts)  # the tools block only where the record had tools
    i = with_tools[0]
    supervised = tok.decode(sft["labels"][i][sft["loss_mask"][i] == 1], skip_special_tokens=False)
    assert supervised.startswith('<tool_call>{"name": "add", "arguments": {"a": ')
    assert supervised.count("<|im_end|>") == 2 and "What is" not in supervised and "# Tools" not in supervised

    pref = load_rows(data / "pref_train.npz")
    chosen = tok.decode(pref["chosen_labels"][0][pref["chosen_loss_mask"][0] == 1], skip_special_tokens=False)
    assert chosen.startswith("The answer is ") and chosen.endswith("<|im_end|>")
    assert set(pref["chosen_reward"].tolist()) == {8.0}

    prompts = load_jsonl(data / "prompts_train.jsonl")
    assert all(p["answer"] == p["reward_model"]["ground_truth"] and p["data_source"] == "demo/add" for p in prompts)
    metrics = outputs["data_prep_metrics"].load()
    assert metrics["prompts_train_samples"] + metrics["prompts_val_samples"] == 32
    for stage in ("sft", "dpo", "reinforce"):
        (version,) = sorted((project / "data" / "06_models" / f"{stage}_policy").iterdir())
        assert checkpoint_meta(version / f"{stage}_policy")["stage"] == stage
    assert outputs["reinforce_metrics"].load()["iterations"] == 1

    # the same preference pairs in TRL's implicit-prompt form, read by kedro-datasets' pandas.ParquetDataset, on into
    # dpo; the same SFT and veRL parquet files read by its polars datasets (a DataFrame, and a LazyFrame in batches)
    catalog = yaml.safe_load((project / "conf" / "test" / "catalog_formats.yml").read_text())
    catalog["raw_preference"] = {"type": "pandas.ParquetDataset", "filepath": "data/01_raw/preference_implicit.parquet"}
    catalog["raw_sft"] = {"type": "polars.EagerPolarsDataset", "filepath": "data/01_raw/sft.parquet",
                          "file_format": "parquet"}
    catalog["raw_prompts"] = {"type": "polars.LazyPolarsDataset", "filepath": "data/01_raw/prompts.parquet",
                              "file_format": "parquet"}
    (project / "conf" / "test" / "catalog_formats.yml").write_text(yaml.safe_dump(catalog))
    before = (data / "pref_train.npz").read_bytes()
    outputs = run_kedro(project, "data_prep", "dpo")
    again = load_rows(data / "pref_train.npz")
    for key in ("chosen_input_ids", "chosen_loss_mask", "rejected_input_ids", "rejected_loss_mask"):
        assert (again[key] == pref[key]).all(), key  # same pairs, same tokens and masks (no scores this time)
    assert before != (data / "pref_train.npz").read_bytes() and np.isnan(again["chosen_reward"]).all()
    pair = _pair(data / "pref_train.npz", tok)
    # the prompt = the messages both conversations share, through the chat template
    assert pair["chosen"][0] == pair["rejected"][0] and pair["chosen"][0].endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert pair["chosen"][0].count("<|im_start|>user\nWhat is ") == 1 and "The answer" not in pair["chosen"][0]
    assert outputs["dpo_metrics"].load()["steps"] == 2
    _dpo_trained_on(project, 2)
    again = load_rows(data / "sft_train.npz")
    assert all((again[key] == sft[key]).all() for key in sft), "polars' SFT rows tokenized differently"
    assert load_jsonl(data / "prompts_train.jsonl") == prompts  # extra_info, data_source, ground truth: all kept
    sources = {name: json.loads((data / f"{name}.meta.json").read_text())["source"]
               for name in ("sft_train.npz", "prompts_train.jsonl")}
    assert sources == {"sft_train.npz": "raw_sft (polars.DataFrame)",
                       "prompts_train.jsonl": "raw_prompts (polars.LazyFrame)"}

    # jsonl files: TRL's implicit-prompt string pairs (verbatim, no template) and prompts as messages, on into dpo and
    # reinforce
    catalog["raw_preference"] = {"type": "align_pipeline.datasets.RawDataset",
                                 "filepath": "data/01_raw/preference_implicit_strings.jsonl"}
    catalog["raw_prompts"] = {"type": "align_pipeline.datasets.RawDataset",
                              "filepath": "data/01_raw/prompts_messages.jsonl"}
    (project / "conf" / "test" / "catalog_formats.yml").write_text(yaml.safe_dump(catalog))
    outputs = run_kedro(project, "data_prep", "dpo", "reinforce")
    pref = load_rows(data / "pref_train.npz")
    text = tok.decode(pref["chosen_input_ids"][0], skip_special_tokens=False)
    assert text.startswith("Q: What is ") and "<|im_start|>" not in text  # verbatim strings
    # the prompt = the texts' shared prefix cut back to a space ("A: 4" of "A: 42" / "A: 43" is not shared)
    pair = _pair(data / "pref_train.npz", tok)
    (prompt, chosen), (prompt_rejected, rejected) = pair["chosen"], pair["rejected"]
    a, b = (int(x) for x in re.fullmatch(r"Q: What is (\d+) \+ (\d+)\?\nA: ", prompt).groups())
    eos = tok.id_to_token(tok.eos_id)
    assert prompt_rejected == prompt and (chosen, rejected) == (f"{a + b}{eos}", f"{a + b + 1}{eos}")
    prompts = load_jsonl(data / "prompts_train.jsonl")
    rendered = tok.decode(prompts[0]["prompt_ids"], skip_special_tokens=False)
    assert rendered.startswith(f"<|im_start|>system\n{SYSTEM}<|im_end|>") and rendered.endswith("<|im_start|>assistant\n")
    assert outputs["reinforce_metrics"].load()["iterations"] == 1
    assert outputs["dpo_metrics"].load()["steps"] == 2
    _dpo_trained_on(project, 3)

    # the same string pairs in TRL's explicit-prompt form: the same tokens and response flags
    implicit = {k: np.asarray(v) for k, v in mmap_npz(data / "pref_train.npz").items()}
    catalog["raw_preference"]["filepath"] = "data/01_raw/preference_strings.jsonl"
    (project / "conf" / "test" / "catalog_formats.yml").write_text(yaml.safe_dump(catalog))
    run_kedro(project, "data_prep")
    explicit = mmap_npz(data / "pref_train.npz")
    assert set(explicit) == set(implicit)
    for key, value in implicit.items():
        assert np.array_equal(explicit[key], value, equal_nan=True), key
