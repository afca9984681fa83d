#!/usr/bin/env python
"""Write docs/config.md: every config key with its type, default and meaning, as Markdown.

The page is rendered from the typed config (`ppo_jax.trainer.config.Config`: its dataclass
tree, each field's help text and `type_name`), the same source as `python train.py
--help-config`, so it cannot say something the config does not. Where `configs/default.yaml`
(the `make train` run) gives a key another value than the default, a `make train` column shows it.

  .venv/bin/python scripts/config_reference.py           # rewrite docs/config.md
  .venv/bin/python scripts/config_reference.py --check   # exit 1 when docs/config.md is stale

tests/test_docs.py fails when docs/config.md differs from what this script writes.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import sys
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "config.md"
DEFAULT_RUN = "configs/default.yaml"
COMMAND = ".venv/bin/python scripts/config_reference.py"


def _value(v) -> str:
    """A value as one would write it in YAML or after `--set` (null, true, [1, 2], text)."""
    if v is None or isinstance(v, (bool, list, dict)):
        return json.dumps(v)
    if isinstance(v, str):
        return v if v else '""'
    return repr(v)


def _cell(text: str) -> str:
    """Text for a Markdown table cell: one line; `|`, `*`, `<` and `>` escaped."""
    text = " ".join(str(text).split())
    for char, escaped in (("|", "\\|"), ("*", "\\*"), ("<", "&lt;"), (">", "&gt;")):
        text = text.replace(char, escaped)
    return text


def _code(v) -> str:
    return f"`{_value(v)}`".replace("|", "\\|")


def _rows(default_obj, given_obj, prefix: str):
    """(key, type, default, given, help) of every leaf of one dataclass, nested sections apart."""
    from ppo_jax.trainer.config import type_name

    hints = typing.get_type_hints(type(default_obj))
    leaves, sections = [], []
    for f in dataclasses.fields(default_obj):
        key = f"{prefix}{f.name}"
        default, given = getattr(default_obj, f.name), getattr(given_obj, f.name)
        if dataclasses.is_dataclass(default):
            sections.append((key, f, default, given))
        else:
            help_text = f.metadata.get("help", "")
            leaves.append((key, type_name(hints[f.name]), default, given, help_text))
    return leaves, sections


def _relative(path: str) -> str:
    """`path` inside the repository, or the module the config is imported from."""
    try:
        return Path(path).resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return "ppo_jax/trainer/config/__init__.py"


def _section_help(f, value) -> str:
    return (f.metadata.get("help") or type(value).__doc__ or "").strip()


def _table(leaves, given_column: bool) -> list[str]:
    """One table row per key; with `given_column`, the default run's value where it differs."""
    head = ["key", "type", "default"] + (["`make train`"] if given_column else []) + ["meaning"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for key, kind, default, given, help_text in leaves:
        cells = [f"`{key}`", _cell(kind), _code(default)]
        if given_column:
            cells.append(_code(given) if given != default else "")
        lines.append("| " + " | ".join(cells + [_cell(help_text)]) + " |")
    return lines


def _render_section(key, f, default_obj, given_obj, depth: int, given_column: bool) -> list[str]:
    leaves, sections = _rows(default_obj, given_obj, f"{key}.")
    lines = ["", f"{'#' * depth} `{key}`", "", " ".join(_section_help(f, default_obj).split()), ""]
    if leaves:
        lines += _table(leaves, given_column)
    for sub in sections:
        lines += _render_section(*sub, depth=depth + 1, given_column=given_column)
    return lines


NO_EFFECT_HEADING = "Settings refused where they have no effect"


def _no_effect_section() -> list[str]:
    """The table of `config.no_effect.NO_EFFECT`: key | refused when | why, one row per key
    (a run of keys with the same condition and reason shares a row), and one error it gives."""
    from ppo_jax.trainer.config import Config
    from ppo_jax.trainer.config.no_effect import NO_EFFECT, check_no_effect

    table = _relative(inspect.getsourcefile(check_no_effect))
    example = Config()
    example.ppo.advantage_estimator = "grpo"
    row = next(r for r in NO_EFFECT if r.key == "ppo.vf_coef" and r.when.holds(example))
    lines = [
        "", f"## {NO_EFFECT_HEADING}", "",
        "A setting that differs from its default where nothing reads it is refused at load "
        "(exit 2, before anything is compiled or written), the error naming it, its value, "
        "the settings that leave it unread, why, and what to set instead:", "",
        f"    error: {row.message(example, 0.5)}", "",
        "A value equal to the default is never refused, so a file may spell the defaults out "
        "and a run's `config.json` (every key) resumes. The conditions on the PPO sections "
        f"hold in `stage: ppo` only. The table is `NO_EFFECT` in `{table}`.", "",
        "| key | refused when | why |", "| --- | --- | --- |",
    ]
    groups: list[tuple[list[str], str, str]] = []
    for r in NO_EFFECT:
        why = f"{r.when.means} ({r.why})"
        if groups and groups[-1][1:] == (r.when.name, why):
            groups[-1][0].append(r.key)
        else:
            groups.append(([r.key], r.when.name, why))
    for keys, when, why in groups:
        cells = [", ".join(f"`{k}`" for k in keys), _cell(when), _cell(why)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def render() -> str:
    """The whole text of docs/config.md."""
    from ppo_jax.trainer.config import Config, load_config

    defaults, given = Config(), load_config(ROOT / DEFAULT_RUN)
    schema = _relative(inspect.getsourcefile(Config))
    given_column = dataclasses.asdict(defaults) != dataclasses.asdict(given)
    leaves, sections = _rows(defaults, given, "")
    default_run = (f"The `make train` column gives the value of `{DEFAULT_RUN}` where it differs "
                   "from the default." if given_column else
                   f"The defaults are the values `make train` runs with (`{DEFAULT_RUN}` changes "
                   "none of them).")
    intro = (
        "Every key of a run's config: its type, default and meaning, rendered from the typed "
        f"config (`{schema}`), the same source as `python train.py --help-config`. A key with "
        "a fixed set of values takes its list from the module that uses the name, so the config "
        "accepts a name exactly when the code does; a wrong key or value is refused at load "
        "time, naming the key and the accepted values. Set a key in a YAML file (`--config`) or "
        "on the command line (`--set ppo.kl_coef=0.1`, repeatable). "
        f"{default_run} `python train.py --config FILE --help-config` shows the values of any "
        "file beside the defaults.")
    lines = [
        "# Config reference",
        "",
        f"<!-- Generated by scripts/config_reference.py; do not edit. Regenerate: {COMMAND} -->",
        "",
        intro,
        "",
        "Sections: " + ", ".join(f"[`{k}`](#{k})" for k, *_ in sections) + "; and the "
        f"[{NO_EFFECT_HEADING.lower()}](#{NO_EFFECT_HEADING.lower().replace(' ', '-')}).",
        "",
        "## Top level",
        "",
    ]
    lines += _table(leaves, given_column)
    for sec in sections:
        lines += _render_section(*sec, depth=2, given_column=given_column)
    lines += _no_effect_section()
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when docs/config.md is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not OUT.is_file() or OUT.read_text(encoding="utf-8") != text:
            print(f"docs/config.md is stale: run {COMMAND}", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
