"""Masked grouped-query attention over a dense key/value sequence: the softmax every cache
layout reduces to (the dense KV cache of `kv_cache`, the gathered pages of `paged_cache`).

Numerics follow transformers' `eager_attention_forward`: scores and softmax in float32; masked
scores are a large negative finite number, so fully masked query rows stay finite.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

MASK_VALUE = -1e30


def dot_attention(q, k, v, allowed, *, window=None, q_slots=None, k_slots=None):
    """Masked grouped-query attention.

    q `[B, L, H, hd]`, k/v `[B, S, KVH, hd]` (H a multiple of KVH), allowed `[B, L, S]` bool.
    window: int32 scalar (0 = none); keys with `q_slot - k_slot >= window` are dropped
    (transformers `sliding_window_overlay`). Scores and softmax in float32; returns
    `[B, L, H * hd]` in v.dtype. Source: Ainslie et al. 2023 (GQA); HF `eager_attention_forward`.
    """
    b, l, h, hd = q.shape
    kvh = k.shape[2]
    qg = q.reshape(b, l, kvh, h // kvh, hd)
    scores = jnp.einsum("blkgd,bskd->bkgls", qg, k, preferred_element_type=jnp.float32)
    scores = scores * jnp.float32(hd ** -0.5)
    if window is not None:
        in_window = (q_slots[:, None] - k_slots[None, :]) < window
        allowed = allowed & ((window <= 0) | in_window)[None]
    scores = jnp.where(allowed[:, None, None], scores, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgls,bskd->blkgd", probs, v)
    return out.reshape(b, l, h * hd)
