"""A research fork's modules, imported by name before a run's config is read, so the names
they register (losses, estimators, reward functions, environments) resolve: `--import` of
train.py, `ppo_jax.generate` and `ppo_jax.evaluate`."""

from __future__ import annotations

import importlib
import os
import sys


def import_modules(names: list[str]) -> bool:
    """Import each `--import` module (a fork's registrations), from the working directory
    first. Returns False, after one `error: --import NAME: ...` line, when one fails in any way:
    not found, a syntax error, an exception at import, a name already registered."""
    if names:
        sys.path.insert(0, os.getcwd())  # modules of a research fork, next to where it runs
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - a fork's module failing at import, named
            what = "" if isinstance(e, ImportError) else f"{type(e).__name__}: "
            print(f"error: --import {name}: {what}{e}", file=sys.stderr)
            return False
    return True
