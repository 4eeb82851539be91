"""The evaluation report's ranking and its Markdown table (pure; used by the evaluation job and the Kedro node)."""

from __future__ import annotations


def rank_policies(policies: dict[str, dict]) -> list[str]:
    """Policy names, best first: higher sampled accuracy, then higher greedy accuracy, then lower KL to the reference.

    A metric a report lacks (``greedy: false``) does not decide; equal keys keep the report's order."""
    def key(name: str) -> tuple[float, float, float]:
        m = policies[name]
        return (-m["accuracy"], -m.get("greedy_accuracy", 0.0), m.get("kl_to_reference", 0.0))

    return sorted(policies, key=key)


TABLE_COLUMNS = {"accuracy": "accuracy (sampled)", "greedy_accuracy": "greedy accuracy",
                 "reward_model_score": "RM score", "kl_to_reference": "KL to reference",
                 "response_length": "length", "ended_with_eos": "EOS", "sft_val_perplexity": "SFT val ppl"}


def report_table(report: dict) -> str:
    """The ranked policies as a Markdown table (per-kind accuracies after the overall one), plus the RM line."""
    policies = report["policies"]
    order = report.get("ranking") or rank_policies(policies)
    first = policies[order[0]]
    kinds = sorted(k for k in first if k.startswith("accuracy_"))
    cols = [c for c in ["accuracy", *kinds, *list(TABLE_COLUMNS)[1:]] if c in first]
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
    ``<policy><sep>rank`` (the job logs them with "/", the Kedro node's MLflow run with ".")."""
    flat = {f"{name}{sep}{k}": v for name, m in report["policies"].items() for k, v in m.items()
            if isinstance(v, float)}
    flat.update({f"reward_model{sep}{k}": float(v) for k, v in report.get("reward_model", {}).items()})
    flat.update({f"{name}{sep}rank": float(i) for i, name in enumerate(report.get("ranking", []), 1)})
    return flat
