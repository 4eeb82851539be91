"""Evaluation gates: thresholds a stage's inputs or a policy's evaluation must meet before the DAG goes on.

* **Before an RL stage** (``ppo.gate`` / ``reinforce.gate``): the reward model's held-out accuracy (the final
  ``val_accuracy`` its training recorded in the checkpoint's meta.json) must reach ``min_reward_model_accuracy``.
  A miss raises :class:`GateFailed` in the node, before any process starts: Kedro stops the node and everything
  that depends on it, the CLI prints the one message (gate, threshold, value), and the MLflow hook tags the node's
  child run and the parent (``gate.failed``, ``gate.<gate>``).
* **Before promotion** (``evaluation.gate``): each policy other than the SFT reference passes when its sampled
  accuracy gains at least ``min_gain_over_sft`` over SFT and its KL to the reference is at most
  ``max_kl_to_reference``. The best policy passing every gate (the report's ranking) is *promoted*: the
  ``promoted_policy`` catalog entry names it (dataset, version, path), and the evaluation report shows pass/fail per
  gate.

Pure functions on plain dicts (no Kedro, no MLflow).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from align_pipeline.errors import UserError


class GateFailed(UserError):
    """A gate's threshold was not met: ``gate`` (its parameter name), ``threshold``, ``value``."""

    def __init__(self, gate: str, threshold: float, value: float | None, what: str):
        self.gate, self.threshold, self.value = gate, threshold, value
        shown = "missing" if value is None else f"{value:.4g}"
        super().__init__(f"gate {gate} failed: {what} is {shown}, the gate needs {threshold:g}; the dependent nodes "
                         "were not run")


@dataclass
class GateResult:
    gate: str
    """Parameter name, e.g. ``evaluation.gate.min_gain_over_sft``."""
    threshold: float
    value: float | None
    passed: bool

    def as_dict(self) -> dict[str, Any]:
        return {"gate": self.gate, "threshold": self.threshold, "value": self.value, "passed": self.passed}


def check_reward_model_gate(gate: str, threshold: float | None, meta: dict[str, Any], version: str) -> None:
    """Raise :class:`GateFailed` when the reward model's recorded ``val_accuracy`` is below ``threshold`` (None: no
    gate). ``meta``: the reward model checkpoint's meta.json; ``version``: its catalog version (for the message)."""
    if threshold is None:
        return
    value = (meta.get("metrics") or {}).get("val_accuracy")
    if value is None or value < threshold:
        raise GateFailed(gate, threshold, value, f"the held-out accuracy of reward model {version}")


def promotion(policies: dict[str, dict[str, float]], ranking: list[str], reference: str | None,
              min_gain_over_sft: float | None, max_kl_to_reference: float | None
              ) -> tuple[dict[str, list[GateResult]], str | None]:
    """Per policy other than ``reference``: its gate results; and the promoted policy (the first of ``ranking`` that
    passes every gate; None when none does). Without a reference the gain gate cannot be measured and fails."""
    base = policies.get(reference, {}).get("accuracy") if reference else None
    results: dict[str, list[GateResult]] = {}
    for name in ranking:
        if name == reference:
            continue
        metrics, checks = policies[name], []
        if min_gain_over_sft is not None:
            acc = metrics.get("accuracy")
            gain = None if acc is None or base is None else acc - base
            checks.append(GateResult("evaluation.gate.min_gain_over_sft", min_gain_over_sft, gain,
                                     gain is not None and gain >= min_gain_over_sft))
        if max_kl_to_reference is not None:
            kl = metrics.get("kl_to_reference")
            checks.append(GateResult("evaluation.gate.max_kl_to_reference", max_kl_to_reference, kl,
                                     kl is not None and kl <= max_kl_to_reference))
        results[name] = checks
    promoted = next((n for n in ranking if n in results and all(c.passed for c in results[n])), None)
    return results, promoted


def gates_markdown(results: dict[str, list[GateResult]], promoted: str | None) -> str:
    """The report's gate section: pass/fail per policy and gate, and the promoted policy."""
    lines = ["## Gates", ""]
    rows = [(name, r) for name, checks in results.items() for r in checks]
    if rows:
        lines += ["| policy | gate | threshold | value | result |", "|---|---|---|---|---|"]
        lines += [f"| {name} | {r.gate} | {r.threshold:g} | {'—' if r.value is None else f'{r.value:.4g}'} | "
                  f"{'pass' if r.passed else 'FAIL'} |" for name, r in rows]
    else:
        lines.append("No promotion gates configured (evaluation.gate): every policy passes.")
    lines += ["", f"Promoted: **{promoted}**" if promoted else "Promoted: none (no policy passed its gates)", ""]
    return "\n".join(lines)


__all__ = ["GateFailed", "GateResult", "check_reward_model_gate", "gates_markdown", "promotion"]
