"""A safe arithmetic calculator for tool calls: no `eval`, no `exec`, bounded work.

`calculate(expression)` parses with `ast.parse(expression, mode="eval")` and walks a whitelist
of nodes: int / float constants, the binary operators `+ - * / // % **`, unary `+ -`, and
parentheses (which the parser folds away). Anything else (a name, a call, an attribute, a
lambda, a string, a comparison, a subscript, ...) is refused by name.

What is accepted before parsing (normalised to Python):
  - thousands separators: `1,234,567` (a comma between digit groups of three);
  - `x`, `X` or `×` between numbers as multiplication (`12x34`, `12 × 34`), `÷` as division,
    `−` (U+2212) as minus;
  - `^` is POWER, as in written maths (`2^10` = 1024), not Python's bitwise xor.

Bounds, the `CalculatorLimits` defaults; each refuses, never truncates:
  - the expression is at most 200 characters;
  - every number, literal or intermediate, has at most 40 digits before the point (an int of
    41 digits, a float of magnitude >= 1e40, inf and nan are refused);
  - an exponent's magnitude is at most 64, and a power whose estimated result exceeds the
    digit bound is refused before it is computed (so `9**9**9` costs nothing);
  - division or modulo by zero, and powers with a non-real result such as `(-8)**0.5`, are
    errors.

Results are text: ints as ints (`408`; an int divided by an int it divides stays an exact int:
`123456789012/4` -> `30864197253`), floats to 10 significant digits with trailing zeros
dropped (`2.5`, `0.3333333333`, `7/7` -> `1`), positional between 1e-6 and 1e40, else in
exponent form (`1e-09`). A refusal is a `CalculatorError` value whose message becomes the
tool's observation.
"""

from __future__ import annotations

import ast
import math
import operator
import re
from dataclasses import dataclass
from decimal import Decimal
from typing import Union

Number = Union[int, float]


@dataclass(frozen=True)
class CalculatorLimits:
    """The calculator's bounds: `max_chars` of the expression, `max_digits` of any number
    before the point, `max_exponent` magnitude of a power's exponent."""

    max_chars: int = 200
    max_digits: int = 40
    max_exponent: int = 64


@dataclass(frozen=True)
class CalculatorError:
    """A refused or failed calculation: `message` says why ("division by zero")."""

    message: str


class _Refused(Exception):
    """Internal: the walk stops with this message (turned into a CalculatorError)."""


_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_REFUSED_NODES = {ast.Call: "function calls are", ast.Attribute: "attribute access is",
                  ast.Lambda: "lambda is", ast.Subscript: "subscripts are", ast.Compare:
                  "comparisons are", ast.BoolOp: "boolean operators are", ast.IfExp:
                  "conditional expressions are", ast.JoinedStr: "strings are", ast.Tuple:
                  "tuples are", ast.List: "lists are", ast.Dict: "dicts are", ast.Set: "sets are",
                  ast.NamedExpr: "assignments are"}
_CONSTANTS = {str: "strings are", bytes: "strings are", complex: "complex numbers are",
              bool: "True and False are", type(None): "None is", type(...): "... is"}
_ALLOWED = "only numbers, + - * / // % ** and parentheses"
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_TIMES = re.compile(r"(?<=[\d).])\s*[xX×]\s*(?=[\d(.+\-])")


def normalise(expression: str) -> str:
    """The expression in Python syntax: thousands separators dropped, `x` / `×` between
    numbers to `*`, `÷` to `/`, `−` to `-`, `^` to `**` (module doc)."""
    text = expression.strip().replace("−", "-").replace("÷", "/").replace("^", "**")
    text = _THOUSANDS.sub("", text)
    return _TIMES.sub("*", text).replace("×", "*")


def calculate(expression: str, limits: CalculatorLimits = CalculatorLimits()
              ) -> Union[str, CalculatorError]:
    """The value of the arithmetic `expression` as text, or a `CalculatorError` saying why
    not (module doc: what is accepted, the bounds, the result format). Never raises."""
    if not isinstance(expression, str):
        return CalculatorError(f"the expression must be text, not {type(expression).__name__}")
    if len(expression) > limits.max_chars:
        return CalculatorError(f"the expression is longer than {limits.max_chars} characters")
    text = normalise(expression)
    if not text:
        return CalculatorError("the expression is empty")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError) as e:
        return CalculatorError(f"not an arithmetic expression ({_syntax_message(e)})")
    try:
        return format_number(_value(tree.body, limits))
    except _Refused as e:
        return CalculatorError(str(e))
    except RecursionError:
        return CalculatorError("the expression is nested too deeply")


def _syntax_message(error: Exception) -> str:
    return getattr(error, "msg", None) or type(error).__name__


def _value(node: ast.AST, limits: CalculatorLimits) -> Number:
    """The value of a whitelisted node, each intermediate checked against `limits`."""
    if isinstance(node, ast.Constant):
        if type(node.value) not in (int, float):
            kind = _CONSTANTS.get(type(node.value), f"{type(node.value).__name__} is")
            raise _Refused(f"{kind} not allowed; {_ALLOWED}")
        return _bounded(node.value, limits)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _bounded(_UNARY[type(node.op)](_value(node.operand, limits)), limits)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left, limits), _value(node.right, limits)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right, limits)
        try:
            result = _BINARY[type(node.op)](left, right)
            if isinstance(node.op, ast.Div) and _exact_quotient(left, right):
                result = left // right  # 408 / 2 is 204, not the float 204.0
        except ZeroDivisionError:
            raise _Refused("division by zero") from None
        except OverflowError:
            raise _Refused(f"the result has more than {limits.max_digits} digits") from None
        return _bounded(result, limits)
    raise _Refused(f"{_refusal(node)} not allowed; {_ALLOWED}")


def _refusal(node: ast.AST) -> str:
    """What `node` is, with its verb: "the name 'x' is", "function calls are", ..."""
    if isinstance(node, ast.Name):
        return f"the name {node.id!r} is"
    if isinstance(node, (ast.BinOp, ast.UnaryOp)):
        return f"the operator {type(node.op).__name__} is"
    return _REFUSED_NODES.get(type(node), f"{type(node).__name__} is")


def _exact_quotient(left: Number, right: Number) -> bool:
    """Both ints and `right` divides `left`: `/` then gives the exact int."""
    return type(left) is int and type(right) is int and right != 0 and left % right == 0


def _check_power(base: Number, exponent: Number, limits: CalculatorLimits) -> None:
    """Refuse a power before computing it: |exponent| > max_exponent, or a result whose
    estimated digits (`exponent * log10|base|`) exceed the bound."""
    if abs(exponent) > limits.max_exponent:
        raise _Refused(f"the exponent {format_number(exponent)} is larger than "
                       f"{limits.max_exponent} in magnitude")
    if base != 0 and exponent > 0 and exponent * math.log10(abs(base)) > limits.max_digits + 1:
        raise _Refused(f"the result has more than {limits.max_digits} digits")
    if base < 0 and exponent != int(exponent):
        raise _Refused("the result is not a real number (a negative base to a fractional "
                       "power)")


def _bounded(value, limits: CalculatorLimits) -> Number:
    """`value` if it is a real number within the digit bound, else refused."""
    if isinstance(value, complex):
        raise _Refused("the result is not a real number")
    if isinstance(value, float):
        if not math.isfinite(value) or abs(value) >= 10.0 ** limits.max_digits:
            raise _Refused(f"the result has more than {limits.max_digits} digits")
        return value
    if abs(value) >= 10 ** limits.max_digits:
        raise _Refused(f"the result has more than {limits.max_digits} digits")
    return value


def format_number(value: Number) -> str:
    """`value` as the calculator writes it: an int in full; a float to 10 significant digits,
    trailing zeros dropped, positional between 1e-6 and 1e40 (`7.0` -> "7", `1/3` ->
    "0.3333333333"), else in exponent form."""
    if isinstance(value, int):
        return str(value)
    if value == 0:
        return "0"
    short = f"{value:.10g}"
    if not 1e-6 <= abs(value) < 1e40:
        return short
    text = format(Decimal(short), "f")
    return text.rstrip("0").rstrip(".") if "." in text else text
