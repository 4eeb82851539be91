"""Raw-data layouts of TRL, OpenAI and veRL next to NeMo-Aligner's, detected per record and normalized into the
records the rest of data_prep reads (:mod:`.schemas` lists them all).

Chat messages (OpenAI / TRL conversational): ``[{"role": "system" | "user" | "assistant" | "tool", "content": str,
"tool_calls"?: [...], "tool_call_id"?: str, "name"?: str, "reasoning_content"?: str}, ...]``. ``content`` is required,
except on an assistant message that makes ``tool_calls`` (then it may be null, empty or absent). A tool call is
``{"type"?: "function", "id"?: str, "function": {"name": str, "arguments": object | str}}``. A ``system`` message
comes first or not at all; a ``tool`` message answers an earlier assistant ``tool_calls``.

Layouts (name: record -> what data_prep reads):

* SFT ``messages``: ``{"messages": [...], "tools"?: [function schemas]}`` -> kept: the messages go through the chat
  template (``tools`` passed to it as transformers' ``apply_chat_template(tools=...)`` does), the loss on every
  assistant turn.
* Preference ``trl_explicit``: ``{"prompt", "chosen", "rejected"}``, all three message lists (the completions: the
  assistant turn(s) after the prompt) or all three strings; ``score_chosen`` / ``score_rejected`` (numbers) become the
  pair's rewards. ``trl_implicit``: ``{"chosen", "rejected"}`` alone, two whole conversations (or texts) sharing a
  prefix: the prompt is their longest common prefix of messages (of text, cut back to a whitespace). Both become
  ``{"prompt", "chosen_response", "rejected_response"}`` with list or string values.
* Prompts ``prompt_messages``: ``{"prompt": [...messages], ...}`` (the string form is the NeMo/TRL ``prompt``
  layout); ``verl``: veRL's parquet rows ``{"data_source", "prompt": [...messages], "ability"?, "reward_model":
  {"style"?, "ground_truth"}, "extra_info"?}``. Every field is kept and reaches the reward functions (which get the
  record's ``prompt`` as it is: a string or the messages); the answer the built-in checkers compare with is
  ``answer``, taken from ``ground_truth`` or veRL's ``reward_model.ground_truth`` when the record has none.

As in TRL, the string forms of the TRL preference layouts are tokenized verbatim (no chat template): the texts are
what the model reads; message lists always go through the template. Other top-level fields of a TRL or veRL record
(ids, sources) are ignored for SFT and preference data and kept for prompts.
"""

from __future__ import annotations

import json
from typing import Any

ROLES = ("system", "user", "assistant", "tool")
MESSAGE_FIELDS = {"role", "content", "tool_calls", "tool_call_id", "name", "reasoning_content"}
TOOL_CALL_FIELDS = {"type", "id", "function"}

LAYOUTS: dict[str, tuple[str, ...]] = {
    "sft": ("nemo", "messages"),
    "preference": ("nemo", "nemo_text", "trl_explicit", "trl_implicit"),
    "prompts": ("prompt", "prompt_messages", "nemo_text", "verl"),
    "regression": ("regression",),
}
"""Every layout of each kind, the NeMo-Aligner ones first (``data_prep.layouts.<kind>`` may name one, or ``auto``)."""

VERBATIM = {"trl_explicit", "trl_implicit"}
"""Layouts whose string forms are tokenized without the chat template (their message forms use it)."""


class LayoutError(Exception):
    """A record does not match its layout: ``fieldname`` (dotted path, or None for the whole record), ``problem``."""

    def __init__(self, fieldname: str | None, problem: str):
        super().__init__(problem)
        self.fieldname = fieldname
        self.problem = problem


def type_name(value: Any) -> str:
    names = {str: "string", int: "int", float: "float", bool: "bool", list: "list", dict: "object",
             type(None): "null"}
    return names.get(type(value), type(value).__name__)


def detect(obj: Any, kind: str) -> str | None:
    """The layout a record's keys say it is in, or None when they name none (then the file's layout checks it)."""
    if not isinstance(obj, dict):
        return None
    keys = obj.keys()
    if kind == "sft":
        if "messages" in keys:
            return "messages"
        return "nemo" if {"conversations", "input", "output"} & keys else None
    if kind == "preference":
        if set(keys) == {"text"}:
            return "nemo_text"
        if {"chosen_response", "rejected_response"} & keys:
            return "nemo"
        if {"chosen", "rejected"} & keys:
            return "trl_explicit" if "prompt" in keys else "trl_implicit"
        return "nemo" if "prompt" in keys else None
    if kind == "prompts":
        if isinstance(obj.get("reward_model"), dict) and isinstance(obj.get("prompt"), list):
            return "verl"
        if "prompt" in keys:
            return "prompt_messages" if isinstance(obj["prompt"], list) else "prompt"
        return "nemo_text" if "text" in keys else None
    return kind if kind == "regression" else None


# ---------------------------------------------------------------------------------------------------------------
# Messages
# ---------------------------------------------------------------------------------------------------------------


def check_messages(messages: Any, where: str, *, need_assistant: bool = False, prompt: bool = False) -> None:
    """Raise :class:`LayoutError` naming the first problem of a message list (``where``: its field, e.g.
    ``messages`` or ``chosen``). ``need_assistant``: at least one assistant turn (something to train on);
    ``prompt``: a conversation a response is generated after (it must not end with an assistant turn)."""
    if not isinstance(messages, list):
        raise LayoutError(where, f"expected a list of messages, got {type_name(messages)}")
    if not messages:
        raise LayoutError(where, "empty list of messages")
    calls: set[str] = set()
    pending_calls = 0
    for i, message in enumerate(messages):
        at = f"{where}[{i}]"
        _known_object(message, at, 'a message {"role", "content"}', MESSAGE_FIELDS, "message")
        role = message.get("role")
        if role is None:
            raise LayoutError(f"{at}.role", "missing (required)")
        if role not in ROLES:
            raise LayoutError(f"{at}.role", f"expected one of {', '.join(ROLES)}, got {role!r}")
        if role == "system" and i:
            raise LayoutError(f"{at}.role", "a system message comes first or not at all")
        tool_calls = message.get("tool_calls")
        if tool_calls is not None:
            if role != "assistant":
                raise LayoutError(f"{at}.tool_calls", f"only an assistant message makes tool calls, not {role!r}")
            _check_tool_calls(tool_calls, f"{at}.tool_calls")
            calls.update(str(c.get("id")) for c in tool_calls if c.get("id") is not None)
            pending_calls += len(tool_calls)
        content = message.get("content")
        if tool_calls and content is None:
            pass  # an assistant turn that only calls tools
        elif "content" not in message:
            raise LayoutError(f"{at}.content", "missing (required)")
        elif not isinstance(content, str):
            raise LayoutError(f"{at}.content", f"expected a string, got {type_name(content)}")
        for key in ("name", "tool_call_id", "reasoning_content"):
            if message.get(key) is not None and not isinstance(message[key], str):
                raise LayoutError(f"{at}.{key}", f"expected a string, got {type_name(message[key])}")
        if role == "tool":
            if not pending_calls:
                raise LayoutError(f"{at}.role", "a tool message answers an assistant's tool_calls; none is open")
            pending_calls -= 1
            call_id = message.get("tool_call_id")
            if call_id is not None and calls and call_id not in calls:
                raise LayoutError(f"{at}.tool_call_id", f"{call_id!r} names no earlier tool call")
        elif role != "assistant":
            pending_calls = 0
    if need_assistant and not any(m["role"] == "assistant" for m in messages):
        raise LayoutError(where, "no assistant message (nothing to train on)")
    if prompt and messages[-1]["role"] == "assistant":
        raise LayoutError(f"{where}[{len(messages) - 1}].role",
                          "the prompt ends with an assistant message: nothing is left for the policy to answer")


def _known_object(value: Any, at: str, expected: str, allowed: set[str], what: str) -> None:
    """Refuse (:class:`LayoutError` at ``at``) a value that is not an object, or one with a field not in
    ``allowed``."""
    if not isinstance(value, dict):
        raise LayoutError(at, f"expected {expected}, got {type_name(value)}")
    extra = [k for k in value if k not in allowed]
    if extra:
        raise LayoutError(f"{at}.{extra[0]}", f"unknown {what} field (allowed: {', '.join(sorted(allowed))})")


def _check_tool_calls(calls: Any, where: str) -> None:
    if not isinstance(calls, list) or not calls:
        raise LayoutError(where, f"expected a non-empty list of tool calls, got {type_name(calls)}")
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        _known_object(call, at, '{"type": "function", "function": {...}}', TOOL_CALL_FIELDS, "tool-call")
        if call.get("type", "function") != "function":
            raise LayoutError(f"{at}.type", f'expected "function", got {call["type"]!r}')
        function = call.get("function")
        if not isinstance(function, dict):
            raise LayoutError(f"{at}.function", f'expected {{"name", "arguments"}}, got {type_name(function)}')
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise LayoutError(f"{at}.function.name", "missing or not a non-empty string")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as exc:
                raise LayoutError(f"{at}.function.arguments", f"not valid JSON ({exc.msg})") from None
            except RecursionError:
                raise LayoutError(f"{at}.function.arguments", "JSON nested too deeply") from None
        if not isinstance(arguments, dict):
            raise LayoutError(f"{at}.function.arguments", f"expected an object, got {type_name(arguments)}")


def _check_tools(tools: Any) -> None:
    if not isinstance(tools, list):
        raise LayoutError("tools", f"expected a list of tool (function) schemas, got {type_name(tools)}")
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise LayoutError(f"tools[{i}]", f"expected an object (a JSON schema of a function), got {type_name(tool)}")


OPTIONAL_FIELDS = ("tool_calls", "tool_call_id", "name", "reasoning_content")


def normalize_tool_calls(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as chat templates take them: optional fields that are null left out (a table gives every
    message every field its file uses; templates test ``'tool_calls' in message``), and every tool call's
    ``arguments`` as an object (templates render them with ``tojson``; OpenAI's wire format sends a JSON string)
    with ``type`` set."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if not (k in OPTIONAL_FIELDS and v is None)}
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                function = dict(c["function"])
                if isinstance(function.get("arguments"), str):
                    function["arguments"] = json.loads(function["arguments"])
                function.setdefault("arguments", {})
                calls.append({**c, "type": "function", "function": function})
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out


# ---------------------------------------------------------------------------------------------------------------
# Layouts
# ---------------------------------------------------------------------------------------------------------------


def normalize(obj: dict[str, Any], kind: str, layout: str) -> dict[str, Any]:
    """Check a record of a TRL / OpenAI / veRL ``layout`` (:class:`LayoutError` on the first problem) and return it
    as data_prep reads it (see the module docstring)."""
    if kind == "sft" and layout == "messages":
        check_messages(obj.get("messages"), "messages", need_assistant=True)
        record = {"messages": normalize_tool_calls(obj["messages"])}
        if obj.get("tools") is not None:
            _check_tools(obj["tools"])
            record["tools"] = obj["tools"]
        return record
    if kind == "preference" and layout == "trl_explicit":
        return _explicit(obj)
    if kind == "preference" and layout == "trl_implicit":
        return _implicit(obj)
    if kind == "prompts" and layout in ("prompt_messages", "verl"):
        return _prompt_record(obj, layout)
    raise ValueError(f"no layout {layout!r} for {kind} records")


def _scores(obj: dict[str, Any]) -> dict[str, float]:
    out = {}
    for side in ("chosen", "rejected"):
        value = obj.get(f"score_{side}")
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise LayoutError(f"score_{side}", f"expected a number, got {type_name(value)}")
        out[f"{side}_reward"] = float(value)
    return out


def _require(obj: dict[str, Any], *keys: str) -> None:
    for key in keys:
        if key not in obj or obj[key] is None:
            raise LayoutError(key, "missing (required)")


def _explicit(obj: dict[str, Any]) -> dict[str, Any]:
    _require(obj, "prompt", "chosen", "rejected")
    conversational = isinstance(obj["prompt"], list)
    for key in ("prompt", "chosen", "rejected"):
        value = obj[key]
        if conversational and not isinstance(value, list):
            raise LayoutError(key, f"expected a list of messages like \"prompt\", got {type_name(value)} (give all "
                                   "three as message lists or all three as strings)")
        if not conversational and not isinstance(value, str):
            raise LayoutError(key, f"expected a string like \"prompt\", got {type_name(value)} (give all three as "
                                   "message lists or all three as strings)")
    if conversational:
        check_messages(obj["prompt"], "prompt", prompt=True)
        for side in ("chosen", "rejected"):
            check_messages(obj[side], side, need_assistant=True)
            _check_joined(obj["prompt"], obj[side], side)
        prompt = normalize_tool_calls(obj["prompt"])
        chosen, rejected = normalize_tool_calls(obj["chosen"]), normalize_tool_calls(obj["rejected"])
    else:
        prompt, chosen, rejected = obj["prompt"], obj["chosen"], obj["rejected"]
    return {"prompt": prompt, "chosen_response": chosen, "rejected_response": rejected, **_scores(obj)}


def _check_joined(prompt: list[dict[str, Any]], completion: list[dict[str, Any]], side: str) -> None:
    """The rules that span the prompt and its completion (a system message first, tool turns after a call), with
    the completion's messages named by their own index."""
    try:
        check_messages(prompt + completion, side)
    except LayoutError as exc:
        name = exc.fieldname or side
        if name.startswith(f"{side}["):
            index = int(name[len(side) + 1 : name.index("]")]) - len(prompt)
            name = f"{side}[{index}]{name[name.index(']') + 1:]}"
        raise LayoutError(name, exc.problem) from None


def _implicit(obj: dict[str, Any]) -> dict[str, Any]:
    _require(obj, "chosen", "rejected")
    chosen, rejected = obj["chosen"], obj["rejected"]
    if isinstance(chosen, str) or isinstance(rejected, str):
        for key in ("chosen", "rejected"):
            if not isinstance(obj[key], str):
                raise LayoutError(key, f"expected a string like the other side, got {type_name(obj[key])}")
        cut = common_prompt_length(chosen, rejected)
        return {"prompt": chosen[:cut], "chosen_response": chosen[cut:], "rejected_response": rejected[cut:],
                **_scores(obj)}
    for key in ("chosen", "rejected"):
        check_messages(obj[key], key, need_assistant=True)
    chosen, rejected = normalize_tool_calls(chosen), normalize_tool_calls(rejected)
    cut = 0
    while cut < min(len(chosen), len(rejected)) and chosen[cut] == rejected[cut]:
        cut += 1
    if cut == len(chosen) == len(rejected):  # identical: the last turn is the completion (chosen == rejected)
        cut -= 1
    if cut == 0:
        raise LayoutError("rejected[0]", "the two conversations share no prompt: they differ from their first "
                                          "message (an implicit-prompt pair shares every message before the answer)")
    for key, side in (("chosen", chosen), ("rejected", rejected)):
        if not any(m["role"] == "assistant" for m in side[cut:]):
            raise LayoutError(key, f"no assistant message after the {cut} message(s) both conversations share: "
                                   "nothing to prefer")
    if cut and chosen[cut - 1]["role"] == "assistant":
        cut_at = f"chosen[{cut - 1}].role"
        raise LayoutError(cut_at, "the shared prompt ends with an assistant message: the two conversations "
                                  "should part at an assistant turn")
    return {"prompt": chosen[:cut], "chosen_response": chosen[cut:], "rejected_response": rejected[cut:],
            **_scores(obj)}


def _prompt_record(obj: dict[str, Any], layout: str) -> dict[str, Any]:
    _require(obj, "prompt")
    check_messages(obj["prompt"], "prompt", prompt=True)
    record = {**obj, "prompt": normalize_tool_calls(obj["prompt"])}
    if layout == "verl":
        reward_model = obj["reward_model"]
        if not isinstance(reward_model, dict):
            raise LayoutError("reward_model", f'expected an object {{"style", "ground_truth"}}, got {type_name(reward_model)}')
        if "ground_truth" not in reward_model:
            raise LayoutError("reward_model.ground_truth", "missing (required)")
        for key in ("data_source", "ability"):
            if obj.get(key) is not None and not isinstance(obj[key], str):
                raise LayoutError(key, f"expected a string, got {type_name(obj[key])}")
        if obj.get("extra_info") is not None and not isinstance(obj["extra_info"], dict):
            raise LayoutError("extra_info", f"expected an object, got {type_name(obj['extra_info'])}")
        if record.get("answer") is None:
            record["answer"] = reward_model["ground_truth"]
    if record.get("answer") is None and record.get("ground_truth") is not None:
        record["answer"] = record["ground_truth"]
    return record


def common_prompt_length(a: str, b: str) -> int:
    """Length of the longest common prefix of ``a`` and ``b``, cut back to just after a whitespace character (so
    no word is split between prompt and response); 0 when there is none."""
    n = 0
    limit = min(len(a), len(b))
    while n < limit and a[n] == b[n]:
        n += 1
    if n == len(a) == len(b):
        return 0  # identical texts: nothing tells a prompt from a response (flagged as chosen == rejected)
    while n > 0 and not a[n - 1].isspace():
        n -= 1
    return n


# ---------------------------------------------------------------------------------------------------------------
# Views of str-or-messages values (used by tokenization, the split and the dubious checks)
# ---------------------------------------------------------------------------------------------------------------


def is_messages(value: Any) -> bool:
    return isinstance(value, list)


def texts_of(value: str | list[dict[str, Any]]) -> list[str]:
    """The texts of a string (itself) or of messages (each message's content, tool calls as JSON): what length
    checks count and truncation cuts."""
    if isinstance(value, str):
        return [value]
    out = []
    for m in value:
        out.append(m.get("content") or "")
        if m.get("reasoning_content"):
            out.append(m["reasoning_content"])
        for call in m.get("tool_calls") or ():
            out.append(json.dumps(call["function"], ensure_ascii=False, sort_keys=True))
    return out


def with_texts(value: str | list[dict[str, Any]], texts: list[str]) -> str | list[dict[str, Any]]:
    """``value`` with its contents replaced by ``texts`` (cut by truncation), in :func:`texts_of`'s order; tool calls
    are kept whole."""
    if isinstance(value, str):
        return texts[0]
    out, k = [], 0
    for m in value:
        m = {**m, "content": texts[k]} if m.get("content") is not None else dict(m)
        k += 1
        if m.get("reasoning_content"):
            m["reasoning_content"] = texts[k]
            k += 1
        k += len(m.get("tool_calls") or ())
        out.append(m)
    return out


def key_text(value: str | list[dict[str, Any]]) -> str:
    """A string that identifies a prompt (the train/val split hashes it): the string, or the messages' canonical
    JSON."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, sort_keys=True)


def blank_response(value: str | list[dict[str, Any]]) -> bool:
    """Empty or whitespace-only trained-on text: a blank string, or an assistant message with blank content and no
    tool call."""
    if isinstance(value, str):
        return not value.strip()
    return any(m["role"] == "assistant" and not (m.get("content") or "").strip() and not m.get("tool_calls")
               for m in value)


__all__ = ["LAYOUTS", "VERBATIM", "LayoutError", "blank_response", "check_messages", "common_prompt_length", "detect", "is_messages",
           "key_text", "normalize", "normalize_tool_calls", "texts_of", "with_texts"]
