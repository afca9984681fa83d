"""Moving batches between host numpy arrays and global (possibly multi-process) jax.Arrays.

In a multi-process run every process holds only some rows of a batch: those of the devices it
addresses. These helpers never call `np.asarray` on an array that spans other processes:

    lo, hi = row_range(rows, global_batch)          # this process's rows of every batch
    q = put_rows(prompt_ids[lo:hi], rows, (B, P))  # host rows -> global array
    resp_np = local_rows(resp)                      # global array -> this process's rows
    params_np = to_host(params)                     # full values (a collective when sharded)
    lo, hi = owned_rows(rows, global_batch)         # the rows whose host work is this process's
    parts = allgather_json(value)                   # every process's `value` (a collective)

With one process, `row_range` is `(0, B)` and these are plain `device_put` / `np.asarray`.
"""

from __future__ import annotations

import json
import math
from typing import Any, Optional, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Sharding


def row_range(sharding: Sharding, global_rows: int) -> tuple[int, int]:
    """`(start, stop)`: the rows of dim 0 that this process's devices hold under `sharding`.

    Raises:
      ValueError: the rows are not one contiguous block (a device order this code does not
        support; `parallel.make_mesh` orders devices process-major, which always gives one).
    """
    index_map = sharding.addressable_devices_indices_map((global_rows,))
    blocks = sorted({s[0].indices(global_rows)[:2] for s in index_map.values()})
    start, stop = blocks[0][0], max(b[1] for b in blocks)
    covered = np.zeros(global_rows, bool)
    for lo, hi in blocks:
        covered[lo:hi] = True
    if not covered[start:stop].all():
        raise ValueError(f"process {jax.process_index()} holds rows {blocks} of the batch: not "
                         "one contiguous block")
    return start, stop


def put_rows(local: np.ndarray, sharding: Sharding, global_shape: Sequence[int]) -> jax.Array:
    """Global array of `global_shape` from this process's rows `local` (`row_range` of them).

    Every process calls it with its own rows (`jax.make_array_from_process_local_data`)."""
    local = np.asarray(local)
    if jax.process_count() == 1:
        return jax.device_put(local, sharding)
    return jax.make_array_from_process_local_data(sharding, local, tuple(global_shape))


def local_rows(x: jax.Array) -> np.ndarray:
    """This process's rows of a global array whose dim 0 is split over devices (numpy)."""
    if x.is_fully_addressable or x.is_fully_replicated:
        return np.asarray(x)
    start, stop = row_range(x.sharding, x.shape[0])
    out = np.empty((stop - start, *x.shape[1:]), x.dtype)
    for shard in x.addressable_shards:
        lo, hi, _ = shard.index[0].indices(x.shape[0])
        out[lo - start:hi - start] = np.asarray(shard.data)
    return out


def to_host(tree: Any) -> Any:
    """Full numpy values of every leaf. A leaf that spans other processes and is not replicated
    is gathered with `process_allgather` (a collective: every process must call this)."""
    def one(x):
        if not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated:
            return np.asarray(x)
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    return jax.tree.map(one, tree)


def owned_rows(sharding: Optional[Sharding], global_rows: int) -> tuple[int, int]:
    """`(start, stop)`: the rows of dim 0 whose host-side work (an environment's calls) is this
    process's: those it holds under `sharding` that no process of a lower index holds too, so
    a row block that several processes hold (a `tensor` axis across processes) is worked on
    once. `(0, global_rows)` with one process or no sharding; `(start, start)` for none.

    Raises:
      ValueError: the owned rows are not one contiguous block (as `row_range`).
    """
    if sharding is None or jax.process_count() == 1:
        return 0, global_rows
    first: dict[tuple[int, int], int] = {}  # row block -> the lowest process holding it
    for device, index in sharding.devices_indices_map((global_rows,)).items():
        block = index[0].indices(global_rows)[:2]
        first[block] = min(first.get(block, device.process_index), device.process_index)
    mine = sorted(b for b, p in first.items() if p == jax.process_index())
    if not mine:
        start = row_range(sharding, global_rows)[0]
        return start, start
    if any(a[1] != b[0] for a, b in zip(mine, mine[1:])):
        raise ValueError(f"process {jax.process_index()} owns rows {mine} of the batch: not "
                         "one contiguous block")
    return mine[0][0], mine[-1][1]


def allgather_json(value: Any) -> list:
    """Every process's `value` (JSON-able: lists, dicts with str keys, str, numbers, None;
    numpy scalars come back as Python numbers), in process order. With one process `[value]`, as given; with several, each value goes
    through JSON (two `process_allgather` calls: the sizes, then the bytes padded to a power
    of two, so that a few shapes are compiled). A collective: every process must call it,
    in the same order as its other collectives.
    """
    if jax.process_count() == 1:
        return [value]
    data = np.frombuffer(json.dumps(value, default=_plain).encode(), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.array([data.size], np.int32)))
    sizes = sizes.reshape(-1)
    width = 1 << max(0, math.ceil(math.log2(max(int(sizes.max()), 1))))
    padded = np.zeros(width, np.uint8)
    padded[:data.size] = data
    parts = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(sizes), width)
    return [json.loads(parts[i, :sizes[i]].tobytes()) for i in range(len(sizes))]


def _plain(value: Any) -> Any:
    """A numpy scalar as its Python number, for `json.dumps` (TypeError for anything else)."""
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON-able")
