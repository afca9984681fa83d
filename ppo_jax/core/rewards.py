"""Reward shaping: per-token KL penalty plus the sequence score on the last response token.

Source: TRL 0.11 ``PPOTrainer.compute_rewards``, written without its per-row loop. The formula
is Ziegler et al. 2019, eq. 2: ``R(x, y) = r(x, y) - beta * log(pi(y|x) / rho(y|x))``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ppo_jax.core import validation as V
from ppo_jax.core.kl import check_estimator, kl_penalty


def last_valid_onehot(valid: jax.Array) -> jax.Array:
    """``[B, T]`` bool, True only at the last valid position of each row (none for empty rows).

    Works for any mask, not only prefixes, as TRL's ``mask.nonzero()[-1]`` does. An empty row
    has last index -1, which matches no position.
    """
    if valid.shape[-1] == 0:  # zero-length responses: no last position
        return jnp.zeros(valid.shape, bool)
    positions = jnp.arange(valid.shape[-1], dtype=jnp.int32)
    last = jnp.max(jnp.where(valid, positions, -1), axis=-1, keepdims=True)
    return positions == last


def compute_rewards_from_kl(
    scores: jax.Array,
    kl: jax.Array,
    mask: jax.Array,
    *,
    kl_coef: Any,
    reward_clip: float | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Shapes rewards from a precomputed per-token KL (e.g. ``full_kl``); see ``compute_rewards``.

    Args:
      scores: ``[B]`` float sequence scores.
      kl: ``[B, T]`` float per-token KL estimate (masked slots may hold anything).
      mask: ``[B, T]`` 0/1 response mask.
      kl_coef: scalar, Python float or traced 0-d array (the KL controller's value).
      reward_clip: if given, scores are clipped to ``[-reward_clip, reward_clip]`` first.

    Returns:
      ``(rewards [B, T], non_score_rewards [B, T])``, float (at least float32).

    Raises:
      ValueError: wrong ranks / dtypes / shapes, non-scalar ``kl_coef``, negative ``reward_clip``.
    """
    kl = V.as_float("kl", kl, ndim=2)
    scores = V.as_float("scores", scores, ndim=1)
    valid = V.as_valid("mask", mask, kl.shape)
    if scores.shape[0] != kl.shape[0]:
        raise ValueError(
            f"scores has shape {tuple(scores.shape)} but the batch is [B, T] = {tuple(kl.shape)}"
        )
    kl_coef = V.as_scalar("kl_coef", kl_coef)
    if reward_clip is not None:
        V.check_nonnegative("reward_clip", reward_clip)
        scores = jnp.clip(scores, -reward_clip, reward_clip)
    # mask before multiplying, so garbage in masked slots reaches no gradient (d/dkl_coef)
    non_score = -kl_coef.astype(kl.dtype) * jnp.where(valid, kl, 0)
    at_last = last_valid_onehot(valid)
    rewards = non_score + jnp.where(at_last, scores.astype(kl.dtype)[:, None], 0)
    return rewards, non_score


def compute_rewards(
    scores: jax.Array,
    logprobs: jax.Array,
    ref_logprobs: jax.Array,
    mask: jax.Array,
    *,
    kl_coef: Any,
    estimator: str = "kl",
    reward_clip: float | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Per-token rewards: ``-kl_coef * KL`` on every response token, plus the score at the end.

    ``non_score[b, t] = -kl_coef * kl_penalty(lp, ref, estimator)[b, t]`` where ``mask`` is 1,
    0 elsewhere; ``rewards = non_score`` plus ``scores[b]`` (clipped to ``+-reward_clip`` when
    given) added at the LAST valid position of row ``b``. A row with an empty mask gets no score
    anywhere (nothing is written at index -1). Masked slots of the inputs may hold NaN.
    Source: TRL 0.11 ``PPOTrainer.compute_rewards`` (+ ``score_clip``); Ziegler et al. 2019, eq. 2.

    Args:
      scores: ``[B]`` float sequence scores (reward model or rule).
      logprobs: ``[B, T]`` float policy log-probs of the response tokens (rollout).
      ref_logprobs: ``[B, T]`` float reference-model log-probs, same temperature.
      mask: ``[B, T]`` 0/1 response mask (1 up to and including EOS).
      kl_coef: scalar, Python float or traced 0-d array (KL controller state value).
      estimator: one of ``"kl"``, ``"abs"``, ``"mse"``, ``"low_var_kl"`` (static string).
      reward_clip: optional non-negative bound on ``|score|``.

    Returns:
      ``(rewards [B, T], non_score_rewards [B, T])``, float (at least float32).

    Raises:
      ValueError: unknown estimator (naming it and the known ones), wrong ranks / dtypes,
        mismatched shapes, non-scalar ``kl_coef``.
    """
    check_estimator(estimator)
    logprobs = V.as_float("logprobs", logprobs, ndim=2)
    ref_logprobs = V.as_float("ref_logprobs", ref_logprobs, ndim=2)
    V.same_shape(logprobs=logprobs, ref_logprobs=ref_logprobs)
    valid = V.as_valid("mask", mask, logprobs.shape)
    kl = kl_penalty(jnp.where(valid, logprobs, 0), jnp.where(valid, ref_logprobs, 0), estimator)
    return compute_rewards_from_kl(scores, kl, valid, kl_coef=kl_coef, reward_clip=reward_clip)


def ended_rows(response_ids: jax.Array, response_mask: jax.Array,
               stop_token_ids) -> jax.Array:
    """`[B]` bool: the response `[B, N]` holds one of `stop_token_ids` (it stopped rather than
    being cut at the length budget) and at least one real token. No stop ids: all False. This
    is the `ended` of `compute_rewards` (its missing-EOS penalty)."""
    stops = jnp.asarray(tuple(stop_token_ids) or (-1,), jnp.int32)
    return jnp.isin(response_ids, stops).any(axis=1) & (response_mask.sum(axis=1) > 0)
