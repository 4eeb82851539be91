"""Real data through the whole DAG: a chat-format dataset made here (multi-turn conversations with a system prompt,
math-style prompts with GSM8K answers and a category, preference pairs), an HF tokenizer with a chat template, SFT
with packing, a reward model and DPO with packed pairs, PPO (math checker weighted with the reward model) and
REINFORCE (math checker), evaluation
grouped by category – through a real KedroSession on a temp project with a real sqlite MLflow store."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import yaml
from chat_tokenizers import make_chat_tokenizer_dir
from projects import copy_project, enter_project, run_kedro

pytestmark = pytest.mark.slow

SYSTEM = "You are a helpful assistant."
TINY = {"training": {"train_steps": 4, "global_batch_size": 8, "micro_batch_size": 4, "log_interval": 2,
                     "eval_interval": 0, "eval_samples": 16, "save_interval": 0}}
TINY_RL = {"rl": {"iterations": 2, "prompts_per_iteration": 8, "epochs": 1, "minibatches": 2, "micro_batch_size": 4,
                  "log_interval": 1, "eval_interval": 0, "eval_prompts": 8, "save_interval": 0},
           "generation": {"max_new_tokens": 12}}
REWARD = {"reward_model_weight": 0.5, "functions": [{"name": "align_pipeline.rewards:math_answer", "weight": 1.0}]}


def _problem(rng: random.Random) -> tuple[str, str, int, str]:
    a, b = rng.randint(10, 60), rng.randint(1, 9)
    if rng.random() < 0.5:
        return f"What is {a} + {b}?", "add", a + b, f"{a} + {b} = {a + b}. #### {a + b}"
    return f"What is {a} - {b}?", "sub", a - b, f"{a} - {b} = {a - b}. #### {a - b}"


def _write_chat_data(raw: Path) -> None:
    rng = random.Random(0)
    sft, pref, prompts = [], [], []
    for _ in range(160):
        (q1, _, n1, _), (q2, _, n2, _) = _problem(rng), _problem(rng)
        sft.append({"system": SYSTEM, "conversations": [
            {"from": "User", "value": q1}, {"from": "Assistant", "value": f"The answer is {n1}."},
            {"from": "User", "value": q2}, {"from": "Assistant", "value": f"The answer is {n2}."}]})
        q, _, n, _ = _problem(rng)
        pref.append({"prompt": q, "chosen_response": f"The answer is {n}.",
                     "rejected_response": f"The answer is {n + rng.choice([-2, -1, 1, 2])}."})
    for _ in range(64):
        q, category, _, solution = _problem(rng)
        prompts.append({"prompt": q, "answer": solution, "category": category})
    for name, records in (("sft", sft), ("preference", pref), ("prompts", prompts)):
        (raw / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


@pytest.fixture
def project(tmp_path, monkeypatch):
    root = copy_project(tmp_path / "proj", raw=False)
    (root / "data" / "01_raw").mkdir(parents=True)
    _write_chat_data(root / "data" / "01_raw")
    tokenizer = make_chat_tokenizer_dir(root / "chat_tokenizer", "chatml")
    params = {
        "model": {"num_layers": 1, "hidden_size": 32, "num_attention_heads": 2, "num_query_groups": 1,
                  "ffn_hidden_size": 64, "seq_length": 96},
        "data_prep": {"tokenizer": {"hf_model_dir": str(tokenizer)}, "overlong": {"sft": "truncate"}},
        "sft": {"packing": True, "training": {**TINY["training"], "train_steps": 6,
                                              "optimizer": {"lr": 3.0e-3, "min_lr": 3.0e-4, "warmup_steps": 1}}},
        "reward_model": {**TINY, "packing": True}, "dpo": {**TINY, "packing": True},  # pairs side by side in rows
        "ppo": {**TINY_RL, "critic_warmup_iterations": 1, "reward": REWARD},
        "reinforce": {**TINY_RL, "generation": {"max_new_tokens": 12, "samples_per_prompt": 4},
                      "reward": {**REWARD, "reward_model_weight": 0.0}},  # the default pipeline: no RM input
        "evaluation": {"generation": {"samples_per_prompt": 1, "max_new_tokens": 12}, "greedy": False,
                       "group_by": "category",
                       "reward": {"functions": [{"name": "align_pipeline.rewards:math_answer", "weight": 1.0}]}},
    }
    (root / "conf" / "test").mkdir(exist_ok=True)
    (root / "conf" / "test" / "parameters_chat.yml").write_text(yaml.safe_dump(params))
    return enter_project(monkeypatch, root, "test-chat")


def _run(root: Path, *pipelines: str):
    return run_kedro(root, *pipelines)


def test_chat_data_through_the_whole_dag(project):
    import mlflow
    from mlflow import MlflowClient

    from align_pipeline.data.formats import load_jsonl
    from align_pipeline.data.store import load_rows
    from align_pipeline.data.tokenizer import load_tokenizer

    outputs = _run(project)  # __default__: data_prep -> sft -> reward_model -> dpo, ppo, reinforce -> evaluation
    data = project / "data" / "05_model_input"
    tok = load_tokenizer(project / "data" / "03_primary" / "tokenizer")
    assert tok.chat_template is not None and tok.bos_id is None and tok.stop_ids == (tok.eos_id,)

    # SFT rows are the chat template's rendering; the loss is on the assistant turns (+ <|im_end|>) only.
    sft = load_rows(data / "sft_train.npz")
    row = sft["input_ids"][0]
    text = tok.decode(row, skip_special_tokens=False)
    assert text.startswith(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\nWhat is ")
    supervised = tok.decode(sft["labels"][0][sft["loss_mask"][0] == 1], skip_special_tokens=False)
    assert supervised.startswith("The answer is ") and supervised.count("<|im_end|>") >= 1
    assert "user" not in supervised and "What is" not in supervised
    # Prompts keep their fields and end with the generation prompt.
    prompts = load_jsonl(data / "prompts_val.jsonl")
    assert {p["category"] for p in prompts} == {"add", "sub"} and all("####" in p["answer"] for p in prompts)
    assert tok.decode(prompts[0]["prompt_ids"], skip_special_tokens=False).endswith("<|im_start|>assistant\n")

    metrics = outputs["data_prep_metrics"].load()
    assert metrics["chat_template"] == 1 and metrics["sft_truncated"] + metrics["sft_dropped"] >= 0
    sft_metrics = outputs["sft_metrics"].load()
    assert sft_metrics["val_loss"] < sft_metrics["first_train_loss"]

    (version,) = sorted((project / "data" / "08_reporting" / "eval_report").iterdir())
    report = json.loads((version / "eval_report" / "report.json").read_text())
    assert set(report["policies"]) == {"sft", "dpo", "ppo", "reinforce"}
    sft_eval = report["policies"]["sft"]
    assert {"accuracy_add", "accuracy_sub"} <= set(sft_eval), sorted(sft_eval)  # grouped by the category field

    client = MlflowClient(tracking_uri=mlflow.get_tracking_uri())
    runs = client.search_runs([client.get_experiment_by_name("test-chat").experiment_id])
    assert runs and all(r.info.status == "FINISHED" for r in runs)
    child = {r.data.tags["kedro.node"]: r for r in runs if "mlflow.parentRunId" in r.data.tags}
    sft_run = client.get_metric_history(child["train_sft"].info.run_id, "step_tokens")
    assert sft_run and max(m.value for m in sft_run) > 8 * 20  # packed rows: more real tokens than 8 short samples
