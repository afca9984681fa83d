"""Moving batches between host numpy arrays and global (possibly multi-process) jax.Arrays.

In a multi-process run every process holds only some rows of a batch: those of the devices it
addresses. These helpers never call `np.asarray` on an array that spans other processes:

    lo, hi = row_range(rows, global_batch)          # this process's rows of every batch
    q = put_rows(prompt_ids[lo:hi], rows, (B, P))  # host rows -> global array
    resp_np = local_rows(resp)                      # global array -> this process's rows
    params_np = to_host(params)                     # full values (a collective when sharded)

With one process, `row_range` is `(0, B)` and these are plain `device_put` / `np.asarray`.
"""

from __future__ import annotations

from typing import Any, Sequence

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
