"""The grouped matmul of the MoE experts: `jax.lax.ragged_dot`, or on TPU jax's Pallas megablox
kernels.

`grouped_matmul(lhs [M, K], rhs [G, K, N], group_sizes [G])` computes, for each group g, its
rows of `lhs` (the `group_sizes[g]` rows after the groups before it) times `rhs[g]`.

Why two kernels: XLA:TPU lowers `ragged_dot`'s forward and input gradient to its Mosaic
grouped-matmul kernel, but the weight gradient (ragged contracting dim) to a dense matmul of
every row against every group: compiled for v5p, M=4096, K=2048, N=768, G=128, the gradient's
matmul FLOPs are 1.66e12 by `aot.hlo_cost` instead of 3 x 1.29e10. megablox's `gmm` is a
custom_vjp whose weight gradient is its own kernel (`tgmm`); MaxText and tunix use it on TPU.
On CPU and GPU `ragged_dot` stays (bit for bit what the experts computed before).

megablox (jax.experimental.pallas.ops.tpu.megablox, jax 0.10.2) constraints met here:
- M a multiple of the row tile: the rows are padded with zeros to one and the result sliced.
  The padding rows are in no group (the sizes sum to the real M): megablox leaves rows past the
  last group unwritten (garbage, NaN in interpret mode) in the output and in the input
  gradient, and masks them out of the weight gradient; the slice drops them and its transpose
  gives them a zero cotangent, so values and gradients are ragged_dot's;
- bfloat16 or float32 operands (other dtypes use ragged_dot);
- Mosaic kernels are not partitioned by XLA's SPMD partitioner ("Mosaic kernels cannot be
  automatically partitioned. Please wrap the call in a shard_map"): the kernel runs where the
  computation is one device's (no mesh, a one-device mesh, or inside `moe_dispatch.dispatch`'s
  `shard_map`), see `use_megablox`.
The output is in the operands' dtype (`preferred_element_type` = lhs dtype, as ragged_dot
without one): the kernels accumulate in float32 over K tiles and round once when storing, and
the backward kernels then read bfloat16 cotangents (float32 ones would make every backward
matmul a float32 one).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.megablox import ops as megablox

KERNEL_DTYPES = (jnp.bfloat16, jnp.float32)
# (rows, K and N) tile caps: MaxText's megablox defaults (tile_batch_seq=512,
# tile_embed_dim=tile_mlp_dim=1024) in bfloat16: the largest kernel (tgmm: double-buffered
# [512, 1024] inputs, a [1024, 1024] output and float32 accumulator) takes 12 MiB of the 16 MiB
# of scoped VMEM; float32 halves the K/N cap to fit alike
MAX_ROW_TILE, MIN_ROW_TILE = 512, 128
MAX_TILE = {2: 1024, 4: 512}
LANES = 128


def platform_of(mesh) -> str:
    """The platform the computation targets: the mesh's devices' (a `--compile-for` mesh holds
    TPU topology devices on a CPU host), else the default device's."""
    devices = mesh.devices.flat if mesh is not None else jax.devices()
    return next(iter(devices)).platform


def use_megablox(mesh, *, per_device: bool) -> bool:
    """Whether the experts' grouped matmul uses megablox: the target is a TPU and the call is
    one device's work (`per_device`: inside `shard_map` over `mesh`; else `mesh` is None or
    has one device, since Mosaic kernels cannot be partitioned by XLA). With `mesh` None and a
    jit over several TPU devices, lowering raises jax's NotImplementedError: pass the mesh."""
    if platform_of(mesh) != "tpu":
        return False
    return per_device or mesh is None or mesh.devices.size == 1


def _tile(dim: int, cap: int) -> int:
    """A K or N tile: the whole dim up to `cap`, else the largest multiple of 128 <= cap that
    divides it, else `cap` (megablox masks a partial last K tile; columns past N are dropped).
    Whole dims and multiples of 128 are the block shapes Mosaic takes (8 x 128 tiling)."""
    if dim <= cap:
        return dim
    fits = [t for t in range(cap, LANES - 1, -LANES) if dim % t == 0]
    return fits[0] if fits else cap


def row_tile(rows: int, groups: int) -> int:
    """The row tile: about the mean group size (a power of two in [128, 512]), since every
    group starts a tile of its own (at most rows / tm + groups - 1 tiles are computed), and no
    more than the rows rounded up to 16 (bfloat16 packs 16 rows per sublane tile)."""
    mean = max(1, -(-rows // groups))
    tm = min(max(MIN_ROW_TILE, 1 << (mean - 1).bit_length()), MAX_ROW_TILE)
    return min(tm, -(-rows // 16) * 16)


@dataclass(frozen=True)
class Tiling:
    """megablox's tiling callable `(m, k, n) -> (tm, tk, tn)`: it is called with each kernel's
    own dims (forward `gmm`, the input gradient's `gmm` with K and N swapped, the weight
    gradient's `tgmm`), so each gets tiles legal for its operands. Frozen: a static argument
    of megablox's jit (equal tilings share its cache)."""

    tm: int
    cap: int

    def __call__(self, m: int, k: int, n: int) -> tuple[int, int, int]:
        return self.tm, _tile(k, self.cap), _tile(n, self.cap)


def megablox_gmm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """`grouped_matmul` by megablox's `gmm` (differentiable: its custom_vjp runs `gmm` for the
    input gradient and `tgmm` for the weight gradient). Requires `sum(group_sizes) == M`
    (rows past it are garbage, where ragged_dot gives zeros): `expert_ffn` counts every row.
    Lowers only for TPU (or under `pltpu.force_tpu_interpret_mode()`)."""
    m, groups = lhs.shape[0], rhs.shape[0]
    tm = row_tile(m, groups)
    pad = -m % tm
    padded = jnp.pad(lhs, ((0, pad), (0, 0))) if pad else lhs
    tiling = Tiling(tm, MAX_TILE[jnp.dtype(lhs.dtype).itemsize])
    out = megablox.gmm(padded, rhs.astype(lhs.dtype), group_sizes.astype(jnp.int32),
                       lhs.dtype, tiling)
    return out[:m] if pad else out


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
                   megablox_kernel: bool = False) -> jax.Array:
    """Each group's rows of `lhs` times its matrix: `[M, N]` in lhs's dtype.

    lhs `[M, K]` (rows sorted by group), rhs `[G, K, N]`, group_sizes `[G]` int32 summing to
    M. megablox_kernel (static): megablox's kernels (`use_megablox` decides; bfloat16 and
    float32 only, others fall back), else `jax.lax.ragged_dot` (rows past the sum give 0).

    Raises:
      ValueError: lhs not 2-D, rhs not 3-D, or their K dims differ.
    """
    if lhs.ndim != 2 or rhs.ndim != 3 or lhs.shape[1] != rhs.shape[1]:
        raise ValueError(f"grouped_matmul takes lhs [M, K] and rhs [G, K, N]; got lhs "
                         f"{tuple(lhs.shape)} and rhs {tuple(rhs.shape)}")
    if megablox_kernel and jnp.dtype(lhs.dtype) in KERNEL_DTYPES:
        return megablox_gmm(lhs, rhs, group_sizes)
    return jax.lax.ragged_dot(lhs, rhs, group_sizes)
