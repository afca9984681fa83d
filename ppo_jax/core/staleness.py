"""Staleness of asynchronous rollouts: how many policy versions behind the trainer a sample is.

With continuous generation (`rollout.stream`) the trainer learns from samples drawn while it
was updating: each response token records the policy version that drew it, and with partial
rollouts one response can span several versions. A sample's staleness is the trainer's
current version minus the OLDEST version among its tokens, so a bound on it bounds every
token's lag. AReaL (Fu et al. 2025, "AReaL: A Large-Scale Asynchronous Reinforcement
Learning System for Language Reasoning", arXiv:2505.24298, its staleness bound eta) admits a
sample only while its lag is at most eta; eta = 0 is synchronous RL. Which samples a trainer
refuses is the trainer's rule; these functions measure.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ppo_jax.core import validation as V

_NO_TOKEN = jnp.iinfo(jnp.int32).max


def sample_staleness(versions: Any, mask: Any, current_version: Any) -> jax.Array:
    """Per-sample staleness: ``current_version - min_t versions[b, t]`` over the real tokens.

    Args:
      versions: ``[B, N]`` int, the policy version that drew each response token (values on
        masked slots are ignored; the stream writes -1 there).
      mask: ``[B, N]`` 0/1, the real response tokens.
      current_version: int scalar, the trainer's policy version.

    Returns:
      ``[B]`` int32; 0 for a row with no real token (nothing in it is stale). Negative when a
      token is newer than ``current_version`` (a caller bug the caller can check for).

    Raises:
      ValueError: ``versions`` not an integer ``[B, N]`` array, ``mask`` of another shape,
        ``current_version`` not a numeric scalar.
    """
    versions = V.as_int("versions", versions, ndim=2).astype(jnp.int32)
    valid = V.as_valid("mask", mask, versions.shape)
    current = V.as_scalar("current_version", current_version).astype(jnp.int32)
    oldest = jnp.min(jnp.where(valid, versions, _NO_TOKEN), axis=1)
    return jnp.where(valid.any(axis=1), current - oldest, 0)


def staleness_metrics(staleness: Any, versions: Any, mask: Any, bins: int = 4) -> dict:
    """Log figures of one batch's staleness and version mix.

    Args:
      staleness: ``[B]`` int, ``sample_staleness``.
      versions, mask: ``[B, N]``, as ``sample_staleness``.
      bins: K >= 1 (static): the histogram's bins are staleness 0 .. K - 1 and ">= K".

    Returns:
      float32 scalars: ``rollout/staleness_hist_{k}`` (k < K) and ``rollout/staleness_hist_ge{K}``,
      the fraction of the B samples at each staleness (negative counts in bin 0);
      ``rollout/staleness_mean`` and ``rollout/staleness_max`` over the samples;
      ``rollout/version_spread``, the newest minus the oldest token version in the batch (0:
      one policy drew everything; 0 with no real token); ``rollout/mixed_version_frac``, the
      fraction of samples whose tokens come from two or more versions (partial rollouts).

    Raises:
      ValueError: ``bins`` not an int >= 1; shapes as ``sample_staleness``.
    """
    if not isinstance(bins, int) or isinstance(bins, bool) or bins < 1:
        raise ValueError(f"bins must be an int >= 1, got {bins!r}")
    staleness = V.as_int("staleness", staleness, ndim=1).astype(jnp.int32)
    versions = V.as_int("versions", versions, ndim=2).astype(jnp.int32)
    valid = V.as_valid("mask", mask, versions.shape)
    if staleness.shape[0] != versions.shape[0]:
        raise ValueError(f"staleness has {staleness.shape[0]} rows, versions {versions.shape[0]}")
    rows = jnp.float32(staleness.shape[0])
    binned = jnp.clip(staleness, 0, bins)
    out = {f"rollout/staleness_hist_{k}": jnp.sum(binned == k) / rows for k in range(bins)}
    out[f"rollout/staleness_hist_ge{bins}"] = jnp.sum(binned == bins) / rows
    out["rollout/staleness_mean"] = jnp.mean(staleness.astype(jnp.float32))
    out["rollout/staleness_max"] = jnp.max(staleness).astype(jnp.float32)
    newest = jnp.max(jnp.where(valid, versions, -_NO_TOKEN), axis=1)  # [B]
    oldest = jnp.min(jnp.where(valid, versions, _NO_TOKEN), axis=1)
    any_token = valid.any()  # the sentinels never enter a difference: 0 replaces them first
    spread = jnp.where(any_token, jnp.max(newest), 0) - jnp.where(any_token, jnp.min(oldest), 0)
    out["rollout/version_spread"] = spread.astype(jnp.float32)
    mixed = valid.any(axis=1) & (newest > oldest)
    out["rollout/mixed_version_frac"] = jnp.sum(mixed) / rows
    return out
