"""The house rules of the style guide ("a function fits on a screen", "a file you can read in one
sitting"), held for the package: no function above 60 lines of code, no module above 400 lines.

Lines of code: a function's lines after its docstring that are neither blank nor comments."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "ppo_jax"
MAX_FUNCTION_LINES = 60
MAX_FILE_LINES = 400


def code_lines(source: list[str], node: ast.AST) -> int:
    body = node.body
    first = body[0]
    has_doc = (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
               and isinstance(first.value.value, str))
    start = first.end_lineno + 1 if has_doc else first.lineno
    lines = source[start - 1:node.end_lineno]
    return sum(1 for line in lines if line.strip() and not line.strip().startswith("#"))


def long_functions(path: Path) -> list[str]:
    text = path.read_text()
    source = text.split("\n")
    return [f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name}: {n} lines of code"
            for node in ast.walk(ast.parse(text))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and (n := code_lines(source, node)) > MAX_FUNCTION_LINES]


def test_code_lines_skip_the_docstring_blank_lines_and_comments():
    source = 'def f():\n    """doc\n    more"""\n    # note\n\n    x = 1\n    return x\n'
    node = ast.parse(source).body[0]
    assert code_lines(source.split("\n"), node) == 2


def test_no_function_is_longer_than_a_screen():
    found = [line for path in sorted(PACKAGE.rglob("*.py")) for line in long_functions(path)]
    assert not found, "split these into named steps:\n" + "\n".join(found)


def test_no_module_is_longer_than_one_sitting():
    long = {str(p.relative_to(PACKAGE.parent)): n for p in sorted(PACKAGE.rglob("*.py"))
            if (n := p.read_text().count("\n")) > MAX_FILE_LINES}
    assert not long, f"modules over {MAX_FILE_LINES} lines: {long}"
