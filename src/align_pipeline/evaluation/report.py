"""The evaluation report's ranking, its Markdown table and its per-group split (pure; used by the evaluation job and
the Kedro node)."""

from __future__ import annotations

from typing import Any

from align_pipeline.rewards.base import metric_key

PRIMARY_METRICS = ("accuracy", "reward_model_score")
"""What ranks the policies first, the first of these a report has: sampled accuracy (there are reward functions,
hence an accuracy function), else the reward model's score (reward-model-only evaluation)."""

UNGROUPED = "ungrouped"
"""The group of a prompt record that lacks the ``evaluation.group_by`` field."""


def rank_policies(policies: dict[str, dict]) -> list[str]:
    """Policy names, best first: higher sampled accuracy (without reward functions: the reward model's score, see
    :data:`PRIMARY_METRICS`), then higher greedy accuracy, then lower KL to the reference.

    A metric a report lacks (``greedy: false``) does not decide; equal keys keep the report's order."""
    def key(name: str) -> tuple[float, float, float]:
        m = policies[name]
        primary = next((m[k] for k in PRIMARY_METRICS if k in m), 0.0)
        return (-primary, -m.get("greedy_accuracy", 0.0), m.get("kl_to_reference", 0.0))

    return sorted(policies, key=key)


def group_labels(records: list[dict[str, Any]], field: str | None) -> list[str] | None:
    """Each record's group under ``evaluation.group_by = field``: its value of ``field`` as a metric-name piece
    (``"add"``, ``"algebra"``; other characters than letters, digits, ``_.-`` become ``_``), :data:`UNGROUPED` for a
    record without it (absent or null). None (no breakdown) when ``field`` is None or no record has it."""
    if field is None or all(r.get(field) is None for r in records):
        return None
    return [UNGROUPED if r.get(field) is None else metric_key(str(r[field])) for r in records]


def group_means(values, labels: list[str], prefix: str) -> dict[str, float]:
    """``{f"{prefix}_{group}": mean of values in group}`` for each group of ``labels`` (parallel to ``values``), in
    sorted group order."""
    out: dict[str, float] = {}
    for group in sorted(set(labels)):
        picked = [float(v) for v, label in zip(values, labels, strict=True) if label == group]
        out[f"{prefix}_{group}"] = sum(picked) / len(picked)
    return out


TABLE_COLUMNS = {"accuracy": "accuracy (sampled)", "greedy_accuracy": "greedy accuracy",
                 "reward_model_score": "RM score", "kl_to_reference": "KL to reference",
                 "response_length": "length", "ended_with_eos": "EOS", "sft_val_perplexity": "SFT val ppl"}


def report_table(report: dict) -> str:
    """The ranked policies as a Markdown table (per-group accuracies after the overall one), plus the RM line."""
    policies = report["policies"]
    order = report.get("ranking") or rank_policies(policies)
    first = policies[order[0]]
    groups = sorted(k for k in first if k.startswith("accuracy_"))
    cols = [c for c in ["accuracy", *groups, *list(TABLE_COLUMNS)[1:]] if c in first]
    head = ["rank", "policy", *(TABLE_COLUMNS.get(c, c.replace("accuracy_", "accuracy ")) for c in cols)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, name in enumerate(order, 1):
        vals = [f"{policies[name][c]:.3f}" if isinstance(policies[name].get(c), float) else "" for c in cols]
        lines.append("| " + " | ".join([str(i), name, *vals]) + " |")
    if "reward_model" in report:
        rm = report["reward_model"]
        lines.append(f"\nReward model accuracy on {rm['pairs']} held-out pairs: {rm['accuracy']:.3f}")
    return "\n".join(lines)


def flat_metrics(report: dict, sep: str = "/") -> dict[str, float]:
    """The report's numbers as flat metric names: ``<policy><sep><metric>``, ``reward_model<sep><metric>`` and
    ``<policy><sep>rank``."""
    flat = {f"{name}{sep}{k}": float(v) for name, m in report["policies"].items() for k, v in m.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}  # counts too (samples, prompts)
    flat.update({f"reward_model{sep}{k}": float(v) for k, v in report.get("reward_model", {}).items()})
    flat.update({f"{name}{sep}rank": float(i) for i, name in enumerate(report.get("ranking", []), 1)})
    return flat
