"""Prompt records against the reward functions configured to score them: every field a function needs is there.

:func:`check_prompts` runs in ``data_prep`` on the raw prompt file (before anything is tokenized or trained);
:func:`check_records` runs in every job that scores responses, on the tokenized prompts it reads.
"""

from __future__ import annotations

from typing import Any

from align_pipeline.config.base import from_dict
from align_pipeline.config.common import RewardConfig, ScoringConfig
from align_pipeline.data.errors import make_error
from align_pipeline.rewards.base import RewardFunctions, Term

SCORING_SECTIONS: dict[str, type[ScoringConfig]] = {
    "ppo": RewardConfig,
    "reinforce": RewardConfig,
    "distill": RewardConfig,
    "evaluation": ScoringConfig,
}
"""The stages that score responses with reward functions -> the type of their ``reward`` subsection."""


def stage_reward_functions(stage_params: dict[str, dict[str, Any] | None]) -> list[RewardFunctions]:
    """The reward functions of each stage in ``stage_params`` (stage -> its raw ``params:<stage>`` dict), loaded
    and validated: a bad spec is a ``ConfigError`` naming ``params:<stage>.reward.functions[i].name``."""
    loaded = []
    for stage, params in stage_params.items():
        if stage not in SCORING_SECTIONS:
            raise ValueError(f"stage {stage!r} does not score with reward functions (known: {sorted(SCORING_SECTIONS)})")
        key = f"params:{stage}.reward"
        # A section without ``reward`` gets the dataclass defaults, as when the stage's section is built.
        scoring = from_dict(SCORING_SECTIONS[stage], (params or {}).get("reward"), key)
        loaded.append(RewardFunctions.load(scoring, key))
    return loaded


def _needed_by(terms: list[Term]) -> str:
    names = " and ".join(f"{t.spec} ({t.where})" for t in terms)
    return f"the reward function{'s' if len(terms) > 1 else ''} {names} need{'' if len(terms) > 1 else 's'} it"


def _check(records: list[dict[str, Any]], lines: list[int], source: str, functions: list[RewardFunctions],
           unit: str = "line") -> None:
    needs: dict[str, list[Term]] = {}
    for rf in functions:
        for name, terms in rf.requirements().items():
            needs.setdefault(name, []).extend(terms)
    if not needs:
        return
    for record, line in zip(records, lines, strict=True):
        for name, terms in needs.items():
            if record.get(name) is None:
                state = "null" if name in record else "missing"
                raise make_error(source, line, name, f"{state}, but {_needed_by(terms)}", unit)


def check_prompts(records: list[dict[str, Any]], lines: list[int], source: str,
                  stage_params: dict[str, dict[str, Any]], unit: str = "line") -> None:
    """Refuse the first raw prompt record that lacks (or has null for) a field that a configured reward function
    needs (its ``required_fields``).

    ``records`` / ``lines``: the raw prompt file's records and their 1-based line (``unit``: or row) numbers;
    ``source``: the file as
    shown in messages; ``stage_params``: ``{"ppo": params_ppo, "reinforce": ..., "evaluation": ...}``, the raw
    parameter dicts of the stages that will score these prompts (any subset). Raises
    :class:`~align_pipeline.data.schemas.DataValidationError` naming file, line, field, and the function and
    parameter key (hence the stage) that needs it, e.g. ``data/01_raw/prompts.jsonl line 3: field "answer":
    missing, but the reward function align_pipeline.rewards:math_answer (params:ppo.reward.functions[0]) needs
    it``; a bad function spec raises :class:`~align_pipeline.config.ConfigError` naming its key.
    """
    _check(records, lines, source, stage_reward_functions(stage_params), unit)


def check_records(records: list[dict[str, Any]], source: str, functions: RewardFunctions) -> None:
    """The same check on the records of a tokenized prompts ``.jsonl`` (one record per line) a job scores."""
    _check(records, list(range(1, len(records) + 1)), source, [functions])
