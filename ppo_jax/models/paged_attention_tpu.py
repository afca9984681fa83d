"""One-token decode attention over the paged KV cache with jax's Pallas TPU kernel.

`pallas_decode_attention(q, kv_layer, view, window)` computes what
`paged_cache.paged_attention_reference` computes for a decode call (one new token per row), but
reads the pages in place with jax's `ragged_paged_attention` (jax.experimental.pallas.ops.tpu;
Kwon et al. 2023, vLLM PagedAttention) instead of gathering every row's pages into a dense
`[R * S, W * page_size]` sequence. The pool layout is the kernel's own (k of KV head h at
combined head 2h, v at 2h + 1), so nothing is copied.

All replicas of one device go into one kernel call: their pools `[r, P, ...]` are read as one
pool `[r * P, ...]` (a free reshape) and replica i's page ids are shifted by `i * P`. With a
mesh, the call is mapped (`jax.shard_map`) over it: replicas over ("data", "fsdp"), heads over
"tensor" where its size divides the KV heads (else every tensor shard computes all heads).

Kernel constraints (jax 0.10.2 + libtpu 0.0.42.1, compiled for v4, v5e, v5p and v6e):
- head_dim == 128 (64 or 192: an assertion in the kernel; 256: Mosaic "The last dim size is not
  128 in original base memref" with 2 or more KV heads; with one, as Gemma-3-270M / 1B have,
  it compiles for v5e in bfloat16, but no chip has run it, so 256 stays refused);
- KV heads per shard: 1, 2, 4 or a multiple of 4 (float32), 1, 2, 4, 8 or a multiple of 8
  (bfloat16) ("num_combined_kv_heads=6 can not be XLA fully tiled": SmolLM2-135M's 3 and
  SmolLM2-360M's 5 KV heads are refused);
- float32 with 8 or more KV heads and no grouping (H == KVH >= 8) is refused by Pallas' block
  shape rule (the kernel takes 4 query heads per block); bfloat16 is not;
- any page size (1 to 256 compiled); float32 or bfloat16 pages (q is cast to the pages' dtype).
`unsupported_reason` reports these for a model before anything is traced.

The kernel takes each row's query position as `kv_len - 1`: it ignores `view.positions`, which
equal that for every live decode row (idle rows: `kv_len >= 1` on the trash page; their output
is garbage either way, and is ignored by the engine).

Interpret mode (`interpret=True`, `pltpu.force_tpu_interpret_mode`): does NOT run this kernel in
jax 0.10.2. The TPU interpreter fails on the kernel's reshaped VMEM ref with `JaxRuntimeError:
INTERNAL: CpuCallback error ... AttributeError: 'ReshapeTransform' object has no attribute
'indices'` (pallas/mosaic/interpret/utils.py `to_range`); the generic `interpret=True`
discharge interpreter fails with `AttributeError: 'TypedInt' object has no attribute 'shape'`
(pallas/primitives.py `_swap_discharge_rule`) and has no strided loads, which the kernel uses.
The flag is kept so the same call runs once jax's interpreter handles the kernel; a caller that
goes through `layers.paged_attention` (no flag) gets the same by tracing under
`with pltpu.force_tpu_interpret_mode():` (the mode is part of jax's jit cache key).

Compiling on a CPU host for TPU (`aot.topology.slice_devices`): with `view.mesh` set, the
shard_map gives the kernel's lowering the chip kind; with `view.mesh=None`, lower inside
`jax.set_mesh(mesh)` of a mesh of the target devices, else the lowering reads the default
(CPU) device: "ValueError: Unsupported TPU device kind: cpu".
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as _rpa
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention
from jax.sharding import PartitionSpec as P

from ppo_jax.models.paged_cache import PagedView, paged_attention_reference

BATCH_AXES = ("data", "fsdp")  # = parallel.mesh.BATCH_AXES (models may not import parallel)
TENSOR_AXIS = "tensor"
HEAD_DIM = 128
MAX_QUERIES_PER_BLOCK = 32  # the default of jax's tuned table (decode: one query per row)
MAX_KV_PAGES_PER_BLOCK = 16  # jax's MAX_PAGES_PER_SEQ: more pages spill the 32 scalar registers
VMEM_BUDGET_BYTES = 8 * 2 ** 20  # what the blocks may take; half of v4's 16 MiB of VMEM
MIN_VMEM_LIMIT_BYTES = 16 * 2 ** 20  # Mosaic's default scoped VMEM on v4 / v5e
KERNEL_DTYPES = ("float32", "bfloat16")


class BlockSizes(NamedTuple):
    """The kernel's tuning arguments, passed explicitly (its own lookup reads the default
    device, the CPU on a compile host)."""

    kv_pages_per_block: int
    queries_per_block: int
    vmem_limit_bytes: int


def _local_kv_heads(num_kv_heads: int, tensor: int) -> int:
    """KV heads on one shard: split over `tensor` when it divides them, else all."""
    return num_kv_heads // tensor if tensor > 1 and num_kv_heads % tensor == 0 else num_kv_heads


def unsupported_reason(num_heads: int, num_kv_heads: int, head_dim: int, dtype,
                       tensor: int = 1) -> Optional[str]:
    """Why the kernel cannot run this attention (None: it can), from the shapes alone.

    num_heads / num_kv_heads: the model's query and KV heads; dtype: the pool's dtype (q is
    cast to it); tensor: the mesh's tensor axis size (heads split over it where it divides
    num_kv_heads). The rules are the module docstring's "Kernel constraints".
    """
    name = jnp.dtype(dtype).name
    if name not in KERNEL_DTYPES:
        return f"the kernel takes {KERNEL_DTYPES} pages, not {name}"
    if head_dim != HEAD_DIM:
        return f"head_dim={head_dim}: the kernel needs head_dim == {HEAD_DIM}"
    if num_heads % num_kv_heads:
        return f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}"
    kvh = _local_kv_heads(num_kv_heads, tensor)
    heads = kvh * (num_heads // num_kv_heads)
    try:
        q_heads, _ = _rpa.get_min_heads_per_blk(heads, 2 * kvh, dtype, dtype)
    except ValueError as e:
        return f"{kvh} KV heads per shard in {name}: {e}"
    if q_heads % 8 and q_heads != heads:
        return (f"{heads} query heads per shard in {name}: the kernel's block of {q_heads} "
                "query heads is neither a multiple of 8 nor all of them")
    return None


def block_sizes(queries: int, num_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                width: int, dtype) -> BlockSizes:
    """The kernel's block sizes for one call of `queries` rows (one token each) over page
    tables of `width` pages, `dtype` pages and queries.

    queries_per_block = min(queries, 32); kv_pages_per_block = the most pages, at most
    min(width, 16), whose VMEM (double-buffered pages, q / out blocks, f32 accumulators and
    two f32 score tiles) fits `VMEM_BUDGET_BYTES`, and at least 1; vmem_limit_bytes = 1.5x that
    footprint rounded up to MiB, at least 16 MiB (so every chip from v4 up takes it while the
    footprint fits the budget). Raises ValueError: heads the kernel cannot tile.
    """
    q_heads, kv_heads2 = _rpa.get_min_heads_per_blk(num_heads, 2 * num_kv_heads, dtype, dtype)
    size, group = jnp.dtype(dtype).itemsize, num_heads // num_kv_heads
    bq = min(queries, MAX_QUERIES_PER_BLOCK)
    fixed = (4 * bq * q_heads * head_dim * size + 4 * bq * q_heads * head_dim
             + 2 * (kv_heads2 // 2) * bq * group * 128 * 4)
    per_page = 2 * page_size * kv_heads2 * head_dim * size + 2 * bq * group * page_size * 4
    bkv = max(1, min(width, MAX_KV_PAGES_PER_BLOCK, (VMEM_BUDGET_BYTES - fixed) // per_page))
    footprint = fixed + bkv * per_page
    limit = max(MIN_VMEM_LIMIT_BYTES, math.ceil(1.5 * footprint / 2 ** 20) * 2 ** 20)
    return BlockSizes(bkv, bq, limit)


def _interpret_mode(interpret: bool):
    """Pallas TPU interpret mode around the kernel's trace (it is in jax's jit cache key)."""
    if interpret:
        return pltpu.force_tpu_interpret_mode(pltpu.InterpretParams())
    return contextlib.nullcontext()


def _local_attention(q, kv, table, lens, *, sliding_window: Optional[int], interpret: bool,
                     scale: Optional[float] = None):
    """One device's replicas in one kernel call.

    q `[r, S, h, hd]`, kv `[r, P, page_size, 2 kvh, hd]`, table `[r, S, W]`, lens `[r, S]`;
    scores scaled by `scale` (None: `hd ** -0.5`); returns `[r, S, h, hd]` in kv.dtype. kv
    lengths are clamped to `[1, W * page_size]` (a length of 0 would leave the kernel's
    accumulator unwritten and its first page fetch unawaited; the table holds no more than W
    pages); rows of length <= 0 return zeros.
    """
    r, s, h, hd = q.shape
    pages, page_size, kv_heads2 = kv.shape[1:4]
    width, n = table.shape[2], r * s
    shift = (jnp.arange(r, dtype=jnp.int32) * pages)[:, None, None]
    page_indices = (table.astype(jnp.int32) + shift).reshape(n, width)
    kv_lens = jnp.clip(lens.reshape(n).astype(jnp.int32), 1, width * page_size)
    blocks = block_sizes(n, h, kv_heads2 // 2, hd, page_size, width, kv.dtype)
    with _interpret_mode(interpret):
        out = ragged_paged_attention(
            q.reshape(n, h, hd).astype(kv.dtype), kv.reshape(r * pages, page_size, kv_heads2, hd),
            kv_lens, page_indices, jnp.arange(n + 1, dtype=jnp.int32),
            jnp.full((1,), n, jnp.int32),
            sm_scale=float(hd) ** -0.5 if scale is None else float(scale),
            sliding_window=sliding_window, num_kv_pages_per_block=blocks.kv_pages_per_block,
            num_queries_per_block=blocks.queries_per_block,
            vmem_limit_bytes=blocks.vmem_limit_bytes)
    out = jnp.where((lens.reshape(n) > 0)[:, None, None], out, jnp.zeros((), out.dtype))
    return out.reshape(r, s, h, hd)


def _mapped(fn, mesh, replicas: int, num_kv_heads: int):
    """`fn` mapped over `mesh`: replicas over the batch axes, heads over tensor where it
    divides the KV heads. Raises ValueError: replicas not a multiple of data x fsdp."""
    shards = math.prod(mesh.shape[a] for a in BATCH_AXES)
    if replicas % shards:
        raise ValueError(f"{replicas} replicas do not split over the mesh's data x fsdp = "
                         f"{shards} devices")
    tensor = mesh.shape[TENSOR_AXIS]
    heads = TENSOR_AXIS if _local_kv_heads(num_kv_heads, tensor) != num_kv_heads else None
    rows = P(BATCH_AXES, None, heads, None)
    specs = (rows, P(BATCH_AXES, None, None, heads, None), P(BATCH_AXES, None, None),
             P(BATCH_AXES, None))
    # check_vma off: pallas_call carries no varying-axes types to check
    return jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=rows, check_vma=False)


def _static_window(window) -> tuple[Optional[int], bool]:
    """`(sliding_window for the kernel, traced)`: None / a concrete int (<= 0: none) is static;
    a traced window gives `(None, True)`."""
    if window is None:
        return None, False
    try:
        w = int(window)
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError):
        return None, True
    return (w if w > 0 else None), False


def _check(q: jax.Array, kv_layer: jax.Array, view: PagedView) -> None:
    replicas, rows, _ = view.page_table.shape
    if q.ndim != 4 or q.shape[1] != 1 or q.shape[0] != replicas * rows:
        raise ValueError(f"q {q.shape}: one token per row expected, [{replicas * rows}, 1, H, "
                         "hd] for the view's page table")
    if kv_layer.ndim != 5 or kv_layer.shape[0] != replicas:
        raise ValueError(f"kv_layer {kv_layer.shape}: [{replicas}, P, page_size, 2 KVH, hd] "
                         "expected")
    tensor = view.mesh.shape[TENSOR_AXIS] if view.mesh is not None else 1
    reason = unsupported_reason(q.shape[2], kv_layer.shape[3] // 2, q.shape[3], kv_layer.dtype,
                                tensor)
    if reason is not None:
        raise ValueError(f"pallas_decode_attention: {reason}; use the reference kernel")


def pallas_decode_attention(q: jax.Array, kv_layer: jax.Array, view: PagedView,
                            window=None, *, interpret: bool = False,
                            scale: Optional[float] = None) -> jax.Array:
    """Decode attention of `q [R * S, 1, H, hd]` over one layer's pool `kv_layer [R, P,
    page_size, 2 * KVH, hd]` through `view` (`page_table [R, S, W]`, `kv_lens [R * S]`, `mesh`);
    returns `[R * S, 1, H * hd]` in q.dtype: `paged_attention_reference(q, kv_layer, view,
    window)` for rows whose position is `kv_len - 1` (jax's `ref_ragged_paged_attention`, the
    kernel's specification, equals it to 1e-5 in float32; q is cast to the pages' dtype).

    window: None, an int, or an int32 scalar (<= 0: none). A concrete one is the kernel's static
    `sliding_window`. A traced one (the layer scan of a model with sliding windows) runs the
    kernel without a window when it cannot bite (window <= 0, or every kv_len <= window: then
    every key is within it) and `paged_attention_reference` otherwise (`lax.cond`), since the
    kernel compiles one window into its mask.
    interpret: run the kernel in Pallas TPU interpret mode (on CPU; fails in jax 0.10.2, see
    the module docstring).
    scale: the scores' factor, the kernel's static `sm_scale` (None: `hd ** -0.5`; Gemma 3:
    `query_pre_attn_scalar ** -0.5`).
    Source: jax `ragged_paged_attention`; Kwon et al. 2023 (vLLM, PagedAttention).

    Raises:
      ValueError: shapes that are not a decode call of this view, a model the kernel cannot
        run (`unsupported_reason`), or replicas that do not split over the mesh's data x fsdp.
    """
    _check(q, kv_layer, view)
    replicas, rows, _ = view.page_table.shape
    static, traced = _static_window(window)
    fn = functools.partial(_local_attention, sliding_window=static, interpret=interpret,
                           scale=scale)
    if view.mesh is not None:
        fn = _mapped(fn, view.mesh, replicas, kv_layer.shape[3] // 2)

    def kernel():
        out = fn(q.reshape(replicas, rows, *q.shape[2:]), kv_layer, view.page_table,
                 view.kv_lens.reshape(replicas, rows))
        return out.reshape(q.shape[0], 1, -1).astype(q.dtype)

    if not traced:
        return kernel()
    bites = (window > 0) & (jnp.max(view.kv_lens) > window)
    return lax.cond(bites, lambda: paged_attention_reference(q, kv_layer, view, window,
                                                             scale=scale), kernel)
