"""Critic-free advantage estimators: GRPO, Dr. GRPO, RLOO, REINFORCE++, REINFORCE++-baseline, ReMax;
and the explained variance of a group's leave-one-out baseline, a critic's reference.

Shapes: ``B`` rows (responses), ``T`` response tokens; ``mask [B, T]`` 0/1 (1 on real tokens,
the stop token included); ``group_ids [B]`` int (rows answering the same prompt share an id in
``[0, B)``, see ``group_ids_for``); ``scores [B]`` sequence scores; ``rewards [B, T]`` shaped
rewards (``compute_rewards``: KL penalty on every token, the score at the last real token).
Each estimator returns ``(advantages [B, T], returns [B, T])``, 0 where ``mask`` is 0, float32
(float64 when given float64), and takes ``**unused`` keywords so that a trainer can pass
``gamma``, ``lam``, ``values``... uniformly.

Group statistics (``jax.ops.segment_sum``) count only rows with at least one real token: a row
with an empty mask (batch padding; a real response always holds its stop token) has no action,
takes no part in its group's mean / std, and its score may be anything, NaN included. An id
outside ``[0, B)`` puts its row in a group of its own. A group of one real row has no baseline:
its advantage is 0 under GRPO, Dr. GRPO and RLOO (verl's GRPO uses mean 0, std 1 there, i.e.
the raw score; TRL divides by a NaN std).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ppo_jax.core import validation as V
from ppo_jax.core.gae import compute_gae
from ppo_jax.core.masked import explained_variance, masked_whiten, safe_divide
from ppo_jax.core.rewards import last_valid_onehot

GRPO_EPS = 1e-6  # verl ``compute_grpo_outcome_advantage(epsilon=1e-6)``


def group_ids_for(num_prompts: int, samples_per_prompt: int) -> np.ndarray:
    """Group ids ``[B = num_prompts * samples_per_prompt]`` int32, the samples of a prompt kept
    together: ``group_ids_for(2, 3) == [0, 0, 0, 1, 1, 1]`` (a plain numpy helper).

    Raises:
      ValueError: either argument is not an int >= 1.
    """
    for name, n in (("num_prompts", num_prompts), ("samples_per_prompt", samples_per_prompt)):
        if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 1:
            raise ValueError(f"{name} must be an int >= 1, got {n!r}")
    return np.repeat(np.arange(num_prompts, dtype=np.int32), samples_per_prompt)


def _outcome_args(scores: Any, group_ids: Any, mask: Any):
    """Validated ``(scores [B] float, group_ids [B] int, valid [B, T] bool)``."""
    valid = V.as_valid("mask", mask)
    if valid.ndim != 2:
        raise ValueError(f"mask must have rank 2 [B, T], got shape {tuple(valid.shape)}")
    b = valid.shape[0]
    scores = V.as_float("scores", scores, ndim=1)
    group_ids = V.as_int("group_ids", group_ids, ndim=1)
    for arg, x in (("scores", scores), ("group_ids", group_ids)):
        if x.shape != (b,):
            raise ValueError(f"{arg} must have shape ({b},) for mask [B, T] = {tuple(valid.shape)}, "
                             f"got {tuple(x.shape)}")
    return scores, group_ids, valid


def _group_sums(group_ids: jax.Array, member: jax.Array, *xs: jax.Array) -> list[jax.Array]:
    """For each ``x [B]``: per row, the sum of ``x`` over the member rows of its group.

    Ids outside ``[0, B)`` go to segments ``B + row`` (a group of their own), hence
    ``num_segments = 2 B``. Non-member entries are replaced by 0 before summing (NaN-safe).
    """
    b = group_ids.shape[0]
    in_range = (group_ids >= 0) & (group_ids < b)
    seg = jnp.where(in_range, group_ids, b + jnp.arange(b, dtype=group_ids.dtype))
    sums = [jax.ops.segment_sum(jnp.where(member, x, 0), seg, num_segments=2 * b) for x in xs]
    return [s[seg] for s in sums]


def _broadcast(row_values: jax.Array, valid: jax.Array) -> jax.Array:
    """``[B] -> [B, T]``: the row's value on its real tokens, 0 elsewhere."""
    return jnp.where(valid, row_values[:, None], jnp.zeros((), row_values.dtype))


def _safe_sqrt(x: jax.Array) -> jax.Array:
    """``sqrt(x)`` for ``x > 0``, else 0, with a finite gradient at 0."""
    pos = x > 0
    return jnp.where(pos, jnp.sqrt(jnp.where(pos, x, 1)), 0)


def grpo(scores: jax.Array, group_ids: jax.Array, mask: jax.Array, *, norm_by_std: bool = True,
         eps: Any = GRPO_EPS, **unused) -> tuple[jax.Array, jax.Array]:
    """Group-relative advantages: ``A_i = (r_i - mean_g) / (std_g + eps)`` on every real token.

    ``mean_g``, ``std_g``: mean and UNBIASED (Bessel) std of the scores of the real rows of
    ``i``'s group (``std_g = 0`` for a group of one, whose advantage is 0). ``norm_by_std=False``
    is Dr. GRPO: ``A_i = r_i - mean_g``. Returns = advantages (no critic). Worked case, one
    group ``[1, 0, 0, 1]``: mean 0.5, std ``sqrt(4 * 0.25 / 3) = 0.5774`` ->
    ``[0.866, -0.866, -0.866, 0.866]`` (Dr. GRPO: ``[0.5, -0.5, -0.5, 0.5]``).
    Source: DeepSeekMath (Shao et al. 2024, sec. 4.1.2, outcome supervision); TRL
    ``GRPOTrainer`` and verl ``compute_grpo_outcome_advantage`` (``torch.std``, unbiased,
    ``eps = 1e-6``); Dr. GRPO (Liu et al. 2025, sec. 3.2).

    Args:
      scores: ``[B]`` float sequence scores.
      group_ids: ``[B]`` int group ids.
      mask: ``[B, T]`` 0/1 response mask.
      norm_by_std: divide by ``std_g + eps`` (static Python bool).
      eps: non-negative scalar added to the std.

    Returns:
      ``(advantages [B, T], returns [B, T])``, the same array twice.

    Raises:
      ValueError: ``mask`` not rank 2; ``scores`` / ``group_ids`` not ``[B]`` float / int;
        a negative static ``eps``.
    """
    scores, group_ids, valid = _outcome_args(scores, group_ids, mask)
    member = jnp.any(valid, axis=1)
    count, total = _group_sums(group_ids, member, jnp.ones_like(scores), scores)
    centered = jnp.where(member, scores - safe_divide(total, count), 0)
    if norm_by_std:
        V.check_nonnegative("eps", eps)
        (sq,) = _group_sums(group_ids, member, centered * centered)
        std = _safe_sqrt(safe_divide(sq, count - 1))  # 0 when count < 2
        centered = safe_divide(centered, std + V.as_scalar("eps", eps).astype(scores.dtype))
    adv = _broadcast(centered, valid)
    return adv, adv


def rloo(scores: jax.Array, group_ids: jax.Array, mask: jax.Array, **unused) -> tuple[jax.Array, jax.Array]:
    """Leave-one-out baseline: ``A_i = r_i - mean_{j != i, j in g(i)} r_j`` on every real token.

    Equals ``n / (n - 1) * (r_i - mean_g)`` for a group of ``n`` real rows; a group of one has
    no baseline and gets advantage 0. Returns = advantages. Worked case ``[1, 0, 0, 1]``:
    ``1 - (0 + 0 + 1) / 3 = 0.667``, ``0 - (1 + 0 + 1) / 3 = -0.667`` ->
    ``[0.667, -0.667, -0.667, 0.667]``.
    Source: Ahmadian et al. 2024 ("Back to Basics", RLOO, eq. 6); Kool et al. 2019.

    Args:
      scores: ``[B]`` float sequence scores.
      group_ids: ``[B]`` int group ids.
      mask: ``[B, T]`` 0/1 response mask.

    Returns:
      ``(advantages [B, T], returns [B, T])``, the same array twice.

    Raises:
      ValueError: ``mask`` not rank 2; ``scores`` / ``group_ids`` not ``[B]`` float / int.
    """
    scores, group_ids, valid = _outcome_args(scores, group_ids, mask)
    member = jnp.any(valid, axis=1)
    count, total = _group_sums(group_ids, member, jnp.ones_like(scores), scores)
    others = jnp.where(member, total - scores, 0)
    has_baseline = member & (count > 1)
    adv_row = jnp.where(has_baseline, scores - safe_divide(others, count - 1), 0)
    adv = _broadcast(adv_row, valid)
    return adv, adv


def group_baseline_explained_variance(returns: jax.Array, group_ids: jax.Array,
                                      mask: jax.Array) -> jax.Array:
    """The explained variance (``masked.explained_variance``) of ``returns`` by a prompt-level
    baseline: on every real token of row ``i``, ``b_i`` = the mean, over the other real rows of
    ``i``'s group, of their return at their first real token (RLOO's leave-one-out baseline).

    The reference for a critic's ``values_explained_variance`` when every prompt is sampled
    ``n`` times: what a critic scores that knows each prompt's expected return from its
    ``n - 1`` other samples alone and nothing of the response. With gamma = lambda = 1 and the
    score as the only reward, every token's return is the row's score and ``b_i`` the others'
    mean score. Leave-one-out, ``b_i`` holds nothing of row ``i``: where the prompts do not
    differ (all scores independent, one mean) it is about ``-1 / (n - 1)``, not 0. A row with
    no other real row in its group gets the mean first-token return of all real rows. Worked
    case, one-token rows, groups ``[1, 0, 0, 1]`` and ``[1, 1]``: ``b = [1/3, 2/3, 2/3, 1/3,
    1, 1]``, ``Var(R) = 2/9``, ``Var(R - b) = 8/27``: ``-1/3``.
    Source: the baseline of Ahmadian et al. 2024 (RLOO, eq. 6), the diagnostic of OpenAI
    Baselines' ``explained_variance``.

    Args:
      returns: ``[B, T]`` float critic targets (the experience's returns).
      group_ids: ``[B]`` int group ids (``group_ids_for``).
      mask: ``[B, T]`` 0/1 (the tokens the returns are over).

    Returns:
      Scalar float (at least float32); 0 where the returns do not vary.

    Raises:
      ValueError: ``mask`` not rank 2; ``returns`` not float ``[B, T]``; ``group_ids`` not int
        ``[B]``.
    """
    returns = V.as_float("returns", returns, ndim=2)
    valid = V.as_valid("mask", mask)
    if returns.shape != valid.shape:
        raise ValueError(f"returns {tuple(returns.shape)} and mask {tuple(valid.shape)} must have "
                         "one shape [B, T]")
    first = jnp.argmax(valid, axis=1)
    row_return = jnp.take_along_axis(returns, first[:, None], axis=1)[:, 0]
    row_return, group_ids, valid = _outcome_args(row_return, group_ids, valid)
    member = jnp.any(valid, axis=1)
    count, total = _group_sums(group_ids, member, jnp.ones_like(row_return), row_return)
    overall = safe_divide(jnp.sum(jnp.where(member, row_return, 0)), jnp.sum(member))
    others = safe_divide(total - row_return, count - 1)
    baseline = jnp.where(member & (count > 1), others, overall)
    return explained_variance(_broadcast(baseline, valid), returns, valid)


def discounted_returns(rewards: jax.Array, mask: jax.Array, *, gamma: Any = 1.0) -> jax.Array:
    """``G_t = sum_{k >= t} gamma^(k - t) r_k`` over real tokens: ``[B, T]``, 0 where ``mask`` is 0.

    Rewards are zeroed outside the mask first (NaN there is fine). This is GAE with ``V = 0``
    and ``lam = 1``, so it is computed by ``compute_gae`` (OpenRLHF ``get_cumulative_returns``).

    Raises:
      ValueError: ``rewards`` not a rank-2 float array; ``mask`` of another shape; non-scalar
        ``gamma``.
    """
    rewards = V.as_float("rewards", rewards, ndim=2)
    returns, _ = compute_gae(jnp.zeros_like(rewards), rewards, mask, gamma=gamma, lam=1.0)
    return returns


def reinforce_plus_plus(rewards: jax.Array, mask: jax.Array, *, gamma: Any = 1.0,
                        **unused) -> tuple[jax.Array, jax.Array]:
    """REINFORCE++: discounted returns, whitened over all real tokens of the batch.

    ``G_t = sum_{k >= t} gamma^(k - t) r_k`` over the row's real tokens (``discounted_returns``);
    ``A = masked_whiten(G, mask)`` = ``(G - mean) / sqrt(var + 1e-8)`` with the mean and
    unbiased variance of ``G`` over every real token of the batch; 0 outside the mask.
    Returns = ``G`` (not whitened). Source: Hu 2025 (REINFORCE++, sec. 3); OpenRLHF
    ``advantage_estimator="reinforce"`` (``get_cumulative_returns`` then batch normalisation).

    Args:
      rewards: ``[B, T]`` float shaped rewards (``compute_rewards``).
      mask: ``[B, T]`` 0/1 response mask.
      gamma: discount, Python float or traced scalar.

    Returns:
      ``(advantages [B, T], returns [B, T])``.

    Raises:
      ValueError: ``rewards`` not a rank-2 float array; ``mask`` of another shape; non-scalar
        ``gamma``.
    """
    returns = discounted_returns(rewards, mask, gamma=gamma)
    return masked_whiten(returns, mask, shift_mean=True), returns


def reinforce_plus_plus_baseline(rewards: jax.Array, scores: jax.Array, group_ids: jax.Array,
                                 mask: jax.Array, *, gamma: Any = 1.0,
                                 **unused) -> tuple[jax.Array, jax.Array]:
    """REINFORCE++-baseline: REINFORCE++ on rewards whose score has its group mean removed.

    ``rewards'[i, t] = rewards[i, t] - mean_g(scores)`` at the LAST real token of row ``i``
    (unchanged elsewhere; ``mean_g`` over the real rows of ``i``'s group, so a group of one
    subtracts its own score), then ``reinforce_plus_plus(rewards', mask, gamma=gamma)``:
    discounted returns of ``rewards'`` (returned) whitened over the batch (advantages). With
    ``rewards`` from ``compute_rewards(scores, ...)`` the score term becomes
    ``scores[i] - mean_g``; the KL terms are kept. Source: OpenRLHF
    ``advantage_estimator="reinforce_baseline"`` (score minus the prompt's mean, KL added,
    cumulative returns, batch whitening); verl ``reinforce_plus_plus_baseline``
    (``compute_reinforce_plus_plus_baseline_outcome_advantage``, gamma 1).

    Args:
      rewards: ``[B, T]`` float shaped rewards (score at the last real token).
      scores: ``[B]`` float sequence scores (those added into ``rewards``).
      group_ids: ``[B]`` int group ids.
      mask: ``[B, T]`` 0/1 response mask.
      gamma: discount, Python float or traced scalar.

    Returns:
      ``(advantages [B, T], returns [B, T])``.

    Raises:
      ValueError: ``rewards`` not ``[B, T]`` float; ``mask`` of another shape; ``scores`` /
        ``group_ids`` not ``[B]`` float / int; non-scalar ``gamma``.
    """
    rewards = V.as_float("rewards", rewards, ndim=2)
    scores, group_ids, valid = _outcome_args(scores, group_ids, V.as_valid("mask", mask, rewards.shape))
    member = jnp.any(valid, axis=1)
    count, total = _group_sums(group_ids, member, jnp.ones_like(scores), scores)
    dtype = jnp.promote_types(rewards.dtype, scores.dtype)
    mean = safe_divide(total, count).astype(dtype)
    shifted = rewards.astype(dtype) - jnp.where(last_valid_onehot(valid), mean[:, None], 0)
    return reinforce_plus_plus(shifted, valid, gamma=gamma)


def remax(rewards: jax.Array, baseline_scores: jax.Array, mask: jax.Array,
          **unused) -> tuple[jax.Array, jax.Array]:
    """ReMax: ``A_t = G_t - b`` with ``G_t = sum_{k >= t} r_k`` (gamma 1) on real tokens.

    ``b = baseline_scores[i]``, the score of the greedy response to row ``i``'s prompt (the
    trainer computes it); returns = ``G``; both 0 outside the mask. A ``gamma`` keyword is
    ignored (ReMax has none). Source: Li et al. 2023 (ReMax, Algorithm 1); verl
    ``compute_remax_outcome_advantage``.

    Args:
      rewards: ``[B, T]`` float shaped rewards (score at the last real token).
      baseline_scores: ``[B]`` float greedy-response scores.
      mask: ``[B, T]`` 0/1 response mask.

    Returns:
      ``(advantages [B, T], returns [B, T])``.

    Raises:
      ValueError: ``rewards`` not ``[B, T]`` float; ``mask`` of another shape;
        ``baseline_scores`` not ``[B]`` float.
    """
    rewards = V.as_float("rewards", rewards, ndim=2)
    valid = V.as_valid("mask", mask, rewards.shape)
    baseline = V.as_float("baseline_scores", baseline_scores, ndim=1)
    if baseline.shape != rewards.shape[:1]:
        raise ValueError(f"baseline_scores must have shape ({rewards.shape[0]},) for rewards "
                         f"[B, T] = {tuple(rewards.shape)}, got {tuple(baseline.shape)}")
    dtype = jnp.promote_types(rewards.dtype, baseline.dtype)
    returns = discounted_returns(rewards.astype(dtype), valid, gamma=1.0)
    advantages = jnp.where(valid, returns - baseline.astype(dtype)[:, None], 0)
    return advantages, returns
