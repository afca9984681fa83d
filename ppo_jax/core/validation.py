"""Trace-time argument checks shared by every public function in ``ppo_jax.core``.

Shapes and dtypes are static under ``jax.jit``, so these checks run in Python while tracing,
before any compile work, and raise ``ValueError`` naming the argument, its shape and dtype.
They never look at values (values are traced).
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np


def _describe(x: jax.Array) -> str:
    return f"shape {tuple(x.shape)} and dtype {x.dtype}"


def as_float(name: str, x: Any, ndim: int | None = None) -> jax.Array:
    """Returns ``x`` as an array of a floating dtype, upcast to at least float32.

    Raises:
      ValueError: ``x`` is not floating point, or its rank is not ``ndim``.
    """
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{name} must be a floating-point array, got {_describe(x)}")
    if ndim is not None and x.ndim != ndim:
        raise ValueError(f"{name} must have rank {ndim}, got {_describe(x)}")
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def as_int(name: str, x: Any, ndim: int | None = None) -> jax.Array:
    """Returns ``x`` as an integer array (token ids).

    Raises:
      ValueError: ``x`` is not an integer array, or its rank is not ``ndim``.
    """
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(f"{name} must be an integer array, got {_describe(x)}")
    if ndim is not None and x.ndim != ndim:
        raise ValueError(f"{name} must have rank {ndim}, got {_describe(x)}")
    return x


def as_valid(name: str, mask: Any, shape: Sequence[int] | None = None) -> jax.Array:
    """Returns a boolean "valid token" array from a 0/1 mask of bool, int or float dtype.

    Any non-zero entry counts as valid; the mask is binary, not a weight.

    Raises:
      ValueError: the dtype is not bool/int/float, or the shape differs from ``shape``.
    """
    mask = jnp.asarray(mask)
    if not (
        mask.dtype == jnp.bool_
        or jnp.issubdtype(mask.dtype, jnp.integer)
        or jnp.issubdtype(mask.dtype, jnp.floating)
    ):
        raise ValueError(f"{name} must be a bool, integer or float 0/1 array, got {_describe(mask)}")
    if shape is not None and tuple(mask.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {_describe(mask)}")
    return mask != 0


def same_shape(**arrays: jax.Array) -> tuple[int, ...]:
    """Checks that all keyword arrays share the first one's shape; returns that shape.

    Raises:
      ValueError: naming the first argument whose shape differs.
    """
    items = list(arrays.items())
    ref_name, ref = items[0]
    for name, x in items[1:]:
        if tuple(x.shape) != tuple(ref.shape):
            raise ValueError(
                f"{name} has shape {tuple(x.shape)} but {ref_name} has shape {tuple(ref.shape)}"
            )
    return tuple(ref.shape)


def is_static_number(x: Any) -> bool:
    """True for a Python / numpy scalar whose value is known at trace time."""
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)


def check_positive(name: str, x: Any, *, strictly_greater_than: float = 0.0) -> None:
    """Checks a hyper-parameter when it is a static number (traced values are not checked).

    Raises:
      ValueError: ``x`` is a static number ``<= strictly_greater_than``.
    """
    if is_static_number(x) and not float(x) > strictly_greater_than:
        raise ValueError(f"{name} must be > {strictly_greater_than}, got {x!r}")


def check_nonnegative(name: str, x: Any) -> None:
    """Checks a static hyper-parameter is ``>= 0`` (traced values are not checked).

    Raises:
      ValueError: ``x`` is a static number ``< 0``.
    """
    if is_static_number(x) and not float(x) >= 0.0:
        raise ValueError(f"{name} must be >= 0, got {x!r}")


def as_scalar(name: str, x: Any) -> jax.Array:
    """Returns a numeric scalar (Python number, 0-d numpy / jax array, traced or not) as a 0-d
    array.

    Raises:
      ValueError: ``x`` is not a scalar or not numeric (strings and None included).
    """
    try:
        arr = jnp.asarray(x)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a numeric scalar, got {type(x).__name__} {x!r:.40}") from None
    if arr.ndim != 0:
        raise ValueError(f"{name} must be a scalar, got {_describe(arr)}")
    if arr.dtype == jnp.bool_ or not (
        jnp.issubdtype(arr.dtype, jnp.floating) or jnp.issubdtype(arr.dtype, jnp.integer)
    ):
        raise ValueError(f"{name} must be a numeric scalar, got {_describe(arr)}")
    return arr


def as_scalar_or_rows(name: str, x: Any, rows: int) -> jax.Array:
    """Returns a numeric scalar as a 0-d array (``as_scalar``), or a numeric ``[rows]`` array
    (one value per batch row) as it is.

    Raises:
      ValueError: ``x`` is neither a numeric scalar nor a numeric array of shape ``(rows,)``.
    """
    try:
        arr = jnp.asarray(x)
    except (TypeError, ValueError):
        return as_scalar(name, x)  # raises its error
    if arr.ndim == 0:
        return as_scalar(name, arr)
    if tuple(arr.shape) != (rows,) or arr.dtype == jnp.bool_ or not (
        jnp.issubdtype(arr.dtype, jnp.floating) or jnp.issubdtype(arr.dtype, jnp.integer)
    ):
        raise ValueError(f"{name} must be a numeric scalar or a [B] = ({rows},) array, got "
                         f"{_describe(arr)}")
    return arr
