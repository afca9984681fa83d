"""Preallocated key/value cache and the mask-derived positions it is read with.

The cache is a NamedTuple (a pytree) of two arrays `[num_layers, B, S, num_kv_heads, head_dim]`.
A forward call with `cache` and `cache_index` writes the L new tokens to slots
`[cache_index, cache_index + L)`; the query at slot i attends to slots j <= i whose
`attention_mask[:, j] == 1` (docs/contracts.md). Slots are shared by all rows, so left-padded
prompts and per-row stops only change the mask, never the slot arithmetic.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from ppo_jax.models.config import ModelConfig


class KVCache(NamedTuple):
    """k, v: `[num_layers, B, S, num_kv_heads, head_dim]` in the cache dtype (RoPE already applied to k)."""

    k: jax.Array
    v: jax.Array

    @property
    def max_len(self) -> int:
        """S, the number of preallocated slots."""
        return self.k.shape[2]


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=None) -> KVCache:
    """Zero cache `[num_layers, batch, max_len, num_kv_heads, head_dim]`.

    dtype defaults to the compute dtype `cfg.dtype`. Memory: 2 * L * B * S * KVH * hd * itemsize.
    Source: the static cache of transformers `cache_utils.StaticCache`.
    """
    dtype = cfg.jnp_dtype if dtype is None else jnp.dtype(dtype)
    shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def positions_from_mask(attention_mask: jax.Array) -> jax.Array:
    """`[B, S] int -> [B, S] int32`: each token's position within its segment.

    A 0/1 mask is one segment a row: `max(cumsum(mask) - 1, 0)`, so left padding never shifts
    positions. A packed row holds segment ids instead (1, 1, 1, 2, 2, 0, ...: `rollout.packing`),
    each segment a contiguous run of one id; positions restart at 0 where a segment starts, as
    each sequence's own row would give them. A pad slot (0) keeps the position of the slot
    before it (0 before any segment).
    """
    real = (attention_mask != 0).astype(jnp.int32)
    count = jnp.cumsum(real, axis=-1)
    before = jnp.pad(attention_mask, ((0, 0), (1, 0)))[:, :-1]
    starts = (real == 1) & (attention_mask != before)
    # the real tokens before each slot's segment: the count where the segment started
    offset = jax.lax.cummax(jnp.where(starts, count - 1, 0), axis=attention_mask.ndim - 1)
    return jnp.maximum(count - 1 - offset, 0)


def same_segment(query_ids: jax.Array, key_ids: jax.Array) -> jax.Array:
    """`[B, L]`, `[B, S]` segment ids -> `[B, L, S]` bool: the key is real and, for a real
    query, in the query's segment. A pad query keeps every real key (a 0/1 mask's pattern), so
    a one-segment row attends as it always has; it is read by no loss."""
    q, k = query_ids[:, :, None], key_ids[:, None, :]
    return (k != 0) & ((q == k) | (q == 0))


def slot_layout(attention_mask: jax.Array, length: int, cache_index=None):
    """Positions of the new tokens and the attention pattern for one forward call.

    Args:
      attention_mask: `[B, S]` int, 1 on real tokens over all S slots (S == length without cache),
        or a packed row's segment ids (`positions_from_mask`): a query attends only within its
        segment (`same_segment`).
      length: L, number of new tokens.
      cache_index: int32 scalar (traced ok), first slot written; None means 0 (no cache).
    Returns:
      positions `[B, L]` int32, allowed `[B, L, S]` bool (causal & same segment),
      q_slots `[L]` int32 and k_slots `[S]` int32 (for sliding windows).
    Raises:
      ValueError if there is no cache and S != L.
    """
    b, s = attention_mask.shape
    start = jnp.asarray(0 if cache_index is None else cache_index, jnp.int32)
    pos_all = positions_from_mask(attention_mask)
    positions = jax.lax.dynamic_slice(pos_all, (jnp.int32(0), start), (b, length))
    q_slots = start + jnp.arange(length, dtype=jnp.int32)
    k_slots = jnp.arange(s, dtype=jnp.int32)
    causal = k_slots[None, :] <= q_slots[:, None]
    q_ids = jax.lax.dynamic_slice(attention_mask, (jnp.int32(0), start), (b, length))
    allowed = causal[None] & same_segment(q_ids, attention_mask)
    return positions, allowed, q_slots, k_slots
