"""The paged KV cache: attention over gathered pages equals dense attention, and a model run over
pages (prefill, then one-token steps) gives the dense cache's logits; padding and idle rows write
only to the trash page."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ppo_jax.models.attention import dot_attention
from ppo_jax.models.heads import init_model
from ppo_jax.models.kv_cache import init_cache
from ppo_jax.models.paged_cache import (
    TRASH_PAGE, PagedKVCache, PagedView, init_paged_cache, paged_attention_reference, write_pages,
)
from ppo_jax.models.tiny_random import tiny_config


def _tables(rng, replicas, rows, width, num_pages):
    """Distinct random pages (never the trash page) for every row of every replica."""
    out = np.zeros((replicas, rows, width), np.int32)
    for r in range(replicas):
        out[r] = rng.permutation(np.arange(1, num_pages))[:rows * width].reshape(rows, width)
    return out


@pytest.mark.parametrize("head_major", [False, True])
@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("window", [None, 5])
def test_paged_attention_equals_dense_attention(jit, window, head_major):
    rng = np.random.default_rng(0)
    replicas, rows, width, page_size, kvh, heads, hd, length = 2, 3, 4, 4, 2, 4, 8, 3
    table = _tables(rng, replicas, rows, width, 32)
    seq = width * page_size
    k = rng.normal(size=(replicas * rows, seq, kvh, hd)).astype(np.float32)
    v = rng.normal(size=(replicas * rows, seq, kvh, hd)).astype(np.float32)
    q = rng.normal(size=(replicas * rows, length, heads, hd)).astype(np.float32)
    kv_lens = np.array([16, 9, 3, 12, 5, 14], np.int32)
    positions = (kv_lens[:, None] - length + np.arange(length)).astype(np.int32)
    # the dense k/v laid into pages: position p of row (r, s) at page table[r, s, p // 4]
    pool = np.zeros((replicas, 32, page_size, 2 * kvh, hd), np.float32)
    for b in range(replicas * rows):
        r, s = divmod(b, rows)
        for p in range(seq):
            pool[r, table[r, s, p // page_size], p % page_size, 0::2] = k[b, p]
            pool[r, table[r, s, p // page_size], p % page_size, 1::2] = v[b, p]
    view = PagedView(jnp.asarray(table), jnp.asarray(positions),
                     jnp.ones(positions.shape, bool), jnp.asarray(kv_lens))
    w = None if window is None else jnp.int32(window)
    if head_major:
        pool = pool.transpose(0, 1, 3, 2, 4)  # [R, P, 2 KVH, page, hd]
    fn = partial(paged_attention_reference, head_major=head_major)
    fn = jax.jit(fn) if jit else fn
    got = fn(jnp.asarray(q), jnp.asarray(pool), view, w)
    j = np.arange(seq)
    allowed = (j <= positions[:, :, None]) & (j < kv_lens[:, None, None])
    if window is not None:  # a sliding window over each row's own positions
        allowed = allowed & (positions[:, :, None] - j < window)
    want = dot_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(allowed))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head_major", [False, True])
def test_writes_of_padding_and_idle_rows_land_on_the_trash_page(head_major):
    rng = np.random.default_rng(1)
    table = _tables(rng, 1, 2, 2, 8)
    shape = (1, 1, 8, 2, 4, 3) if head_major else (1, 1, 8, 4, 2, 3)  # 8 pages of 4, 1 KV head
    cache = PagedKVCache(jnp.zeros(shape, jnp.float32), head_major)
    k = jnp.ones((2, 3, 1, 3))
    write = jnp.asarray([[False, True, True], [False, False, False]])
    view = PagedView(jnp.asarray(table), jnp.asarray([[0, 0, 1], [4, 5, 6]], jnp.int32), write,
                     jnp.asarray([2, 7], jnp.int32))
    out = np.asarray(write_pages(cache, jnp.int32(0), view, k, 2 * k).kv)
    if head_major:
        out = out.transpose(0, 1, 2, 4, 3, 5)  # back to [layers, R, pages, page, 2 KVH, hd]
    written = np.argwhere(out[0, 0].any(axis=(2, 3)))  # (page, offset) pairs holding data
    want = {(table[0, 0, 0], 0), (table[0, 0, 0], 1), (TRASH_PAGE, 0), (TRASH_PAGE, 1),
            (TRASH_PAGE, 2)}
    assert {tuple(x) for x in written} <= want
    assert {(table[0, 0, 0], 0), (table[0, 0, 0], 1)} <= {tuple(x) for x in written}
    np.testing.assert_array_equal(out[0, 0, table[0, 0, 0], 0, 1], 2.0)  # v at combined head 1


def _paged_logits(model, ids, mask, steps, page_size, width, head_major, whole_pages=False):
    """Prefill left-padded `[B, P]` prompts into pages, then `steps` greedy one-token steps;
    the logits of every step `[steps + 1, B, V]`."""
    batch, plen = ids.shape
    rng = np.random.default_rng(2)
    table = jnp.asarray(_tables(rng, 1, batch, width, batch * width + 1))
    cache = init_paged_cache(model.cfg, 1, batch * width + 1, page_size, jnp.float32, head_major)
    lens = mask.sum(axis=1).astype(np.int32)
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
    view = PagedView(table, jnp.asarray(positions), jnp.asarray(mask.astype(bool)),
                     jnp.asarray(lens), whole_pages=whole_pages)
    hidden, cache = model.backbone(jnp.asarray(ids), None, cache=cache, paged=view)
    logits = [model.lm_head(hidden[:, -1])]
    for t in range(steps):
        token = jnp.argmax(logits[-1], axis=-1)[:, None]
        pos = jnp.asarray(lens + t)[:, None]
        view = PagedView(table, pos, jnp.ones((batch, 1), bool), jnp.asarray(lens + t + 1))
        hidden, cache = model.backbone(token, None, cache=cache, paged=view)
        logits.append(model.lm_head(hidden[:, 0]))
    return jnp.stack(logits)


def _dense_logits(model, ids, mask, steps):
    batch, plen = ids.shape
    cache = init_cache(model.cfg, batch, plen + steps, jnp.float32)
    full = np.concatenate([mask, np.zeros((batch, steps), mask.dtype)], axis=1)
    hidden, cache = model.backbone(jnp.asarray(ids), jnp.asarray(full), cache=cache, cache_index=0)
    logits = [model.lm_head(hidden[:, -1])]
    for t in range(steps):
        token = jnp.argmax(logits[-1], axis=-1)[:, None]
        full[:, plen + t] = 1
        hidden, cache = model.backbone(token, jnp.asarray(full), cache=cache,
                                       cache_index=plen + t)
        logits.append(model.lm_head(hidden[:, 0]))
    return jnp.stack(logits)


@pytest.mark.parametrize("whole_pages", [False, True])
@pytest.mark.parametrize("head_major", [False, True])
@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
def test_a_model_over_pages_gives_the_dense_cache_logits(model_type, head_major, whole_pages):
    """Prefill (token by token, or as whole pages) then six one-token steps: the dense cache's
    logits."""
    extra = {} if model_type == "llama" else dict(model_type="gpt2", num_kv_heads=4,
                                                   hidden_act="gelu_new", intermediate_size=256)
    model = init_model(tiny_config(64, **extra), seed=1)
    rng = np.random.default_rng(3)
    ids = rng.integers(4, 64, (3, 7)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[1, :3], mask[2, :6] = 0, 0  # left padding; row 2 holds one prompt token
    ids[mask == 0] = 0
    got = _paged_logits(model, ids, mask, 6, 4, 4, head_major, whole_pages)
    want = _dense_logits(model, ids, mask, 6)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
