"""Environment "calculator": arithmetic problems the model may solve with a calculator tool.

A row has `prompt` (the problem) and `answer` (the number). `reset` appends an instruction on
how to call the tool, with one example call, in the format of the `format` kwarg (`calc`, the
default: `<calc>12*34</calc>`, for small models; `tool_call`: the Hermes JSON form;
`tool_calls.py` says why two). Each policy turn is then one of:

- a tool call (the first of the turn counts): the observation is the calculator's result
  ("408"), its error ("calculator error: division by zero") or the parse error of a malformed
  call ("could not parse the tool call: ..."); not done. Reward parts: `tool_cost` =
  -`tool_call_cost` on every call turn, `malformed_penalty` = -`malformed_penalty` on a
  malformed one (0.0 otherwise). Info: `tool_call` 1, `used_tool` 1 on the episode's first
  call, `malformed` 0/1, `tool_error` 0/1 (the calculator refused the expression).
- no call: the final answer. `final_number` reads it (the `<answer>` tag when there is one,
  else the last number of the text), compared exactly with the row's answer (as rationals;
  `rel_tol` allows a relative error). Reward part `correct` 1.0 / 0.0; done. Info: `answered`
  0/1 (a number was found).

Every turn's info has the same keys (tool_call, used_tool, malformed, tool_error, answered);
the driver sums each over an episode and logs its mean over the episodes as `env/<key>`: tool
calls per episode, the share of episodes that used the tool, malformed calls and tool errors
per episode, the share that gave a number. The turn limit is the rollout driver's (`max_turns`): an
episode that reaches it without a final answer ends there with no `correct` part, which the
driver scores as a wrong answer; the environment is not told.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Any, Optional, Union

from ppo_jax.trainer.environments.base import Environment, StepResult, register_environment
from ppo_jax.trainer.environments.calculator import CalculatorError, CalculatorLimits, calculate
from ppo_jax.trainer.environments.tool_calls import (
    FORMATS, MalformedCall, ToolCall, call_text, malformed, parse_tool_call,
)
from ppo_jax.trainer.rewards.verifiers import format_free_answer, tagged_answer

EXAMPLE_EXPRESSION = "12*34"


def final_number(text: str) -> Optional[Fraction]:
    """The number a final answer gives, exactly (a `Fraction`), or None when it gives none:
    the last number inside the last `<answer>...</answer>` when the text has that tag (none
    in it: None; the text outside does not count), else the last number of the whole text.

    A number is what `rewards.verifiers.format_free_answer` reads: optional minus (not after a
    word character or `)`, so `12-3` reads 12 and 3), digits with optional thousands
    separators (`1,234`), optional decimals (`2.5`).
    """
    answer = tagged_answer(text)
    found = format_free_answer(answer if answer is not None else text)
    return Fraction(found) if found is not None else None


def _as_fraction(value: Any) -> Optional[Fraction]:
    try:
        return Fraction(str(value).strip().replace(",", ""))
    except (ValueError, ZeroDivisionError):
        return None


def numbers_match(given: Optional[Fraction], gold: Fraction, rel_tol: float = 0.0) -> bool:
    """`given` equals `gold` exactly, or within `rel_tol` x |gold| when `rel_tol` > 0."""
    if given is None:
        return False
    return given == gold or abs(given - gold) <= Fraction(rel_tol) * abs(gold)


@dataclass(frozen=True)
class CalculatorState:
    """One episode: the gold `answer` and the number of tool `calls` made so far."""

    answer: Fraction
    calls: int = 0


def instruction(fmt: str, tool: bool = True) -> str:
    """The text `reset` appends to the prompt: how to call the calculator in `fmt`, with one
    example call, and how to give the final answer (without `tool`: only the latter).

    Raises:
      ValueError: an unknown format.
    """
    if not tool:
        return "Give the final answer as <answer>NUMBER</answer>."
    example = call_text(fmt, EXAMPLE_EXPRESSION)
    return (f"You can use a calculator: write {example} and stop; the result comes back in "
            "the next message. When you know the result, give the final answer as "
            "<answer>NUMBER</answer>.")


class CalculatorEnv(Environment):
    """The "calculator" environment (module doc); built by `get_environment("calculator",
    **kwargs)`."""

    name = "calculator"

    def __init__(self, fmt: str, tool_call_cost: float, malformed_penalty: float,
                 rel_tol: float, limits: CalculatorLimits, tool: bool = True):
        self.format, self.limits, self.rel_tol, self.tool = fmt, limits, rel_tol, tool
        self.tool_call_cost, self.malformed_penalty = tool_call_cost, malformed_penalty
        self.instruction = instruction(fmt, tool)

    def reset(self, row: dict) -> tuple[CalculatorState, str]:
        """`(state, prompt)`: the row's prompt with the tool instruction after it.

        Raises:
          ValueError: a row without `prompt` or `answer`, or an answer that is not a number.
        """
        missing = [k for k in ("prompt", "answer") if k not in row]
        if missing:
            raise ValueError(f"environment 'calculator' reads the prompt and answer of every "
                             f"row; this row has no {missing} (it has {sorted(row)})")
        gold = _as_fraction(row["answer"])
        if gold is None:
            raise ValueError(f"environment 'calculator': the row's answer {row['answer']!r:.40}"
                             " is not a number")
        return CalculatorState(gold), f"{row['prompt']}\n{self.instruction}"

    def step(self, state: CalculatorState, assistant_text: str) -> StepResult:
        """Answer one turn: a tool call's result, or the score of the final answer."""
        call = parse_tool_call(assistant_text) if self.tool else None
        if call is None:
            given = final_number(assistant_text)
            correct = numbers_match(given, state.answer, self.rel_tol)
            return StepResult(None, True, {"correct": float(correct)}, state,
                              _info(answered=given is not None))
        call = _calculator_call(call)
        first = state.calls == 0
        state = replace(state, calls=state.calls + 1)
        rewards = {"tool_cost": 0.0 - self.tool_call_cost, "malformed_penalty": 0.0}
        if isinstance(call, MalformedCall):
            rewards["malformed_penalty"] = 0.0 - self.malformed_penalty
            return StepResult(call.message, False, rewards, state,
                              _info(call=True, first=first, bad=True))
        result = calculate(call.arguments["expression"], self.limits)
        if isinstance(result, CalculatorError):
            return StepResult(f"calculator error: {result.message}", False, rewards, state,
                              _info(call=True, first=first, error=True))
        return StepResult(result, False, rewards, state, _info(call=True, first=first))


def _info(*, call: bool = False, first: bool = False, bad: bool = False, error: bool = False,
          answered: bool = False) -> dict:
    """One turn's counts (module doc); `first`: the episode's first call (`used_tool`)."""
    return {"tool_call": int(call), "used_tool": int(first), "malformed": int(bad),
            "tool_error": int(error), "answered": int(answered)}


def _calculator_call(call: Union[ToolCall, MalformedCall]) -> Union[ToolCall, MalformedCall]:
    """`call` if it is a well-formed calculator call (tool "calculator", arguments exactly
    {"expression": str}), else the MalformedCall saying what is wrong."""
    if isinstance(call, MalformedCall):
        return call
    if call.name != "calculator":
        return malformed(f"unknown tool {call.name!r:.40}; the only tool is calculator",
                         call.format)
    if set(call.arguments) != {"expression"} or not isinstance(call.arguments["expression"], str):
        return malformed(f"the calculator takes one argument, expression (a string), got "
                         f"{sorted(call.arguments)}", call.format)
    if not call.arguments["expression"].strip():
        return malformed("the expression is empty", call.format)
    return call


@register_environment("calculator")
def calculator_environment(format: str = "calc", tool_call_cost: float = 0.0,
                           malformed_penalty: float = 0.0, rel_tol: float = 0.0,
                           max_chars: int = 200, max_digits: int = 40,
                           max_exponent: int = 64, tool: bool = True) -> CalculatorEnv:
    """The "calculator" environment (module doc).

    Args:
      format: the call format the instruction teaches, "calc" or "tool_call" (both are read).
      tool_call_cost: cost of each call turn, >= 0 (reward part `tool_cost` = -cost: 0.05
        takes 0.05 off the episode's score per call).
      malformed_penalty: cost of a malformed call, >= 0 (reward part `malformed_penalty` =
        -it).
      rel_tol: relative error a final answer may have (0: exact).
      max_chars, max_digits, max_exponent: the calculator's bounds (`CalculatorLimits`).
      tool: False: no calculator (the same task and verifier, one answer, nothing parsed as a
        call): the no-tool baseline.

    Raises:
      ValueError: an unknown format, a cost that is not a number, non-finite or negative (a
        negative one would pay a bonus per call: the policy would learn to call until
        `env.max_turns`), a `rel_tol` that is not a number >= 0, or a bound that is not an int
        >= 1; a setting is named as `env.kwargs.<name>` with its value.
    """
    if format not in FORMATS:
        raise ValueError(f"environment 'calculator': format={format!r}; known: "
                         f"{', '.join(FORMATS)}")
    for key, value in (("tool_call_cost", tool_call_cost), ("malformed_penalty",
                                                            malformed_penalty)):
        value = _number(key, value)
        if value < 0:
            raise ValueError(f"environment 'calculator': env.kwargs.{key}={value!r} must be >= "
                             f"0: it is a cost, added to the score as -{key} (a negative one "
                             f"pays a bonus; for a cost of {-value:g} give {key}: {-value:g})")
    if not _number("rel_tol", rel_tol) >= 0:
        raise ValueError(f"environment 'calculator': env.kwargs.rel_tol={rel_tol!r} must be >= 0")
    for key, value in (("max_chars", max_chars), ("max_digits", max_digits),
                       ("max_exponent", max_exponent)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"environment 'calculator': env.kwargs.{key}={value!r:.40} is not "
                             "an int")
    if min(max_chars, max_digits, max_exponent) < 1:
        raise ValueError("environment 'calculator': max_chars, max_digits and max_exponent must "
                         "be >= 1")
    return CalculatorEnv(format, float(tool_call_cost), float(malformed_penalty), float(rel_tol),
                         CalculatorLimits(max_chars, max_digits, max_exponent), bool(tool))


def _number(key: str, value: Any) -> float:
    """`env.kwargs.<key>` as a finite float.

    Raises:
      ValueError: naming the key and the value: not a number, or not finite.
    """
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"environment 'calculator': env.kwargs.{key}={value!r:.40} is not a "
                         "number") from None
    if not math.isfinite(number):
        raise ValueError(f"environment 'calculator': env.kwargs.{key}={value!r} is not finite")
    return number
