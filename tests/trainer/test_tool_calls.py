"""Tool calls in a model's turn (issue 38): the Hermes `<tool_call>` JSON form and the
small-model `<calc>` tag, malformed variants as messages (never exceptions), no call as a
final answer, and only the first call of a turn counting."""

from __future__ import annotations

import pytest

from ppo_jax.trainer.environments.tool_calls import (
    ALL_STOP_STRINGS, STOP_STRINGS, MalformedCall, ToolCall, call_text, parse_tool_call,
)

CALC = ToolCall("calculator", {"expression": "12*34"}, "calc")
HERMES = ToolCall("calculator", {"expression": "12*34"}, "tool_call")


@pytest.mark.parametrize("text, want", [
    ("<calc>12*34</calc>", CALC),
    ("Let me compute. <calc> 12*34 </calc>", CALC),  # the expression is stripped
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>',
     HERMES),
    ('I will use the tool.\n<tool_call>\n{"name": "calculator", "arguments": '
     '{"expression": "12*34"}}\n</tool_call>', HERMES),  # Qwen2.5's newlines around the JSON
    ('<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"12*34\\"}"}'
     '</tool_call>', HERMES),  # OpenAI's arguments-as-a-JSON-string
    ('<tool_call>{"name": "search", "arguments": {"q": "x", "k": 2}}</tool_call>',
     ToolCall("search", {"q": "x", "k": 2}, "tool_call")),  # any tool: the env checks names
])
def test_both_formats_parse(text, want):
    assert parse_tool_call(text) == want


@pytest.mark.parametrize("text", [
    "The answer is <answer>408</answer>",
    "12 * 34 = 408",
    "",
    "I could use <calc but I will not",  # not a tag
])
def test_a_turn_without_a_call_is_a_final_answer(text):
    assert parse_tool_call(text) is None


@pytest.mark.parametrize("text, message, fmt", [
    ("<calc>12*34", "<calc> is never closed with </calc>", "calc"),
    ("<calc>  </calc>", "the expression in <calc></calc> is empty", "calc"),
    ("12*34</calc>", "</calc> without its opening tag <calc>", "calc"),
    ('{"name": "calculator"}</tool_call>', "</tool_call> without its opening tag <tool_call>",
     "tool_call"),
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}',
     "<tool_call> is never closed with </tool_call>", "tool_call"),
    ("<tool_call>{name: calculator}</tool_call>",
     "bad JSON (Expecting property name enclosed in double quotes at character 1) in "
     "'{name: calculator}'", "tool_call"),
    ("<tool_call>[1, 2]</tool_call>",
     "expected a JSON object with name and arguments, got list", "tool_call"),
    ('<tool_call>{"name": "calculator", "arguments": {}, "id": 3}</tool_call>',
     "unknown keys ['id']; expected exactly name and arguments", "tool_call"),
    ('<tool_call>{"name": "calculator"}</tool_call>',
     "missing keys ['arguments']; expected exactly name and arguments", "tool_call"),
    ('<tool_call>{"tool": "calculator"}</tool_call>',
     "unknown keys ['tool'] and missing keys ['name', 'arguments']; expected exactly name and "
     "arguments", "tool_call"),
    ('<tool_call>{"name": "", "arguments": {}}</tool_call>',
     "the name must be a non-empty string, got ''", "tool_call"),
    ('<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>',
     "arguments must be a JSON object, got list", "tool_call"),
    ('<tool_call>{"name": "calculator", "arguments": "12*34"}</tool_call>',
     "arguments must be a JSON object, got str", "tool_call"),
])
def test_malformed_calls_are_messages(text, message, fmt):
    assert parse_tool_call(text) == MalformedCall(f"could not parse the tool call: {message}", fmt)


def test_a_long_bad_json_body_is_quoted_short():
    call = parse_tool_call("<tool_call>{" + "x" * 500 + "</tool_call>")
    assert isinstance(call, MalformedCall)
    assert call.message.endswith(" in '{" + "x" * 59 + "...'")  # 60 characters of the body


@pytest.mark.parametrize("text, want", [
    ("<calc>1+1</calc> and then <calc>2+2</calc>", ToolCall("calculator", {"expression": "1+1"},
                                                             "calc")),
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "3"}}</tool_call>'
     "<calc>4</calc>", ToolCall("calculator", {"expression": "3"}, "tool_call")),
    ('<calc>4</calc><tool_call>{"name": "calculator", "arguments": {"expression": "3"}}'
     "</tool_call>", ToolCall("calculator", {"expression": "4"}, "calc")),
    ("<calc>5</calc><calc>", ToolCall("calculator", {"expression": "5"}, "calc")),  # 2nd ignored
])
def test_only_the_first_call_of_a_turn_counts(text, want):
    assert parse_tool_call(text) == want


def test_a_malformed_first_call_is_not_rescued_by_a_later_one():
    call = parse_tool_call("<tool_call>{bad}</tool_call> <calc>1+1</calc>")
    assert isinstance(call, MalformedCall) and call.format == "tool_call"


def test_stop_strings_are_each_formats_closing_tag():
    assert STOP_STRINGS == {"calc": ("</calc>",), "tool_call": ("</tool_call>",)}
    assert ALL_STOP_STRINGS == ("</calc>", "</tool_call>")


@pytest.mark.parametrize("fmt", ["calc", "tool_call"])
def test_call_text_round_trips(fmt):
    assert parse_tool_call(call_text(fmt, "47*382")) == ToolCall(
        "calculator", {"expression": "47*382"}, fmt)
    with pytest.raises(ValueError, match="unknown tool-call format 'xml'; known: calc, tool_call"):
        call_text("xml", "1")
