"""PPO clipped policy loss and clipped value loss, per token; the entropy and KL-loss terms.

The registered forms, ``ppo_clip_loss`` and ``clipped_value_loss``, take one ``LossInputs``
batch and return a PER-TOKEN loss ``[B, T]`` and per-token stats; the trainer reduces them once,
with ``core.aggregation``. ``policy_loss`` and ``value_loss`` are the design doc's scalar forms:
the token means of the per-token forms. With ``loss_normalizer = N``, the valid-token count of
the whole minibatch, every result is ``masked_sum / N``, so the sums of ``loss`` and ``stats``
over a minibatch's micro-batches are exactly the minibatch token means.

Masked slots may hold NaN/inf in any input: they are replaced with ``jnp.where`` before any
arithmetic, so they reach neither the loss nor its gradient.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ppo_jax.core import validation as V
from ppo_jax.core.aggregation import Normalizers, reduce_loss
from ppo_jax.core.kl import check_estimator, kl_penalty
from ppo_jax.core.loss_inputs import LossInputs
from ppo_jax.core.registry import register_policy_loss, register_value_loss


def _prepare(names: tuple[str, ...], arrays: tuple[Any, ...], mask: Any):
    for n, a in zip(names, arrays):
        if a is None:
            raise ValueError(f"{n} is missing from the loss batch (None)")
    out = [V.as_float(n, a, ndim=2) for n, a in zip(names, arrays)]
    V.same_shape(**dict(zip(names, out)))
    valid = V.as_valid("mask", mask, out[0].shape)
    dtype = jnp.result_type(*out)
    return [jnp.where(valid, a, 0).astype(dtype) for a in out], valid, dtype


def ratio_inputs(batch: LossInputs):
    """``(lp, old, adv, valid, dtype)`` of a policy loss's batch: masked slots 0, the old
    log-probs and advantages constants (``stop_gradient``)."""
    (lp, old, adv), valid, dtype = _prepare(
        ("logprobs", "old_logprobs", "advantages"),
        (batch.logprobs, batch.old_logprobs, batch.advantages), batch.mask)
    return lp, jax.lax.stop_gradient(old), jax.lax.stop_gradient(adv), valid, dtype


def _token_mean(per_token, stats, mask, loss_normalizer, loss_key):
    """The scalar form: ``(token mean, {loss_key: it, **stat token means})``."""
    norm = None
    if loss_normalizer is not None:
        V.check_nonnegative("loss_normalizer", loss_normalizer)
        norm = Normalizers(V.as_scalar("loss_normalizer", loss_normalizer), 1.0, 1.0)
    return reduce_loss({loss_key: per_token}, stats, mask, "token-mean", norm)


@register_policy_loss("ppo_clip")
def ppo_clip_loss(batch: LossInputs, *, cliprange: Any, cliprange_high: Any = None,
                  dual_clip: Any = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """PPO clipped surrogate loss per token (to minimise), optionally asymmetric and dual-clipped.

    ``r = exp(lp - old)``, with the log-ratio set to 0 on masked slots before ``exp``;
    ``l = max(-A r, -A clip(r, 1 - cliprange, 1 + cliprange_high))``, where ``cliprange_high``
    defaults to ``cliprange``; with ``dual_clip = c > 1``, ``l = min(l, -c A)`` where ``A < 0``.
    Sources: Schulman et al. 2017 eq. 7 (sign flipped) as in TRL 0.11 ``PPOTrainer.loss``;
    asymmetric "clip-higher" from DAPO (Yu et al. 2025, eq. 10); dual-clip from Ye et al. 2020
    ("Mastering Complex Control in MOBA Games with Deep RL", eq. 5).

    Args:
      batch: ``LossInputs`` with ``logprobs`` (differentiated), ``old_logprobs``,
        ``advantages`` (treated as constants) and ``mask``, all ``[B, T]``.
      cliprange: epsilon (low side, and high side unless ``cliprange_high``).
      cliprange_high: optional epsilon for the high side.
      dual_clip: optional constant ``c > 1`` bounding the loss of negative-advantage tokens.

    Returns:
      ``per_token_loss [B, T]``, 0 on masked slots, and ``stats``: per-token ``[B, T]``
      ``stop_gradient``-ed arrays. ``clipfrac`` is 1 where the clipped term is the larger,
      ``dual_clipfrac`` 1 where dual-clip caps the loss, ``approxkl`` is ``0.5 (lp - old)^2``,
      ``policykl`` is ``old - lp`` and ``ratio`` is ``r``.

    Raises:
      ValueError: a missing field, wrong ranks / dtypes / shapes; a clip range or
        ``dual_clip`` that is not a numeric scalar; static ``cliprange < 0``,
        ``cliprange_high < 0``, ``dual_clip <= 1``.
    """
    V.check_nonnegative("cliprange", cliprange)
    if cliprange_high is not None:
        V.check_nonnegative("cliprange_high", cliprange_high)
    if dual_clip is not None:
        V.check_positive("dual_clip", dual_clip, strictly_greater_than=1.0)
    (lp, old, adv), valid, dtype = _prepare(
        ("logprobs", "old_logprobs", "advantages"),
        (batch.logprobs, batch.old_logprobs, batch.advantages), batch.mask)
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
    stats = {"clipfrac": clipped.astype(dtype), "dual_clipfrac": dual_clipped.astype(dtype),
             "approxkl": 0.5 * log_ratio * log_ratio, "policykl": -log_ratio, "ratio": ratio}
    return per_token, jax.lax.stop_gradient(stats)


@register_value_loss("clipped_mse")
def clipped_value_loss(batch: LossInputs, *, cliprange_value: Any
                       ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Clipped value loss per token ``0.5 max((V - R)^2, (clip(V, old - c, old + c) - R)^2)``.

    Sources: TRL 0.11 ``PPOTrainer.loss`` (value part); DeepSpeed-Chat ``critic_loss_fn``;
    PPO2 value clipping (Dhariwal et al., OpenAI Baselines).

    Args:
      batch: ``LossInputs`` with ``values`` (differentiated), ``old_values``, ``returns``
        (treated as constants) and ``mask``, all ``[B, T]``.
      cliprange_value: ``c``, the allowed move of the value from ``old_values``.

    Returns:
      ``per_token_loss [B, T]``, 0 on masked slots, and ``stats``: per-token
      ``stop_gradient``-ed arrays. ``vf_clipfrac`` is 1 where the clipped error is the larger,
      ``value_error`` is ``(V - R)^2`` and ``vpred`` is ``V``.

    Raises:
      ValueError: a missing field, wrong ranks / dtypes / shapes; ``cliprange_value`` not a
        numeric scalar or, static, ``< 0``.
    """
    V.check_nonnegative("cliprange_value", cliprange_value)
    (v, old, ret), valid, dtype = _prepare(
        ("values", "old_values", "returns"), (batch.values, batch.old_values, batch.returns),
        batch.mask)
    old = jax.lax.stop_gradient(old)
    ret = jax.lax.stop_gradient(ret)
    cliprange_value = V.as_scalar("cliprange_value", cliprange_value).astype(dtype)

    v_clipped = jnp.clip(v, old - cliprange_value, old + cliprange_value)
    err1 = (v - ret) ** 2
    err2 = (v_clipped - ret) ** 2
    stats = {"vf_clipfrac": (err2 > err1).astype(dtype), "value_error": err1, "vpred": v}
    return 0.5 * jnp.maximum(err1, err2), jax.lax.stop_gradient(stats)


def policy_loss(logprobs: jax.Array, old_logprobs: jax.Array, advantages: jax.Array,
                mask: jax.Array, *, cliprange: Any, cliprange_high: Any = None,
                dual_clip: Any = None, loss_normalizer: Any = None
                ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Scalar PPO clipped loss: the token mean of ``ppo_clip_loss`` (design-doc signature).

    Args:
      logprobs, old_logprobs, advantages: ``[B, T]`` float (see ``ppo_clip_loss``).
      mask: ``[B, T]`` 0/1 response mask.
      cliprange, cliprange_high, dual_clip: as ``ppo_clip_loss``.
      loss_normalizer: optional total valid-token count of the minibatch (module doc).

    Returns:
      ``(loss, stats)``: scalar loss; stats ``pg_loss`` (= loss), ``clipfrac``,
      ``dual_clipfrac``, ``approxkl``, ``policykl``, ``ratio``, all token means / normalised
      sums.

    Raises:
      ValueError: as ``ppo_clip_loss``; static ``loss_normalizer < 0``.
    """
    batch = LossInputs(mask=mask, logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages)
    per_token, stats = ppo_clip_loss(batch, cliprange=cliprange, cliprange_high=cliprange_high,
                                     dual_clip=dual_clip)
    return _token_mean(per_token, stats, mask, loss_normalizer, "pg_loss")


def value_loss(values: jax.Array, old_values: jax.Array, returns: jax.Array, mask: jax.Array, *,
               cliprange_value: Any, loss_normalizer: Any = None
               ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Scalar clipped value loss: the token mean of ``clipped_value_loss`` (design-doc signature).

    Returns:
      ``(loss, stats)``: scalar loss; stats ``vf_loss`` (= loss), ``vf_clipfrac``,
      ``value_error``, ``vpred``, all token means / normalised sums.

    Raises:
      ValueError: as ``clipped_value_loss``; static ``loss_normalizer < 0``.
    """
    batch = LossInputs(mask=mask, values=values, old_values=old_values, returns=returns)
    per_token, stats = clipped_value_loss(batch, cliprange_value=cliprange_value)
    return _token_mean(per_token, stats, mask, loss_normalizer, "vf_loss")


def policy_regularizers(batch: LossInputs, *, entropy_coef: float = 0.0, kl_loss_coef: float = 0.0,
                        kl_loss_estimator: str = "low_var_kl") -> dict[str, jax.Array]:
    """The built-in per-token terms added to every policy loss (``ppo.entropy_coef``,
    ``ppo.kl_loss_coef``); a term whose static coefficient is 0 is left out (not added as 0).

    - ``entropy_loss = -entropy_coef * H`` (entropy bonus; Mnih et al. 2016, A3C, and the PPO
      paper's ``c_2 S`` term, Schulman et al. 2017 eq. 9), differentiated through ``entropy``.
    - ``kl_loss = kl_loss_coef * kl_penalty(lp, ref, kl_loss_estimator)``, differentiated
      through ``logprobs`` (``ref_logprobs`` constant): the KL in the loss as GRPO does (Shao
      et al. 2024, eq. 3-4, k3 = ``"low_var_kl"``), independent of the KL penalty in the reward
      (``ppo.kl_coef``).

    Args:
      batch: ``LossInputs`` (``entropy`` needed when ``entropy_coef`` is non-zero; ``logprobs``
        and ``ref_logprobs`` when ``kl_loss_coef`` is).
      entropy_coef, kl_loss_coef: static or traced scalars.
      kl_loss_estimator: one of ``KL_ESTIMATORS``.

    Returns:
      ``{"entropy_loss": [B, T], "kl_loss": [B, T]}`` with only the active terms; 0 on masked
      slots.

    Raises:
      ValueError: unknown estimator; a needed field missing or of the wrong shape / dtype.
    """
    check_estimator(kl_loss_estimator)
    terms = {}
    if not (V.is_static_number(entropy_coef) and entropy_coef == 0):
        (ent,), valid, dtype = _prepare(("entropy",), (batch.entropy,), batch.mask)
        terms["entropy_loss"] = -V.as_scalar("entropy_coef", entropy_coef).astype(dtype) * ent
    if not (V.is_static_number(kl_loss_coef) and kl_loss_coef == 0):
        (lp, ref), valid, dtype = _prepare(("logprobs", "ref_logprobs"),
                                           (batch.logprobs, batch.ref_logprobs), batch.mask)
        kl = kl_penalty(lp, jax.lax.stop_gradient(ref), kl_loss_estimator)
        terms["kl_loss"] = V.as_scalar("kl_loss_coef", kl_loss_coef).astype(dtype) * jnp.where(valid, kl, 0)
    return terms
