"""Every dotted name of the package that a docstring or a doc cites exists.

Cited names are read from the docstrings (module, class, function) of every module under
ppo_jax/ and from README.md and docs/*.md:

- full names, `ppo_jax.rollout.engine.PagedEngine`;
- short names that start with a subpackage of ppo_jax (`rollout.engine`, `core.gae`) or of
  ppo_jax.trainer (`stages.ppo.update`, `lifecycle.resume`), resolved against `ppo_jax.`,
  `ppo_jax.trainer.` and, in a docstring, the package of its module (a sibling module:
  `rewards.text_scores` in stages/ppo/ is `stages.ppo.rewards.text_scores`); any will do.

Not citations: a name right after a dot (`cfg.data.prompts`), a config key (`data.prompts`,
`config.stage`), a file name (`config.json`), and a short name that starts with a variable: a
parameter of the function whose docstring it is in (`models.actor`), or a name a doc's code
blocks assign (`trainer = PPOTrainer(cfg)`, then `trainer.learn`). docs/history.md is left out:
it names what modules were called before they moved.

A name exists when its longest module prefix imports and each further part is an attribute (a
submodule, class, function, constant) or a dataclass field. Modules are imported, nothing is
compiled. The failure lists every missing name with the file and line that cite it.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ppo_jax"
DOCS = [ROOT / "README.md",
        *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "history.md")]

TOP = ("core", "models", "rollout", "parallel", "aot", "trainer")
TRAINER = ("stages", "config", "data", "loading", "tracking", "environments", "rewards", "host",
           "lifecycle")
# a file name, not a module path: `config.json`, `results.md`
FILE_SUFFIXES = {"json", "jsonl", "yaml", "yml", "py", "md", "png", "txt", "toml", "csv", "sh",
                 "gguf", "safetensors", "parquet", "jinja", "lock", "log"}

_DOTTED = r"(?:\.[A-Za-z_]\w*)+"
# not inside a longer word or path, and not cut from one (`config.resume-<step>.json`)
FULL = re.compile(r"(?<![\w./-])(ppo_jax" + _DOTTED + r")(?![\w<>-])")
SHORT = re.compile(r"(?<![\w./-])((?:" + "|".join(TOP + TRAINER) + ")" + _DOTTED + r")(?![\w<>-])")
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
ASSIGNED = re.compile(r"^\s*([A-Za-z_]\w*(?:\s*,\s*[A-Za-z_]\w*)*)\s*=(?!=)", re.MULTILINE)


def docstrings(path: Path):
    """(line, text, parameter names) of each docstring of a module: its own, its classes' and
    its functions' (only a function has parameters)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                    and isinstance(body[0].value.value, str)):
                params = set()
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    a = node.args
                    params = {x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs,
                                              *filter(None, (a.vararg, a.kwarg)))}
                yield body[0].value.lineno, body[0].value.value, frozenset(params)


def assigned_in_code(page_text: str) -> frozenset[str]:
    """The names a page's fenced code blocks assign (`trainer = ...`, `state, place = ...`)."""
    return frozenset(name.strip() for block in FENCE.findall(page_text)
                     for names in ASSIGNED.findall(block) for name in names.split(","))


def cited(text: str, first_line: int = 1, variables: frozenset[str] = frozenset(),
          package: str = ""):
    """(line, name as written, full names to try) of each name `text` cites; a short name that
    starts with one of `variables` is a variable's attribute, not a citation, and one in the
    `package` of the module being read may name a sibling module."""
    short = ("ppo_jax.", "ppo_jax.trainer.", *([package + "."] if package else []))
    for pattern, prefixes in ((FULL, ("",)), (SHORT, short)):
        for m in pattern.finditer(text):
            name = m.group(1)
            head, _, rest = name.partition(".")
            if (name.rsplit(".", 1)[1] in FILE_SUFFIXES or is_config_key(name)
                    or (head == "config" and is_config_key(rest))
                    or (pattern is SHORT and head in variables)):
                continue
            yield first_line + text.count("\n", 0, m.start()), name, [p + name for p in prefixes]


@functools.lru_cache(maxsize=1)
def _config_class():
    from ppo_jax.trainer.config import Config

    return Config


def is_config_key(name: str) -> bool:
    """A key of the typed config (`data.prompts`, `data.task.kwargs`), or a section of it."""
    cls = _config_class()
    for part in name.split("."):
        fields = ({f.name: f for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls)
                  else {})
        if part not in fields:
            return False
        cls = fields[part].type
        if isinstance(cls, str):  # postponed annotations: the section's class by its name
            cls = getattr(importlib.import_module(_config_class().__module__), cls, None)
    return True


def resolve(name: str) -> str | None:
    """None when `name` exists, else why not (the first part that does not)."""
    return _resolve(name)[1]


@functools.lru_cache(maxsize=None)
def _resolve(name: str) -> tuple[int, str | None]:
    """(parts resolved, None or why the next one does not)."""
    parts = name.split(".")
    try:
        obj = importlib.import_module(parts[0])
    except ImportError as e:
        return 0, f"cannot import {parts[0]}: {e}"
    path = parts[0]
    for depth, part in enumerate(parts[1:], start=1):
        path = f"{path}.{part}"
        if hasattr(obj, part):
            obj = getattr(obj, part)
            continue
        if isinstance(obj, type) and dataclasses.is_dataclass(obj) and part in {
                f.name for f in dataclasses.fields(obj)}:
            return len(parts), None  # a field with no class-level default; its value unchecked
        if getattr(obj, "__path__", None) is not None:  # a package: the part may be a submodule
            try:
                obj = importlib.import_module(path)
                continue
            except ModuleNotFoundError as e:
                if e.name != path:
                    return depth, f"importing {path}: {e}"
            except ImportError as e:
                return depth, f"importing {path}: {e}"
        return depth, f"no {part} in {path.rsplit('.', 1)[0]}"
    return len(parts), None


def citations():
    """(file, line, name as written, full names to try) over the docstrings and the docs."""
    for path in sorted(PACKAGE.rglob("*.py")):
        package = ".".join(path.relative_to(ROOT).parent.parts)
        for line, text, params in docstrings(path):
            for hit in cited(text, line, params, package):
                yield (path, *hit)
    for page in DOCS:
        text = page.read_text(encoding="utf-8")
        for hit in cited(text, 1, assigned_in_code(text)):
            yield (page, *hit)


def missing_names() -> list[str]:
    out = []
    for path, line, name, candidates in citations():
        prefix = {c: c.count(".") - name.count(".") for c in candidates}  # parts put before it
        results = [(depth - prefix[c], why) for c in candidates for depth, why in [_resolve(c)]]
        if all(why for _, why in results):
            _, why = max(results, key=lambda r: r[0])  # the reading that got furthest into it
            out.append(f"{path.relative_to(ROOT)}:{line}: {name} ({why})")
    return out


def test_every_cited_name_exists():
    missing = missing_names()
    assert not missing, (f"{len(missing)} cited names do not exist:\n  " + "\n  ".join(missing))


def test_the_reader_finds_names_and_leaves_the_rest():
    text = ("`ppo_jax.core.gae` and `rollout.engine`, `stages.ppo.update`; not `cfg.data.prompts`,"
            " `data.prompts=x`, `config.stage`, `config.json`, `config.resume-<step>.json`,"
            " ppo_jax/core/gae.py or `models.actor` (a parameter)")
    names = [name for _, name, _ in cited(text, 1, frozenset({"models"}))]
    assert names == ["ppo_jax.core.gae", "rollout.engine", "stages.ppo.update"]
    code = "```python\ntrainer = PPOTrainer(cfg)\nstate, place = trainer.state, trainer.place\n```"
    assert assigned_in_code(code) == {"trainer", "state", "place"}
    assert resolve("ppo_jax.trainer.lifecycle.checkpoint.Checkpointer") is None
    assert resolve("ppo_jax.trainer.state.TrainState.params") is None  # a dataclass field
    assert resolve("ppo_jax.core.no_such_name") == "no no_such_name in ppo_jax.core"
    assert resolve("ppo_jax.no_such_module").startswith("no no_such_module in ppo_jax")
