"""The hyper-parameter checks of the built-in policy losses: one validator per loss.

A registered loss may carry ``fn.check_kwargs(**kwargs)``: it takes the keyword arguments of
the trainer's call (``cliprange`` and, when set, ``cliprange_high`` / ``dual_clip``, plus the
entries of ``ppo.policy_loss_kwargs``) and raises ``LossKwargError`` naming the keyword and
its value. The config runs it when it loads (``trainer.config.loss_checks``), before any
compile; each built-in loss also runs it on its own arguments, so a direct call is checked
the same way. Only static Python / numpy numbers are range-checked: a traced value passes.

``fn.reads_cliprange = False`` marks a loss that takes the trainer's ``cliprange`` (the
trainer always passes it) and ignores it; the config then refuses a ``ppo.cliprange`` set
away from its default for it (``trainer.config.no_effect``).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Optional

import jax

from ppo_jax.core import validation as V


class LossKwargError(ValueError):
    """A bad hyper-parameter of a loss: ``key`` (e.g. ``"tau_pos"``), its ``value``, ``why``."""

    def __init__(self, key: str, value: Any, why: str):
        self.key, self.value, self.why = key, value, why
        super().__init__(f"{key}={value!r} {why}")


def _static(key: str, value: Any) -> Optional[float]:
    """``value`` as a float when static; None when traced.

    Raises:
      LossKwargError: not a number (a string, a bool, None), or not finite.
    """
    if isinstance(value, jax.Array) and value.ndim == 0:
        return None
    if not V.is_static_number(value):
        raise LossKwargError(key, value, "must be a number")
    if not math.isfinite(float(value)):
        raise LossKwargError(key, value, "must be a finite number")
    return float(value)


def check_positive(kwargs: Mapping[str, Any], key: str) -> None:
    """``kwargs[key] > 0`` when present (a temperature, a coefficient of a divisor).

    Raises:
      LossKwargError: naming ``key``.
    """
    if key in kwargs and (v := _static(key, kwargs[key])) is not None and not v > 0:
        raise LossKwargError(key, kwargs[key], "must be > 0")


def check_nonnegative(kwargs: Mapping[str, Any], key: str) -> None:
    """``kwargs[key] >= 0`` when present (a clip range, a penalty coefficient).

    Raises:
      LossKwargError: naming ``key``.
    """
    if key in kwargs and (v := _static(key, kwargs[key])) is not None and not v >= 0:
        raise LossKwargError(key, kwargs[key], "must be >= 0")


def check_fraction(kwargs: Mapping[str, Any], key: str) -> None:
    """``kwargs[key]`` in ``(0, 1]`` when present (a fraction of the tokens).

    Raises:
      LossKwargError: naming ``key``.
    """
    if key in kwargs and (v := _static(key, kwargs[key])) is not None and not 0 < v <= 1:
        raise LossKwargError(key, kwargs[key], "must lie in (0, 1] (a fraction of the tokens)")


def check_band(kwargs: Mapping[str, Any], low_key: str, high_key: str) -> None:
    """``kwargs[low_key] <= kwargs[high_key]`` when both are present and static.

    Raises:
      LossKwargError: naming ``low_key`` and the high bound.
    """
    if low_key in kwargs and high_key in kwargs:
        low, high = _static(low_key, kwargs[low_key]), _static(high_key, kwargs[high_key])
        if low is not None and high is not None and low > high:
            raise LossKwargError(low_key, kwargs[low_key],
                                 f"must be <= {high_key}={kwargs[high_key]!r} (an empty band)")


def check_clip_ranges(kwargs: Mapping[str, Any]) -> None:
    """The trainer's ``cliprange`` / ``cliprange_high`` (>= 0) and no ``dual_clip`` under 1.

    Raises:
      LossKwargError: naming the key.
    """
    for key in ("cliprange", "cliprange_high"):
        if kwargs.get(key) is not None:
            check_nonnegative(kwargs, key)
    if kwargs.get("dual_clip") is not None:
        v = _static("dual_clip", kwargs["dual_clip"])
        if v is not None and not v > 1:
            raise LossKwargError("dual_clip", kwargs["dual_clip"], "must be > 1")


def check_loss_kwargs(fn: Callable, kwargs: Mapping[str, Any]) -> None:
    """Runs ``fn.check_kwargs`` on ``kwargs`` when ``fn`` has one.

    Raises:
      LossKwargError: from the validator.
    """
    check = getattr(fn, "check_kwargs", None)
    if check is not None:
        check(**kwargs)


def reads_cliprange(fn: Callable) -> bool:
    """Whether policy loss ``fn`` reads the trainer's ``cliprange`` (``fn.reads_cliprange``)."""
    return getattr(fn, "reads_cliprange", True)
