"""The import graph of the `ppo_jax` package: no cycles, and imports point down the layers of
docs/contracts.md (core <- models <- rollout <- trainer).

The graph is read from the source with `ast` (nothing is imported): every `import ppo_jax...`
and `from ppo_jax... import ...`, at module level and inside functions (a function-level import
still closes a cycle, it only defers it: `trainer_class` importing the stage trainers, which
import the config, which imported `stages` for its `Stage` type). Imports under
`if TYPE_CHECKING:` never run and are left out. `from pkg import name` is an edge to the
submodule `pkg.name` when there is one, else to `pkg` (its `__init__`); the implicit import of
a module's parent packages is not an edge, so a package `__init__` that gathers its own
submodules is no cycle.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "ppo_jax"

# (lower layer, layers above it that it must not import), docs/contracts.md; `parallel` (mesh,
# sharding rules) sits on `models`, under `rollout`
LAYERS = [
    ("ppo_jax.core", ("ppo_jax.models", "ppo_jax.parallel", "ppo_jax.rollout", "ppo_jax.trainer")),
    ("ppo_jax.models", ("ppo_jax.rollout", "ppo_jax.trainer")),
    ("ppo_jax.parallel", ("ppo_jax.rollout", "ppo_jax.trainer")),
    ("ppo_jax.rollout", ("ppo_jax.trainer",)),
    # inside the trainer: the rooms and the shared loop sit under the stages, and the stages do
    # not import each other (`stages/__init__` picks one: it is not a stage)
    *[(f"ppo_jax.trainer.{room}", ("ppo_jax.trainer.stages",))
      for room in ("config", "data", "rewards", "loading", "tracking", "host", "loop", "lifecycle",
                   "state", "optim", "accumulate", "placement", "programs", "environments")],
    *[(f"ppo_jax.trainer.{room}", ("ppo_jax.trainer.loading", "ppo_jax.trainer.loop"))
      for room in ("config", "data", "rewards", "tracking", "host", "environments", "lifecycle")],
    *[(f"ppo_jax.trainer.stages.{stage}", ("ppo_jax.trainer.stages.ppo",))
      for stage in ("sft", "reward_model", "supervised")],
]
# the config and the modules it is split into
CONFIG_MODULES = ("ppo_jax.trainer.config", "ppo_jax.trainer.config.schema",
                  "ppo_jax.trainer.config.checks", "ppo_jax.trainer.config.help")


def modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file of every `.py` under the package directory `root`."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST):
    """(node, inside a function) of every import statement, skipping `if TYPE_CHECKING:` bodies."""
    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for sub in child.orelse:
                    yield from visit(ast.Module(body=[sub], type_ignores=[]), in_function)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, in_function
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            yield from visit(child, nested)
    yield from visit(tree, False)


def _targets(node, module: str, is_package: bool, known) -> list[str]:
    """The package modules one import statement of `module` runs (see the module docstring)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
        return [max((n for n in known if name == n or name.startswith(n + ".")), key=len, default=name)
                for name in names]
    base = node.module or ""
    if node.level:  # relative: from . / .. import
        parts = module.split(".") if is_package else module.split(".")[:-1]
        parts = parts[:len(parts) - node.level + 1]
        base = ".".join(parts + ([node.module] if node.module else []))
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]


def import_graph(root: Path = PACKAGE) -> dict[str, dict[str, tuple[int, bool]]]:
    """module -> {imported package module: (line, inside a function)} over the package `root`."""
    known = modules(root)
    graph = {}
    for name, path in known.items():
        edges = {}
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node, in_function in _import_nodes(tree):
            for target in _targets(node, name, path.name == "__init__.py", known):
                if target in known and target != name:
                    edges.setdefault(target, (node.lineno, in_function))
        graph[name] = edges
    return graph


def strongly_connected(graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def a_cycle(graph, component: list[str]) -> list[str]:
    """One cycle through the component's first module (breadth first, so a shortest one)."""
    inside, start = set(component), component[0]
    parent, frontier = {start: None}, [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w == start:
                    path = [v]
                    while parent[path[-1]] is not None:
                        path.append(parent[path[-1]])
                    return [start, *reversed(path[:-1]), start] if len(path) > 1 else [start, v, start]
                if w in inside and w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start}")


def describe_cycle(graph, cycle: list[str], root: Path = PACKAGE) -> str:
    """`a -> b   [a's file:line of the import] -> ...`, one import a line, for an error message."""
    files, steps = modules(root), [cycle[0]]
    for a, b in zip(cycle, cycle[1:]):
        line, in_function = graph[a][b]
        where = f"{files[a].relative_to(root.parent)}:{line}{', in a function' if in_function else ''}"
        steps.append(f"{b}   [{where}]")
    return "\n    -> ".join(steps)


def cycles_report(graph, root: Path = PACKAGE) -> list[str]:
    """One cycle of each strongly connected component, as `describe_cycle` words it."""
    return [describe_cycle(graph, a_cycle(graph, comp), root) for comp in strongly_connected(graph)]


def reachable(graph, start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for w in graph[todo.pop()]:
            if w not in seen:
                seen.add(w)
                todo.append(w)
    return seen


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert "ppo_jax.trainer.config" in graph and "ppo_jax.trainer.stages.ppo.trainer" in graph
    cycles = cycles_report(graph)
    assert not cycles, "import cycles in ppo_jax:\n  " + "\n  ".join(cycles)


def test_imports_point_down_the_layers():
    graph = import_graph()
    wrong = [f"{m} imports {t}   [line {line}]"
             for lower, above in LAYERS for m, edges in graph.items()
             if m == lower or m.startswith(lower + ".")
             for t, (line, _) in edges.items() if any(t == a or t.startswith(a + ".") for a in above)]
    assert not wrong, "imports against the layers (docs/contracts.md):\n  " + "\n  ".join(wrong)


def test_the_config_imports_nothing_above_it():
    """The config is a leaf of the trainer: nothing it reads (directly or not) reads the config,
    and nothing of `trainer.stages` is among what it reads (the stage names live in the config)."""
    graph = import_graph()
    for name in CONFIG_MODULES:
        below = reachable(graph, name)
        above = {m for m in graph if name in reachable(graph, m)}
        assert not below & above, f"{name} imports modules that import it: {sorted(below & above)}"
        stages = sorted(m for m in below if m.startswith("ppo_jax.trainer.stages"))
        assert not stages, f"{name} imports {stages}"


def test_a_cycle_closed_by_a_function_level_import_is_found(tmp_path):
    """The cycle this test was written for: the config imported `stages` for its `Stage` type,
    and `stages.trainer_class` imports the trainers (inside the function), which import the
    config. The report names each module and the line of each import."""
    files = {
        "pkg/__init__.py": "",
        "pkg/config.py": "from pkg.stages import Stage\n",
        "pkg/stages/__init__.py": """\
            from typing import TYPE_CHECKING
            Stage = str
            if TYPE_CHECKING:
                from pkg.unused import Nothing
            def trainer_class():
                from pkg.stages.ppo import PPOTrainer
                return PPOTrainer
            """,
        "pkg/stages/ppo.py": "from ..config import Stage\nclass PPOTrainer: pass\n",
        "pkg/unused.py": "import pkg.config\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(textwrap.dedent(text))
    graph = import_graph(tmp_path / "pkg")
    assert graph["pkg.stages"] == {"pkg.stages.ppo": (6, True)}  # TYPE_CHECKING import left out
    assert graph["pkg.stages.ppo"] == {"pkg.config": (1, False)}  # relative import resolved
    (report,) = cycles_report(graph, tmp_path / "pkg")
    assert report.splitlines() == [
        "pkg.config",
        "    -> pkg.stages   [pkg/config.py:1]",
        "    -> pkg.stages.ppo   [pkg/stages/__init__.py:6, in a function]",
        "    -> pkg.config   [pkg/stages/ppo.py:1]",
    ]
