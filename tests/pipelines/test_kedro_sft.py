"""data_prep + sft through a real KedroSession on a temp copy of the project, with a real sqlite MLflow store."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from projects import copy_project, enter_project, run_kedro

pytestmark = pytest.mark.slow

FAST = {
    "model": {"num_layers": 1, "hidden_size": 32, "num_attention_heads": 2, "num_query_groups": 1,
              "ffn_hidden_size": 64},
    "sft": {"training": {"train_steps": 24, "global_batch_size": 8, "micro_batch_size": 4, "log_interval": 8,
                         "eval_interval": 12, "eval_samples": 32, "save_interval": 12,
                         "optimizer": {"lr": 3.0e-3, "min_lr": 3.0e-4, "warmup_steps": 4}}},
}


@pytest.fixture
def project(tmp_path, monkeypatch):
    root = copy_project(tmp_path / "proj", params={"test/fast": FAST})
    return enter_project(monkeypatch, root, "test-sft")


def _run(root: Path, *pipelines: str):
    return run_kedro(root, *pipelines)


def test_data_prep_and_sft_then_rerun_sft_reuses_it_as_a_second_version(project):
    import mlflow
    from mlflow import MlflowClient

    from align_pipeline.data.formats import checkpoint_meta as read_meta

    outputs = _run(project, "data_prep", "sft")
    metrics = outputs["sft_metrics"].load()
    assert metrics["val_loss"] < metrics["first_train_loss"] - 0.2, metrics
    versions = sorted((project / "data" / "06_models" / "sft_policy").iterdir())
    assert len(versions) == 1
    meta = read_meta(versions[0] / "sft_policy")
    assert meta["stage"] == "sft" and meta["step"] == 24
    assert set(meta["lineage"]["data"]) == {"train", "val", "tokenizer"}
    assert meta["metrics"]["val_loss"] == pytest.approx(metrics["val_loss"])
    assert not any((project / "data" / "06_models" / "_runs" / "sft").iterdir())  # run dir handed over

    _run(project, "sft")  # rerun SFT alone on the persisted data_prep outputs: the same key, reused (no training)
    versions = sorted((project / "data" / "06_models" / "sft_policy").iterdir())
    assert len(versions) == 2 and all((v / "sft_policy" / "meta.json").is_file() for v in versions)
    reused = json.loads((versions[1] / "sft_policy" / "reuse.json").read_text())
    assert reused["reused_from"]["version"] == versions[0].name and reused["metrics"] == metrics

    client = MlflowClient(tracking_uri=mlflow.get_tracking_uri())
    exp = client.get_experiment_by_name("test-sft")
    runs = client.search_runs([exp.experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert len(parents) == 2 and all(r.info.status == "FINISHED" for r in runs)
    assert {r.data.tags.get("kedro.pipeline") for r in parents} == {"data_prep,sft", "sft"}
    sft_children = [r for r in children if r.data.tags["kedro.node"] == "train_sft"]
    assert len(sft_children) == 2 and sorted(r.data.tags.get("reused_from", "") for r in sft_children) == \
        ["", versions[0].name]
    sft_children.sort(key=lambda r: "reused_from" in r.data.tags)  # the run that trained first
    history = client.get_metric_history(sft_children[0].info.run_id, "loss")
    # MLflow gets every step (metrics_interval: null = train_steps // 50, at least 1), the console every 8th
    assert [m.step for m in history] == list(range(1, 25))
    assert "val_loss" in sft_children[0].data.metrics
    assert sft_children[0].data.tags["mlflow.parentRunId"] in {p.info.run_id for p in parents}
    # the checkpoint's lineage names the MLflow child run that produced it
    assert meta["lineage"]["mlflow_run_id"] in {c.info.run_id for c in sft_children}


def test_bad_sft_params_fail_before_any_launch(project):
    from align_pipeline.config import ConfigError

    bad = {**FAST, "sft": {"training": {**FAST["sft"]["training"], "global_batch_size": 10}}}
    (project / "conf" / "test" / "parameters_fast.yml").write_text(yaml.safe_dump(bad))
    with pytest.raises(ConfigError, match="global_batch_size"):
        _run(project, "sft")
    assert not (project / "data" / "06_models" / "_runs").exists()


TINY_STAGE = {"training": {"train_steps": 4, "global_batch_size": 8, "micro_batch_size": 8, "log_interval": 2,
                           "eval_interval": 0, "eval_samples": 16, "save_interval": 0}}


TINY_RL = {"rl": {"iterations": 3, "prompts_per_iteration": 8, "epochs": 1, "minibatches": 2, "micro_batch_size": 4,
                  "log_interval": 1, "eval_interval": 2, "eval_prompts": 8, "save_interval": 2},
           "generation": {"max_new_tokens": 8}}


def _fast_flows(project: Path) -> None:
    fast = {**FAST, "reward_model": TINY_STAGE, "dpo": TINY_STAGE, "ppo": {**TINY_RL, "critic_warmup_iterations": 1},
            "reinforce": {**TINY_RL, "generation": {"max_new_tokens": 8, "samples_per_prompt": 4}},
            "evaluation": {"generation": {"samples_per_prompt": 1, "max_new_tokens": 8}, "greedy": False}}
    (project / "conf" / "test" / "parameters_fast.yml").write_text(yaml.safe_dump(fast))


def _report_policies(project: Path) -> tuple[set[str], dict]:
    (version,) = sorted((project / "data" / "08_reporting" / "eval_report").iterdir())
    report = json.loads((version / "eval_report" / "report.json").read_text())
    assert sorted(report["ranking"]) == sorted(report["policies"])  # every evaluated policy is ranked
    assert (version / "eval_report" / "report.md").is_file()
    return set(report["policies"]), report


def test_dpo_flow_runs_on_a_fresh_project_then_a_beta_sweep_compares(project):
    """The composition produces everything its evaluation needs (nothing from another flow) and no reward model; its
    evaluation promotes DPO through the gates. Then `align-pipeline sweep` runs DPO + its evaluation at two betas
    and the comparison report shows both betas and the accuracy delta (beta 0.1 is the flow's own DPO: reused)."""
    _fast_flows(project)
    fast = yaml.safe_load((project / "conf" / "test" / "parameters_fast.yml").read_text())
    fast["evaluation"]["gate"] = {"min_gain_over_sft": -1.0, "max_kl_to_reference": 1.0e6}
    (project / "conf" / "test" / "parameters_fast.yml").write_text(yaml.safe_dump(fast))
    outputs = _run(project, "dpo_flow")
    policies, report = _report_policies(project)
    assert policies == {"sft", "dpo"} and "reward_model" not in report
    promoted = outputs["promoted_policy"].load()
    (dpo_version,) = sorted((project / "data" / "06_models" / "dpo_policy").iterdir())
    assert (promoted["policy"], promoted["dataset"], promoted["version"]) == ("dpo", "dpo_policy", dpo_version.name)
    assert promoted["passed"] == {"dpo": True}
    (version,) = sorted((project / "data" / "08_reporting" / "eval_report").iterdir())
    text = (version / "eval_report" / "report.md").read_text()
    assert "| dpo | evaluation.gate.min_gain_over_sft | -1 |" in text and "Promoted: **dpo**" in text
    _exports_are_mlflow_models_and_the_promoted_one_is_champion(project, dpo_version.name)

    env = {k: v for k, v in os.environ.items() if k != "KEDRO_ENV"}
    sweep = subprocess.run([sys.executable, "-m", "align_pipeline", "sweep", "--pipelines", "dpo_evaluation",
                            "--grid", "dpo.loss.beta=0.1,0.3", "--env", "test", "--out", str(project / "cmp")],
                           cwd=project, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert sweep.returncode == 0, sweep.stdout[-3000:] + sweep.stderr[-3000:]
    assert "1/2: --params dpo.loss.beta=0.1" in sweep.stdout and "2/2: --params dpo.loss.beta=0.3" in sweep.stdout
    summary = json.loads((project / "cmp" / "comparison.json").read_text())
    assert [e["label"] for e in summary["experiments"]] == ["dpo.loss.beta=0.1", "dpo.loss.beta=0.3"]
    accuracy = summary["evaluation"]["dpo/accuracy"]
    assert len(accuracy) == 2 and all(a is not None for a in accuracy)
    text = (project / "cmp" / "report.md").read_text()
    assert "| dpo.loss.beta | 0.1 | 0.3 |" in text
    assert f"| dpo/accuracy ↑ | {accuracy[0]:.4g} | {accuracy[1]:.4g} | {accuracy[1] - accuracy[0]:+.4g} |" in text
    # a winner only beyond the binomial noise of the sampled answers (equal accuracies: "same")
    verdict, (a, b) = summary["verdicts"]["dpo/accuracy"], accuracy
    assert verdict == "same" if a == b else verdict.startswith(("within noise", "dpo.loss.beta=")), verdict
    assert (project / "cmp" / "train_dpo__loss.png").is_file()
    if "val_rewards/margins" in summary["curves"].get("train_dpo", {}):  # drawn: then said to scale with beta
        assert "dpo.loss.beta differs between these runs" in text
    assert "| evaluate_policies: promoted | dpo_policy@" in text  # the gates of each point's evaluation
    # the console of a piped kedro run: one plain record per line, no known third-party warnings, no doubled label
    out = sweep.stdout + sweep.stderr
    assert re.search(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d INFO align_pipeline\.launch: \[dpo\] step 4/4 \| loss", out, re.MULTILINE)
    assert "full scope is deprecated" not in out and "ShardedTensor" not in out and "[dpo] [dpo]" not in out
    assert "Loading data from params:" not in out and "as logging configuration" not in out  # conf/logging.yml
    first = sweep.stdout.splitlines()[1]  # after the sweep's own "1/2: --params ..." line: kedro's first record
    assert re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d (INFO|WARNING) ", first), sweep.stdout[:500]
    assert re.search(r"train_dpo: stored dpo_policy -> \S+/data/06_models/dpo_policy/[^/]+/dpo_policy$", out, re.MULTILINE)
    # the rank logs outlive the run directory, as artifacts of the node's MLflow run
    import mlflow
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=mlflow.get_tracking_uri())
    last = client.get_run(summary["experiments"][-1]["runs"]["train_dpo"])
    assert "logs/dpo/rank0.log" in {a.path for a in client.list_artifacts(last.info.run_id, "logs/dpo")}


def _exports_are_mlflow_models_and_the_promoted_one_is_champion(project: Path, dpo_version: str) -> None:
    """`--pipelines export` after the evaluation: both policies become registered MLflow models; the promoted DPO
    version is `models:/dpo_policy_hf@champion` with its gate results as tags, and MLflow serves it back (the same
    logits as the exported directory)."""
    import mlflow
    import torch
    from mlflow import MlflowClient
    from transformers import AutoModelForCausalLM

    _run(project, "export")
    client = MlflowClient(tracking_uri=mlflow.get_tracking_uri())
    champion = client.get_model_version_by_alias("dpo_policy_hf", "champion")
    assert champion.tags["lineage.dpo_policy"] == dpo_version and champion.tags["export.check"] == "passed"
    assert champion.tags["gate.min_gain_over_sft"].startswith("pass (") and champion.tags["gates.passed"] == "true"
    assert champion.tags["evaluation.promoted"] == "true"
    (sft,) = client.search_model_versions("name = 'sft_policy_hf'")
    assert sft.tags["gates.passed"] == "reference (not gated)" and "champion" not in sft.aliases
    (exported,) = (project / "data" / "07_model_output" / "dpo_policy_hf").iterdir()
    assert champion.tags["lineage.out.dpo_policy_hf"] == exported.name
    assert not champion.source.startswith(str(exported))  # a copy in MLflow's artifact store
    components = mlflow.transformers.load_model("models:/dpo_policy_hf@champion", return_type="components")
    ids = torch.tensor([[1, 5, 9, 12, 7]])
    expected = AutoModelForCausalLM.from_pretrained(str(exported / "dpo_policy_hf")).eval()(ids).logits
    assert torch.equal(components["model"].eval()(ids).logits, expected)


def test_rlhf_on_a_fresh_project_then_reinforce_on_its_sft_policy(project):
    """rlhf = data_prep -> sft -> reward_model -> ppo -> evaluation; then the reinforce stage alone reuses sft_policy.
    MLflow has the RL metrics of every iteration on the stage's child run."""
    import mlflow
    from mlflow import MlflowClient

    _fast_flows(project)
    _run(project, "rlhf")
    policies, report = _report_policies(project)
    assert policies == {"sft", "ppo"} and "reward_model" in report
    models = project / "data" / "06_models"
    assert len(list((models / "ppo_policy").iterdir())) == 1 and len(list((models / "ppo_critic").iterdir())) == 1

    # a reward-model gate PPO cannot pass: the node stops before any job, with the message and the MLflow tags
    from align_pipeline.evaluation.gates import GateFailed

    fast = yaml.safe_load((project / "conf" / "test" / "parameters_fast.yml").read_text())
    fast["ppo"]["gate"] = {"min_reward_model_accuracy": 1.0}  # the tiny RM is below 1 (the range is [0, 1])
    (project / "conf" / "test" / "parameters_fast.yml").write_text(yaml.safe_dump(fast))
    with pytest.raises(GateFailed, match=r"gate ppo.gate.min_reward_model_accuracy failed: the held-out accuracy of "
                       r"reward model \S+ is 0\.\d+, the gate needs 1(\.0)?\b"):
        _run(project, "ppo", "evaluation")
    assert len(list((models / "ppo_policy").iterdir())) == 1  # no new version
    client = MlflowClient(tracking_uri=mlflow.get_tracking_uri())
    gated = client.search_runs([client.get_experiment_by_name("test-sft").experiment_id],
                               filter_string="tags.`gate.failed` = 'ppo.gate.min_reward_model_accuracy'")
    assert sorted(r.data.tags.get("kedro.node", "parent") for r in gated) == ["parent", "train_ppo"]
    fast["ppo"].pop("gate")
    (project / "conf" / "test" / "parameters_fast.yml").write_text(yaml.safe_dump(fast))
    _run(project, "ppo")  # the first run's key again: its policy and critic, both from that one run, are reused
    (first, _), (first_critic, _) = (sorted((models / name).iterdir()) for name in ("ppo_policy", "ppo_critic"))
    for name in ("ppo_policy", "ppo_critic"):
        newest = max((models / name).iterdir()) / name
        assert json.loads((newest / "reuse.json").read_text())["reused_from"] == {"artifact": name,
                                                                                 "version": first.name}
    assert first_critic.name == first.name
    outputs = _run(project, "reinforce")
    (version,) = sorted((models / "reinforce_policy").iterdir())
    meta = json.loads((version / "reinforce_policy" / "meta.json").read_text())
    assert meta["stage"] == "reinforce" and meta["lineage"]["parent"]["path"].endswith("sft_policy")
    assert outputs["reinforce_metrics"].load()["iterations"] == 3.0

    client = MlflowClient(tracking_uri=mlflow.get_tracking_uri())
    runs = client.search_runs([client.get_experiment_by_name("test-sft").experiment_id])
    child = {r.data.tags["kedro.node"]: r for r in runs if "mlflow.parentRunId" in r.data.tags}
    for node, key in (("train_ppo", "critic/value_loss"), ("train_reinforce", "train/pg_loss")):
        for name in (key, "rollout/rewards_mean", "rollout/init_policy_kl", "timing/generate_s"):
            history = client.get_metric_history(child[node].info.run_id, name)
            assert [m.step for m in history] == [1, 2, 3], (node, name)
        assert "val/greedy_accuracy" in child[node].data.metrics


def _llama32_style_hf_dir(path: Path) -> None:
    """A tiny Llama-3.2-style HF model (llama3 RoPE scaling, tied embeddings) with a character tokenizer that covers
    the demo data and a chat template, made here with `transformers` / `tokenizers` (nothing downloaded)."""
    import torch
    from hf_models import LLAMA3_ROPE, demo_hf_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = demo_hf_tokenizer(path)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         rope_parameters=dict(LLAMA3_ROPE), tie_word_embeddings=True, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    LlamaForCausalLM(config).save_pretrained(str(path))


def test_hf_model_through_data_prep_sft_dpo_then_export(project):
    """data_prep (the HF model's tokenizer) -> sft (init_from the HF dir) -> dpo (export_hf: true) on a tiny
    Llama-3.2-style model; then `--pipelines export` writes sft_policy_hf and dpo_policy_hf (only the models the
    project has), which transformers loads and generates with, chat template included."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_dir = project / "hf_base"
    _llama32_style_hf_dir(hf_dir)
    params = {**FAST, "model": {**FAST["model"], "seq_length": 64},  # room for the chat template's role markup
              "data_prep": {"tokenizer": {"hf_model_dir": str(hf_dir)}},
              "sft": {**FAST["sft"], "init_from": str(hf_dir)}, "dpo": {**TINY_STAGE, "export_hf": True}}
    (project / "conf" / "test" / "parameters_fast.yml").write_text(yaml.safe_dump(params))
    _run(project, "data_prep", "sft", "dpo")
    (dpo_version,) = (project / "data" / "06_models" / "dpo_policy").iterdir()
    inline = dpo_version / "dpo_policy" / "hf"
    assert json.loads((inline / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]

    outputs = _run(project, "export")
    exported = project / "data" / "07_model_output"
    assert sorted(p.name for p in exported.iterdir() if p.name.endswith("_hf")) == ["dpo_policy_hf", "sft_policy_hf"]
    assert outputs["reward_model_export_metrics"].load() == {}
    (version,) = (exported / "dpo_policy_hf").iterdir()
    out = version / "dpo_policy_hf"
    config = json.loads((out / "config.json").read_text())
    source = json.loads((hf_dir / "config.json").read_text())
    for key in ("rope_parameters", "tie_word_embeddings", "max_position_embeddings", "model_type"):
        assert config[key] == source[key], key
    meta = json.loads((out / "align_pipeline_meta.json").read_text())
    assert meta["stage"] == "dpo" and meta["lineage"]["parent"]["path"].endswith("sft_policy")
    tok = AutoTokenizer.from_pretrained(str(out))
    assert tok.chat_template == AutoTokenizer.from_pretrained(str(hf_dir)).chat_template
    model = AutoModelForCausalLM.from_pretrained(str(out))
    prompt = tok.apply_chat_template([{"role": "user", "content": "add: 1+2"}], tokenize=False)
    ids = torch.tensor([[tok.bos_token_id, *tok.encode(prompt, add_special_tokens=False)]])
    new = model.generate(ids, max_new_tokens=4, do_sample=False)[0, ids.shape[1]:]
    assert 1 <= len(new) <= 4
    assert outputs["dpo_policy_export_metrics"].load()["bytes"] > 0
    # the export is a version of a registered model in MLflow, searchable by the checkpoint version it exports
    import mlflow
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=mlflow.get_tracking_uri())
    (dpo_checkpoint,) = (project / "data" / "06_models" / "dpo_policy").iterdir()
    (registered,) = client.search_model_versions(f"tags.`lineage.dpo_policy` = '{dpo_checkpoint.name}'")
    assert registered.name == "dpo_policy_hf" and registered.tags["lineage.out.dpo_policy_hf"] == version.name
    served = Path(mlflow.artifacts.download_artifacts(f"models:/dpo_policy_hf/{registered.version}"))
    assert (served / "model" / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()
    assert (served / "components" / "tokenizer" / "chat_template.jinja").exists() or "chat_template" in (
        served / "components" / "tokenizer" / "tokenizer_config.json").read_text()



def test_lora_stages_on_an_hf_model_store_adapters_that_export_merged(project):
    """SFT and DPO with adapters (`sft.lora`, `dpo.lora`) from a tiny HF model: each stored policy is its adapters
    alone with its base (SFT: the HF directory; DPO: the SFT version), a fraction of the base's size; DPO starts
    from the SFT artifact (merged on load), and `--pipelines export` with `export.check` writes both as merged HF
    directories whose transformers logits equal the checkpoints' (fp32, 1e-4)."""
    hf_dir = project / "hf_base"
    _llama32_style_hf_dir(hf_dir)
    lora = {"rank": 4, "alpha": 8.0}
    params = {**FAST, "model": {**FAST["model"], "seq_length": 64},
              "data_prep": {"tokenizer": {"hf_model_dir": str(hf_dir)}}, "export": {"check": True},
              "sft": {**FAST["sft"], "init_from": str(hf_dir), "lora": lora}, "dpo": {**TINY_STAGE, "lora": lora}}
    (project / "conf" / "test" / "parameters_fast.yml").write_text(yaml.safe_dump(params))
    _run(project, "data_prep", "sft", "dpo")
    bases = {"sft": str(hf_dir.resolve())}
    for stage in ("sft", "dpo"):
        (version,) = (project / "data" / "06_models" / f"{stage}_policy").iterdir()
        artifact = version / f"{stage}_policy"
        meta = json.loads((artifact / "meta.json").read_text())
        assert meta["lora"]["storage"] == "adapters" and meta["lora"]["rank"] == 4, stage
        assert meta["lora"]["base"] == bases[stage], stage
        bases["dpo"] = str(artifact.resolve())
        assert not list(artifact.glob("*.distcp")), stage  # no model weights, only adapters/
        size = sum(f.stat().st_size for f in (artifact / "adapters").rglob("*") if f.is_file())  # the weights kept
        base_size = sum(f.stat().st_size for f in hf_dir.rglob("*.safetensors"))
        assert 0 < size < base_size, (stage, size, base_size)  # tiny model: rank 4 is a large share of it
    outputs = _run(project, "export")
    for stage in ("sft", "dpo"):
        summary = outputs[f"{stage}_policy_export_metrics"].load()
        assert summary["max_abs_logit_diff"] <= 1e-4, (stage, summary)
