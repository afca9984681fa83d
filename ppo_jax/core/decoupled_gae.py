"""GAE with one lambda for the critic's targets and another for the policy's advantages.

- **Decoupled GAE** (VC-PPO: Yuan et al. 2025, "What's Behind PPO's Collapse in Long-CoT? Value
  Optimization Holds the Secret", decoupled GAE; VAPO: Yue et al. 2025, "VAPO: Efficient and
  Reliable Reinforcement Learning for Advanced Reasoning Tasks", "Mitigating Value Model Bias
  over Long Sequences"): the returns the critic regresses on are ``A(critic_lam) + V``, with
  ``critic_lam`` typically 1.0 (the Monte-Carlo return: a terminal reward does not decay over
  a long response); the policy's advantages are ``A(lam)``, with the policy's own lambda.
- **Length-adaptive lambda** (VAPO, "Managing Heterogeneous Sequence Lengths during Training",
  Length-Adaptive GAE): each row's policy lambda makes the sum of its GAE weights
  ``sum_t lam^t = 1 / (1 - lam)`` proportional to the row's length ``l``: ``1 / (1 - lam) =
  alpha l``, so ``lam = 1 - 1 / (alpha l)`` (VAPO uses ``alpha = 0.05``), clipped to ``[0, 1]``.

Both run ``gae.compute_gae`` (any method); with ``critic_lam`` None (or equal to ``lam``) and
``lam_length_alpha == 0`` they are that one call, unchanged.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp

from ppo_jax.core import validation as V
from ppo_jax.core.gae import DEFAULT_CHUNK, DEFAULT_GAE_METHOD, DEFAULT_UNROLL, compute_gae


def length_adaptive_lam(mask: jax.Array, alpha: Any) -> jax.Array:
    """VAPO's per-row policy lambda, ``clip(1 - 1 / (alpha l), 0, 1)``.

    ``l`` is the row's number of valid tokens of ``mask`` (its action tokens, as the estimator
    sees them). ``l = 40`` with ``alpha = 0.05`` gives 0.5; rows shorter than ``1 / alpha``
    tokens get 0 (one-step TD advantages), an empty row gets 0 (its advantages are 0 anyway).
    Source: Yue et al. 2025 (VAPO), Length-Adaptive GAE.

    Args:
      mask: ``[B, T]`` 0/1 response (action) mask.
      alpha: ``> 0``, Python float or traced scalar.

    Returns:
      ``[B]`` float (at least float32; float64 for a float64 ``alpha`` under x64).

    Raises:
      ValueError: ``mask`` not a ``[B, T]`` 0/1 array; ``alpha`` not a numeric scalar, or a
        static number ``<= 0``.
    """
    V.check_positive("alpha", alpha)
    alpha = V.as_scalar("alpha", alpha)
    alpha = alpha.astype(jnp.promote_types(alpha.dtype, jnp.float32))
    valid = V.as_valid("mask", mask)
    if valid.ndim != 2:
        raise ValueError(f"mask must be [B, T], got shape {tuple(valid.shape)}")
    scaled = alpha * jnp.sum(valid, axis=1, dtype=alpha.dtype)
    ok = scaled > 0
    lam = jnp.where(ok, 1 - 1 / jnp.where(ok, scaled, 1), 0)
    return jnp.clip(lam, 0, 1)


def _is_zero(x: Any) -> bool:
    return V.is_static_number(x) and float(x) == 0.0


def decoupled_gae(
    values: jax.Array,
    rewards: jax.Array,
    mask: jax.Array,
    *,
    gamma: Any,
    lam: Any,
    critic_lam: Optional[Any] = None,
    lam_length_alpha: Any = 0.0,
    method: str = DEFAULT_GAE_METHOD,
    unroll: int = DEFAULT_UNROLL,
    chunk: int = DEFAULT_CHUNK,
) -> tuple[jax.Array, jax.Array]:
    """GAE advantages with the policy's lambda, returns with the critic's (``[B, T]``).

    ``advantages = A(lam_policy)``, ``returns = A(critic_lam) + V`` (``compute_gae`` for both;
    0 where ``mask`` is 0), with ``lam_policy = length_adaptive_lam(mask, lam_length_alpha)``
    per row when ``lam_length_alpha > 0``, else ``lam``; ``critic_lam`` None means ``lam``.
    Sources: VC-PPO and VAPO (Yuan et al. 2025; Yue et al. 2025), decoupled and length-adaptive
    GAE.

    Args:
      values, rewards, mask: as ``compute_gae``: ``[B, T]`` float, float and 0/1.
      gamma: discount, Python float or traced scalar.
      lam: the policy's lambda; with ``critic_lam`` None also the critic's.
      critic_lam: the critic's lambda (VAPO: 1.0), or None.
      lam_length_alpha: VAPO's ``alpha`` (0.05 there); 0 (a static zero): off. Any other value,
        traced ones included, turns the length-adaptive policy lambda on.
      method, unroll, chunk: as ``compute_gae``.

    Returns:
      ``(advantages [B, T], returns [B, T])``, float (at least float32).

    Raises:
      ValueError: as ``compute_gae``; a static ``lam_length_alpha < 0``.
    """
    if V.is_static_number(lam_length_alpha) and float(lam_length_alpha) < 0:
        raise ValueError(f"lam_length_alpha must be >= 0 (0: off), got {lam_length_alpha!r}")
    kw = dict(gamma=gamma, method=method, unroll=unroll, chunk=chunk)
    adaptive = not _is_zero(lam_length_alpha)
    policy_lam = length_adaptive_lam(mask, lam_length_alpha) if adaptive else lam
    advantages, returns = compute_gae(values, rewards, mask, lam=policy_lam, **kw)
    same = critic_lam is None or critic_lam is lam or (
        V.is_static_number(critic_lam) and V.is_static_number(lam)
        and float(critic_lam) == float(lam))
    if adaptive or not same:  # the critic's targets need their own pass
        _, returns = compute_gae(values, rewards, mask, lam=lam if critic_lam is None else critic_lam,
                                 **kw)
    return advantages, returns
