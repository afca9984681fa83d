"""Clip-Cov and KL-Cov: PPO losses that act on the few tokens whose log-prob / advantage
covariance is largest, against entropy collapse (Cui et al. 2025, "The Entropy Mechanism of
Reinforcement Learning for Reasoning Language Models", arXiv:2505.22617).

Each token's covariance term is ``cov_t = (A_t - mean A) (lp_t - mean lp)``, the means over the
valid tokens of THE CALL, as verl centres them over its micro-batch. The trainer calls a loss
once per micro-batch, so these two losses depend on how a minibatch is split into
micro-batches (``ppo.micro_batch_size``, ``ppo.micro_batch_tokens``): unlike every other
registered loss, their minibatch loss is not the same for every split. The number of tokens
selected, ``max(1, floor(ratio * N))``, also counts the call's ``N`` valid tokens.

Selection is deterministic: verl's Clip-Cov draws its tokens at random among those in the
covariance band (``torch.randperm``); a loss call here has no RNG key and a random choice
would make the loss and its test irreproducible, so both losses take the tokens of LARGEST
covariance (Clip-Cov: within its band), ties broken by the lower flat index ``b * T + t``, as
KL-Cov's top-k does. The anchor is verl ``verl/trainer/ppo/core_algos.py`` at commit b178a3cd.

Masked slots may hold NaN/inf in any input: they are replaced with ``jnp.where`` before any
arithmetic, so they reach neither the loss nor its gradient.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ppo_jax.core import loss_kwargs as K
from ppo_jax.core import validation as V
from ppo_jax.core.loss_inputs import LossInputs
from ppo_jax.core.losses import _prepare
from ppo_jax.core.masked import masked_mean
from ppo_jax.core.registry import register_policy_loss


def token_covariance(logprobs: jax.Array, advantages: jax.Array, valid: jax.Array) -> jax.Array:
    """``[B, T]`` ``(A - mean A)(lp - mean lp)``, the means over ``valid`` tokens; 0 elsewhere.

    The log-probs enter under ``stop_gradient``: the term only selects tokens. Its mean is the
    covariance of log-prob and advantage that, by the paper's analysis, drives the change of the
    policy's entropy.

    Args:
      logprobs, advantages: ``[B, T]`` float, 0 on masked slots.
      valid: ``[B, T]`` bool.
    """
    lp = jax.lax.stop_gradient(logprobs)
    cov = (advantages - masked_mean(advantages, valid)) * (lp - masked_mean(lp, valid))
    return jnp.where(valid, cov, 0)


def top_tokens(score: jax.Array, eligible: jax.Array, k: jax.Array) -> jax.Array:
    """``[B, T]`` bool: the ``k`` eligible tokens of largest ``score`` (fewer when fewer are
    eligible), ties broken by the lower flat index. ``k`` may be traced."""
    flat = jnp.where(eligible, score, -jnp.inf).reshape(-1)
    order = jnp.argsort(-flat, stable=True)
    rank = jnp.zeros_like(order).at[order].set(jnp.arange(order.size, dtype=order.dtype))
    return eligible & (rank.reshape(score.shape) < k)


def _count(name: str, ratio: Any, valid: jax.Array, dtype) -> jax.Array:
    """``max(1, floor(ratio * N))`` with ``N`` the call's valid tokens (verl's count)."""
    n = jnp.sum(valid, dtype=dtype)
    return jnp.maximum(1.0, jnp.floor(V.as_scalar(name, ratio).astype(dtype) * n))


def check_clip_cov_kwargs(*, cliprange: Any = 0.2, cliprange_high: Any = None,
                          clip_cov_ratio: Any = 2e-4, clip_cov_lb: Any = 1.0,
                          clip_cov_ub: Any = 5.0) -> None:
    """Clip ranges >= 0, ``clip_cov_ratio`` in (0, 1], ``clip_cov_lb <= clip_cov_ub``.

    Raises:
      LossKwargError: naming the key.
    """
    K.check_clip_ranges({"cliprange": cliprange, "cliprange_high": cliprange_high})
    K.check_fraction({"clip_cov_ratio": clip_cov_ratio}, "clip_cov_ratio")
    K.check_band({"clip_cov_lb": clip_cov_lb, "clip_cov_ub": clip_cov_ub}, "clip_cov_lb",
                 "clip_cov_ub")


@register_policy_loss("clip_cov")
def clip_cov_loss(batch: LossInputs, *, cliprange: Any, cliprange_high: Any = None,
                  clip_cov_ratio: Any = 2e-4, clip_cov_lb: Any = 1.0, clip_cov_ub: Any = 5.0
                  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Clip-Cov per token (to minimise): PPO's clipped loss, with the tokens of largest
    covariance inside a band taken out of the loss.

    ``l_t = max(-A r, -A clip(r, 1 - cliprange, 1 + cliprange_high))`` as ``ppo_clip``.
    Candidates: valid tokens that PPO's clip leaves unclipped and whose ``cov_t``
    (module doc) lies strictly inside ``(clip_cov_lb, clip_cov_ub)``; the
    ``max(1, floor(clip_cov_ratio * N))`` candidates of largest ``cov_t`` are selected
    (module doc: deterministic where verl draws at random) and their ``l_t`` is multiplied
    by 0, value and gradient, as verl's ``corr`` does. The paper "detaches" their gradient:
    the same gradient, and a reported ``pg_loss`` without them. Source: Cui et al. 2025
    (arXiv:2505.22617), Clip-Cov (paper's r = 2e-4, band [1, 5]). Checked against verl
    ``compute_policy_loss_clip_cov`` (core_algos.py lines 1517-1539).

    Args:
      batch: ``LossInputs`` with ``logprobs`` (differentiated), ``old_logprobs``,
        ``advantages`` (constants) and ``mask``, all ``[B, T]``.
      cliprange, cliprange_high: PPO's clip (no ``dual_clip``).
      clip_cov_ratio: the fraction of the call's tokens to take out, in (0, 1].
      clip_cov_lb, clip_cov_ub: the covariance band.

    Returns:
      ``per_token_loss [B, T]``, 0 on masked and selected slots, and ``stop_gradient``-ed
      per-token stats: ``clipfrac`` (PPO's clip), ``cov_clipfrac`` (the selected tokens),
      ``ratio``, ``approxkl``, ``policykl``.

    Raises:
      ValueError: a missing field, wrong ranks / dtypes / shapes; ``LossKwargError`` for a
        static bad hyper-parameter (``check_clip_cov_kwargs``).
    """
    check_clip_cov_kwargs(cliprange=cliprange, cliprange_high=cliprange_high,
                          clip_cov_ratio=clip_cov_ratio, clip_cov_lb=clip_cov_lb,
                          clip_cov_ub=clip_cov_ub)
    (lp, old, adv), valid, dtype = _prepare(
        ("logprobs", "old_logprobs", "advantages"),
        (batch.logprobs, batch.old_logprobs, batch.advantages), batch.mask)
    old, adv = jax.lax.stop_gradient(old), jax.lax.stop_gradient(adv)
    low = V.as_scalar("cliprange", cliprange).astype(dtype)
    high = low if cliprange_high is None else V.as_scalar("cliprange_high", cliprange_high).astype(dtype)
    log_ratio = lp - old  # 0 on masked slots
    ratio = jnp.exp(log_ratio)
    pg1, pg2 = -adv * ratio, -adv * jnp.clip(ratio, 1.0 - low, 1.0 + high)
    clipped = valid & (pg2 > pg1)
    cov = token_covariance(lp, adv, valid)
    lb = V.as_scalar("clip_cov_lb", clip_cov_lb).astype(dtype)
    ub = V.as_scalar("clip_cov_ub", clip_cov_ub).astype(dtype)
    candidates = valid & ~clipped & (cov > lb) & (cov < ub)
    selected = top_tokens(cov, candidates, _count("clip_cov_ratio", clip_cov_ratio, valid, dtype))
    per_token = jnp.where(valid & ~selected, jnp.maximum(pg1, pg2), 0)
    stats = {"clipfrac": clipped.astype(dtype), "cov_clipfrac": selected.astype(dtype),
             "ratio": ratio, "approxkl": 0.5 * log_ratio * log_ratio, "policykl": -log_ratio}
    return per_token, jax.lax.stop_gradient(stats)


clip_cov_loss.check_kwargs = check_clip_cov_kwargs
# its value depends on which rows a call holds: packing keeps the padded micro-batches
clip_cov_loss.per_micro_batch = True


def check_kl_cov_kwargs(*, cliprange: Any = None, kl_cov_ratio: Any = 2e-4,
                        kl_cov_coef: Any = 1.0) -> None:
    """``kl_cov_ratio`` in (0, 1], ``kl_cov_coef >= 0``.

    Raises:
      LossKwargError: naming the key.
    """
    K.check_fraction({"kl_cov_ratio": kl_cov_ratio}, "kl_cov_ratio")
    K.check_nonnegative({"kl_cov_coef": kl_cov_coef}, "kl_cov_coef")


@register_policy_loss("kl_cov")
def kl_cov_loss(batch: LossInputs, *, cliprange: Any = None, kl_cov_ratio: Any = 2e-4,
                kl_cov_coef: Any = 1.0) -> tuple[jax.Array, dict[str, jax.Array]]:
    """KL-Cov per token (to minimise): the unclipped surrogate, plus a KL penalty on the
    tokens of largest covariance.

    ``l_t = -A r + kl_cov_coef |lp - old|`` on the ``max(1, floor(kl_cov_ratio * N))`` valid
    tokens of largest ``cov_t`` (module doc), ``l_t = -A r`` on the others; no clip, so
    ``cliprange`` is taken and ignored (``reads_cliprange = False``). ``|x|`` is written as
    ``sign(x) x``: its gradient at ``x = 0`` is 0, as torch's ``abs`` (jnp.abs's is 1), so on
    the first minibatch (``lp = old``) the penalty adds no gradient, as in verl. Source: Cui
    et al. 2025 (arXiv:2505.22617), KL-Cov (paper's k = 2e-4 for 32B, 2e-3 for 7B; beta
    = 1). Checked against verl ``compute_policy_loss_kl_cov`` (core_algos.py lines 1601-1614;
    ``ppo_kl_coef`` there is ``kl_cov_coef`` here).

    Args:
      batch: ``LossInputs`` with ``logprobs`` (differentiated), ``old_logprobs``,
        ``advantages`` (constants) and ``mask``, all ``[B, T]``.
      cliprange: ignored.
      kl_cov_ratio: the fraction of the call's tokens penalised, in (0, 1].
      kl_cov_coef: the penalty's coefficient beta, >= 0.

    Returns:
      ``per_token_loss [B, T]``, 0 on masked slots, and ``stop_gradient``-ed per-token stats:
      ``kl_cov_frac`` (the penalised tokens), ``abs_kl`` (``|lp - old|``), ``ratio``,
      ``approxkl``, ``policykl``.

    Raises:
      ValueError: a missing field, wrong ranks / dtypes / shapes; ``LossKwargError`` for a
        static bad hyper-parameter (``check_kl_cov_kwargs``).
    """
    check_kl_cov_kwargs(kl_cov_ratio=kl_cov_ratio, kl_cov_coef=kl_cov_coef)
    (lp, old, adv), valid, dtype = _prepare(
        ("logprobs", "old_logprobs", "advantages"),
        (batch.logprobs, batch.old_logprobs, batch.advantages), batch.mask)
    old, adv = jax.lax.stop_gradient(old), jax.lax.stop_gradient(adv)
    log_ratio = lp - old  # 0 on masked slots
    ratio = jnp.exp(log_ratio)
    abs_kl = jnp.sign(log_ratio) * log_ratio
    selected = top_tokens(token_covariance(lp, adv, valid), valid,
                          _count("kl_cov_ratio", kl_cov_ratio, valid, dtype))
    coef = V.as_scalar("kl_cov_coef", kl_cov_coef).astype(dtype)
    per_token = jnp.where(valid, -adv * ratio + jnp.where(selected, coef * abs_kl, 0), 0)
    stats = {"kl_cov_frac": selected.astype(dtype), "abs_kl": abs_kl, "ratio": ratio,
             "approxkl": 0.5 * log_ratio * log_ratio, "policykl": -log_ratio}
    return per_token, jax.lax.stop_gradient(stats)


kl_cov_loss.check_kwargs = check_kl_cov_kwargs
kl_cov_loss.per_micro_batch = True
kl_cov_loss.reads_cliprange = False
