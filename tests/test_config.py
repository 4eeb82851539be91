"""The config family: parsing errors name the key; every field of every section and job has a docstring."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import json
from pathlib import Path

import pytest

from align_pipeline import config
from align_pipeline.config import (
    ConfigError,
    LaunchConfig,
    ModelConfig,
    ParallelConfig,
    PPOConfig,
    ReinforceConfig,
    SFTJob,
    from_dict,
)
from align_pipeline.config.checks import Arch, Names, check_job, check_job_layout, hf_arch
from align_pipeline.launch.world import world_size

REPO = Path(__file__).resolve().parents[1]

CLASSES = [getattr(config, name) for name in config.__all__
           if dataclasses.is_dataclass(getattr(config, name, None))]


def _documented_fields(cls) -> set[str]:
    """Fields of ``cls`` (and its dataclass bases) followed by a string literal in the class body."""
    names = set()
    for klass in cls.__mro__:
        if not dataclasses.is_dataclass(klass):
            continue
        body = ast.parse(inspect.getsource(klass)).body[0].body
        for stmt, nxt in itertools.pairwise(body):
            if (isinstance(stmt, ast.AnnAssign) and isinstance(nxt, ast.Expr)
                    and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
                names.add(stmt.target.id)
    return names


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_every_field_has_a_docstring(cls):
    missing = {f.name for f in dataclasses.fields(cls)} - _documented_fields(cls)
    assert not missing, f"{cls.__name__}: fields without a docstring: {sorted(missing)}"


def test_unknown_key_names_the_section_and_the_allowed_keys():
    with pytest.raises(ConfigError, match=r"params:ppo.kl: unknown key\(s\) \['coef'\]; allowed: .*'beta'"):
        from_dict(PPOConfig, {"kl": {"coef": 0.1}}, "params:ppo")


def test_wrong_type_names_the_key():
    with pytest.raises(ConfigError, match=r"params:ppo.rl.iterations: expected an integer, got 'ten'"):
        from_dict(PPOConfig, {"rl": {"iterations": "ten"}}, "params:ppo")
    with pytest.raises(ConfigError, match=r"params:ppo.kl.estimator: 'k9' is not one of"):
        from_dict(PPOConfig, {"kl": {"estimator": "k9"}}, "params:ppo")


def test_missing_required_key_and_cross_field_checks():
    with pytest.raises(ConfigError, match=r"SFTJob.paths: required key is missing"):
        from_dict(SFTJob, {})
    with pytest.raises(ConfigError, match="samples_per_prompt >= 2"):
        from_dict(ReinforceConfig, {"generation": {"samples_per_prompt": 1}})
    with pytest.raises(ConfigError, match="kl.adaptive"):
        from_dict(ReinforceConfig, {"generation": {"samples_per_prompt": 4}, "kl": {"adaptive": True}})
    with pytest.raises(ConfigError, match="min_lr"):
        from_dict(PPOConfig, {"optimizer": {"lr": 1e-4, "min_lr": 1e-3}})
    with pytest.raises(ConfigError, match=r"critic_warmup_iterations must be in \[0, rl.iterations = 10\), got 10"):
        from_dict(PPOConfig, {"rl": {"iterations": 10}, "critic_warmup_iterations": 10})


def test_a_job_round_trips_through_json():
    job = from_dict(SFTJob, {"paths": {"run_dir": "r", "train_data": "t", "val_data": "v", "tokenizer": "k"},
                             "sft": {"training": {"train_steps": 5}}})
    assert from_dict(SFTJob, config.to_dict(job)) == job
    assert job.sft.training.train_steps == 5 and job.paths.init_from is None


@pytest.mark.parametrize("env", ["gpu", "hf_example"], ids=["conf-gpu", "conf-hf_example"])  # id "gpu" = GPU-only
def test_shipped_environments_load_and_validate(env):
    """conf/gpu and conf/hf_example merge over conf/base (soft) and every section validates; hf_example takes the
    model directory from `--params hf_model_dir=...` for both the tokenizer and SFT's starting weights."""
    from kedro.config import OmegaConfigLoader

    from align_pipeline.kedro.params_hook import PARAM_SCHEMAS, validate_params
    from align_pipeline.settings import CONFIG_LOADER_ARGS

    loader = OmegaConfigLoader(str(REPO / "conf"), env=env, runtime_params={"hf_model_dir": "/models/x"},
                               **{k: v for k, v in CONFIG_LOADER_ARGS.items()})
    params = loader["parameters"]
    validate_params(params, set(PARAM_SCHEMAS))
    assert params["parallel"]["bf16"] is True and params["launch"]["nproc_per_node"] == "gpus"
    assert params["sft"]["training"]["train_steps"] == 600  # base keys kept under the env's overrides
    if env == "hf_example":
        assert params["sft"]["init_from"] == params["data_prep"]["tokenizer"]["hf_model_dir"] == "/models/x"


def test_hf_example_is_the_gpu_env_for_an_hf_model():
    """Kedro takes one env: `-e hf_example` resolves every GPU setting (parallel, launch, attention backend) to what
    `-e gpu` does, so an HF model on GPUs runs as the gpu env would; neither names the legacy ``launch.backend: nccl``
    (``launch.dist_backend``; auto, hf_example's, is nccl with CUDA)."""
    import yaml
    from kedro.config import OmegaConfigLoader

    from align_pipeline.settings import CONFIG_LOADER_ARGS

    def params(env):
        return OmegaConfigLoader(str(REPO / "conf"), env=env, runtime_params={"hf_model_dir": "/models/x"},
                                 **CONFIG_LOADER_ARGS)["parameters"]

    gpu, hf = params("gpu"), params("hf_example")
    assert hf["parallel"] == gpu["parallel"]
    assert {**hf["launch"], "dist_backend": "nccl"} == gpu["launch"] and hf["launch"]["dist_backend"] == "auto"
    assert hf["model"]["attention_backend"] == gpu["model"]["attention_backend"]
    for env in ("gpu", "hf_example"):
        own = yaml.safe_load((REPO / "conf" / env / "parameters.yml").read_text())
        assert own["launch"].get("backend") in (None, "local", "slurm"), env


# ---- ranges: each section's validate(), the error names the key as the parameters spell it ----

RANGES = [  # (section, dataclass, a failing value, a passing value, the message of the failing one)
    ("model", config.ModelConfig, {"num_layers": 0}, {"num_layers": 1}, "params:model.num_layers=0 must be >= 1"),
    ("model", config.ModelConfig, {"hidden_size": 0}, {"hidden_size": 1}, "params:model.hidden_size=0 must be >= 1"),
    ("model", config.ModelConfig, {"num_attention_heads": 0}, {"num_attention_heads": 1},
     "params:model.num_attention_heads=0 must be >= 1"),
    ("model", config.ModelConfig, {"num_query_groups": 0}, {"num_query_groups": 1},
     "params:model.num_query_groups=0 must be >= 1"),
    ("model", config.ModelConfig, {"ffn_hidden_size": 0}, {"ffn_hidden_size": 1},
     "params:model.ffn_hidden_size=0 must be >= 1"),
    ("model", config.ModelConfig, {"seq_length": 0}, {"seq_length": 1}, "params:model.seq_length=0 must be >= 1"),
    ("model", config.ModelConfig, {"vocab_size": 0}, {"vocab_size": 1}, "params:model.vocab_size=0 must be >= 1"),
    ("model", config.ModelConfig, {"make_vocab_size_divisible_by": 0}, {"make_vocab_size_divisible_by": 1},
     "params:model.make_vocab_size_divisible_by=0 must be >= 1"),
    ("model", config.ModelConfig, {"kv_channels": 0}, {"kv_channels": 1}, "params:model.kv_channels=0 must be >= 1"),
    # 4 query heads: 3 key/value groups cannot each serve a whole group, 2 groups serve 2 heads each
    ("model", config.ModelConfig, {"num_attention_heads": 4, "num_query_groups": 3},
     {"num_attention_heads": 4, "num_query_groups": 2},
     "params:model.num_query_groups=3 does not divide params:model.num_attention_heads=4"),
    ("parallel", config.ParallelConfig, {"tensor_model_parallel_size": -2}, {"tensor_model_parallel_size": 2},
     "params:parallel.tensor_model_parallel_size=-2 must be >= 1"),
    ("parallel", config.ParallelConfig, {"pipeline_model_parallel_size": 0}, {"pipeline_model_parallel_size": 2},
     "params:parallel.pipeline_model_parallel_size=0 must be >= 1"),
    ("parallel", config.ParallelConfig, {"recompute_num_layers": 0}, {"recompute_num_layers": 1},
     "params:parallel.recompute_num_layers=0 must be >= 1"),
    ("launch", config.LaunchConfig, {"nproc_per_node": 0}, {"nproc_per_node": "gpus"},
     "params:launch.nproc_per_node=0 must be >= 1"),
    ("launch", config.LaunchConfig, {"nnodes": 0}, {"nnodes": 1}, "params:launch.nnodes=0 must be >= 1"),
    ("launch", config.LaunchConfig, {"nnodes": 2, "node_rank": 1, "master_port": 29500},
     {"nnodes": 2, "node_rank": 0, "master_port": 29500},
     r"params:launch.node_rank=1: kedro runs on node 0 only; start every other node with `align-pipeline worker"),
    ("launch", config.LaunchConfig, {"slurm": {"sbatch_lines": ["qos=high"]}},
     {"slurm": {"sbatch_lines": ["--qos=high"]}},
     r"params:launch.slurm.sbatch_lines: each is an sbatch option starting with '-'"),
    ("launch", config.LaunchConfig, {"master_port": 70000}, {"master_port": 65535},
     r"params:launch.master_port=70000 must be in \[0, 65535\]"),
    ("launch", config.LaunchConfig, {"nnodes": 2}, {"nnodes": 2, "master_port": 29500},
     r"params:launch.master_port=0 \(pick a free one\) works on one node only; params:launch.nnodes=2 needs"),
    ("launch", config.LaunchConfig, {"threads_per_process": 0}, {"threads_per_process": 1},
     "params:launch.threads_per_process=0 must be >= 1"),
    ("launch", config.LaunchConfig, {"log_tail_lines": -1}, {"log_tail_lines": 0},
     "params:launch.log_tail_lines=-1 must be >= 0"),
    ("sft", config.SFTConfig, {"training": {"micro_batch_size": 0}}, {"training": {"micro_batch_size": 1}},
     "params:sft.training.micro_batch_size=0 must be >= 1"),
    ("sft", config.SFTConfig, {"training": {"global_batch_size": 0}}, {"training": {"global_batch_size": 8}},
     "params:sft.training.global_batch_size=0 must be >= 1"),
    ("sft", config.SFTConfig, {"training": {"global_batch_size": 10, "micro_batch_size": 4}},
     {"training": {"global_batch_size": 12, "micro_batch_size": 4}},
     "params:sft.training.global_batch_size=10 must be a multiple of params:sft.training.micro_batch_size=4"),
    ("sft", config.SFTConfig, {"training": {"train_steps": 0}}, {"training": {"train_steps": 1}},
     "params:sft.training.train_steps=0 must be >= 1"),
    ("sft", config.SFTConfig, {"training": {"log_interval": 0}}, {"training": {"log_interval": 1}},
     "params:sft.training.log_interval=0 must be >= 1"),
    ("sft", config.SFTConfig, {"training": {"eval_interval": -1}}, {"training": {"eval_interval": 0}},
     "params:sft.training.eval_interval=-1 must be >= 0"),
    ("sft", config.SFTConfig, {"training": {"save_interval": -1}}, {"training": {"save_interval": 0}},
     "params:sft.training.save_interval=-1 must be >= 0"),
    ("sft", config.SFTConfig, {"training": {"keep_checkpoints": -1}}, {"training": {"keep_checkpoints": 0}},
     "params:sft.training.keep_checkpoints=-1 must be >= 0"),
    ("sft", config.SFTConfig, {"training": {"eval_samples": 0}}, {"training": {"eval_samples": 1}},
     "params:sft.training.eval_samples=0 must be >= 1"),
    ("sft", config.SFTConfig, {"training": {"optimizer": {"warmup_steps": -1}}},
     {"training": {"optimizer": {"warmup_steps": 0}}}, "params:sft.training.optimizer.warmup_steps=-1 must be >= 0"),
    ("evaluation", config.EvaluationConfig, {"micro_batch_size": 0}, {"micro_batch_size": 1},
     "params:evaluation.micro_batch_size=0 must be >= 1"),
    ("evaluation", config.EvaluationConfig, {"generation": {"samples_per_prompt": 0}},
     {"generation": {"samples_per_prompt": 1}}, "params:evaluation.generation.samples_per_prompt=0 must be >= 1"),
    ("evaluation", config.EvaluationConfig, {"generation": {"batch_size": 0}}, {"generation": {"batch_size": 1}},
     "params:evaluation.generation.batch_size=0 must be >= 1"),
    ("evaluation", config.EvaluationConfig, {"generation": {"max_new_tokens": 0}},
     {"generation": {"max_new_tokens": 1}}, "params:evaluation.generation.max_new_tokens=0 must be >= 1"),
    ("evaluation", config.EvaluationConfig, {"generation": {"top_k": -1}}, {"generation": {"top_k": 0}},
     "params:evaluation.generation.top_k=-1 must be >= 0"),
    ("evaluation", config.EvaluationConfig, {"generation": {"top_p": 0.0}}, {"generation": {"top_p": 0.5}},
     r"params:evaluation.generation: need temperature >= 0 \(got 1.0\) and 0 < top_p <= 1 \(got 0.0\)"),
    ("evaluation", config.EvaluationConfig, {"generation": {"temperature": -0.5}}, {"generation": {"temperature": 0}},
     r"params:evaluation.generation: need temperature >= 0 \(got -0.5\)"),
    ("dpo", config.DPOConfig, {"reference_micro_batch_size": 0}, {"reference_micro_batch_size": 1},
     "params:dpo.reference_micro_batch_size=0 must be >= 1"),
    *[("ppo", PPOConfig, {"rl": {key: 0}}, {"rl": {key: 1}}, f"params:ppo.rl.{key}=0 must be >= 1")
      for key in ("iterations", "prompts_per_iteration", "epochs", "minibatches", "micro_batch_size", "log_interval")],
    *[("ppo", PPOConfig, {"rl": {key: -1}}, {"rl": {key: 0}}, f"params:ppo.rl.{key}=-1 must be >= 0")
      for key in ("eval_interval", "eval_prompts", "save_interval", "keep_checkpoints")],
]


@pytest.mark.parametrize(("section", "cls", "bad", "good", "message"), RANGES,
                         ids=[f"{r[0]}-{'-'.join(map(str, r[2].items()))}" for r in RANGES])
def test_each_range_rule_fails_naming_the_key_and_passes_inside_the_range(section, cls, bad, good, message):
    with pytest.raises(ConfigError, match=message):
        from_dict(cls, bad, f"params:{section}")
    from_dict(cls, good, f"params:{section}")


def test_a_range_rule_fails_before_an_arithmetic_error():
    """micro_batch_size 0 was a ZeroDivisionError in the old `global % micro` check."""
    with pytest.raises(ConfigError, match="params:dpo.training.micro_batch_size=0 must be >= 1"):
        from_dict(config.DPOConfig, {"training": {"micro_batch_size": 0}}, "params:dpo")


# ---- layout: the rules that span sections (config.checks), as the hook and the jobs apply them ----

HEADS4 = Arch(ModelConfig(num_layers=2, num_attention_heads=4, num_query_groups=2, seq_length=32))


def _layout(stage: str = "sft", model: Arch | None = HEADS4, section=None, world: int = 1, **parallel) -> int:
    section = section or from_dict(config.SECTIONS.get(stage, config.DPOConfig), {})
    return check_job_layout(stage, section, ParallelConfig(**parallel), world, [model] if model else [])


def test_world_size_must_be_divisible_by_tp_times_pp():
    launch = from_dict(LaunchConfig, {"nproc_per_node": 1}, "params:launch")
    world, desc = world_size(launch)
    with pytest.raises(ConfigError, match=r"params:launch.nproc_per_node=1 x params:launch.nnodes=1 \(world size 1\) "
                                          r"is not divisible by params:parallel.tensor_model_parallel_size=2 x "
                                          r"params:parallel.pipeline_model_parallel_size=1"):
        check_job_layout("sft", config.SFTConfig(), ParallelConfig(tensor_model_parallel_size=2), world,
                         names=Names(section="params:sft", world=desc))
    # 3 per node x 2 nodes = 6 = TP 2 x PP 1 x DP 3
    world, _ = world_size(LaunchConfig(nproc_per_node=3, nnodes=2, master_port=29500))
    assert world == 6
    assert _layout(world=6, tensor_model_parallel_size=2, section=config.SFTConfig(
        training=config.TrainingConfig(global_batch_size=6, micro_batch_size=2))) == 3
    with pytest.raises(ConfigError, match=r"world size 6 is not divisible by .*=2 x .*pipeline_model_parallel_size=4"):
        _layout(world=6, tensor_model_parallel_size=2, pipeline_model_parallel_size=4, model=None)  # 6 % (2 x 4) = 6


def test_nproc_gpus_is_resolved_and_no_visible_gpu_is_an_error():
    gpus = LaunchConfig(nproc_per_node="gpus")
    assert world_size(gpus, gpus=lambda: 4) == (
        4, "params:launch.nproc_per_node=gpus (4 visible) x params:launch.nnodes=1 (world size 4)")
    with pytest.raises(ConfigError, match="params:launch.nproc_per_node=gpus but no GPU is visible"):
        world_size(gpus, gpus=lambda: 0)


def test_tp_must_divide_the_attention_heads():
    with pytest.raises(ConfigError, match=r"params:parallel.tensor_model_parallel_size=3 does not divide "
                                          r"params:model.num_attention_heads=4"):
        _layout(world=3, tensor_model_parallel_size=3)  # 4 % 3 = 1
    _layout(world=2, tensor_model_parallel_size=2,
            section=config.SFTConfig(training=config.TrainingConfig(micro_batch_size=4)))  # 4 % 2 = 0


def test_tp_and_query_groups_must_divide_one_another():
    model = ModelConfig(num_attention_heads=12, num_query_groups=3)
    sft = config.SFTConfig(training=config.TrainingConfig(global_batch_size=24, micro_batch_size=4))
    with pytest.raises(ConfigError, match=r"params:parallel.tensor_model_parallel_size=2 neither divides nor is a "
                                          r"multiple of params:model.num_query_groups=3"):
        _layout(model=Arch(model), world=2, tensor_model_parallel_size=2, section=sft)  # 3 % 2, 2 % 3
    _layout(model=Arch(model), world=6, tensor_model_parallel_size=6, section=sft)  # 6 % 3 = 0: each group on 2 ranks
    _layout(model=Arch(model), world=3, tensor_model_parallel_size=3, section=sft)  # 3 % 3 = 0


def test_hf_weights_need_tp_to_divide_the_key_value_heads(tmp_path):
    (tmp_path / "config.json").write_text('{"num_attention_heads": 8, "num_key_value_heads": 2, '
                                          '"num_hidden_layers": 2, "hidden_size": 64}')
    arch = hf_arch(tmp_path, ModelConfig())
    assert (arch.model.num_attention_heads, arch.model.num_query_groups, arch.model.num_layers) == (8, 2, 2)
    sft = config.SFTConfig(training=config.TrainingConfig(micro_batch_size=8))
    with pytest.raises(ConfigError, match=r"params:parallel.tensor_model_parallel_size=4 does not divide "
                                          rf"{tmp_path}/config.json:num_key_value_heads=2"):
        _layout(model=arch, world=4, tensor_model_parallel_size=4, section=sft)  # 2 % 4 = 2
    _layout(model=arch, world=2, tensor_model_parallel_size=2, section=sft)  # 2 % 2 = 0


def test_pp_must_divide_the_layers():
    with pytest.raises(ConfigError, match=r"params:parallel.pipeline_model_parallel_size=3 does not divide "
                                          r"params:model.num_layers=2"):
        _layout(world=3, pipeline_model_parallel_size=3)  # 2 % 3 = 2
    _layout(world=2, pipeline_model_parallel_size=2)  # 2 % 2 = 0


def test_sequence_parallel_needs_seq_length_divisible_by_tp():
    odd = Arch(ModelConfig(num_attention_heads=4, seq_length=47))
    sft = config.SFTConfig(training=config.TrainingConfig(micro_batch_size=16))
    with pytest.raises(ConfigError, match=r"params:parallel.sequence_parallel splits the sequence over "
                                          r"params:parallel.tensor_model_parallel_size=2 ranks: "
                                          r"params:model.seq_length=47 is not divisible by it"):
        _layout(model=odd, world=2, tensor_model_parallel_size=2, sequence_parallel=True, section=sft)
    _layout(model=odd, world=2, tensor_model_parallel_size=2, section=sft)  # no sequence parallelism: any length
    even = Arch(ModelConfig(num_attention_heads=4, seq_length=48))
    _layout(model=even, world=2, tensor_model_parallel_size=2, sequence_parallel=True, section=sft)  # 48 % 2 = 0


@pytest.mark.parametrize("stage", ["ppo", "reinforce", "evaluation"])
def test_generating_stages_refuse_pipeline_parallelism(stage):
    section = _rl(64, 4, 1, 16) if stage == "reinforce" else None  # a valid section: only PP is wrong
    with pytest.raises(ConfigError, match=rf"params:parallel.pipeline_model_parallel_size=2: the {stage} stage needs 1"):
        _layout(stage, section=section, world=2, pipeline_model_parallel_size=2)
    _layout(stage, section=section, world=2)  # PP 1, DP 2


@pytest.mark.parametrize("stage", ["sft", "reward_model", "dpo", "reference_logps"])
def test_other_stages_take_pipeline_parallelism(stage):
    section = from_dict(config.SECTIONS.get(stage, config.DPOConfig), {"training": {"micro_batch_size": 16}})
    _layout(stage, section=section, world=2, pipeline_model_parallel_size=2)  # DP 1: 32 % (1 x 16) = 0


def test_a_pipeline_parallel_rl_job_fails_when_the_job_is_built():
    paths = {"run_dir": "r", "prompts": "p", "tokenizer": "t", "policy": "s"}
    reward = {"reward_model_weight": 0.0, "functions": [{"name": "align_pipeline.rewards:demo_task"}]}
    job = {"paths": paths, "reinforce": {"reward": reward, "generation": {"samples_per_prompt": 4}}}
    with pytest.raises(ConfigError, match=r"ReinforceJob.parallel.pipeline_model_parallel_size=2: the reinforce"):
        from_dict(config.ReinforceJob, {**job, "parallel": {"pipeline_model_parallel_size": 2}})
    from_dict(config.ReinforceJob, job)


def test_global_batch_must_split_over_data_parallel_ranks_into_micro_batches():
    bad = config.SFTConfig(training=config.TrainingConfig(global_batch_size=24, micro_batch_size=8))
    with pytest.raises(ConfigError, match=r"params:<stage>.training.global_batch_size=24 must split over DP=4 "
                                          r"data-parallel ranks \(world size 4 / \(TP=1 x PP=1\)\) into micro-batches "
                                          r"of params:<stage>.training.micro_batch_size=8: it must be a multiple of 32"):
        _layout(section=bad, world=4)  # 24 % (4 x 8) = 24, though 24 % 8 = 0
    _layout(section=config.SFTConfig(training=config.TrainingConfig(global_batch_size=32, micro_batch_size=8)),
            world=4)  # 32 = 4 ranks x 1 micro-batch of 8
    _layout(section=bad, world=3)  # 24 = 3 ranks x 1 micro-batch of 8


def _rl(prompts: int, samples: int, minibatches: int, micro: int) -> config.ReinforceConfig:
    return from_dict(config.ReinforceConfig, {
        "rl": {"prompts_per_iteration": prompts, "minibatches": minibatches, "micro_batch_size": micro},
        "generation": {"samples_per_prompt": samples}}, "params:reinforce")


def test_rollout_prompts_must_split_over_data_parallel_ranks():
    with pytest.raises(ConfigError, match=r"params:<stage>.rl.prompts_per_iteration=30 must split over DP=4 "
                                          r"data-parallel ranks .*: it must be a multiple of 4"):
        _layout("reinforce", section=_rl(30, 4, 1, 2), world=4)  # 30 % 4 = 2
    _layout("reinforce", section=_rl(32, 4, 1, 2), world=4)  # 8 prompts per rank


def test_rollout_rows_must_split_into_minibatches_of_whole_micro_batches():
    # 32 prompts / DP 4 = 8 per rank, x 4 samples = 32 rows; 2 minibatches x 32 rows = 64 does not divide 32
    with pytest.raises(ConfigError, match=r"a rollout has 32 rows per data-parallel rank \(params:<stage>.rl."
                                          r"prompts_per_iteration=32 / DP=4 x params:<stage>.generation."
                                          r"samples_per_prompt=4\); they must split into params:<stage>.rl."
                                          r"minibatches=2 minibatches of whole micro-batches of params:<stage>.rl."
                                          r"micro_batch_size=32: a multiple of 64"):
        _layout("ppo", section=_rl(32, 4, 2, 32), world=4)
    _layout("ppo", section=_rl(32, 4, 2, 16), world=4)  # 32 rows = 2 minibatches x 1 micro-batch of 16


def test_an_entry_point_names_its_own_keys_and_model():
    """Inside a job the same rules name the job's fields and its real world size."""
    sft = config.SFTConfig(training=config.TrainingConfig(global_batch_size=8, micro_batch_size=4))
    with pytest.raises(ConfigError, match=r"the job's world size 1 is not divisible by "
                                          r"parallel.tensor_model_parallel_size=2"):
        check_job("sft", sft, ParallelConfig(tensor_model_parallel_size=2), 1, ModelConfig())
    with pytest.raises(ConfigError, match=r"parallel.tensor_model_parallel_size=3 does not divide "
                                          r"/ckpt model.num_attention_heads=4"):
        check_job("sft", sft, ParallelConfig(tensor_model_parallel_size=3), 3, ModelConfig(), "/ckpt", "checkpoint")
    with pytest.raises(ConfigError, match=r"sft.training.global_batch_size=8 must split over DP=4"):
        check_job("sft", sft, ParallelConfig(), 4, ModelConfig())  # 8 % (4 x 4) = 8
    assert check_job("sft", sft, ParallelConfig(), 2, ModelConfig()) == 2  # 8 = 2 ranks x 1 micro-batch of 4


# ---- the hook: every stage node of the pipeline being run, with the model its job will build ----


class _Catalog:
    """Stands in for Kedro's catalog: dataset name -> the path its current version loads as."""

    def __init__(self, **paths: Path):
        self.paths = paths

    def get(self, name: str):
        from types import SimpleNamespace

        path = self.paths.get(name)
        return None if path is None else SimpleNamespace(exists=lambda: True, load=lambda: str(path))


def _checkpoint(path: Path, **model) -> Path:
    path.mkdir(parents=True)
    (path / "meta.json").write_text(json.dumps({"stage": "sft", "model": config.to_dict(ModelConfig(**model))}))
    return path


def _params(tp: int = 1, nproc: int = 1, **sections) -> dict:
    return {"model": {"num_layers": 2, "num_attention_heads": 4, "num_query_groups": 2},
            "parallel": {"tensor_model_parallel_size": tp}, "launch": {"nproc_per_node": nproc},
            "reinforce": {"generation": {"samples_per_prompt": 4}}, **sections}


@pytest.fixture(scope="module")
def pipelines():
    from align_pipeline.pipeline_registry import register_pipelines

    return register_pipelines()


def _base_parameters() -> dict:
    import yaml

    params: dict = {}
    for f in sorted((REPO / "conf" / "base").glob("parameters*.yml")):
        params.update(yaml.safe_load(f.read_text()) or {})
    return params


def test_the_default_project_passes_every_layout_rule(pipelines):
    from align_pipeline.kedro.params_hook import PARAM_SCHEMAS, check_layouts, validate_params

    params = _base_parameters()
    validate_params(params, set(PARAM_SCHEMAS))
    for pipeline in pipelines.values():
        check_layouts(params, pipeline, _Catalog())


@pytest.mark.parametrize("gpus", [1, 2, 4, 8])
def test_the_gpu_environment_passes_every_layout_rule(pipelines, gpus):
    """conf/gpu launches one process per visible GPU; its batches split at 1, 2 or 4 GPUs."""
    from kedro.config import OmegaConfigLoader

    from align_pipeline.kedro.params_hook import check_layouts
    from align_pipeline.settings import CONFIG_LOADER_ARGS

    params = OmegaConfigLoader(str(REPO / "conf"), env="gpu", **CONFIG_LOADER_ARGS)["parameters"]
    for pipeline in pipelines.values():
        check_layouts(params, pipeline, _Catalog(), gpus=lambda: gpus)


def test_hook_checks_the_stage_with_the_model_from_params_when_sft_makes_it(pipelines, tmp_path):
    """rlhf trains sft_policy itself: the later stages build params:model, not the catalog's older version."""
    from align_pipeline.kedro.params_hook import check_layouts

    stale = _Catalog(sft_policy=_checkpoint(tmp_path / "old", num_attention_heads=3))
    check_layouts(_params(tp=2, nproc=2), pipelines["rlhf"], stale)  # params:model: 4 heads % TP 2 = 0
    with pytest.raises(ConfigError, match=r"params:parallel.tensor_model_parallel_size=3 does not divide "
                                          r"params:model.num_attention_heads=4"):
        check_layouts(_params(tp=3, nproc=3), pipelines["rlhf"], stale)


def test_hook_reads_the_starting_checkpoint_of_a_stage_run_alone(pipelines, tmp_path):
    from align_pipeline.kedro.params_hook import check_layouts

    ckpt = _checkpoint(tmp_path / "sft", num_attention_heads=3, num_layers=3)
    with pytest.raises(ConfigError, match=rf"params:parallel.tensor_model_parallel_size=2 does not divide "
                                          rf"sft_policy {ckpt}/meta.json model.num_attention_heads=3"):
        check_layouts(_params(tp=2, nproc=2), pipelines["dpo"], _Catalog(sft_policy=ckpt))
    check_layouts(_params(tp=3, nproc=3), pipelines["dpo"], _Catalog(sft_policy=ckpt))  # 3 % 3; params:model unused
    check_layouts(_params(tp=2, nproc=2), pipelines["dpo"], _Catalog())  # no version yet: the node reports that


def test_hook_reads_init_from_instead_of_params_model(pipelines, tmp_path):
    from align_pipeline.kedro.params_hook import check_layouts

    ckpt = _checkpoint(tmp_path / "start", num_attention_heads=6)
    sft = {"init_from": str(ckpt)}
    check_layouts(_params(tp=3, nproc=3, sft=sft), pipelines["sft"])  # 6 % 3 = 0, though params:model has 4 heads
    with pytest.raises(ConfigError, match=rf"params:parallel.tensor_model_parallel_size=4 does not divide "
                                          rf"params:sft.init_from {ckpt}/meta.json model.num_attention_heads=6"):
        check_layouts(_params(tp=4, nproc=4, sft=sft), pipelines["sft"])


def test_hook_checks_the_frozen_models_an_rl_stage_builds(pipelines, tmp_path):
    """reinforce builds the reward model only when its weight is not 0 (reinforce_rm); ppo always (critic, RM)."""
    from align_pipeline.kedro.params_hook import check_layouts

    catalog = _Catalog(sft_policy=_checkpoint(tmp_path / "sft", num_attention_heads=4),
                       reward_model=_checkpoint(tmp_path / "rm", num_attention_heads=3))
    rm_used = {"generation": {"samples_per_prompt": 4}, "reward": {"reward_model_weight": 0.5}}
    check_layouts(_params(tp=2, nproc=2), pipelines["reinforce"], catalog)
    check_layouts(_params(tp=2, nproc=2, reinforce=rm_used), pipelines["reinforce"], catalog)  # no RM input wired
    for name, params in (("reinforce_rm", _params(tp=2, nproc=2, reinforce=rm_used)), ("ppo", _params(tp=2, nproc=2))):
        with pytest.raises(ConfigError, match=r"does not divide reward_model .*/rm/meta.json "
                                              r"model.num_attention_heads=3"):
            check_layouts(params, pipelines[name], catalog)


def test_hook_resolves_gpus_only_for_stage_nodes(pipelines):
    from align_pipeline.kedro.params_hook import check_layouts

    params = {**_params(), "launch": {"nproc_per_node": "gpus"}}
    check_layouts(params, pipelines["data_prep"], _Catalog(), gpus=lambda: 0)  # launches nothing
    with pytest.raises(ConfigError, match="params:launch.nproc_per_node=gpus but no GPU is visible"):
        check_layouts(params, pipelines["sft"], _Catalog(), gpus=lambda: 0)


def test_launch_backend_names_the_launcher_and_its_old_values_the_distributed_backend():
    """`launch.backend` is local | slurm; configs written when it named the torch.distributed backend still load."""
    old = from_dict(config.LaunchConfig, {"backend": "gloo"}, "params:launch")
    assert (old.backend, old.dist_backend) == ("local", "gloo")
    new = from_dict(config.LaunchConfig, {"backend": "slurm", "dist_backend": "nccl"}, "params:launch")
    assert (new.backend, new.dist_backend) == ("slurm", "nccl")
    with pytest.raises(ConfigError, match="params:launch.nproc_per_node=gpus with backend slurm needs "
                                          "params:launch.slurm.gpus_per_node"):  # the job's nodes, not this one's
        world_size(from_dict(config.LaunchConfig, {"backend": "slurm", "nproc_per_node": "gpus"}, "params:launch"),
                   gpus=lambda: 8)
