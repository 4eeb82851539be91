"""Chat templates: render records with an HF tokenizer's Jinja chat template and find the assistant tokens.

A template is rendered the way ``transformers``' ``apply_chat_template`` renders it (sandboxed Jinja with
``trim_blocks``/``lstrip_blocks``, ``raise_exception``, ``tojson``, ``strftime_now``, the tokenizer's special-token
strings as variables; ``{% generation %}`` blocks are rendered as plain text) – a test checks the two agree.

Which tokens carry the loss is derived by rendering prefixes, so it works for any template: for an assistant turn i,
``render(messages[:i], add_generation_prompt=True)`` ends where the turn's text starts, and
``render(messages[:i + 1])`` ends where it ends (its end-of-turn marker included, trailing whitespace not). Both must be prefixes of the whole
conversation's rendering; a template that renders earlier turns differently once later turns follow (e.g. one that
drops the reasoning of past turns) is refused with a :class:`ChatTemplateError` rather than trained on the wrong
tokens. The text is then tokenized once, with character offsets, and a token is an assistant token when it starts
inside an assistant span.

    template = ChatTemplate(source, special_tokens={"bos_token": "<s>", "eos_token": "</s>"},
                            origin="models/qwen/chat_template.jinja")
    text, spans = template.render_with_spans(messages)       # spans: [(start, end)] of assistant turns, in chars
    prompt = template.render(messages[:1], add_generation_prompt=True)

A template is compiled when it is loaded. Every problem – one that does not compile (a syntax error, an unknown
filter), or one raised while rendering (``raise_exception(...)``, an undefined variable) – is a
:class:`ChatTemplateError` (a user error) naming where the template came from and its line:
``chat template in models/qwen/chat_template.jinja: line 3: No filter named 'foo'.``; data_prep adds the record's
file, line and field to a rendering error.

Records become messages with :func:`sft_messages` (NeMo-Aligner ``conversations`` / ``input``+``output``) and
:func:`prompt_messages`. Nothing here imports torch or Kedro.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

from align_pipeline.errors import UserError

ROLE_OF = {"User": "user", "Assistant": "assistant"}


class ChatTemplateError(UserError, ValueError):
    """The template does not compile, or cannot render a record (it raised, or it renders a turn differently when
    turns follow); the message names the template's origin and line."""


def _template_line(exc: BaseException) -> int | None:
    """The template line of a Jinja error: a syntax error carries it; a rendering error has it in the traceback
    frames Jinja rewrites to point at the template (``<template>``), innermost last."""
    line = getattr(exc, "lineno", None)
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


def _problem(origin: str, exc: BaseException) -> str:
    """``chat template in <origin>: line <n>: <what Jinja says>``."""
    import jinja2

    line = _template_line(exc)
    where = f"chat template in {origin}" + (f": line {line}" if line else "")
    if isinstance(exc, jinja2.TemplateSyntaxError):
        what = exc.message or type(exc).__name__
    elif isinstance(exc, jinja2.TemplateError) and str(exc):  # raise_exception(...), undefined variables
        what = str(exc)
    else:
        what = f"{type(exc).__name__}: {exc}"
    return f"{where}: {what}"


@lru_cache(maxsize=8)
def _compile(source: str):
    import jinja2
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask marker): rendered as its body."""

        tags = frozenset({"generation"})

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class ChatTemplate:
    """An HF chat template plus the special-token strings it may refer to (``bos_token``, ``eos_token``, ...)."""

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None, origin: str = "(inline)"):
        self.source = source
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        self.origin = origin
        """Where the template came from, as messages name it: a file (``.../chat_template.jinja``), a JSON file and
        key (``.../tokenizer_config.json ("chat_template")``), a parameter."""
        try:
            _compile(source)
        except Exception as exc:  # noqa: BLE001 - jinja's syntax errors, unknown filters and the like
            raise ChatTemplateError(_problem(origin, exc)) from None

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False,
               tools: list[dict[str, Any]] | None = None) -> str:
        """The template's text for ``messages`` (``[{"role", "content"}, ...]``), with ``tools`` (function schemas)
        passed as the template's ``tools`` variable when given, as ``apply_chat_template(tools=...)`` does."""
        extra = {"tools": tools} if tools is not None else {}
        try:
            return _compile(self.source).render(
                messages=messages, add_generation_prompt=add_generation_prompt, **extra, **self.special_tokens
            )
        except Exception as exc:  # noqa: BLE001 - raise_exception() in the template, undefined variables, ...
            raise ChatTemplateError(_problem(self.origin, exc)) from None

    def render_with_spans(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                          train_from: int = 0) -> tuple[str, list[tuple[int, int]]]:
        """The whole conversation's text and the ``[start, end)`` character span of every assistant turn from message
        ``train_from`` on (a preference pair's completion; the prompt's own assistant turns are context)."""
        text = self.render(messages, tools=tools)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant" or i < train_from:
                continue
            before = self.render(messages[:i], add_generation_prompt=True, tools=tools) if i else ""
            through = self.render(messages[: i + 1], tools=tools)
            if not (through.startswith(before) and text.startswith(through)):
                raise ChatTemplateError(
                    f"chat template in {self.origin}: renders assistant turn {i} differently once later turns "
                    "follow, so its tokens cannot be located; give one conversation per final assistant turn, or a "
                    "template whose renderings of a conversation's prefixes are prefixes of it"
                )
            end = len(through.rstrip())  # the newline a template may put after the end-of-turn is not trained on
            if end > len(before):
                spans.append((len(before), end))
        return text, spans

    def end_of_turn(self) -> str:
        """The text the template puts right after an assistant turn's content (e.g. ``<|im_end|>``), or ''."""
        marker = "\x00ASSISTANT\x00"
        messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}]
        text = self.render(messages)
        at = text.rfind(marker)
        return text[at + len(marker) :] if at >= 0 else ""


def sft_messages(record: dict[str, Any]) -> list[dict[str, Any]]:
    """An SFT record as chat messages: its ``messages`` (OpenAI / TRL layout) as they are; NeMo's optional
    ``system``, then the turns (``User`` -> ``user``, ``Assistant`` -> ``assistant``), a turn's SteerLM ``label``
    kept as the message's ``label`` (templates may render it); ``{"input", "output"}`` is one user and one
    assistant message."""
    if "messages" in record:
        return list(record["messages"])
    if "conversations" not in record:
        return [{"role": "user", "content": record["input"]}, {"role": "assistant", "content": record["output"]}]
    messages = [{"role": "system", "content": record["system"]}] if record.get("system") else []
    for turn in record["conversations"]:
        message = {"role": ROLE_OF[turn["from"]], "content": turn["value"]}
        if turn.get("label") is not None:
            message["label"] = turn["label"]
        messages.append(message)
    return messages


def prompt_messages(prompt: str | list[dict[str, Any]], system: str | None = None) -> list[dict[str, Any]]:
    """A prompt (preference, RL, evaluation) as chat messages: a string is one user turn (after ``system``); a list
    is already messages."""
    if isinstance(prompt, list):
        return list(prompt)
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]


def completion_messages(response: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response as chat messages: a string is one assistant turn; a list (a TRL completion) is already messages."""
    return list(response) if isinstance(response, list) else [{"role": "assistant", "content": response}]


__all__ = ["ChatTemplate", "ChatTemplateError", "completion_messages", "prompt_messages", "sft_messages"]
