"""Masked reductions: sum, mean, variance and whitening over valid tokens.

``mask`` is a 0/1 array (bool, int or float) of the same shape as ``x``; any non-zero entry is
a valid token. Masked-out entries of ``x`` may hold anything, NaN and inf included: they are
replaced with ``jnp.where`` before any arithmetic, so they reach neither values nor gradients.

Formulas follow TRL 0.11 ``trl.core.masked_mean / masked_var / masked_whiten``, with two
guards TRL does not have: an empty mask gives 0 instead of NaN, and Bessel's correction is
skipped when fewer than two entries are valid (TRL raises or divides by zero).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ppo_jax.core import validation as V

WHITEN_EPS = 1e-8  # TRL 0.11: ``(x - mean) * rsqrt(var + 1e-8)``


def safe_divide(num: jax.Array, den: Any) -> jax.Array:
    """``num / den`` where ``den > 0``, else 0. Gradient-safe (no 0/0 in either branch)."""
    den = jnp.asarray(den, dtype=num.dtype)
    ok = den > 0
    return jnp.where(ok, num / jnp.where(ok, den, 1), jnp.zeros_like(num))


def _prepare(x: Any, mask: Any) -> tuple[jax.Array, jax.Array]:
    """Validated ``(x with masked entries replaced by 0, valid)``: NaN there cannot reach a
    value, nor a gradient through a product (``0 * NaN`` in a backward pass)."""
    x = V.as_float("x", x)
    valid = V.as_valid("mask", mask, x.shape)
    return jnp.where(valid, x, 0), valid


def masked_sum(x: jax.Array, mask: jax.Array, axis: int | tuple[int, ...] | None = None) -> jax.Array:
    """Sum of ``x`` over valid entries.

    Args:
      x: float array, any shape (e.g. ``[B, T]``).
      mask: 0/1 array, same shape as ``x``.
      axis: axes to reduce; ``None`` reduces all.

    Returns:
      The sum, float (at least float32), with ``axis`` removed.

    Raises:
      ValueError: ``x`` is not floating point, or ``mask`` has a different shape / bad dtype.
    """
    x, valid = _prepare(x, mask)
    return jnp.sum(jnp.where(valid, x, 0), axis=axis)


def masked_count(mask: jax.Array, axis: int | tuple[int, ...] | None = None, dtype=jnp.float32) -> jax.Array:
    """Number of valid entries of ``mask`` along ``axis`` (all axes when ``None``), as ``dtype``.

    Raises:
      ValueError: ``mask`` is not a bool/int/float array.
    """
    return jnp.sum(V.as_valid("mask", mask), axis=axis, dtype=dtype)


def masked_mean(x: jax.Array, mask: jax.Array, axis: int | tuple[int, ...] | None = None) -> jax.Array:
    """Mean of ``x`` over valid entries: ``sum(x[mask]) / count(mask)``; 0 where nothing is valid.

    Source: TRL 0.11 ``trl.core.masked_mean`` (which gives NaN on an empty mask).

    Args:
      x: float array, any shape (e.g. ``[B, T]``).
      mask: 0/1 array, same shape as ``x``.
      axis: axes to reduce; ``None`` reduces all (a token mean over the batch).

    Returns:
      The mean, float (at least float32), with ``axis`` removed.

    Raises:
      ValueError: ``x`` is not floating point, or ``mask`` has a different shape / bad dtype.
    """
    x, valid = _prepare(x, mask)
    total = jnp.sum(jnp.where(valid, x, 0), axis=axis)
    count = jnp.sum(valid, axis=axis, dtype=x.dtype)
    return safe_divide(total, count)


def masked_var(x: jax.Array, mask: jax.Array, unbiased: bool = True) -> jax.Array:
    """Variance of ``x`` over all valid entries (a scalar).

    ``var = mean((x - mean)^2)``, times ``n / (n - 1)`` when ``unbiased`` and ``n >= 2``.
    Bessel's correction is skipped for ``n < 2``, so one valid entry gives 0, not NaN or inf.
    Source: TRL 0.11 ``trl.core.masked_var``.

    Args:
      x: float array, any shape (e.g. ``[B, T]``).
      mask: 0/1 array, same shape as ``x``.
      unbiased: apply Bessel's correction (static Python bool).

    Returns:
      Scalar variance, float (at least float32).

    Raises:
      ValueError: ``x`` is not floating point, or ``mask`` has a different shape / bad dtype.
    """
    x, valid = _prepare(x, mask)
    count = jnp.sum(valid, dtype=x.dtype)
    mean = safe_divide(jnp.sum(jnp.where(valid, x, 0)), count)
    centered = jnp.where(valid, x - mean, 0)
    var = safe_divide(jnp.sum(centered * centered), count)
    if unbiased:
        bessel = jnp.where(count > 1, count / jnp.where(count > 1, count - 1, 1), 1)
        var = var * bessel
    return var


def masked_whiten(x: jax.Array, mask: jax.Array, shift_mean: bool = True) -> jax.Array:
    """Whitens ``x`` with the mean and (unbiased) variance of its valid entries.

    ``out = (x - mean) / sqrt(var + 1e-8)``, plus ``mean`` again when ``shift_mean`` is False
    (rewards whitening keeps the mean). Valid entries only; masked entries of the output are 0
    (TRL leaves them as garbage). With fewer than two valid entries the variance is 0 and the
    output stays finite. Source: TRL 0.11 ``trl.core.masked_whiten``.

    Args:
      x: float array, any shape (e.g. advantages ``[B, T]``).
      mask: 0/1 array, same shape as ``x``.
      shift_mean: subtract the mean (True) or keep it (False); static Python bool.

    Returns:
      Array of ``x``'s shape, float (at least float32).

    Raises:
      ValueError: ``x`` is not floating point, or ``mask`` has a different shape / bad dtype.
    """
    x, valid = _prepare(x, mask)
    count = jnp.sum(valid, dtype=x.dtype)
    mean = safe_divide(jnp.sum(jnp.where(valid, x, 0)), count)
    var = masked_var(x, valid, unbiased=True)
    whitened = (x - mean) * jax.lax.rsqrt(var + WHITEN_EPS)
    if not shift_mean:
        whitened = whitened + mean
    return jnp.where(valid, whitened, 0)


_EV_RELATIVE_TOLERANCE = 1e-10  # Var(returns) below this x the mean squares is rounding, not signal


def explained_variance(values: jax.Array, returns: jax.Array, mask: jax.Array) -> jax.Array:
    """How much of the returns' variance the critic's values explain, over valid tokens:
    ``1 - Var(returns - values) / Var(returns)`` (population variances, ``masked_var``).

    1: the values equal the returns; 0: no better than a constant; negative: worse than one.
    The result is 0 where ``Var(returns)`` is 0 or at rounding level, at most ``1e-10`` times
    ``mean(returns^2) + mean(values^2)``. There is nothing to explain then: no valid token, or
    every response got the same score and the float32 returns ``A + V`` differ only in their
    last bits. The plain ratio there read -2e13 in an RLVR run where all 64 scores were 0.1.
    Source: the critic diagnostic ``explained_variance(y_pred, y_true)`` of OpenAI Baselines
    and Stable-Baselines3, here masked.

    Args:
      values: ``[B, T]`` float critic values (the experience's old values).
      returns: ``[B, T]`` float critic targets (``compute_gae`` / ``decoupled_gae`` returns).
      mask: ``[B, T]`` 0/1.

    Returns:
      Scalar float (at least float32).

    Raises:
      ValueError: ``values`` or ``returns`` not floating point, shapes differ, bad ``mask``.
    """
    values, valid = _prepare(values, mask)
    returns, _ = _prepare(returns, valid)
    var_returns = masked_var(returns, valid, unbiased=False)
    var_error = masked_var(returns - values, valid, unbiased=False)
    scale = masked_mean(returns * returns, valid) + masked_mean(values * values, valid)
    ok = var_returns > _EV_RELATIVE_TOLERANCE * scale
    return jnp.where(ok, 1 - var_error / jnp.where(ok, var_returns, 1), 0)
