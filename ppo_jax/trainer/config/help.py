"""The text of `python train.py --help-config`: every config key with its type, default and help
text, section by section, and the value a given config gives it where that differs."""

from __future__ import annotations

import dataclasses
import typing
from typing import Literal

from ppo_jax.trainer.config.schema import Config


def leaves(obj, prefix: str = ""):
    """(dotted key, value, resolved type) of every field of a config dataclass, depth first."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value, key = getattr(obj, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            yield from leaves(value, key + ".")
        else:
            yield key, value, hints[f.name]


def type_name(kind) -> str:
    """A field's type as `--help-config` shows it: `one of: a | b`, `float or null`, ..."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin is Literal:
        return "one of: " + " | ".join(map(str, args))
    if origin is typing.Union and type(None) in args:
        return " or ".join(type_name(a) for a in args if a is not type(None)) + " or null"
    if origin in (list, dict):
        return f"{origin.__name__}[{', '.join(type_name(a) for a in args)}]"
    return getattr(kind, "__name__", str(kind).replace("typing.", ""))


def _section_lines(obj, prefix: str, help_text: str, default_of: dict, given: dict,
                   name: str | None) -> list[str]:
    """The header and key lines of one section `obj` (keys `prefix` + field), its nested
    sections (e.g. `model.lora`) after its own keys."""
    lines = ["", f"[{prefix[:-1]}] {' '.join(help_text.split())}"]
    hints, nested = typing.get_type_hints(type(obj)), []
    for f in dataclasses.fields(obj):
        key, value = prefix + f.name, getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            nested.append((value, key + ".", f.metadata.get("help", "")))
            continue
        default = default_of[key]
        line = f"  {key}: {type_name(hints[f.name])} = {default!r}"
        if key in given and given[key] != default:
            line += f"   ({name or 'this config'}: {given[key]!r})"
        lines += [line, f"      {f.metadata.get('help', '')}"]
    for value, key, text in nested:
        lines += _section_lines(value, key, text, default_of, given, name)
    return lines


def describe(cfg: Config | None = None, name: str | None = None) -> str:
    """Every config key with its type, default and help text, section by section (the text of
    `python train.py --help-config`). With `cfg` (loaded from the file `name`), a value that
    differs from the default is shown too."""
    defaults, lines = Config(), []
    default_of = {k: v for k, v, _ in leaves(defaults)}
    given = {k: v for k, v, _ in leaves(cfg)} if cfg is not None else {}
    hints = typing.get_type_hints(Config)
    for sec in dataclasses.fields(Config):
        value = getattr(defaults, sec.name)
        if dataclasses.is_dataclass(value):
            lines += _section_lines(value, sec.name + ".", sec.metadata["help"], default_of,
                                    given, name)
            continue
        key, default = sec.name, default_of[sec.name]
        line = f"  {key}: {type_name(hints[sec.name])} = {default!r}"
        if key in given and given[key] != default:
            line += f"   ({name or 'this config'}: {given[key]!r})"
        lines += [line, f"      {sec.metadata.get('help', '')}"]
    return "\n".join(lines[1:] if lines and not lines[0] else lines)
