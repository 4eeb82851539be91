"""``kedro run``'s pipeline, node and tag names are checked against the project's registered pipelines before Kedro
starts a session (the real registry; the CLI itself: tests/faults/test_cli_errors.py)."""

from __future__ import annotations

import pytest

from align_pipeline.cli import check_selection
from align_pipeline.errors import UserError
from align_pipeline.pipeline_registry import register_pipelines


@pytest.fixture(scope="module")
def registry():
    return register_pipelines()


def _check(registry, pipelines=(), tags=(), **nodes):
    check_selection(registry, pipelines, {f"--{k.replace('_', '-')}": v for k, v in nodes.items()}, tags)


def test_known_names_pass(registry):
    _check(registry, ["data_prep", "sft"], tags=["sft"], nodes=["train_sft"], from_nodes=["fit_tokenizer"])
    _check(registry, ["__default__"], to_nodes=["train_dpo"])
    _check(registry, [], nodes=["train_dpo", "compute_reference_logps"])  # the default pipeline


@pytest.mark.parametrize(
    "pipelines, tags, nodes, message",
    [
        (["rlhff"], [], {}, "--pipelines: unknown pipeline 'rlhff' (did you mean 'rlhf'?); pipelines: data_prep, "),
        ([], [], {"from_nodes": ["train_dpo", "trian_sft"]},
         "--from-nodes: unknown node 'trian_sft' (did you mean 'train_sft'?); nodes of the default pipeline: "),
        (["sft"], [], {"to_nodes": ["train_dpo"]},
         ("--to-nodes: no node 'train_dpo' in pipeline sft; it is in pipelines dpo, dpo_evaluation, dpo_flow, "
          "__default__ (add --pipelines dpo)")),
        ([], [], {"nodes": ["export_sft_policy"]},
         ("--nodes: no node 'export_sft_policy' in the default pipeline; it is in pipeline export (add --pipelines "
          "export)")),
        ([], ["dpoo"], {},
         ("--tags: unknown tag 'dpoo' (did you mean 'dpo'?); tags of the default pipeline: data_prep, dpo, "
          "evaluation, ppo, reinforce, reward_model, sft")),
        (["sft", "dpo"], ["ppo"], {},
         "--tags: no tag 'ppo' in pipelines sft, dpo; it is in pipelines ppo, rlhf, __default__ (add --pipelines ppo)"),
    ],
)  # fmt: skip
def test_unknown_names_are_one_line_with_the_closest_ones(registry, pipelines, tags, nodes, message):
    with pytest.raises(UserError) as excinfo:
        _check(registry, pipelines, tags, **nodes)
    assert str(excinfo.value).startswith(message) and "\n" not in str(excinfo.value)
