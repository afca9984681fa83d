"""The experts of a sparse layer as a grouped matmul, over all tokens or, on a device mesh,
over each device's own tokens.

`expert_ffn` sorts the call's T*k (token, expert) rows by expert and runs a grouped matmul
over them (`models.grouped_matmul`: `jax.lax.ragged_dot`, or on TPU megablox's kernels where
the work is one device's: inside `dispatch`, or with no mesh / a one-device mesh; XLA cannot
partition a Mosaic kernel). That sort mixes all rows and ragged_dot has no batch dim to
split ("ragged_dot vmap over any dim but 0 - NYI"), so when the batch is split over the
mesh's ("data", "fsdp") axes the SPMD partitioner moves every token's rows to every device at
every sparse layer (an all-gather or all-reduce of the `[T*k, D]` rows in the compiled CPU
program) and each device computes all T*k rows against its slice of the experts: the work
is split over the expert shards, never over the batch (`data` replicas repeat it).

`dispatch` runs the whole sparse block (`SparseMoeBlock.local`: router, top-k, replay,
grouped matmul) inside `jax.shard_map` over the mesh instead:
- the tokens `[B, L, D]` (and mask, routes) enter split over ("data", "fsdp") along B, as the
  batch already is (`parallel.mesh.batch_sharding`): each device routes its own B/n rows'
  tokens, sorts them by expert and runs the grouped matmul; no token leaves its device (the
  partitioner also gathered the `[T, E]` router probabilities for top-k);
- the expert weights enter whole over `fsdp` (their expert dim, `parallel.rules`), cast to the
  compute dtype first: the partitioner gathers them per layer, as it gathers every dense
  layer's weights inside the layer scan (FSDP / ZeRO-3; their gradients are summed over the
  batch axes on the way back); a rollout copy laid out by `ROLLOUT_RULES` needs no gather;
- the expert FFN width F stays split over `tensor` (when `tensor` divides it, as the rules
  split it): gate/up give F/tensor columns per expert and the down projection's partial sums
  are `psum`'d over `tensor` (Megatron's column- then row-parallel MLP, per expert; Shoeybi
  et al. 2019). The router is replicated, so each tensor shard routes alike;
- the load-balancing statistics (`RouterStats.counts`, `.probs`) are `psum`'d over the batch
  axes: the whole call's, so the aux loss is transformers' `load_balancing_loss_func`.

Without a mesh, on a mesh whose batch axes have one device, or when their size does not
divide B, the block runs globally as before (bit for bit).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P

from ppo_jax.models.functional import path_str
from ppo_jax.models.grouped_matmul import grouped_matmul, use_megablox
from ppo_jax.parallel.mesh import AXES, BATCH_AXES, batch_shards


def expert_ffn(x: jax.Array, experts: jax.Array, weights: jax.Array, gate_proj: jax.Array,
               up_proj: jax.Array, down_proj: jax.Array, act,
               megablox_kernel: bool = False) -> jax.Array:
    """`sum_j weights[t, j] * FFN_{experts[t, j]}(x[t])` as a grouped matmul.

    x `[T, D]`; experts `[T, k]` int32 in [0, E); weights `[T, k]`; gate_proj / up_proj
    `[E, D, F]`, down_proj `[E, F, D]` (all in x's dtype); act: the activation. The T*k rows
    are sorted by expert (a stable argsort), run through `grouped_matmul` with group sizes
    counted from `experts` (megablox's TPU kernels when `megablox_kernel`, static: see
    `grouped_matmul.use_megablox`; else `jax.lax.ragged_dot`), scaled by their gate value and
    summed back per token. `[T, D]` out, x's dtype.
    """
    t, k = experts.shape
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    rows = jnp.take(x, order // k, axis=0)
    sizes = jnp.bincount(flat, length=gate_proj.shape[0]).astype(jnp.int32)

    def gmm(lhs, rhs):
        return grouped_matmul(lhs, rhs, sizes, megablox_kernel=megablox_kernel)

    h = act(gmm(rows, gate_proj)) * gmm(rows, up_proj)
    y = gmm(h, down_proj)
    y = y * jnp.take(weights.reshape(-1), order).astype(y.dtype)[:, None]
    # gather back to (token, slot) order rather than scatter-add: deterministic, sums k values
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(t * k, dtype=order.dtype))
    return jnp.sum(jnp.take(y, inverse, axis=0).reshape(t, k, -1), axis=1)


def splits_rows(mesh: Mesh | None, rows: int) -> bool:
    """Whether `dispatch` splits a call of `rows` batch rows over `mesh`: the mesh's
    batch axes ("data", "fsdp") span more than one device and their size divides `rows`.

    Raises ValueError: a mesh without the axes ("data", "fsdp", "tensor") of
    `parallel.make_mesh`."""
    if mesh is None:
        return False
    missing = [a for a in AXES if a not in mesh.shape]
    if missing:
        raise ValueError(f"mesh axes {tuple(mesh.shape)} lack {missing}: the experts are laid "
                         f"out over {AXES} (parallel.make_mesh)")
    shards = batch_shards(mesh)
    return shards > 1 and rows % shards == 0


def _tensor_axis(mesh: Mesh, width: int) -> str | None:
    """"tensor" when it splits the expert FFN width (size > 1 dividing it, as `param_spec`
    decides), else None (the width is whole on every device)."""
    size = mesh.shape["tensor"]
    return "tensor" if size > 1 and width % size == 0 else None


def _state_specs(state, tp: str | None):
    """The `shard_map` in_specs of a `SparseMoeBlock`'s state: the experts' FFN width over
    `tp` (gate/up `[E, D, F]` columns, down `[E, F, D]` rows), whole over every other axis."""
    def spec(path, _):
        name = path_str(path)
        if name.endswith(("experts/gate_proj", "experts/up_proj")):
            return P(None, None, tp)
        return P(None, tp, None) if name.endswith("experts/down_proj") else P()

    return jax.tree_util.tree_map_with_path(spec, state)


def dispatch(block, mesh: Mesh, x: jax.Array, token_mask: jax.Array,
             routes: jax.Array | None):
    """A `moe.SparseMoeBlock` on `mesh`, each device routing and computing its own rows
    (`block.local` inside `jax.shard_map`); call only where `splits_rows(mesh, B)`.

    x `[B, L, D]`, token_mask `[B, L]`, routes None or `[B, L, k]` int32, all split over the
    batch axes along B. Returns `(out [B, L, D] in x's dtype, experts [B, L, k] int32,
    counts [E], probs [E])`: the `RouterStats` fields, counts and probs summed over the
    devices (the whole call's, as `load_balancing_loss_func` pools them).
    """
    graphdef, state = nnx.split(block)
    tp = _tensor_axis(mesh, block.experts.gate_proj.shape[-1])
    megablox_kernel = use_megablox(mesh, per_device=True)
    # cast before the fsdp gather (in the compute dtype, as `local` would after it): exact
    state = jax.tree_util.tree_map_with_path(
        lambda p, a: a.astype(x.dtype) if "experts/" in path_str(p) else a, state)

    def local(state, x, token_mask, routes):
        out, stats = nnx.merge(graphdef, state).local(x, token_mask, routes, tp, megablox_kernel)
        counts, probs = (jax.lax.psum(v, BATCH_AXES) for v in (stats.counts, stats.probs))
        return out, stats.experts, counts, probs

    batch = P(BATCH_AXES)
    # megablox's pallas_call declares outputs without varying mesh axes, which check_vma
    # refuses (MaxText maps it with the check off too); unchecked, shard_map's transpose still
    # scales the cotangents of replicated outputs, so the gradients are the same (tested)
    return jax.shard_map(local, mesh=mesh,
                         in_specs=(_state_specs(state, tp), batch, batch, batch),
                         out_specs=(batch, batch, P(), P()),
                         check_vma=not megablox_kernel)(state, x, token_mask, routes)
