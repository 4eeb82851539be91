"""Built-in environments (``env.name: align_pipeline.envs.builtin:<Class>``).

* :class:`Calculator` - tool calling: the policy may call a ``calculator`` tool (in the Hermes / Qwen format
  ``<tool_call>{"name": "calculator", "arguments": {"expression": "12 + 30"}}</tool_call>``, or a bare JSON object
  ``{"name": ..., "arguments" | "parameters": ...}`` as Llama 3.1 writes it), gets the value back as a ``tool`` turn,
  and finishes with an answer, scored by a reward function (``check``, default ``math_answer``).
* :class:`StepVerifier` - multi-step answers with partial credit: the record's ``steps`` are the expected answer of
  each turn; each correct turn earns ``1 / len(steps)`` and the next prompt, a wrong one ends the episode.

Both are pure functions of (messages, record), as the protocol asks (:mod:`.base`). The calculator evaluates
arithmetic itself (numbers, + - * / // % **, parentheses, unary signs; bounded sizes): never ``eval``.
"""

from __future__ import annotations

import ast
import json
import math
import operator
import re
from typing import Any

from align_pipeline.config.reward_spec import load_reward_function
from align_pipeline.data.chat import prompt_messages
from align_pipeline.envs.base import Environment, Step
from align_pipeline.rewards.base import call

CALCULATOR_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression (numbers, + - * / // % **, parentheses).",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]},
    },
}

_TAGGED = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
MAX_EXPRESSION = 200
"""Characters of an expression at most."""
MAX_MAGNITUDE = 1e100
"""Largest |value| of an intermediate result."""


class ToolCallError(ValueError):
    """A tool call that cannot be parsed or run: its message is the tool's answer."""


def parse_tool_calls(text: str) -> list[tuple[str, dict[str, Any]]]:
    """The tool calls of a policy turn: every ``<tool_call>...</tool_call>`` block, else the whole turn when it is a
    JSON object with a ``name``; [] when the turn makes none. A block that is not a call raises
    :class:`ToolCallError`."""
    blocks = _TAGGED.findall(text)
    if not blocks:
        stripped = text.strip()
        if not (stripped.startswith("{") and stripped.endswith("}") and '"name"' in stripped):
            return []
        blocks = [stripped]
    calls = []
    for block in blocks:
        try:
            obj = json.loads(block)
        except json.JSONDecodeError as exc:
            raise ToolCallError(f"error: the tool call is not JSON ({exc.msg})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            raise ToolCallError('error: a tool call is {"name": ..., "arguments": {...}}')
        arguments = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(arguments, str):  # OpenAI's wire format: the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                raise ToolCallError("error: the arguments are not a JSON object") from None
        if not isinstance(arguments, dict):
            raise ToolCallError("error: the arguments are not a JSON object")
        calls.append((obj["name"], arguments))
    return calls


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression; :class:`ToolCallError` for anything else (names, calls, attributes,
    a division by zero, a result beyond 1e100)."""
    if not isinstance(expression, str) or not expression.strip():
        raise ToolCallError("error: expression must be a non-empty string")
    if len(expression) > MAX_EXPRESSION:
        raise ToolCallError(f"error: expression longer than {MAX_EXPRESSION} characters")
    try:
        tree = ast.parse(expression.replace("^", "**").replace("×", "*").replace("÷", "/"), mode="eval")
    except SyntaxError:
        raise ToolCallError(f"error: cannot parse {expression!r}") from None
    return _value(tree.body)


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        value = node.value
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _value(node.operand)
        value = -value if isinstance(node.op, ast.USub) else value
    elif isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > 64 or abs(left) > 1e6):
            raise ToolCallError("error: power too large")
        try:
            value = _OPS[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ToolCallError("error: division by zero") from None
        except OverflowError:
            raise ToolCallError("error: result too large") from None
    else:
        raise ToolCallError("error: only numbers, + - * / // % ** and parentheses are allowed")
    if isinstance(value, complex) or not math.isfinite(value) or abs(value) > MAX_MAGNITUDE:
        raise ToolCallError("error: result too large or not a real number")
    return value


def format_number(value: float) -> str:
    """``42``, ``0.5``, ``3.333333333333`` (12 significant digits; integral floats without ``.0``)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value) if isinstance(value, int) else format(value, ".12g")


def _opening(prompt: str | list[dict[str, Any]], system: str | None) -> list[dict[str, Any]]:
    """The record's prompt as the episode's first messages (:func:`~align_pipeline.data.chat.prompt_messages`), with
    ``system`` first when the messages have no system turn of their own."""
    messages = prompt_messages(prompt, system)
    if system and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system})
    return messages


class Calculator(Environment):
    """Tool calling with a calculator (module docstring). Config:

    * ``system``: a system message put first (none by default);
    * ``max_calls`` (3): calls per episode; one more ends the episode unanswered (reward 0);
    * ``check`` (``align_pipeline.rewards:math_answer``): the reward function that scores the final answer against
      the record (>= 1 = correct);
    * ``call_reward`` (0.0): reward of each turn whose calls all ran (a shaping bonus for using the tool well);
    * ``call_format`` (``json``): ``json`` = the tool calls above, the tool's schema given to the chat template,
      answers as ``tool`` turns; ``plain`` = for a model without a chat template (the embedded demo's): a turn that
      is exactly ``<tool_name>(<expression>)`` is a call, answered by a ``user`` turn ``=<value>`` and a newline;
    * ``tool_name`` (``calculator``): the name a ``plain`` call uses (e.g. ``calc``: ``calc(57+68)``).

    A turn without a tool call is the final answer: the episode ends with the check's value and ``info["correct"]``,
    ``info["calls"]`` (the calls made)."""

    def __init__(self, system: str | None = None, max_calls: int = 3, check: str = "align_pipeline.rewards:math_answer",
                 call_reward: float = 0.0, call_format: str = "json", tool_name: str = "calculator") -> None:
        super().__init__(system=system, max_calls=max_calls, check=check, call_reward=call_reward,
                         call_format=call_format, tool_name=tool_name)
        if call_format not in ("json", "plain"):
            raise ValueError(f"call_format must be 'json' or 'plain', got {call_format!r}")
        if not re.fullmatch(r"[A-Za-z_]\w*", tool_name or ""):
            raise ValueError(f"tool_name must be an identifier, got {tool_name!r}")
        self.system, self.max_calls, self.call_reward = system, int(max_calls), float(call_reward)
        self.plain = call_format == "plain"
        self.plain_call = re.compile(rf"\s*{tool_name}\((.*)\)\s*", re.DOTALL)
        self.check_spec = check
        self.check = load_reward_function(check, "env.config.check")

    def reset(self, record: dict[str, Any]) -> dict[str, Any] | list[dict[str, Any]]:
        if self.plain:
            return _opening(record["prompt"], self.system)
        return {"messages": _opening(record["prompt"], self.system), "tools": [CALCULATOR_TOOL]}

    def _answer(self, content: str) -> dict[str, str]:
        return {"role": "user", "content": f"={content}\n"} if self.plain else {"role": "tool", "content": content}

    def _calls(self, text: str) -> list[tuple[str, dict[str, Any]]]:
        if not self.plain:
            return parse_tool_calls(text)
        call = self.plain_call.fullmatch(text)
        return [("calculator", {"expression": call.group(1)})] if call else []

    def step(self, messages: list[dict[str, Any]], record: dict[str, Any]) -> Step:
        text = messages[-1]["content"] or ""
        made = sum(m["role"] == "tool" for m in messages) if not self.plain else \
            sum(m["role"] == "assistant" for m in messages) - 1  # every earlier policy turn was a call
        try:
            calls = self._calls(text)
        except ToolCallError as exc:
            return Step([self._answer(str(exc))], 0.0, False, {})
        if not calls:
            value = call(self.check, self.check_spec, record["prompt"], text, record)
            return Step([], value, True, {"correct": value >= 1.0, "calls": made})
        if made + len(calls) > self.max_calls:
            return Step([], 0.0, True, {"correct": False, "calls": made, "reason": "too many tool calls"})
        answers, ran = [], 0
        for name, arguments in calls:
            try:
                if name != "calculator":
                    raise ToolCallError(f"error: unknown tool {name!r} (the tool is 'calculator')")
                answers.append(self._answer(format_number(evaluate(arguments.get("expression")))))
                ran += 1
            except ToolCallError as exc:
                answers.append(self._answer(str(exc)))
        return Step(answers, self.call_reward if ran == len(calls) else 0.0, False, {})


class StepVerifier(Environment):
    """Multi-step answers with partial credit. The record's ``steps`` (a list of expected answers, one per turn)
    are checked in order: a turn whose answer matches the next step (``math_answer``'s comparison: numbers by
    value, text squashed) earns ``1 / len(steps)`` and gets ``next_prompt``; a wrong turn ends the episode with what
    it earned; the last step right ends it with ``info["correct"]`` True. Config: ``system``, ``next_prompt``
    ("Correct. Next step.")."""

    required_fields = ("steps",)

    def __init__(self, system: str | None = None, next_prompt: str = "Correct. Next step.") -> None:
        super().__init__(system=system, next_prompt=next_prompt)
        self.system, self.next_prompt = system, next_prompt

    def reset(self, record: dict[str, Any]) -> list[dict[str, Any]]:
        steps = record.get("steps")
        if not isinstance(steps, list) or not steps:
            raise ValueError('StepVerifier needs a non-empty list "steps" in each prompt record')
        return _opening(record["prompt"], self.system)

    def step(self, messages: list[dict[str, Any]], record: dict[str, Any]) -> Step:
        from align_pipeline.rewards.math_answers import answers_match, final_answer, reference_answer

        steps = record["steps"]
        turn = sum(m["role"] == "assistant" for m in messages)  # 1-based: this turn answers steps[turn - 1]
        said = messages[-1]["content"] or ""
        right = answers_match(final_answer(said) or said.strip(), reference_answer(steps[turn - 1]))
        if not right:
            return Step([], 0.0, True, {"correct": False, "steps_right": turn - 1})
        if turn == len(steps):
            return Step([], 1.0 / len(steps), True, {"correct": True, "steps_right": turn})
        return Step([{"role": "user", "content": self.next_prompt}], 1.0 / len(steps), False, {})


__all__ = ["CALCULATOR_TOOL", "Calculator", "StepVerifier", "ToolCallError", "evaluate", "format_number",
           "parse_tool_calls"]
