"""PPO clipped policy loss and clipped value loss, with micro-batch-exact token means.

Token reduction: without ``loss_normalizer`` the loss and every stat are masked token means
over this call's ``mask``. With ``loss_normalizer = N`` (the total number of valid tokens of the
whole minibatch, a Python number or traced scalar) the loss and every stat are
``masked_sum / N``: summing ``(loss, stats)`` over the micro-batches of a minibatch
(``jax.tree.map(jnp.add, ...)``) gives exactly the minibatch token means — sums divided by the
total token count, never means of means. Stats are
``stop_gradient``-ed scalars with a fixed set of keys.

Masked slots may hold NaN/inf in any input: they are replaced with ``jnp.where`` before any
arithmetic, so they reach neither the loss nor its gradient.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ppo_jax.core import validation as V
from ppo_jax.core.masked import safe_divide
from ppo_jax.core.registry import register_policy_loss, register_value_loss


def _reducer(valid: jax.Array, dtype, loss_normalizer: Any):
    """Returns ``reduce(x)``: masked token sum over ``valid`` divided by the normalizer."""
    if loss_normalizer is None:
        den = jnp.sum(valid, dtype=dtype)
    else:
        V.check_nonnegative("loss_normalizer", loss_normalizer)
        den = V.as_scalar("loss_normalizer", loss_normalizer).astype(dtype)

    def reduce(x: jax.Array) -> jax.Array:
        return safe_divide(jnp.sum(jnp.where(valid, x.astype(dtype), 0)), den)

    return reduce


def _prepare(names: tuple[str, ...], arrays: tuple[Any, ...], mask: Any):
    out = [V.as_float(n, a, ndim=2) for n, a in zip(names, arrays)]
    V.same_shape(**dict(zip(names, out)))
    valid = V.as_valid("mask", mask, out[0].shape)
    dtype = jnp.result_type(*out)
    return [jnp.where(valid, a, 0).astype(dtype) for a in out], valid, dtype


@register_policy_loss("ppo_clip")
def policy_loss(
    logprobs: jax.Array,
    old_logprobs: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    cliprange: Any,
    cliprange_high: Any = None,
    dual_clip: Any = None,
    loss_normalizer: Any = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """PPO clipped surrogate loss (to minimise), optionally asymmetric and dual-clipped.

    ``r = exp(lp - old)`` (the log-ratio is set to 0 on masked slots before ``exp``);
    ``l = max(-A r, -A clip(r, 1 - cliprange, 1 + cliprange_high))`` (``cliprange_high``
    defaults to ``cliprange``); with ``dual_clip = c > 1``, ``l = min(l, -c A)`` where ``A < 0``.
    ``loss = token_mean(l)`` (see module doc for ``loss_normalizer``).
    Sources: Schulman et al. 2017 eq. 7 (sign flipped) as in TRL 0.11 ``PPOTrainer.loss``;
    asymmetric "clip-higher" from DAPO (Yu et al. 2025, eq. 10); dual-clip from Ye et al. 2020
    ("Mastering Complex Control in MOBA Games with Deep RL", eq. 5).

    Args:
      logprobs: ``[B, T]`` float, new log-probs (the differentiated input).
      old_logprobs: ``[B, T]`` float, log-probs at rollout time.
      advantages: ``[B, T]`` float (whitened GAE advantages; treated as constants).
      mask: ``[B, T]`` 0/1 response mask.
      cliprange: epsilon (low side, and high side unless ``cliprange_high``).
      cliprange_high: optional epsilon for the high side.
      dual_clip: optional constant ``c > 1`` bounding the loss of negative-advantage tokens.
      loss_normalizer: optional total valid-token count of the minibatch.

    Returns:
      ``(loss, stats)``: scalar loss; stats ``clipfrac`` (share of tokens where the clipped
      term is the larger), ``dual_clipfrac`` (share capped by dual-clip; 0 when off),
      ``approxkl`` (``0.5 (lp - old)^2``), ``policykl`` (``old - lp``), ``ratio`` (mean ``r``),
      ``pg_loss`` (= loss), all token means / normalised sums.

    Raises:
      ValueError: wrong ranks / dtypes / shapes; a clip range or ``dual_clip`` that is not a
        numeric scalar; static ``cliprange < 0``, ``cliprange_high < 0``, ``dual_clip <= 1``,
        ``loss_normalizer < 0``.
    """
    V.check_nonnegative("cliprange", cliprange)
    if cliprange_high is not None:
        V.check_nonnegative("cliprange_high", cliprange_high)
    if dual_clip is not None:
        V.check_positive("dual_clip", dual_clip, strictly_greater_than=1.0)
    (lp, old, adv), valid, dtype = _prepare(
        ("logprobs", "old_logprobs", "advantages"), (logprobs, old_logprobs, advantages), mask
    )
    reduce = _reducer(valid, dtype, loss_normalizer)
    adv = jax.lax.stop_gradient(adv)
    old = jax.lax.stop_gradient(old)
    cliprange = V.as_scalar("cliprange", cliprange).astype(dtype)
    high = cliprange if cliprange_high is None else V.as_scalar("cliprange_high", cliprange_high).astype(dtype)
    if dual_clip is not None:
        dual_clip = V.as_scalar("dual_clip", dual_clip).astype(dtype)

    log_ratio = lp - old  # 0 on masked slots: both were replaced by 0
    ratio = jnp.exp(log_ratio)
    pg1 = -adv * ratio
    pg2 = -adv * jnp.clip(ratio, 1.0 - cliprange, 1.0 + high)
    per_token = jnp.maximum(pg1, pg2)
    clipped = pg2 > pg1
    if dual_clip is None:
        dual_clipped = jnp.zeros_like(clipped)
    else:
        cap = -adv * dual_clip
        dual_clipped = (adv < 0) & (per_token > cap)
        per_token = jnp.where(adv < 0, jnp.minimum(per_token, cap), per_token)

    loss = reduce(per_token)
    stats = {
        "pg_loss": loss,
        "clipfrac": reduce(clipped),
        "dual_clipfrac": reduce(dual_clipped),
        "approxkl": reduce(0.5 * log_ratio * log_ratio),
        "policykl": reduce(-log_ratio),
        "ratio": reduce(ratio),
    }
    return loss, jax.lax.stop_gradient(stats)


@register_value_loss("clipped_mse")
def value_loss(
    values: jax.Array,
    old_values: jax.Array,
    returns: jax.Array,
    mask: jax.Array,
    *,
    cliprange_value: Any,
    loss_normalizer: Any = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Clipped value loss ``0.5 token_mean(max((V - R)^2, (clip(V, old - c, old + c) - R)^2))``.

    Sources: TRL 0.11 ``PPOTrainer.loss`` (value part); DeepSpeed-Chat ``critic_loss_fn``;
    PPO2 value clipping (Dhariwal et al., OpenAI Baselines).

    Args:
      values: ``[B, T]`` float, new critic values (the differentiated input).
      old_values: ``[B, T]`` float, values at rollout time.
      returns: ``[B, T]`` float, GAE returns (treated as constants).
      mask: ``[B, T]`` 0/1 response mask.
      cliprange_value: ``c``, the allowed move of the value from ``old_values``.
      loss_normalizer: optional total valid-token count of the minibatch (see module doc).

    Returns:
      ``(loss, stats)``: scalar loss; stats ``vf_loss`` (= loss), ``vf_clipfrac`` (share of
      tokens where the clipped error is the larger), ``value_error`` (``(V - R)^2``),
      ``vpred`` (mean ``V``), all token means / normalised sums.

    Raises:
      ValueError: wrong ranks / dtypes / shapes; ``cliprange_value`` not a numeric scalar;
        static ``cliprange_value < 0`` or ``loss_normalizer < 0``.
    """
    V.check_nonnegative("cliprange_value", cliprange_value)
    (v, old, ret), valid, dtype = _prepare(
        ("values", "old_values", "returns"), (values, old_values, returns), mask
    )
    reduce = _reducer(valid, dtype, loss_normalizer)
    old = jax.lax.stop_gradient(old)
    ret = jax.lax.stop_gradient(ret)
    cliprange_value = V.as_scalar("cliprange_value", cliprange_value).astype(dtype)

    v_clipped = jnp.clip(v, old - cliprange_value, old + cliprange_value)
    err1 = (v - ret) ** 2
    err2 = (v_clipped - ret) ** 2
    loss = 0.5 * reduce(jnp.maximum(err1, err2))
    stats = {
        "vf_loss": loss,
        "vf_clipfrac": reduce(err2 > err1),
        "value_error": reduce(err1),
        "vpred": reduce(v),
    }
    return loss, jax.lax.stop_gradient(stats)
