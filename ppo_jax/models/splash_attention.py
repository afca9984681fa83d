"""Full-sequence causal attention with segment ids through jax's Pallas splash attention (TPU).

`splash_attention(q, k, v, segment_ids, ...)` computes what `attention.dot_attention` computes
for a no-cache forward over rows whose attention mask is 0/1 or a packed row's segment ids
(`kv_cache.slot_layout`), on every real query (mask != 0), without forming the `[B, H, L, S]`
scores: jax's `splash_attention` (jax.experimental.pallas.ops.tpu.splash_attention, jax 0.10.2;
the block-sparse flash attention MaxText trains with) with a causal or local static mask and
the mask as its `SegmentIds`.

The segment ids are the attention mask itself: a real token attends to the keys of its own
segment (a 0/1 row is one segment, id 1); a pad (0) is a segment of its own, so a pad query
attends to the pads before it. `dot_attention` lets a pad query read every real key instead:
the outputs differ on pad positions only, which no loss reads, and no real query reads a pad
key either way, so real positions (and gradients, which reach pads only through their own
outputs) are the same to float rounding.

Kernel facts (jax 0.10.2 `splash_attention_kernel`), the shapes compiled for v5p from this CPU
host (`aot.topology`): q `[H, L, hd]` and k / v `[KVH, L, hd]` per row (`make_splash_mha`
takes H a multiple of KVH: GQA without repeating k / v), vmapped over rows; head_dim 32, 64,
128 and 256 compile in float32 and bfloat16; the kv block must be a multiple of 128 lanes, so
L is padded to a multiple of 128 (pad ids -1: a segment of their own, sliced off); the kernel
has no score scale, so q is multiplied by it first (in float32, rounded once to q's dtype:
exact for a power-of-two scale, hd 64 or 256; otherwise one extra rounding of q in bfloat16);
scores, softmax and the value product are in float32 (the reference rounds the probabilities
to v's dtype before the value product: in bfloat16 the two differ by that rounding).
Sliding windows are a `LocalMask((w - 1, 0))`: key k is kept for query q when q - k < w, as
`dot_attention`'s window. A window traced in the layer scan picks one of the model's static
windows by `lax.switch`.

Mosaic kernels cannot be partitioned by XLA's SPMD partitioner, so with a mesh the call runs
under `jax.shard_map`: rows over ("data", "fsdp"), heads over "tensor" where it divides the KV
heads (else each tensor shard computes every head), as `paged_attention_tpu` does.

Interpret mode: `interpret=True` runs the kernel in Pallas' interpreter on CPU (tests); it is
what `ModelConfig.attention == "splash"` does off TPU.
"""

from __future__ import annotations

import functools
import math
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas.ops.tpu import splash_attention as splash
from jax.sharding import PartitionSpec as P

BATCH_AXES = ("data", "fsdp")  # = parallel.mesh.BATCH_AXES (models may not import parallel)
TENSOR_AXIS = "tensor"
LANES = 128  # the kv block (and so L) is a multiple of this
MAX_BLOCK = 512  # MaxText's default splash block sizes (sa_block_q / kv = 512)
PAD_ID = -1  # the segment id of the padding to a multiple of LANES
KERNEL_DTYPES = ("float32", "bfloat16")
MAX_HEAD_DIM = 256


def unsupported_reason(num_heads: int, num_kv_heads: int, head_dim: int, dtype) -> Optional[str]:
    """Why this attention cannot run on the splash kernel (None: it can), from the shapes.

    The limits are those compiled for TPU on this host (module docstring): float32 or
    bfloat16, H a multiple of KVH, head_dim a multiple of 8 up to 256."""
    name = jnp.dtype(dtype).name
    if name not in KERNEL_DTYPES:
        return f"the splash kernel takes {KERNEL_DTYPES}, not {name}"
    if num_heads % num_kv_heads:
        return f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}"
    if head_dim % 8 or head_dim > MAX_HEAD_DIM:
        return f"head_dim={head_dim}: the splash kernel is used for multiples of 8 up to 256"
    return None


def padded_length(length: int) -> int:
    """L rounded up to a multiple of `LANES` (128)."""
    return -(-length // LANES) * LANES


def block_size(length: int) -> int:
    """The kernel's q and kv block for a padded length: the largest of 512, 256, 128 dividing
    it (every block size of `splash.BlockSizes`, forward and backward)."""
    return next(b for b in (MAX_BLOCK, 256, LANES) if length % b == 0)


def splash_pattern(segment_ids: jax.Array, window: int = 0) -> jax.Array:
    """`[B, L]` segment ids -> `[B, L, L]` bool: what the kernel lets query i read, causal and
    same segment (and within `window` when > 0). Pure jnp: the kernel's specification, for
    tests against `kv_cache.slot_layout`'s `allowed`."""
    n = segment_ids.shape[1]
    i, j = jnp.arange(n)[:, None], jnp.arange(n)[None, :]
    keep = (j <= i) & ((window <= 0) | (i - j < window))
    return keep[None] & (segment_ids[:, :, None] == segment_ids[:, None, :])


def _static_mask(length: int, window: int) -> splash.Mask:
    if window > 0:
        return splash.LocalMask((length, length), (window - 1, 0), 0)
    return splash.CausalMask((length, length))


def _row_kernel(num_heads: int, length: int, window: int, interpret: bool):
    """One row's kernel: `(q [H, L, hd], k, v [KVH, L, hd], SegmentIds) -> [H, L, hd]`."""
    b = block_size(length)
    blocks = splash.BlockSizes(block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b,
                               block_kv_dkv=b, block_kv_dkv_compute=b, block_q_dq=b,
                               block_kv_dq=b)
    mask = splash.MultiHeadMask([_static_mask(length, window)] * num_heads)
    return splash.make_splash_mha(mask, block_sizes=blocks, head_shards=1, q_seq_shards=1,
                                  interpret=interpret)


def _local_attention(q, k, v, ids, window, *, windows: tuple[int, ...], scale: float,
                     interpret: bool):
    """One device's rows: q `[b, L, h, hd]`, k / v `[b, L, kvh, hd]`, ids `[b, L]` int32,
    window None / int / int32 scalar -> `[b, L, h, hd]` in v.dtype."""
    b, n, h, hd = q.shape
    length = padded_length(n)
    pad = ((0, 0), (0, length - n), (0, 0), (0, 0))
    q = (q.astype(jnp.float32) * jnp.float32(scale)).astype(q.dtype)
    qh, kh, vh = (jnp.pad(x, pad).transpose(0, 2, 1, 3) for x in (q, k, v))
    ids = jnp.pad(ids.astype(jnp.int32), ((0, 0), (0, length - n)), constant_values=PAD_ID)

    def run(w: int):
        kernel = _row_kernel(h, length, w, interpret)

        def branch(qh, kh, vh, ids):
            row = lambda qr, kr, vr, sr: kernel(qr, kr, vr, segment_ids=splash.SegmentIds(sr, sr))
            return jax.vmap(row)(qh, kh, vh, ids)
        return branch

    if window is None or isinstance(window, int):
        out = run(int(window or 0))(qh, kh, vh, ids)
    else:  # traced: the layer scan's window, one of the model's static ones
        options = tuple(sorted(set(windows) | {0}))
        index = sum(jnp.where(window == w, i, 0) for i, w in enumerate(options))
        out = lax.switch(index, [run(w) for w in options], qh, kh, vh, ids)
    return out.transpose(0, 2, 1, 3)[:, :n].astype(v.dtype)


def _local_kv_heads(num_kv_heads: int, tensor: int) -> int:
    return num_kv_heads // tensor if tensor > 1 and num_kv_heads % tensor == 0 else num_kv_heads


def splits_rows(mesh, rows: int) -> bool:
    """Whether `rows` batch rows split evenly over the mesh's ("data", "fsdp") devices (the
    shard_map needs it; else the caller uses the reference)."""
    return rows % math.prod(mesh.shape[a] for a in BATCH_AXES) == 0


def splash_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array,
                     window=None, *, windows: Sequence[int] = (), scale: float | None = None,
                     mesh=None, interpret: bool = False) -> jax.Array:
    """Causal grouped-query attention within segments, on the splash kernel.

    q `[B, L, H, hd]`, k / v `[B, L, KVH, hd]` (H a multiple of KVH), segment_ids `[B, L]`
    int (the no-cache attention mask: 0 pad, 1.. segments). window: None, an int or an int32
    scalar traced in the layer scan (<= 0: none); a traced one must be one of `windows` (the
    model's `sliding_windows`). scale: the scores' factor (None: `hd ** -0.5`). mesh: None (a
    one-device program) or the mesh the rows are split over (module docstring). interpret:
    Pallas interpret mode (CPU). Returns `[B, L, H * hd]` in v.dtype: `dot_attention(q, k, v,
    allowed)` on every real query (module docstring for pads and numerics).
    Source: jax `splash_attention`; Dao et al. 2022 (FlashAttention).

    Raises:
      ValueError: a model the kernel does not take (`unsupported_reason`), or rows that do not
        split over the mesh's data x fsdp.
    """
    b, n, h, hd = q.shape
    reason = unsupported_reason(h, k.shape[2], hd, q.dtype)
    if reason is not None:
        raise ValueError(f"splash_attention: {reason}; use the reference attention")
    fn = functools.partial(_local_attention, windows=tuple(windows), interpret=interpret,
                           scale=float(hd) ** -0.5 if scale is None else float(scale))
    if mesh is not None:
        if not splits_rows(mesh, b):
            raise ValueError(f"splash_attention: {b} rows do not split over the mesh's "
                             "data x fsdp devices")
        tensor = mesh.shape[TENSOR_AXIS]
        heads = TENSOR_AXIS if _local_kv_heads(k.shape[2], tensor) != k.shape[2] else None
        rows = P(BATCH_AXES, None, heads, None)
        traced = window is not None and not isinstance(window, int)
        inner = fn
        fn = jax.shard_map(
            lambda q, k, v, ids, w: inner(q, k, v, ids, w if traced else window), mesh=mesh,
            in_specs=(rows, rows, rows, P(BATCH_AXES, None), P()), out_specs=rows,
            # check_vma off: pallas_call carries no varying-axes types to check
            check_vma=False)
        window_arg = jnp.asarray(window if traced else 0, jnp.int32)
        return fn(q, k, v, segment_ids, window_arg).reshape(b, n, h * hd)
    return fn(q, k, v, segment_ids, window).reshape(b, n, h * hd)
