"""Per-token log-probabilities and entropies from logits, with sampling temperature.

The same temperature must be used for rollout, old, new and reference log-probs (else the
first-minibatch ratio is not 1): the sampled distribution is ``softmax(logits / temperature)``.
Everything is computed in float32 (or float64 when the logits are float64), whatever the
logits' dtype.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ppo_jax.core import validation as V


def _scaled(logits: Any, temperature: Any) -> jax.Array:
    V.check_positive("temperature", temperature)
    logits = V.as_float("logits", logits, ndim=3)
    if V.is_static_number(temperature) and float(temperature) == 1.0:
        return logits
    return logits / jnp.asarray(temperature, logits.dtype)


def logprobs_from_logits(logits: jax.Array, tokens: jax.Array, temperature: Any = 1.0) -> jax.Array:
    """Log-probability of ``tokens`` under ``softmax(logits / temperature)``.

    ``logprob[b, t] = z[b, t, tokens[b, t]] - logsumexp(z[b, t, :])`` with
    ``z = logits / temperature``. The full log-softmax ``[B, T, V]`` is never formed: under
    ``jit`` XLA fuses the scaling into the gather and the logsumexp reduction.
    Source: TRL 0.11 ``trl.core.logprobs_from_logits`` (there, the caller divides the logits by
    the temperature first).

    Args:
      logits: ``[B, T, V]`` float (any float dtype; computed in at least float32).
      tokens: ``[B, T]`` int token ids in ``[0, V)`` (not checked: the values may be traced;
        an id outside gives an undefined log-prob, e.g. -1 reads the last column).
      temperature: positive scalar (Python float or traced 0-d array).

    Returns:
      ``[B, T]`` float32 (float64 for float64 logits).

    Raises:
      ValueError: wrong rank or dtype of ``logits`` / ``tokens``, mismatched ``[B, T]``, or a
        static ``temperature <= 0``.
    """
    z = _scaled(logits, temperature)
    tokens = V.as_int("tokens", tokens, ndim=2)
    if tuple(tokens.shape) != tuple(z.shape[:2]):
        raise ValueError(
            f"tokens has shape {tuple(tokens.shape)} but logits has shape {tuple(z.shape)}; "
            "expected tokens [B, T] for logits [B, T, V]"
        )
    picked = jnp.take_along_axis(z, tokens[..., None], axis=-1)[..., 0]
    return picked - jax.nn.logsumexp(z, axis=-1)


def entropy_from_logits(logits: jax.Array, temperature: Any = 1.0) -> jax.Array:
    """Entropy of ``softmax(logits / temperature)`` per token.

    ``H = -sum_v p_v log p_v`` with ``log p = z - logsumexp(z)``, ``z = logits / temperature``;
    this equals TRL's ``logsumexp(z) - sum_v p_v z_v``. Terms with ``p_v == 0``, such as those
    of ``-inf`` logits, contribute 0, not NaN, in value and gradient.
    Source: TRL 0.11 ``trl.core.entropy_from_logits``.

    Args:
      logits: ``[B, T, V]`` float (any float dtype; computed in at least float32).
      temperature: positive scalar (Python float or traced 0-d array).

    Returns:
      ``[B, T]`` float32 (float64 for float64 logits).

    Raises:
      ValueError: ``logits`` is not a rank-3 float array, or a static ``temperature <= 0``.
    """
    z = _scaled(logits, temperature)
    lse = jax.nn.logsumexp(z, axis=-1, keepdims=True)
    logp = z - lse
    p = jnp.exp(logp)
    safe_logp = jnp.where(p > 0, logp, 0)
    return -jnp.sum(p * safe_logp, axis=-1)
