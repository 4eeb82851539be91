"""The evaluation report's ranking and table (pure functions, hand-made reports)."""

from __future__ import annotations

from align_pipeline.evaluation.report import UNGROUPED, group_labels, group_means, rank_policies, report_table


def _m(acc: float, greedy: float | None = None, kl: float = 0.0) -> dict:
    m = {"accuracy": acc, "accuracy_add": acc + 0.1, "kl_to_reference": kl, "response_length": 4.0}
    if greedy is not None:
        m["greedy_accuracy"] = greedy
    return m


def test_rank_by_sampled_accuracy_then_greedy_then_lower_kl():
    policies = {
        "sft": _m(0.21, 0.58, 0.0),
        "dpo": _m(0.30, 0.72, 0.07),
        "ppo": _m(0.46, 0.65, 0.27),   # ties with reinforce on sampled accuracy, loses on greedy (0.65 < 0.68)
        "reinforce": _m(0.46, 0.68, 0.33),
        "rloo": _m(0.30, 0.72, 0.05),  # ties with dpo on both accuracies, wins on the lower KL (0.05 < 0.07)
    }
    assert rank_policies(policies) == ["reinforce", "ppo", "rloo", "dpo", "sft"]


def test_missing_greedy_does_not_decide_and_ties_keep_report_order():
    policies = {"a": _m(0.5), "b": _m(0.5), "c": _m(0.6)}
    assert rank_policies(policies) == ["c", "a", "b"]


def test_table_lists_policies_in_rank_order_with_kind_columns_and_rm_line():
    report = {"policies": {"sft": _m(0.2, 0.5), "dpo": _m(0.3, 0.7, 0.07)},
              "reward_model": {"accuracy": 0.665, "mean_margin": 0.4, "pairs": 200}}
    report["ranking"] = rank_policies(report["policies"])
    lines = report_table(report).splitlines()
    assert lines[0] == ("| rank | policy | accuracy (sampled) | accuracy add | greedy accuracy | KL to reference "
                        "| length |")
    assert lines[2] == "| 1 | dpo | 0.300 | 0.400 | 0.700 | 0.070 | 4.000 |"
    assert lines[3] == "| 2 | sft | 0.200 | 0.300 | 0.500 | 0.000 | 4.000 |"
    assert lines[-1] == "Reward model accuracy on 200 held-out pairs: 0.665"


def test_without_reward_functions_the_reward_model_score_ranks():
    policies = {"sft": {"reward_model_score": 0.1, "kl_to_reference": 0.0},
                "ppo": {"reward_model_score": 0.9, "kl_to_reference": 0.3},
                "dpo": {"reward_model_score": 0.9, "kl_to_reference": 0.1}}
    assert rank_policies(policies) == ["dpo", "ppo", "sft"]
    report = {"policies": policies, "ranking": rank_policies(policies)}
    lines = report_table(report).splitlines()
    assert lines[0] == "| rank | policy | RM score | KL to reference |"
    assert lines[2] == "| 1 | dpo | 0.900 | 0.100 |"


def test_group_labels_come_from_a_record_field_not_the_prompt_text():
    records = [{"prompt": "add: 1+2", "category": "add"}, {"prompt": "reverse: ab", "category": "reverse"},
               {"prompt": "x: y", "category": "Number Theory/2"}, {"prompt": "q", "category": None}, {"prompt": "r"}]
    assert group_labels(records, "category") == ["add", "reverse", "Number_Theory_2", UNGROUPED, UNGROUPED]
    assert group_labels(records, None) is None
    assert group_labels(records, "level") is None  # no record has it: no breakdown (not one "ungrouped" group)
    assert group_labels([{"prompt": "p", "level": 3}], "level") == ["3"]


def test_group_means():
    assert group_means([1.0, 0.0, 1.0, 1.0], ["b", "a", "b", "a"], "accuracy") == {"accuracy_a": 0.5,
                                                                                   "accuracy_b": 1.0}
