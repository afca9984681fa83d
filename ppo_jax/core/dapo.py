"""DAPO's overlong reward shaping and dynamic-sampling group selection, as pure functions.

Source: Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale"
(arXiv:2503.14476): sec. 3.2 "Dynamic Sampling" and sec. 3.4 "Overlong Reward Shaping"
(eq. 13). Clip-higher (sec. 3.1) is ``ppo_clip``'s ``cliprange_high``; the token-level loss
(sec. 3.3) is ``loss_aggregation: token-mean``.

Dynamic sampling with static shapes: the trainer samples ``G_total`` prompt groups of ``n``
responses each (more than it trains on), scores them, and keeps ``keep`` groups:
``informative_groups`` marks the groups whose scores are not all equal (a group of equal
scores has zero GRPO / RLOO advantage, hence no gradient), ``select_groups`` picks the first
``keep`` informative groups (filling with uninformative ones when there are too few, so the
shape never changes) and ``group_rows`` turns the chosen groups into row indices to gather.
Groups are adjacent rows: group ``g`` is rows ``g n .. g n + n - 1`` (``group_ids_for``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ppo_jax.core import validation as V


def _static_int(name: str, x: Any, minimum: int) -> int:
    """``x`` as a Python int; raises ``ValueError`` unless it is a static int ``>= minimum``."""
    if not isinstance(x, (int, np.integer)) or isinstance(x, bool) or x < minimum:
        raise ValueError(f"{name} must be a static int >= {minimum}, got {x!r}")
    return int(x)


def overlong_penalty(lengths: jax.Array, *, max_length: int, buffer: int,
                     penalty_factor: Any = 1.0) -> jax.Array:
    """DAPO's soft overlong punishment, a reward added to the score of each response.

    With ``L = lengths``, ``L_max = max_length`` and ``L_cache = buffer``, the penalty is DAPO
    eq. 13 times ``penalty_factor``, as verl's ``overlong_penalty_factor`` scales it::

        0                                      L <= L_max - L_cache
        ((L_max - L_cache) - L) / L_cache      L_max - L_cache < L <= L_max
        -1                                     L > L_max

    so the penalty falls linearly from 0 to ``-penalty_factor`` over the last ``buffer`` tokens.
    ``buffer = 0`` turns it off (all 0). Worked case ``max_length=10, buffer=4``: lengths
    ``6, 7, 10, 11`` -> ``0, -0.25, -1, -1``.

    Args:
      lengths: ``[B]`` int response lengths, the stop token included: ``mask.sum(axis=1)``.
      max_length: ``L_max``, static int >= 1 (the maximum response length).
      buffer: ``L_cache``, static int in ``[0, max_length]``.
      penalty_factor: non-negative scalar (static or traced) scaling the penalty.

    Returns:
      ``[B]`` float32, in ``[-penalty_factor, 0]``.

    Raises:
      ValueError: ``lengths`` not a rank-1 int array; ``max_length`` / ``buffer`` not static
        ints in range; ``penalty_factor`` not a numeric scalar or, static, ``< 0``.
    """
    lengths = V.as_int("lengths", lengths, ndim=1)
    max_length = _static_int("max_length", max_length, 1)
    buffer = _static_int("buffer", buffer, 0)
    if buffer > max_length:
        raise ValueError(f"buffer={buffer} must be <= max_length={max_length}")
    V.check_nonnegative("penalty_factor", penalty_factor)
    factor = V.as_scalar("penalty_factor", penalty_factor).astype(jnp.float32)
    if buffer == 0:
        return jnp.zeros(lengths.shape, jnp.float32)
    start = max_length - buffer
    ramp = (start - lengths).astype(jnp.float32) / buffer
    penalty = jnp.where(lengths <= start, 0.0, jnp.where(lengths <= max_length, ramp, -1.0))
    return (penalty * factor).astype(jnp.float32)


def informative_groups(scores: jax.Array, num_groups: int, samples_per_prompt: int) -> jax.Array:
    """Which prompt groups have scores that are not all equal.

    DAPO sec. 3.2 keeps a prompt when ``0 < |{o_i : is_equivalent(a, o_i)}| < G``, that is when
    its answers are neither all right nor all wrong; this generalises that rule to any score.

    Group ``g`` (rows ``g n .. g n + n - 1``, ``n = samples_per_prompt``) is informative when
    ``max(scores) > min(scores)`` over its rows: an exact comparison, no tolerance, so scores
    that differ in the last bit count as different (their GRPO advantages are then tiny, not
    large: GRPO divides by ``std + eps``). A group holding a NaN score is not informative
    (comparisons with NaN are False). With ``n = 1`` no group is informative.

    Args:
      scores: ``[R = num_groups * samples_per_prompt]`` float sequence scores.
      num_groups: ``G``, static int >= 1.
      samples_per_prompt: ``n``, static int >= 1.

    Returns:
      ``[G]`` bool.

    Raises:
      ValueError: ``scores`` not a rank-1 float array of length ``G n``; a count not a static
        int >= 1.
    """
    num_groups = _static_int("num_groups", num_groups, 1)
    n = _static_int("samples_per_prompt", samples_per_prompt, 1)
    scores = V.as_float("scores", scores, ndim=1)
    if scores.shape[0] != num_groups * n:
        raise ValueError(f"scores must have shape ({num_groups * n},) = num_groups * "
                         f"samples_per_prompt, got {tuple(scores.shape)}")
    grouped = scores.reshape(num_groups, n)
    return jnp.max(grouped, axis=1) > jnp.min(grouped, axis=1)


def select_groups(informative: jax.Array, keep: int) -> tuple[jax.Array, jax.Array]:
    """The ``keep`` groups of a training batch: informative ones first, in order, then (when
    fewer than ``keep`` are informative) the first uninformative ones, in order.

    A stable argsort of ``~informative``: deterministic, static shapes, jit-able. DAPO
    (sec. 3.2) over-samples and keeps only informative groups, re-sampling until the batch is
    full; with static shapes the batch is filled with uninformative groups instead (zero
    advantage under GRPO / RLOO, so no policy gradient) and the count tells how many are real.
    Worked case: ``informative = [F, T, F, T, T]``, ``keep = 2`` -> ``[1, 3]``, 2;
    ``keep = 4`` -> ``[1, 3, 4, 0]``, 3.

    Args:
      informative: ``[G_total]`` bool (0/1 ints and floats are read as bool).
      keep: static int in ``[1, G_total]``.

    Returns:
      ``(group_index [keep] int32, num_informative int32 scalar)``, the second being
      ``min(sum(informative), keep)``, the number of informative groups kept.

    Raises:
      ValueError: ``informative`` not rank 1; ``keep`` not a static int in ``[1, G_total]``.
    """
    informative = V.as_valid("informative", informative)
    if informative.ndim != 1:
        raise ValueError(f"informative must have rank 1 [G], got shape {tuple(informative.shape)}")
    keep = _static_int("keep", keep, 1)
    if keep > informative.shape[0]:
        raise ValueError(f"keep={keep} must be <= the number of groups {informative.shape[0]}")
    order = jnp.argsort((~informative).astype(jnp.int32), stable=True)
    count = jnp.minimum(jnp.sum(informative, dtype=jnp.int32), keep)
    return order[:keep].astype(jnp.int32), count


def group_rows(group_index: jax.Array, samples_per_prompt: int) -> jax.Array:
    """Row indices of the given groups: group ``g`` -> rows ``g n .. g n + n - 1``, in order.

    ``group_rows([2, 0], 3) == [6, 7, 8, 0, 1, 2]``; gather the experience rows with them.

    Args:
      group_index: ``[K]`` int group indices (``select_groups``).
      samples_per_prompt: ``n``, static int >= 1.

    Returns:
      ``[K n]`` int32.

    Raises:
      ValueError: ``group_index`` not a rank-1 int array; ``samples_per_prompt`` not a static
        int >= 1.
    """
    n = _static_int("samples_per_prompt", samples_per_prompt, 1)
    index = V.as_int("group_index", group_index, ndim=1).astype(jnp.int32)
    return (index[:, None] * n + jnp.arange(n, dtype=jnp.int32)).reshape(-1)
