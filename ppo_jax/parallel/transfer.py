"""Moving arrays between two groups of devices without leaving the devices: the weight sync and
the rollout's batches of the split placement (`generation.placement: split`, docs/async_rl.md).

    moved = transfer(tree, shardings)     # every leaf laid out as `shardings` says, elsewhere
    missing = uncovered(src, dst, shape)  # None, or why a process lacks a destination shard

`transfer` cuts each destination shard from the source shards its own process holds (no cut
when a source shard already is the destination shard) and moves all of them in one batched
`jax.device_put` of device buffers to devices, so no byte passes through host memory. Where
one destination shard spans several source shards (a batch split into 4 row blocks going to 2),
the pieces are moved and joined on the destination device.

Why not `jax.device_put(tree, shardings)` alone: between two device sets of one process it
copies whole shards where each destination shard is a source shard, but otherwise gathers the
array to host first (jax 0.10.2, `array._array_shard_arg` -> `x._value`); with several
processes it refuses two different device sets ("For a cross-host reshard in multi-controller
JAX, input and target sharding should have the same set of devices", `dispatch.py`) unless
the runtime does cross-host transfers (TPU's TFRT runtime, experimental). Here each process
moves what it holds to its own devices; a destination shard no source shard of its process
holds is refused (`uncovered` says which, before any run).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Sharding

Box = tuple[tuple[int, int], ...]  # (start, stop) per dim


def _box(index: tuple, shape: tuple[int, ...]) -> Box:
    """A shard's index (slices, None = whole dim) as (start, stop) per dim."""
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


def _cover(dst: Box, sources: list[tuple[Box, Any]]) -> Optional[list[tuple[Any, Box]]]:
    """Source pieces `(source, box relative to it)` that make up the box `dst`: one source
    containing it whole, else consecutive sources along dim 0, each containing `dst`'s other
    dims; None when `sources` do not cover `dst`. `sources` on the destination's own device
    are listed first by the caller, so a shard already in place is taken as it is."""
    def inside(box, dims):
        return all(lo <= d_lo and d_hi <= hi
                   for (lo, hi), (d_lo, d_hi) in zip(box[dims], dst[dims]))

    def relative(box, part):
        return tuple((a - lo, b - lo) for (lo, _), (a, b) in zip(box, part))

    for box, src in sources:
        if inside(box, slice(None)):
            return [(src, relative(box, dst))]
    if not dst:
        return None
    (row, stop), out = dst[0], []
    while row < stop:  # along dim 0: the source holding `row` that reaches furthest
        best = max(((box, src) for box, src in sources
                    if box[0][0] <= row < box[0][1] and inside(box, slice(1, None))),
                   key=lambda b: b[0][0][1], default=None)
        if best is None:
            return None
        box, src = best
        end = min(box[0][1], stop)
        out.append((src, relative(box, ((row, end), *dst[1:]))))
        row = end
    return out


def uncovered(src: Sharding, dst: Sharding, shape: tuple[int, ...]) -> Optional[str]:
    """Why `transfer` cannot lay an array of `shape` out from `src` to `dst`: the first
    destination device (with its index) whose shard the source devices of its own process do
    not hold, or None when every one is held. Reads the shardings only (every process gets the
    same answer)."""
    shape = tuple(shape)
    held: dict[int, list] = {}
    for device, index in src.devices_indices_map(shape).items():
        held.setdefault(device.process_index, []).append((_box(index, shape), device))
    for device, index in dst.devices_indices_map(shape).items():
        box = _box(index, shape)
        if _cover(box, held.get(device.process_index, [])) is None:
            return (f"destination device {device.id} (process {device.process_index}) needs "
                    f"{box} of an array {shape}: no source device of its process holds it")
    return None


def _pieces(x: jax.Array, sharding: Sharding):
    """`[(destination device, [buffer pieces])]` of this process's destination shards of `x`."""
    shape, out = x.shape, []
    shards = [(_box(s.index, shape), s) for s in x.addressable_shards]
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        box = _box(index, shape)
        ordered = sorted(shards, key=lambda b: b[1].device != device)  # in place first
        cover = _cover(box, ordered)
        if cover is None:
            raise ValueError(f"transfer: {uncovered(x.sharding, sharding, shape)}")
        pieces = []
        for shard, rel in cover:
            whole = all(hi - lo == n for (lo, hi), n in zip(rel, shard.data.shape))
            pieces.append(shard.data if whole else shard.data[tuple(slice(*r) for r in rel)])
        out.append((device, pieces))
    return out


def transfer(tree: Any, shardings: Any) -> Any:
    """Every leaf of `tree` laid out by the same-structure `shardings`, on their devices.

    jax.Arrays move device to device: each destination shard is cut from the source shards of
    its own process, all pieces are moved by one `jax.device_put`, and pieces of one shard are
    concatenated (dim 0) on their destination device. `jax.ShapeDtypeStruct`s come back with the
    new sharding (an abstract build), other leaves (numpy) are `jax.device_put` as they are.
    Asynchronous like `jax.device_put`: block on the result to time it.

    Raises:
      ValueError: a destination shard that no source device of its process holds (`uncovered`).
    """
    leaves, treedef = jax.tree.flatten(tree)
    targets = treedef.flatten_up_to(shardings)
    plans, bufs, devices = [], [], []
    for x, s in zip(leaves, targets):
        if isinstance(x, jax.ShapeDtypeStruct):
            plans.append(jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s))
        elif not isinstance(x, jax.Array):
            plans.append(jax.device_put(x, s))
        else:
            plan = _pieces(x, s)
            for device, pieces in plan:
                bufs += pieces
                devices += [device] * len(pieces)
            plans.append((x, s, plan))
    moved = iter(jax.device_put(bufs, devices)) if bufs else iter(())
    out = []
    for plan in plans:
        if not isinstance(plan, tuple):
            out.append(plan)
            continue
        x, s, per_device = plan
        arrays = []
        for _, pieces in per_device:
            parts = [next(moved) for _ in pieces]
            arrays.append(parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0))
        out.append(jax.make_array_from_single_device_arrays(x.shape, s, arrays, dtype=x.dtype))
    return jax.tree.unflatten(treedef, out)


def tree_bytes(tree: Any) -> int:
    """Bytes of one copy of every array (or `ShapeDtypeStruct`) of `tree`: size x itemsize."""
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))
