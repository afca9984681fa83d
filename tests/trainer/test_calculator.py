"""The calculator tool (issue 38): results of hand-checked expressions, the accepted notations,
and every refusal (too long, huge powers and numbers, names, calls, attributes, lambda,
strings, division by zero) as a message, never an exception and never an `eval`."""

from __future__ import annotations

import pytest

from ppo_jax.trainer.environments.calculator import (
    CalculatorError, CalculatorLimits, calculate, format_number, normalise,
)


@pytest.mark.parametrize("expression, want", [
    ("12*34", "408"),
    ("  12 * 34  ", "408"),
    ("(2 + 3) * 4", "20"),
    ("-3 + +5", "2"),
    ("7 / 2", "3.5"),
    ("408 / 2", "204"),  # an int divided by an int it divides stays an int
    ("123456789012 / 4", "30864197253"),  # exact, not rounded to 10 significant digits
    ("7 / 7", "1"),
    ("1 / 3", "0.3333333333"),
    ("2 / 3", "0.6666666667"),
    ("0.1 + 0.2", "0.3"),
    ("17 // 5", "3"),
    ("-17 // 5", "-4"),  # floor division, as Python
    ("17 % 5", "2"),
    ("2 ** 10", "1024"),
    ("2 ** -2", "0.25"),
    ("2 ** 64", "18446744073709551616"),
    ("10 ** 39", "1" + "0" * 39),  # 40 digits: the bound, still allowed
    ("-8 ** 0.5", "-2.828427125"),  # -(8 ** 0.5): a real number
    ("2.5e3", "2500"),
    ("1e-9", "1e-09"),  # below 1e-6: exponent form
    ("-0.0", "0"),
    ("((((1))))", "1"),
])
def test_calculate_gives_hand_checked_results(expression, want):
    assert calculate(expression) == want


@pytest.mark.parametrize("expression, want", [
    ("1,234 * 2", "2468"),  # thousands separators
    ("1,000,000 / 4", "250000"),
    ("12x34", "408"),
    ("12 X 34", "408"),
    ("12 × 34", "408"),
    ("12 x (3 + 4)", "84"),
    ("12 ÷ 4", "3"),
    ("5 − 7", "-2"),  # U+2212 minus
    ("2^10", "1024"),  # ^ is power, not xor
    ("2^3^2", "512"),  # right-associative, as **
])
def test_written_maths_notations_are_normalised(expression, want):
    assert calculate(expression) == want


def test_normalise_touches_only_the_documented_notations():
    assert normalise("1,234x2^3") == "1234*2**3"
    assert normalise("f(1, 2)") == "f(1, 2)"  # a comma that is not a thousands separator stays
    assert normalise("max") == "max"  # an x that is not between numbers stays (and is refused)


@pytest.mark.parametrize("expression, message", [
    ("1" * 201, "the expression is longer than 200 characters"),
    ("9**9**9", "the exponent 387420489 is larger than 64 in magnitude"),
    ("2 ** 65", "the exponent 65 is larger than 64 in magnitude"),
    ("2 ** -65", "the exponent -65 is larger than 64 in magnitude"),
    ("10 ** 40", "the result has more than 40 digits"),
    ("99999999999 ** 5", "the result has more than 40 digits"),  # estimated, never computed
    ("1" * 41, "the result has more than 40 digits"),  # a literal over the bound
    ("10**20 * 10**20", "the result has more than 40 digits"),  # an intermediate over it
    ("1e40", "the result has more than 40 digits"),
    ("1e400", "the result has more than 40 digits"),  # inf
    ("1 / 0", "division by zero"),
    ("1 // 0", "division by zero"),
    ("5 % 0", "division by zero"),
    ("0 ** -1", "division by zero"),
    ("(-8) ** 0.5", "the result is not a real number (a negative base to a fractional power)"),
    ("", "the expression is empty"),
    ("   ", "the expression is empty"),
])
def test_refusals_are_messages(expression, message):
    assert calculate(expression) == CalculatorError(message)


ALLOWED = "not allowed; only numbers, + - * / // % ** and parentheses"


@pytest.mark.parametrize("expression, what", [
    ("x + 1", "the name 'x' is"),
    ("__import__", "the name '__import__' is"),
    ("abs(-3)", "function calls are"),
    ("__import__('os').system('true')", "function calls are"),
    ("(1).real", "attribute access is"),
    ("(1).__class__", "attribute access is"),
    ("lambda: 1", "lambda is"),
    ("'a' * 3", "strings are"),
    ("b'a'", "strings are"),
    ("f'{1}'", "strings are"),
    ("3 > 2", "comparisons are"),
    ("1 and 2", "boolean operators are"),
    ("1 if 1 else 2", "conditional expressions are"),
    ("[1, 2]", "lists are"),
    ("(1, 2)", "tuples are"),
    ("{1: 2}", "dicts are"),
    ("(1)[0]", "subscripts are"),
    ("~5", "the operator Invert is"),
    ("1 & 3", "the operator BitAnd is"),
    ("1 << 3", "the operator LShift is"),
    ("1j", "complex numbers are"),
    ("True + 1", "True and False are"),
    ("None", "None is"),
    ("...", "... is"),
])
def test_anything_but_arithmetic_is_refused_by_name(expression, what):
    assert calculate(expression) == CalculatorError(f"{what} {ALLOWED}")


def test_syntax_errors_and_non_text_are_messages():
    assert calculate("1 2") == CalculatorError("not an arithmetic expression (invalid syntax)")
    assert calculate("x = 1").message.startswith("not an arithmetic expression")  # a statement
    assert calculate("1\x00") .message.startswith("not an arithmetic expression")
    assert calculate(12) == CalculatorError("the expression must be text, not int")


def test_deep_nesting_within_the_length_bound_is_fine_and_beyond_a_limit_is_refused():
    assert calculate("(" * 99 + "1" + ")" * 99) == "1"
    assert calculate("-" * 199 + "1") == "-1"
    deep = CalculatorLimits(max_chars=10_000)
    assert calculate("(" * 1000 + "1" + ")" * 1000, deep) == CalculatorError(
        "not an arithmetic expression (too many nested parentheses)")
    too_deep = calculate("-" * 5000 + "1", deep)  # the parser's or the walk's recursion limit
    assert isinstance(too_deep, CalculatorError) and "Recursion" in too_deep.message or (
        too_deep == CalculatorError("the expression is nested too deeply"))


def test_limits_are_configurable():
    tight = CalculatorLimits(max_chars=5, max_digits=3, max_exponent=2)
    assert calculate("123456", tight) == CalculatorError("the expression is longer than 5 "
                                                         "characters")
    assert calculate("2**3", tight) == CalculatorError("the exponent 3 is larger than 2 in "
                                                       "magnitude")
    assert calculate("999+1", tight) == CalculatorError("the result has more than 3 digits")
    assert calculate("999", tight) == "999"


@pytest.mark.parametrize("value, want", [
    (408, "408"), (-5, "-5"), (3.0, "3"), (2.50, "2.5"), (1 / 3, "0.3333333333"),
    (123456789012.0, "123456789000"), (1e-7, "1e-07"), (0.000123, "0.000123"), (-0.0, "0"),
])
def test_format_number(value, want):
    assert format_number(value) == want
