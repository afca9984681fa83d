"""Tool calls written by the model in its turn: find the first one, parse it, or say why not.

Two formats, both always recognised (an environment's instruction teaches one of them):

- `tool_call`: the Hermes function-calling convention (NousResearch's Hermes-Function-Calling;
  the chat template of Qwen2.5 instruct models, in their tokenizer_config.json, asks for the
  same): a JSON object with exactly the keys `name` and `arguments` between `<tool_call>` and
  `</tool_call>`::

      <tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>

  Larger instruct models are trained to emit exactly this, so an environment that uses it
  meets them where they are. `arguments` may also be a JSON string holding the object (the
  OpenAI API's convention), which is decoded.
- `calc`: one tag whose text is the calculator's expression, for small models::

      <calc>12*34</calc>

  A 135M model cannot reliably write nested, quoted JSON; a bare tag around the expression is
  a format it can learn in a few steps. It always means the tool "calculator" with the
  argument `expression`.

Rules: only the FIRST call of a turn counts (the sampler ends a turn on a call's closing tag,
`STOP_STRINGS`, so a second call is text the model should not have written). A turn with no
opening tag and no closing tag holds no call: it is the final answer (`parse_tool_call` returns
None). Anything that looks like a call but cannot be read (an unclosed tag, a closing tag
without its opening one, bad JSON, missing or unknown keys, an empty expression) is a
`MalformedCall` whose message ("could not parse the tool call: ...") becomes the observation,
so the model learns from it; parsing never raises.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Optional, Union

FORMATS = ("calc", "tool_call")
TAGS = {"calc": ("<calc>", "</calc>"), "tool_call": ("<tool_call>", "</tool_call>")}
# the strings that end a turn in each format (the sampler stops on them, stop string kept)
STOP_STRINGS = {fmt: (close,) for fmt, (_, close) in TAGS.items()}
ALL_STOP_STRINGS = tuple(s for fmt in FORMATS for s in STOP_STRINGS[fmt])
MALFORMED_PREFIX = "could not parse the tool call: "
_EXCERPT = 60  # characters of the model's text quoted in a malformed-call message


@dataclass(frozen=True)
class ToolCall:
    """A parsed call: the tool's `name`, its `arguments` (a dict) and the `format` it was
    written in ("calc" | "tool_call")."""

    name: str
    arguments: dict = field(default_factory=dict)
    format: str = "tool_call"


@dataclass(frozen=True)
class MalformedCall:
    """A call that could not be read: `message` starts with "could not parse the tool call: ";
    `format` is the format it started in."""

    message: str
    format: str = "tool_call"


def malformed(reason: str, fmt: str) -> MalformedCall:
    """The `MalformedCall` of `reason` (prefixed with `MALFORMED_PREFIX`)."""
    return MalformedCall(MALFORMED_PREFIX + reason, fmt)


def _first(text: str, pattern_of) -> Optional[tuple[int, str]]:
    """`(position, format)` of the earliest tag of any format, or None."""
    found = [(text.find(pattern_of(fmt)), fmt) for fmt in FORMATS]
    found = [(i, fmt) for i, fmt in found if i >= 0]
    return min(found) if found else None


def _excerpt(text: str) -> str:
    text = text.strip()
    return repr(text if len(text) <= _EXCERPT else text[:_EXCERPT] + "...")


def parse_tool_call(text: str) -> Union[ToolCall, MalformedCall, None]:
    """The first tool call in the turn `text` (module doc: formats and rules).

    Returns:
      a `ToolCall`, a `MalformedCall` (it looks like a call but cannot be read), or None (no
      call: the turn is a final answer).
    """
    opening = _first(text, lambda fmt: TAGS[fmt][0])
    if opening is None:
        closing = _first(text, lambda fmt: TAGS[fmt][1])
        if closing is None:
            return None
        close_tag = TAGS[closing[1]][1]
        return malformed(f"{close_tag} without its opening tag {TAGS[closing[1]][0]}",
                         closing[1])
    start, fmt = opening
    open_tag, close_tag = TAGS[fmt]
    body_start = start + len(open_tag)
    end = text.find(close_tag, body_start)
    if end < 0:
        return malformed(f"{open_tag} is never closed with {close_tag}", fmt)
    body = text[body_start:end]
    return _calc_call(body) if fmt == "calc" else _json_call(body)


def _calc_call(body: str) -> Union[ToolCall, MalformedCall]:
    expression = body.strip()
    if not expression:
        return malformed("the expression in <calc></calc> is empty", "calc")
    return ToolCall("calculator", {"expression": expression}, "calc")


def _json_call(body: str) -> Union[ToolCall, MalformedCall]:
    """A Hermes `<tool_call>` body: `{"name": str, "arguments": object}`, nothing else."""
    try:
        call = json.loads(body)
    except json.JSONDecodeError as e:
        return malformed(f"bad JSON ({e.msg} at character {e.pos}) in {_excerpt(body)}",
                         "tool_call")
    if not isinstance(call, dict):
        return malformed(f"expected a JSON object with name and arguments, got "
                         f"{type(call).__name__}", "tool_call")
    unknown = sorted(set(call) - {"name", "arguments"})
    missing = [k for k in ("name", "arguments") if k not in call]
    if unknown or missing:
        parts = ([f"unknown keys {unknown}"] if unknown else []) + (
            [f"missing keys {missing}"] if missing else [])
        return malformed(f"{' and '.join(parts)}; expected exactly name and arguments",
                         "tool_call")
    name, arguments = call["name"], call["arguments"]
    if not isinstance(name, str) or not name.strip():
        return malformed(f"the name must be a non-empty string, got {name!r:.40}", "tool_call")
    if isinstance(arguments, str):  # the OpenAI convention: the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        return malformed(f"arguments must be a JSON object, got {type(arguments).__name__}",
                         "tool_call")
    return ToolCall(name.strip(), arguments, "tool_call")


def call_text(fmt: str, expression: str) -> str:
    """How a calculator call on `expression` is written in the format `fmt` (for prompts and
    tests): `<calc>12*34</calc>` or the Hermes `<tool_call>{...}</tool_call>`.

    Raises:
      ValueError: an unknown format.
    """
    if fmt == "calc":
        return f"<calc>{expression}</calc>"
    if fmt == "tool_call":
        payload = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
        return f"<tool_call>{payload}</tool_call>"
    raise ValueError(f"unknown tool-call format {fmt!r}; known: {', '.join(FORMATS)}")

