"""KL penalty estimators between the policy and the reference model.

Per-token estimators of ``KL(pi || pi_ref)`` from the log-probs of the sampled tokens
(Schulman, "Approximating KL Divergence", 2020: k1, k2, k3), as in TRL 0.11
``PPOTrainer._kl_penalty``; ``full_kl`` is the exact KL from full logits (TRL's ``"full"``).
"""

from __future__ import annotations

from typing import Any, Literal

import jax
import jax.numpy as jnp

from ppo_jax.core import validation as V

KL_ESTIMATORS: tuple[str, ...] = ("kl", "abs", "mse", "low_var_kl")
KLEstimator = Literal[KL_ESTIMATORS]  # the config's type of ppo.kl_estimator / kl_loss_estimator


def check_estimator(estimator: str) -> None:
    """Raises ``ValueError`` unless ``estimator`` is one of ``KL_ESTIMATORS``."""
    if estimator == "full":
        raise ValueError(
            "estimator 'full' needs full logits, not per-token log-probs: compute "
            "full_kl(logits, ref_logits, temperature) and pass it to compute_rewards_from_kl"
        )
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {estimator!r}; known: {', '.join(KL_ESTIMATORS)}")


def kl_penalty(logprobs: jax.Array, ref_logprobs: jax.Array, estimator: str = "kl") -> jax.Array:
    """Elementwise KL estimate from sampled-token log-probs.

    With ``d = logprobs - ref_logprobs`` (log pi - log pi_ref):

    - ``"kl"``  (k1): ``d``
    - ``"abs"``:      ``|d|``
    - ``"mse"`` (k2): ``0.5 d^2``
    - ``"low_var_kl"`` (k3): ``exp(-d) + d - 1`` (= ``exp(ref - lp) - (ref - lp) - 1``)

    Source: TRL 0.11 ``PPOTrainer._kl_penalty``; k3 from Schulman (2020), used by GRPO/verl.
    The function is elementwise and does no masking: callers with padding use
    ``compute_rewards``, which replaces masked slots before calling it.

    Args:
      logprobs: float array, any shape (usually ``[B, T]``).
      ref_logprobs: float array, same shape.
      estimator: one of ``KL_ESTIMATORS`` (static string).

    Returns:
      Array of the inputs' shape, float (at least float32).

    Raises:
      ValueError: unknown ``estimator`` (``"full"`` is pointed to ``full_kl``), non-float
        inputs or mismatched shapes.
    """
    check_estimator(estimator)
    logprobs = V.as_float("logprobs", logprobs)
    ref_logprobs = V.as_float("ref_logprobs", ref_logprobs)
    V.same_shape(logprobs=logprobs, ref_logprobs=ref_logprobs)
    d = logprobs - ref_logprobs
    if estimator == "kl":
        return d
    if estimator == "abs":
        return jnp.abs(d)
    if estimator == "mse":
        return 0.5 * d * d
    return jnp.expm1(-d) + d  # low_var_kl: exp(-d) - 1 + d, expm1 for accuracy near d = 0


def full_kl(logits: jax.Array, ref_logits: jax.Array, temperature: Any = 1.0) -> jax.Array:
    """Exact per-token ``KL(pi || pi_ref) = sum_v p_v (log p_v - log q_v)`` from full logits.

    Both distributions are ``softmax(logits / temperature)``. Terms with ``p_v == 0`` contribute 0
    rather than a ``0 * inf`` NaN. Source: TRL 0.11 ``_kl_penalty(..., "full")``, which computes
    ``F.kl_div(ref_logprob, logprob, log_target=True).sum(-1)``.

    Args:
      logits: ``[B, T, V]`` float, the policy.
      ref_logits: ``[B, T, V]`` float, the reference model.
      temperature: positive scalar (Python float or traced 0-d array).

    Returns:
      ``[B, T]`` float32 (float64 for float64 logits).

    Raises:
      ValueError: ranks other than 3, non-float dtypes, mismatched shapes, static
        ``temperature <= 0``.
    """
    V.check_positive("temperature", temperature)
    logits = V.as_float("logits", logits, ndim=3)
    ref_logits = V.as_float("ref_logits", ref_logits, ndim=3)
    V.same_shape(logits=logits, ref_logits=ref_logits)
    t = jnp.asarray(temperature, logits.dtype)
    logp = jax.nn.log_softmax(logits / t, axis=-1)
    logq = jax.nn.log_softmax(ref_logits / t, axis=-1)
    p = jnp.exp(logp)
    live = p > 0
    term = jnp.where(live, p * (jnp.where(live, logp, 0) - jnp.where(live, logq, 0)), 0)
    return jnp.sum(term, axis=-1)


def sequence_kl(logprobs: jax.Array, ref_logprobs: jax.Array, mask: jax.Array) -> jax.Array:
    """The k1 KL of each response: ``sum_t (logprobs - ref_logprobs)`` over its real tokens.

    TRL 0.11 logs the batch mean of this as ``objective/kl`` and updates the adaptive KL
    controller with that mean.

    Args:
      logprobs, ref_logprobs: ``[B, T]`` float, policy and reference log-probs of the sampled
        tokens (any values on masked slots, NaN included).
      mask: ``[B, T]``, nonzero on real response tokens.

    Returns:
      ``[B]`` float, 0 for a row with no real token.
    """
    return jnp.sum(jnp.where(mask > 0, logprobs - ref_logprobs, 0.0), axis=1)
