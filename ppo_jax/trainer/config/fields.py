"""The building blocks of the config schema: a field with its help text, a nested section, and
the error every config check raises (`config.schema` builds the tree from them)."""

from __future__ import annotations

from dataclasses import field
from typing import Any


class ConfigError(ValueError):
    """A config file, an override or a combination of fields is invalid."""


def opt(default: Any = None, help: str = "", *, factory=None):
    """A config field with its help text (`python train.py --help-config` prints it)."""
    if factory is not None:
        return field(default_factory=factory, metadata={"help": help})
    return field(default=default, metadata={"help": help})


def section(cls, help: str | None = None):
    """A nested config section; its help text is `help` or the class docstring."""
    return field(default_factory=cls, metadata={"help": (help or cls.__doc__ or "").strip()})
