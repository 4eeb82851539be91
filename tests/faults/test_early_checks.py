"""Item 7 of issue 29: what used to be found inside the torchrun job, after data_prep had replaced its outputs, is
refused before any node runs, with one line naming the file/key (a :class:`UserError`: exit 2 from ``kedro run``).

* ``<stage>.init_from`` an HF directory without ``config.json``, or of a family the import does not know (gpt2,
  gemma2);
* a tokenizer (``data_prep.tokenizer.hf_model_dir``'s, or the catalog's) with more tokens, added ones included, than
  the HF model has embedding rows (``vocab_size``);
* a prompt without a field the configured reward function declares (``required_fields``): the raw prompts data_prep
  will tokenize, and the tokenized prompts a stage run alone reads from the catalog.

A real KedroSession on a temp copy of the project whose data_prep outputs exist (made once, from a tiny HF
tokenizer); each refused run leaves every file under data/ as it was (content and mtime) and opens no MLflow run.
No HF weights are needed: nothing gets as far as loading them.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from projects import copy_project, run_kedro

from align_pipeline.data.demo_task import make_demo_datasets
from align_pipeline.errors import UserError

pytestmark = pytest.mark.slow  # launches a KedroSession

EXPERIMENT = "test-early-checks"
SMALL = {"model": {"num_layers": 1, "hidden_size": 32, "num_attention_heads": 2, "num_query_groups": 1,
                   "ffn_hidden_size": 64, "seq_length": 48}}
LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 64,
         "rms_norm_eps": 1e-6, "tie_word_embeddings": True}
REWARDS = '''
def needs_difficulty(prompt, response, record):
    return float(record["difficulty"] > 1)


needs_difficulty.required_fields = ("difficulty",)
'''


def _hf_tokenizer(path: Path, raw: Path, added: tuple[str, ...] = ()) -> int:
    """An HF tokenizer (character level, trained on the raw data, saved by transformers) in ``path``, with ``added``
    special tokens on top; returns its size without them."""
    from hf_models import demo_hf_tokenizer

    return len(demo_hf_tokenizer(path, raw, added, chat_template=False)) - len(added)


def _config(path: Path, **fields) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**LLAMA, **fields}, indent=2))
    return path


def _outputs(root: Path) -> dict[str, tuple[int, str]]:
    """Every file under data/ but the raw data: path -> (mtime, sha256)."""
    return {str(p.relative_to(root)): (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted((root / "data").rglob("*")) if p.is_file() and "01_raw" not in p.parts}


def _mlflow_runs(root: Path) -> int:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    experiment = client.get_experiment_by_name(EXPERIMENT)
    return len(client.search_runs([experiment.experiment_id])) if experiment else 0


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A project with small raw data, a tiny HF tokenizer directory (``hf``, its size ``tokens``) and the data_prep
    outputs made from them."""
    tmp = tmp_path_factory.mktemp("early")
    root = copy_project(tmp / "proj", raw=False)
    raw = root / "data" / "01_raw"
    raw.mkdir(parents=True)
    for kind, records in make_demo_datasets(n_sft=40, n_preference=20, n_prompts=10, seed=1).items():
        (raw / f"{kind}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    hf = tmp / "hf"
    tokens = _hf_tokenizer(hf, raw)
    _config(hf, vocab_size=tokens)
    (tmp / "rewards").mkdir()
    (tmp / "rewards" / "early_rewards.py").write_text(REWARDS)
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root / 'mlflow.db'}")
        mp.setenv("MLFLOW_EXPERIMENT_NAME", EXPERIMENT)
        mp.syspath_prepend(str(tmp / "rewards"))
        _params(root, {"data_prep": {"tokenizer": {"hf_model_dir": str(hf)}}})
        run_kedro(root, "data_prep")
        assert (root / "data" / "05_model_input" / "prompts_train.jsonl").is_file()
        yield {"root": root, "tmp": tmp, "hf": hf, "tokens": tokens}


def _params(root: Path, values: dict) -> None:
    (root / "conf" / "test").mkdir(exist_ok=True)
    (root / "conf" / "test" / "parameters_early.yml").write_text(yaml.safe_dump({**SMALL, **values}))


def _refused(prepared: dict, params: dict, *pipelines: str) -> str:
    """Run ``pipelines`` with ``params`` (over the HF tokenizer of ``prepared``); expect a UserError before any node
    ran: nothing under data/ touched, no MLflow run, no run directory. Returns the message."""
    root = prepared["root"]
    _params(root, {"data_prep": {"tokenizer": {"hf_model_dir": str(prepared["hf"])}}, **params})
    before, runs = _outputs(root), _mlflow_runs(root)
    with pytest.raises(UserError) as excinfo:
        run_kedro(root, *pipelines)
    assert _outputs(root) == before  # data_prep's outputs neither replaced nor touched
    assert _mlflow_runs(root) == runs and not (root / "data" / "06_models" / "_runs").exists()
    message = str(excinfo.value)
    assert "\n" not in message, message
    return message


def test_a_supported_hf_directory_passes_the_checks(prepared):
    """The same checks pass a llama directory whose vocab_size covers its tokenizer, for every pipeline (no run)."""
    from kedro.config import OmegaConfigLoader

    from align_pipeline.kedro.params_hook import check_layouts, pipeline_tokenizer
    from align_pipeline.pipeline_registry import register_pipelines
    from align_pipeline.settings import CONFIG_LOADER_ARGS

    root, hf = prepared["root"], str(prepared["hf"])
    _params(root, {"data_prep": {"tokenizer": {"hf_model_dir": hf}}, "sft": {"init_from": hf},
                   "dpo": {"init_from": hf}, "reinforce": {"init_from": hf}})
    params = OmegaConfigLoader(str(root / "conf"), env="test", **CONFIG_LOADER_ARGS)["parameters"]
    for pipeline in register_pipelines().values():
        tokenizer = pipeline_tokenizer(params, pipeline)
        check_layouts(params, pipeline, tokenizer=tokenizer)
    assert pipeline_tokenizer(params, register_pipelines()["dpo_flow"]) == (prepared["tokens"],
                                                                             f"{hf} (params:data_prep.tokenizer.hf_model_dir)")


def test_init_from_without_config_json_is_refused_before_data_prep(prepared):
    bare = prepared["tmp"] / "no_config"
    shutil.copytree(prepared["hf"], bare, ignore=shutil.ignore_patterns("config.json"))  # the tokenizer alone
    message = _refused(prepared, {"sft": {"init_from": str(bare)}}, "data_prep", "sft")
    assert message == (f"params:sft.init_from={bare}: config.json is missing (not a Hugging Face model directory; "
                       "no meta.json: not a checkpoint of this project either)")


@pytest.mark.parametrize("model_type", ["gpt2", "gemma2"])
def test_unsupported_model_type_is_refused_before_data_prep(prepared, model_type):
    from transformers import AutoConfig

    other = prepared["tmp"] / model_type
    AutoConfig.for_model(model_type, vocab_size=prepared["tokens"]).save_pretrained(str(other))  # as transformers writes it
    message = _refused(prepared, {"sft": {"init_from": str(other)}}, "data_prep", "sft")
    assert message == (f"model_type '{model_type}' in {other}/config.json (params:sft.init_from) is not supported "
                       "(supported: llama, qwen2, qwen3, mistral, qwen3_moe, qwen2_moe, mixtral, deepseek_v3)")


def test_tokenizer_with_added_tokens_beyond_the_embeddings_is_refused_before_data_prep(prepared):
    """conf/hf_example's layout: the tokenizer and the weights from one HF directory, whose tokenizer has two added
    tokens that its config.json's vocab_size does not count."""
    model = prepared["tmp"] / "added"
    base = _hf_tokenizer(model, prepared["root"] / "data" / "01_raw", added=("<|im_start|>", "<|im_end|>"))
    _config(model, vocab_size=base)
    params = {"data_prep": {"tokenizer": {"hf_model_dir": str(model)}}, "sft": {"init_from": str(model)}}
    message = _refused(prepared, params, "data_prep", "sft")
    assert message == (f"tokenizer {model} (params:data_prep.tokenizer.hf_model_dir) has {base + 2} tokens (added "
                       f"tokens included) but the model params:sft.init_from {model}/config.json has {base} embedding "
                       "rows (vocab_size)")


def test_the_catalog_tokenizer_beyond_the_embeddings_is_refused_before_the_stage(prepared):
    """A stage run alone reads data_prep's stored tokenizer: the same check against it."""
    small = _config(prepared["tmp"] / "small_vocab", vocab_size=prepared["tokens"] - 1)
    message = _refused(prepared, {"sft": {"init_from": str(small)}}, "sft")
    tokenizer = prepared["root"].resolve() / "data" / "03_primary" / "tokenizer"
    assert message == (f"tokenizer {tokenizer} (the catalog's tokenizer) has {prepared['tokens']} tokens (added tokens "
                       f"included) but the model params:sft.init_from {small}/config.json has "
                       f"{prepared['tokens'] - 1} embedding rows (vocab_size)")


def test_a_prompt_without_an_answer_is_refused_before_data_prep(prepared):
    """The shipped reward (demo_task) declares ``answer``: a prompt without one (here not a demo-task prompt either,
    which the REINFORCE job used to fail on mid-rollout) is named with file and line."""
    path = prepared["root"] / "data" / "01_raw" / "prompts.jsonl"
    original = path.read_text()
    lines = original.splitlines()
    lines[3] = json.dumps({"prompt": "What is 2 + 2?", "category": "math"})
    path.write_text("\n".join(lines) + "\n")
    try:
        message = _refused(prepared, {}, "data_prep", "reinforce")
    finally:
        path.write_text(original)
    assert message == ('data/01_raw/prompts.jsonl line 4: field "answer": missing, but the reward functions '
                       "align_pipeline.rewards:demo_task (params:ppo.reward.functions[0]) and "
                       "align_pipeline.rewards:demo_task (params:reinforce.reward.functions[0]) and "
                       "align_pipeline.rewards:demo_task (params:evaluation.reward.functions[0]) need it")


def test_stored_prompts_without_a_field_the_stage_needs_are_refused_before_the_stage(prepared):
    """REINFORCE run alone with a reward function that needs a field data_prep's prompts do not have: refused with
    the stored file and line, before the job starts (it used to be the job's own check)."""
    reward = {"reward": {"functions": [{"name": "early_rewards:needs_difficulty", "weight": 1.0}]}}
    message = _refused(prepared, {"reinforce": reward}, "reinforce")
    assert message == ('data/05_model_input/prompts_train.jsonl line 1: field "difficulty": missing, but the reward '
                       "function early_rewards:needs_difficulty (params:reinforce.reward.functions[0]) needs it")


def test_kedro_run_ends_with_the_one_line_and_exit_code_2(prepared):
    other = _config(prepared["tmp"] / "gpt2_cli", model_type="gpt2")
    root = prepared["root"]
    _params(root, {"data_prep": {"tokenizer": {"hf_model_dir": str(prepared["hf"])}}, "sft": {"init_from": str(other)}})
    before = _outputs(root)
    env = {**os.environ, "KEDRO_DISABLE_TELEMETRY": "true", "MLFLOW_TRACKING_URI": f"sqlite:///{root / 'mlflow.db'}",
           "MLFLOW_EXPERIMENT_NAME": EXPERIMENT, "COLUMNS": "200"}
    env.pop("ALIGN_TRACEBACK", None)
    done = subprocess.run([sys.executable, "-c", "from kedro.framework.cli import main; main()", "run", "--env", "test",
                           "--pipelines", "data_prep,sft"], cwd=root, env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    out = done.stdout + done.stderr
    assert done.returncode == 2, out
    line = (f"model_type 'gpt2' in {other}/config.json (params:sft.init_from) is not supported (supported: llama, "
            "qwen2, qwen3, mistral, qwen3_moe, qwen2_moe, mixtral, deepseek_v3)")
    assert out.count(line) == 1 and "Traceback" not in out, out
    assert _outputs(root) == before
