"""A paged key/value cache and attention over its pages (the rollout engine's cache).

The cache is one array `kv [num_layers, R, num_pages, ...]`: R independent replicas (one per
data-parallel row block of the mesh, `rollout.engine`), each with its own pool of fixed-size
pages. Keys and values of KV head h sit at combined heads 2h and 2h + 1; a page is
token-major (jax's Pallas `ragged_paged_attention` reads it as it is, on TPU) or head-major
(what the reference reads fastest; `PagedKVCache`). A sequence's token at position p (its index in the sequence, prompt first)
lives in page `page_table[r, s, p // page_size]` at offset `p % page_size`. Page 0 of every
replica is the trash page: it is never given to a sequence, and the writes of padding tokens
and idle slots land there, so no write ever reaches another sequence's page.

A forward call over pages takes a `PagedView`: the page table of its rows, the position of
every new token (RoPE and the causal mask follow it), which new tokens are written, and each
row's KV length after the writes. The plain-JAX reference (`paged_attention_reference`) gathers
a row's pages into one `[W * page_size]` sequence and masks it by position and length: the same
softmax as the dense cache's `dot_attention`, over a width the caller chooses (the engine
passes the fewest pages that hold its longest live row). Sources: Kwon et al. 2023 (vLLM,
PagedAttention); jax `ragged_paged_attention` (kernel and `ref_ragged_paged_attention`).
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
from flax import struct

from ppo_jax.models.attention import kv_major_attention
from ppo_jax.models.config import ModelConfig

TRASH_PAGE = 0
ATTENTION_KERNELS = ("reference", "pallas")


@struct.dataclass
class PagedKVCache:
    """kv: the pool, RoPE applied to the keys, k of KV head h at combined head 2h, v at 2h + 1,
    in one of two page layouts (static `head_major`):

    - token-major, `[num_layers, R, num_pages, page_size, 2 * num_kv_heads, head_dim]`: the
      layout of jax's Pallas `ragged_paged_attention` (`generation.attention: pallas`);
    - head-major, `[num_layers, R, num_pages, 2 * num_kv_heads, page_size, head_dim]`: each
      head of a page is one contiguous block, so the reference gathers a row's pages straight
      into the `[KVH, W * page_size, hd]` blocks its attention reads (no transpose: on XLA:CPU
      the decode attention over SmolLM2's 20 pages of 16 takes 0.19 s a step instead of 0.27).
    """

    kv: jax.Array
    head_major: bool = struct.field(pytree_node=False, default=False)

    @property
    def page_size(self) -> int:
        return self.kv.shape[4 if self.head_major else 3]

    @property
    def num_pages(self) -> int:
        """Pages per replica, the trash page included."""
        return self.kv.shape[2]


@struct.dataclass
class PagedView:
    """What one forward call over pages reads and writes.

    page_table: `[R, S, W]` int32, the first W pages of each of the S rows of every replica
      (page ids local to the replica; unused entries point at the trash page).
    positions: `[R * S, L]` int32, the position of each new token in its sequence.
    write: `[R * S, L]` bool, the new tokens whose k/v are stored (padding and idle rows: no).
    kv_lens: `[R * S]` int32, each row's sequence length after this call's writes.
    kernel: "reference" (gather the pages, everywhere) or "pallas" (TPU; one-token decode
      calls only, `paged_attention_tpu`; `layers.paged_attention` dispatches); static.
    mesh: the mesh the Pallas kernel is mapped over (None: one device); static.
    whole_pages: the call is a prefill from position 0 (each row's new tokens are its positions
      0..kv_len - 1, left-padded): written as whole pages, one scatter index per page (the
      token-wise scatter of a prefill made XLA:TPU relayout the whole pool at every layer);
      the tail of a row's last page is zeroed; static.
    """

    page_table: jax.Array
    positions: jax.Array
    write: jax.Array
    kv_lens: jax.Array
    kernel: str = struct.field(pytree_node=False, default="reference")
    mesh: Any = struct.field(pytree_node=False, default=None)
    whole_pages: bool = struct.field(pytree_node=False, default=False)


def init_paged_cache(cfg: ModelConfig, replicas: int, num_pages: int, page_size: int,
                     dtype=None, head_major: bool = False) -> PagedKVCache:
    """Zero pool of `replicas` x `num_pages` pages of `page_size` tokens (`PagedKVCache` for the
    layouts) in `dtype` (default the compute dtype). Memory: num_layers x replicas x num_pages
    x page_size x 2 x num_kv_heads x head_dim x the item size."""
    dtype = cfg.jnp_dtype if dtype is None else jnp.dtype(dtype)
    page = ((2 * cfg.num_kv_heads, page_size) if head_major
            else (page_size, 2 * cfg.num_kv_heads))
    shape = (cfg.num_layers, replicas, num_pages, *page, cfg.head_dim)
    return PagedKVCache(jnp.zeros(shape, dtype), head_major)


def _per_replica(x: jax.Array, replicas: int) -> jax.Array:
    """`[R * S, ...]` -> `[R, S, ...]`."""
    return x.reshape(replicas, x.shape[0] // replicas, *x.shape[1:])


def write_pages(cache: PagedKVCache, layer, view: PagedView, k: jax.Array,
                v: jax.Array) -> PagedKVCache:
    """Store the new `k, v [R * S, L, KVH, hd]` of layer `layer` (int32 scalar, traced ok) at
    their positions' pages; tokens with `view.write` False go to the trash page."""
    replicas, _, _ = view.page_table.shape
    b, length, kvh, hd = k.shape
    new = jnp.stack([k, v], axis=3).reshape(b, length, 2 * kvh, hd).astype(cache.kv.dtype)
    if view.whole_pages:
        return _write_whole_pages(cache, layer, view, new)
    pos = _per_replica(view.positions, replicas)
    page = jnp.take_along_axis(view.page_table, pos // cache.page_size, axis=2, mode="clip")
    page = jnp.where(_per_replica(view.write, replicas), page, TRASH_PAGE)
    offset = pos % cache.page_size
    # explicit replica indices, not a vmap over the pool's replica axis (dim 1): a batched
    # scatter there makes XLA move that axis first, copying the whole pool at every layer
    replica = jnp.arange(replicas, dtype=jnp.int32)[:, None, None]
    new = _per_replica(new, replicas)  # [R, S, L, 2 KVH, hd]
    if cache.head_major:  # the indexed dims lead the result: [R, S, L, 2 KVH, hd] again
        return cache.replace(kv=cache.kv.at[layer, replica, page, :, offset].set(new))
    return cache.replace(kv=cache.kv.at[layer, replica, page, offset].set(new))


def _write_whole_pages(cache: PagedKVCache, layer, view: PagedView, new: jax.Array):
    """A prefill's `new [R * S, L, 2 KVH, hd]` (row r's positions 0..kv_len - 1 in its last
    kv_len columns) as the pages of `view.page_table [R, S, W]`, W * page_size >= L."""
    replicas, rows, width = view.page_table.shape
    b, length = new.shape[:2]
    ps = cache.page_size
    q = jnp.arange(width * ps, dtype=jnp.int32)  # the positions the row's W pages hold
    lens = view.kv_lens.astype(jnp.int32)[:, None]
    column = jnp.clip(length - lens + q, 0, length - 1)  # left padding: position q's column
    blocks = jnp.take_along_axis(new, column[:, :, None, None], axis=1)
    blocks = jnp.where((q < lens)[:, :, None, None], blocks, jnp.zeros((), new.dtype))
    blocks = blocks.reshape(replicas, rows, width, ps, *new.shape[2:])
    if cache.head_major:
        blocks = blocks.swapaxes(3, 4)  # [R, S, W, 2 KVH, page, hd]
    replica = jnp.arange(replicas, dtype=jnp.int32)[:, None, None]
    return cache.replace(kv=cache.kv.at[layer, replica, view.page_table].set(blocks))


def gather_pages(kv_layer: jax.Array, page_table: jax.Array,
                 head_major: bool = False) -> tuple[jax.Array, jax.Array]:
    """One layer's pool (`[R, P, page_size, 2 KVH, hd]`, or `[R, P, 2 KVH, page_size, hd]`
    head-major) read through `page_table [R, S, W]` -> `(k, v)`, each `[R * S, KVH, W *
    page_size, hd]` (`attention.kv_major_attention`'s layout): every row's first W pages."""
    replicas, rows, width = page_table.shape
    if head_major:
        heads2, page_size, hd = kv_layer.shape[2:]
        flat = kv_layer.reshape(replicas, -1, page_size, hd)  # [R, P * 2 KVH, page, hd]
        first = page_table[:, :, None, :] * heads2 + jnp.arange(0, heads2, 2)[:, None]
        take = jax.vmap(lambda f, i: f[i])  # [R, S, KVH, W, page, hd]
        shape = (replicas * rows, heads2 // 2, width * page_size, hd)
        return take(flat, first).reshape(shape), take(flat, first + 1).reshape(shape)
    pages = jax.vmap(lambda kv_r, table_r: kv_r[table_r])(kv_layer, page_table)
    heads = pages.transpose(0, 1, 4, 2, 3, 5)  # [R, S, 2 KVH, W, page_size, hd]
    flat = heads.reshape(replicas * rows, kv_layer.shape[3], width * kv_layer.shape[2], -1)
    return flat[:, 0::2], flat[:, 1::2]


def paged_mask(view: PagedView, kv_width: int, window: Optional[jax.Array] = None) -> jax.Array:
    """`[R * S, L, kv_width]` bool: key j is seen by the new token at position p when
    `j <= p`, `j < kv_len` and (with a sliding window w > 0) `p - j < w`."""
    j = jnp.arange(kv_width, dtype=jnp.int32)
    pos = view.positions[:, :, None]
    allowed = (j <= pos) & (j < view.kv_lens[:, None, None])
    if window is not None:
        allowed = allowed & ((window <= 0) | (pos - j < window))
    return allowed


def paged_attention_reference(q: jax.Array, kv_layer: jax.Array, view: PagedView,
                              window: Optional[jax.Array] = None,
                              head_major: bool = False, scale: Optional[float] = None) -> jax.Array:
    """Attention of the new queries `q [R * S, L, H, hd]` over their rows' pages of one layer's
    pool `kv_layer` (either layout, `PagedKVCache`), gathered (`gather_pages`) and masked
    (`paged_mask`); scores (scaled by `scale`, None: `hd ** -0.5`) and softmax in float32 as
    `attention.dot_attention`. Returns `[R * S, L, H * hd]` in q.dtype."""
    k, v = gather_pages(kv_layer, view.page_table, head_major)
    allowed = paged_mask(view, k.shape[2], window)
    return kv_major_attention(q, k.astype(q.dtype), v.astype(q.dtype), allowed, scale)
