"""The device mesh of a run and the layout of batches on it.

Three named axes: `data` (pure data parallelism: params replicated),
`fsdp` (data parallelism with params, gradients and optimiser state sharded, ZeRO-3 /
FSDP), `tensor` (Megatron-style splits of attention heads and MLP columns, Shoeybi et al. 2019).
A batch is split over `data` x `fsdp`; `tensor` shards see the same rows.

    mesh = make_mesh(data=-1, fsdp=4, tensor=2)     # -1 takes the remaining devices
    rows = batch_sharding(mesh)                     # dim 0 over ("data", "fsdp")
    x = shard_rows(x, mesh)                         # inside jit: a with_sharding_constraint

Every helper here is the identity / a no-op when `mesh` is None, so single-device code paths
pass `mesh=None` and stay exactly as they were.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")


def resolve_axis_sizes(data: int, fsdp: int, tensor: int, num_devices: int) -> tuple[int, int, int]:
    """Axis sizes with one `-1` replaced by the devices left over.

    Raises:
      ValueError: a size is 0 or below -1, more than one size is -1, the fixed sizes do not
        divide the device count, or the sizes do not multiply to `num_devices` (the message
        names the sizes and the device count).
    """
    sizes = [data, fsdp, tensor]
    named = ", ".join(f"{a}={s}" for a, s in zip(AXES, sizes))
    if any(s == 0 or s < -1 for s in sizes):
        raise ValueError(f"mesh sizes must be positive or -1, got {named}")
    free = [i for i, s in enumerate(sizes) if s == -1]
    if len(free) > 1:
        raise ValueError(f"at most one mesh axis may be -1, got {named}")
    fixed = math.prod(s for s in sizes if s != -1)
    if free:
        if num_devices % fixed:
            raise ValueError(f"mesh {named}: the fixed sizes (product {fixed}) do not divide the "
                             f"{num_devices} devices")
        sizes[free[0]] = num_devices // fixed
    if math.prod(sizes) != num_devices:
        raise ValueError(f"mesh {named} has {math.prod(sizes)} devices but there are "
                         f"{num_devices}; set one axis to -1 or make the sizes multiply to "
                         f"{num_devices}")
    return tuple(sizes)


def make_mesh(data: int = -1, fsdp: int = 1, tensor: int = 1,
              devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
    """A `Mesh` over `devices` (default: all devices of all processes) with axes
    ("data", "fsdp", "tensor").

    Devices are laid out by `jax.make_mesh` (topology-aware on TPU); their order is
    process-major, so each process owns a contiguous block of every batch. On a TPU torus whose
    axes the sizes do not divide whole, such as tensor=4 on v6e-64's 8x8, a physical axis is
    split between mesh axes instead of failing, with `allow_split_physical_axes=True`. The axes
    are `AxisType.Auto`: shardings are propagated by the SPMD partitioner from the in/out
    shardings of `jax.jit` and the constraints below. Part of a TPU slice (a group of the split
    placement, `trainer.split`) is no torus jax can lay out: its devices keep the order given
    (process-major, each host's chips together, so `tensor` stays inside a host).

    Raises:
      ValueError: see `resolve_axis_sizes`.
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = resolve_axis_sizes(data, fsdp, tensor, len(devices))
    types = (AxisType.Auto,) * len(AXES)
    try:
        return jax.make_mesh(sizes, AXES, axis_types=types, devices=devices)
    except NotImplementedError:  # jax's torus layout needs whole physical axes per mesh axis
        from jax.experimental import mesh_utils

        grid = mesh_utils.create_device_mesh(sizes, devices, allow_split_physical_axes=True)
        return Mesh(grid, AXES, axis_types=types)
    except AssertionError:  # jax 0.10.2 asserts that TPU devices fill their torus (a subset)
        return Mesh(np.asarray(devices, dtype=object).reshape(sizes), AXES, axis_types=types)


def batch_shards(mesh: Optional[Mesh]) -> int:
    """Number of row blocks a batch is split into: `data * fsdp` (1 without a mesh)."""
    if mesh is None:
        return 1
    return math.prod(mesh.shape[a] for a in BATCH_AXES)


def replicated(mesh: Mesh) -> NamedSharding:
    """Every device holds the whole array (scalars, RNG keys, KL controller, metrics)."""
    return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh, axis: int = 0) -> NamedSharding:
    """Dim `axis` split over ("data", "fsdp"), the other dims replicated. Usable as a pytree
    prefix for any pytree whose leaves all have their batch dim at `axis`."""
    return NamedSharding(mesh, P(*([None] * axis), BATCH_AXES))


def rows_spec(shape: Sequence[int], mesh: Mesh, axis: int = 0,
              dims: Optional[dict[int, str]] = None) -> P:
    """PartitionSpec for an array of `shape`: dim `axis` over ("data", "fsdp") and each
    `{dim: mesh axis}` of `dims`, each only where the axis size divides the dim (else that dim
    is replicated)."""
    spec = [None] * len(shape)
    if shape[axis] % batch_shards(mesh) == 0:
        spec[axis] = BATCH_AXES
    for d, name in (dims or {}).items():
        if shape[d] % mesh.shape[name] == 0:
            spec[d] = name
    while spec and spec[-1] is None:
        spec.pop()
    return P(*spec)


def shard_rows(x: jax.Array, mesh: Optional[Mesh], axis: int = 0,
               dims: Optional[dict[int, str]] = None) -> jax.Array:
    """Inside jit: constrain dim `axis` of `x` to be split over ("data", "fsdp") (left free
    when the batch axes do not divide it); `dims` adds `{dim: mesh axis}` constraints, each
    applied only where the axis size divides the dim. The identity when `mesh` is None."""
    if mesh is None:
        return x
    spec = rows_spec(x.shape, mesh, axis, dims)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def shard_rows_tree(tree, mesh: Optional[Mesh], axis: int = 0):
    """`shard_rows` on every leaf of a pytree (all leaves have their batch dim at `axis`)."""
    if mesh is None:
        return tree
    return jax.tree.map(lambda x: shard_rows(x, mesh, axis), tree)
