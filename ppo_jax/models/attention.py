"""Masked grouped-query attention over a dense key/value sequence: the softmax every cache
layout reduces to (the dense KV cache of `kv_cache`, the gathered pages of `paged_cache`).

Numerics follow transformers' `eager_attention_forward`: scores and softmax in float32; masked
scores are a large negative finite number, so fully masked query rows stay finite.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

MASK_VALUE = -1e30


def dot_attention(q, k, v, allowed, *, window=None, q_slots=None, k_slots=None, scale=None):
    """Masked grouped-query attention.

    q `[B, L, H, hd]`, k/v `[B, S, KVH, hd]` (H a multiple of KVH), allowed `[B, L, S]` bool.
    window: int32 scalar (0 = none); keys with `q_slot - k_slot >= window` are dropped
    (transformers `sliding_window_overlay`). scale: the scores' factor, None for `hd ** -0.5`
    (Gemma 3: `query_pre_attn_scalar ** -0.5`). Scores and softmax in float32; returns
    `[B, L, H * hd]` in v.dtype. Source: Ainslie et al. 2023 (GQA); HF `eager_attention_forward`.
    One-token calls (decoding, L = 1) run `kv_major_attention` on k / v moved to
    `[B, KVH, S, hd]`: on XLA:CPU 2x faster for SmolLM2's decode shapes, transposes included.
    """
    allowed = windowed(allowed, window, q_slots, k_slots)
    if q.shape[1] == 1:
        return kv_major_attention(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), allowed,
                                  scale)
    b, l, h, hd = q.shape
    kvh = k.shape[2]
    qg = q.reshape(b, l, kvh, h // kvh, hd)
    scores = jnp.einsum("blkgd,bskd->bkgls", qg, k, preferred_element_type=jnp.float32)
    scores = scores * jnp.float32(hd ** -0.5 if scale is None else scale)
    scores = jnp.where(allowed[:, None, None], scores, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgls,bskd->blkgd", probs, v)
    return out.reshape(b, l, h * hd)


def windowed(allowed, window, q_slots, k_slots):
    """`allowed [B, L, S]` with the keys outside a sliding window dropped: kept where `q_slot -
    k_slot < window` (transformers `sliding_window_overlay`); window None or <= 0: unchanged."""
    if window is None:
        return allowed
    in_window = (q_slots[:, None] - k_slots[None, :]) < window
    return allowed & ((window <= 0) | in_window)[None]


def kv_major_attention(q, k, v, allowed, scale=None):
    """`dot_attention` (no window) with keys and values laid out head-major: q `[B, L, H,
    hd]`, k / v `[B, KVH, S, hd]`, allowed `[B, L, S]`, scale (None: `hd ** -0.5`) ->
    `[B, L, H * hd]` in v.dtype. Each
    head's keys are one contiguous `[S, hd]` block (the layout the paged cache's gather writes,
    `paged_cache.gather_pages`), and the queries of a KV head are one `[G * L, hd]` matrix, so
    each head is one plain matmul."""
    b, l, h, hd = q.shape
    kvh, keys = k.shape[1], k.shape[2]
    g = h // kvh
    qh = q.reshape(b, l, kvh, g, hd).transpose(0, 2, 3, 1, 4).reshape(b, kvh, g * l, hd)
    scores = jnp.einsum("bkqd,bksd->bkqs", qh, k, preferred_element_type=jnp.float32)
    mask = jnp.broadcast_to(allowed[:, None, None], (b, 1, g, l, keys)).reshape(b, 1, g * l, keys)
    scale = jnp.float32(hd ** -0.5 if scale is None else scale)
    scores = jnp.where(mask, scores * scale, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkqs,bksd->bkqd", probs, v).reshape(b, kvh, g, l, hd)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, l, h * hd)
