"""The built-in environments called as the protocol calls them: the calculator's tool calls (both formats), its
arithmetic (never eval: names, calls and huge powers refused), its final answer and call limit; the step verifier's
partial credit."""

from __future__ import annotations

import pytest

from align_pipeline.envs.base import as_start, as_step
from align_pipeline.envs.builtin import Calculator, StepVerifier, ToolCallError, evaluate, parse_tool_calls


@pytest.mark.parametrize(("expression", "value"), [("12 + 30", 42), ("(1 + 2) * 3", 9), ("7 / 2", 3.5), ("-3 ** 2", -9),
                                                    ("2 ^ 10", 1024), ("17 // 5 + 17 % 5", 5), ("1e3 - 1", 999.0)])
def test_arithmetic(expression, value):
    assert evaluate(expression) == value


@pytest.mark.parametrize(("expression", "problem"), [
    ("__import__('os').system('true')", "only numbers"), ("x + 1", "only numbers"), ("1 / 0", "division by zero"),
    ("9 ** 99999", "power too large"), ("(10 ** 60) * (10 ** 60)", "too large"), ("1 +", "cannot parse"),
    ("1" * 300, "longer than"), ("", "non-empty"), ("[1, 2]", "only numbers")])
def test_anything_else_is_refused_with_a_message(expression, problem):
    with pytest.raises(ToolCallError, match=problem):
        evaluate(expression)


def test_tool_call_formats():
    hermes = 'Let me compute. <tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}</tool_call>'
    assert parse_tool_calls(hermes) == [("calculator", {"expression": "2+2"})]
    llama = '{"name": "calculator", "parameters": {"expression": "3*3"}}'
    assert parse_tool_calls(llama) == [("calculator", {"expression": "3*3"})]
    as_string = '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1\\"}"}</tool_call>'
    assert parse_tool_calls(as_string) == [("calculator", {"expression": "1"})]
    assert parse_tool_calls("The answer is 42.") == []
    with pytest.raises(ToolCallError, match="not JSON"):
        parse_tool_calls("<tool_call>{calculator}</tool_call>")


def test_calculator_episode():
    env = Calculator(system="Use the calculator.", max_calls=2)
    record = {"prompt": "What is 347 * 29?", "answer": "10063"}
    messages, tools = as_start(env.reset(record), "reset()")
    assert [m["role"] for m in messages] == ["system", "user"] and tools[0]["function"]["name"] == "calculator"
    messages.append({"role": "assistant", "content": '<tool_call>{"name": "calculator", "arguments": '
                                                     '{"expression": "347 * 29"}}</tool_call>'})
    step = as_step(env.step(messages, record), "step()")
    assert step.messages == [{"role": "tool", "content": "10063"}] and not step.done and step.reward == 0.0
    messages += step.messages + [{"role": "assistant", "content": "347 * 29 = 10063"}]
    final = as_step(env.step(messages, record), "step()")
    assert final.done and final.reward == 1.0 and final.info == {"correct": True, "calls": 1}
    wrong = as_step(env.step(messages[:-1] + [{"role": "assistant", "content": "It is 10000."}], record), "step()")
    assert wrong.done and wrong.reward == 0.0 and wrong.info["correct"] is False


def test_calculator_errors_answer_as_the_tool_and_calls_are_limited():
    env = Calculator(max_calls=1, call_reward=0.1)
    record = {"prompt": "What is 2 + 2?", "answer": 4}
    user = [{"role": "user", "content": "What is 2 + 2?"}]
    bad = env.step(user + [{"role": "assistant", "content": '<tool_call>{"name": "search", "arguments": {}}'
                                                            "</tool_call>"}], record)
    assert bad.messages[0]["content"].startswith("error: unknown tool 'search'") and bad.reward == 0.0
    good = env.step(user + [{"role": "assistant", "content": '<tool_call>{"name": "calculator", "arguments": '
                                                             '{"expression": "2 + 2"}}</tool_call>'}], record)
    assert good.messages == [{"role": "tool", "content": "4"}] and good.reward == 0.1
    again = user + [{"role": "assistant", "content": "x"}, {"role": "tool", "content": "4"},
                    {"role": "assistant", "content": '<tool_call>{"name": "calculator", "arguments": '
                                                     '{"expression": "2 + 2"}}</tool_call>'}]
    over = env.step(again, record)
    assert over.done and over.reward == 0.0 and over.info["reason"] == "too many tool calls"


def test_calculator_plain_calls_for_a_model_without_a_chat_template():
    """call_format plain: the turn ``calc(<expression>)`` is a call, answered by a user turn ``=<value>\\n``; no tool
    schema (a template-less tokenizer has no rendering for one); anything else is the answer; calls are counted."""
    env = Calculator(call_format="plain", tool_name="calc", max_calls=1)
    record = {"prompt": "add: 57+68\n", "answer": "125"}
    messages, tools = as_start(env.reset(record), "reset()")
    assert messages == [{"role": "user", "content": "add: 57+68\n"}] and tools is None
    messages.append({"role": "assistant", "content": "calc(57+68)"})
    step = as_step(env.step(messages, record), "step()")
    assert step.messages == [{"role": "user", "content": "=125\n"}] and not step.done
    messages += step.messages + [{"role": "assistant", "content": "125"}]
    final = as_step(env.step(messages, record), "step()")
    assert final.done and final.reward == 1.0 and final.info == {"correct": True, "calls": 1}
    bad = as_step(env.step(messages[:1] + [{"role": "assistant", "content": "calc(57+x)"}], record), "step()")
    assert bad.messages[0]["content"].startswith("=error: only numbers") and bad.reward == 0.0
    over = as_step(env.step(messages[:-1] + [{"role": "assistant", "content": "calc(1+1)"}], record), "step()")
    assert over.done and over.info["reason"] == "too many tool calls"
    assert as_step(env.step(messages[:1] + [{"role": "assistant", "content": "124"}], record), "step()").reward == 0
    for config in ({"call_format": "xml"}, {"call_format": "plain", "tool_name": "calc)("}):
        with pytest.raises(ValueError):
            Calculator(**config)


def test_step_verifier_gives_partial_credit():
    env = StepVerifier()
    record = {"prompt": "Add 27 and 45 one digit at a time.", "steps": ["12", "72"]}
    messages = env.reset(record) + [{"role": "assistant", "content": "7 + 5 = 12"}]
    first = as_step(env.step(messages, record), "step()")
    assert first.reward == 0.5 and not first.done and first.messages[0]["role"] == "user"
    messages += first.messages
    wrong = as_step(env.step(messages + [{"role": "assistant", "content": "71"}], record), "step()")
    assert wrong.done and wrong.reward == 0.0 and wrong.info == {"correct": False, "steps_right": 1}
    right = as_step(env.step(messages + [{"role": "assistant", "content": "So 72"}], record), "step()")
    assert right.done and right.reward == 0.5 and right.info == {"correct": True, "steps_right": 2}
    with pytest.raises(ValueError, match="steps"):
        env.reset({"prompt": "no steps"})
