"""Generalised Advantage Estimation over padded response tokens.

Schulman et al. 2016, "High-Dimensional Continuous Control Using GAE", eq. 16:
``delta_t = r_t + gamma V_{t+1} - V_t``, ``A_t = delta_t + gamma lam A_{t+1}``, with
``V_T = A_T = 0`` past the end. Masking as TRL 0.11 ``PPOTrainer.compute_advantages``: values
and rewards are zeroed outside the mask first (so a value in a padded slot never leaks in);
advantages are then 0 outside the mask. ``returns = A + V``. No whitening here.

Three implementations of the same linear recurrence ``A_t = delta_t + c A_{t+1}``
(``c = gamma lam``: a scalar, or one value per row ``[B]`` when ``lam`` is per row), selectable
by ``method``; all agree to float rounding:

- ``"chunked"`` (default): two small matmuls, within chunks of ``chunk`` steps and across
  chunks; no sequential loop, no transposes. Fastest on a 2-core CPU at ``[256, 1024]``
  (docs/benchmarks.md, "GAE methods", commit ``1c4762a``); expected to suit GPU/TPU too (matmul units, constant depth), not yet
  measured there.
- ``"scan"``: the reference form, a reverse ``jax.lax.scan`` over time (``unroll`` steps per
  loop iteration; on CPU ``unroll=1`` measured fastest). T sequential steps, so T loop
  iterations on an accelerator.
- ``"associative"``: ``jax.lax.associative_scan`` on the affine maps ``x -> c x + delta``,
  O(log T) depth.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ppo_jax.core import validation as V

GAE_METHODS: tuple[str, ...] = ("chunked", "scan", "associative")
DEFAULT_GAE_METHOD = "chunked"
DEFAULT_UNROLL = 1
DEFAULT_CHUNK = 32


def _discounted_reverse_cumsum_scan(deltas: jax.Array, c: jax.Array, unroll: int) -> jax.Array:
    """``A_t = delta_t + c A_{t+1}`` over the last axis of ``[B, T]`` by a reverse ``lax.scan``
    (``c`` a scalar or ``[B]``)."""

    def step(next_adv, delta_t):
        adv = delta_t + c * next_adv
        return adv, adv

    init = jnp.zeros(deltas.shape[:-1], deltas.dtype)
    _, adv_t = jax.lax.scan(step, init, jnp.swapaxes(deltas, 0, -1), reverse=True, unroll=unroll)
    return jnp.swapaxes(adv_t, 0, -1)


def _discounted_reverse_cumsum_chunked(deltas: jax.Array, c: jax.Array, chunk: int) -> jax.Array:
    """Same recurrence as two small matmuls: within chunks of ``chunk`` steps, then across chunks.

    Within a chunk, ``L_j = sum_{j' >= j} c^(j'-j) delta_j'`` (``[.., C] @ [C, C]``); the value
    entering chunk ``k`` from the right is ``S_{k+1}`` with ``S_k = sum_{m >= k} c^(C(m-k)) L_{m,0}``
    (``[.., n] @ [n, n]``); then ``A_{k,j} = L_{k,j} + c^(C-j) S_{k+1}``. ``T`` is zero-padded to a
    multiple of ``chunk`` (zero deltas add nothing). Matmuls run at HIGHEST precision. A per-row
    ``c`` ``[B]`` gives each row its own discount matrices (``[B, C, C]``, ``[B, n, n]``).
    """
    b, t = deltas.shape
    n = -(-t // chunk)
    padded = jnp.pad(deltas, ((0, 0), (0, n * chunk - t))).reshape(b, n, chunk)

    def discount_matrix(size: int, base: jax.Array) -> jax.Array:
        """``[size, size]`` for a scalar ``base``, ``[B, size, size]`` for a ``[B]`` one."""
        lag = jnp.arange(size)[:, None] - jnp.arange(size)[None, :]  # row: source j', col: target j
        # base ** 0 written as 1, not computed: its derivative 0 * base ** -1 is NaN at base 0
        powers = base[..., None, None] ** jnp.maximum(lag, 1).astype(deltas.dtype)
        powers = jnp.where(lag == 0, 1, powers)
        return jnp.where(lag >= 0, powers, 0).astype(deltas.dtype)

    per_row = c.ndim == 1
    hi = jax.lax.Precision.HIGHEST
    local = jnp.einsum("bnk,bkj->bnj" if per_row else "bnk,kj->bnj", padded,
                       discount_matrix(chunk, c), precision=hi)
    starts = jnp.einsum("bm,bmk->bk" if per_row else "bm,mk->bk", local[:, :, 0],
                        discount_matrix(n, c**chunk), precision=hi)
    entering = jnp.concatenate([starts[:, 1:], jnp.zeros_like(starts[:, :1])], axis=1)
    tail = c[..., None] ** (chunk - jnp.arange(chunk)).astype(deltas.dtype)  # [C] or [B, C]
    adv = local + tail[..., None, :] * entering[:, :, None]
    return adv.reshape(b, n * chunk)[:, :t]


def _discounted_reverse_cumsum_associative(deltas: jax.Array, c: jax.Array) -> jax.Array:
    """Same recurrence by ``lax.associative_scan`` over the affine maps ``x -> a x + b`` (``c`` a
    scalar or ``[B]``)."""

    def compose(later, earlier):
        # ``later`` maps A_{beyond} to A at its first step; ``earlier`` precedes it in time.
        a_l, b_l = later
        a_e, b_e = earlier
        return a_e * a_l, a_e * b_l + b_e

    coef = jnp.broadcast_to(c[:, None] if c.ndim else c, deltas.shape).astype(deltas.dtype)
    _, adv = jax.lax.associative_scan(compose, (coef, deltas), reverse=True, axis=deltas.ndim - 1)
    return adv


def compute_gae(
    values: jax.Array,
    rewards: jax.Array,
    mask: jax.Array,
    *,
    gamma: Any,
    lam: Any,
    method: str = DEFAULT_GAE_METHOD,
    unroll: int = DEFAULT_UNROLL,
    chunk: int = DEFAULT_CHUNK,
) -> tuple[jax.Array, jax.Array]:
    """GAE advantages and returns for ``[B, T]`` response tokens.

    Values and rewards are zeroed where ``mask`` is 0 (NaN there is fine), then
    ``delta_t = r_t + gamma V_{t+1} - V_t`` (``V_T = 0``), ``A_t = delta_t + gamma lam A_{t+1}``,
    ``returns = A + V``; advantages and returns are 0 where ``mask`` is 0. ``lam`` may be one
    value per row (VAPO's length-adaptive lambda, ``decoupled_gae.length_adaptive_lam``); a
    scalar ``lam`` computes exactly what it always did.
    Source: Schulman et al. 2016 eq. 16; masking as TRL 0.11 ``compute_advantages``
    (which returns ``A + V`` unmasked and whitens inside; whiten with ``masked_whiten``).

    Args:
      values: ``[B, T]`` float critic values of the response tokens (old values).
      rewards: ``[B, T]`` float shaped rewards (``compute_rewards``).
      mask: ``[B, T]`` 0/1 response mask.
      gamma: discount, Python float or traced scalar.
      lam: GAE lambda, Python float or traced scalar, or a ``[B]`` float array (one per row).
      method: ``"chunked"`` (default), ``"scan"`` or ``"associative"``; same values.
      unroll: loop unrolling of the ``"scan"`` method (static int >= 1).
      chunk: chunk length of the ``"chunked"`` method (static int >= 1).

    Returns:
      ``(advantages [B, T], returns [B, T])``, float (at least float32).

    Raises:
      ValueError: wrong ranks / dtypes / shapes (``lam`` neither a scalar nor ``[B]``), unknown
        ``method``, ``unroll`` or ``chunk`` not an int >= 1.
    """
    if method not in GAE_METHODS:
        raise ValueError(f"unknown GAE method {method!r}; known: {', '.join(GAE_METHODS)}")
    for name, n in (("unroll", unroll), ("chunk", chunk)):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"{name} must be an int >= 1, got {n!r}")
    values = V.as_float("values", values, ndim=2)
    rewards = V.as_float("rewards", rewards, ndim=2)
    V.same_shape(values=values, rewards=rewards)
    valid = V.as_valid("mask", mask, values.shape)
    dtype = jnp.promote_types(values.dtype, rewards.dtype)
    values = jnp.where(valid, values, 0).astype(dtype)
    rewards = jnp.where(valid, rewards, 0).astype(dtype)
    gamma = V.as_scalar("gamma", gamma).astype(dtype)
    lam = V.as_scalar_or_rows("lam", lam, values.shape[0]).astype(dtype)

    next_values = jnp.concatenate([values[:, 1:], jnp.zeros_like(values[:, :1])], axis=1)
    deltas = rewards + gamma * next_values - values
    if method == "chunked":
        adv = _discounted_reverse_cumsum_chunked(deltas, gamma * lam, chunk)
    elif method == "scan":
        adv = _discounted_reverse_cumsum_scan(deltas, gamma * lam, unroll)
    else:
        adv = _discounted_reverse_cumsum_associative(deltas, gamma * lam)
    adv = jnp.where(valid, adv, 0)
    return adv, adv + values
