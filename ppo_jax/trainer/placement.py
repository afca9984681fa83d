"""Where the arrays of a run live: the device mesh, the shardings of train states, frozen params
and batches, and the host <-> device moves of a step. All are safe with several processes.

    place = Placement.from_config(cfg.mesh)            # mesh over all devices of all processes
    models = build_models(cfg, sharding_fn=place.sharding_fn)   # params placed as they are read
    state = place.create_state(params, tx)              # TrainState, optimiser state sharded like params
    lo, hi = place.row_range(B)                         # this process's rows of every batch
    q = place.put_rows(ids[lo:hi], (B, P))

Frozen params (reference, reward model) can be kept in pinned host memory between phases
(`model.offload_frozen`): `offload` moves them to host, `onload` brings a device copy for the
experience pass, which is dropped after it.

An abstract placement, made with `abstract=True` for `train.py --compile-for`, lays out the
same shardings over devices that hold no data, such as a TPU topology compiled for on a CPU
host. Every method that would move data returns
`jax.ShapeDtypeStruct`s with the sharding the real call would give, so a trainer built on it
holds shapes in place of arrays and its jitted functions can be lowered and compiled as is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding

from ppo_jax.parallel import batch_shards, batch_sharding, make_mesh, param_spec, replicated, tree_shardings
from ppo_jax.parallel.host import put_rows, row_range
from ppo_jax.trainer.config.schema import ConfigError
from ppo_jax.trainer.state import TrainState

HOST_MEMORY = "pinned_host"


@dataclass
class Placement:
    """The mesh of a run and the shardings derived from it (see module docstring)."""

    mesh: Mesh
    abstract: bool = False  # shapes only: no data is moved (see the module docstring)

    @classmethod
    def from_config(cls, mesh_cfg, devices: Optional[Sequence[jax.Device]] = None,
                    abstract: bool = False) -> "Placement":
        """Raises ValueError when the mesh sizes do not fit the devices."""
        return cls(make_mesh(mesh_cfg.data, mesh_cfg.fsdp, mesh_cfg.tensor, devices), abstract)

    @property
    def by_row(self) -> NamedSharding:
        """The sharding of a batch: its leading (row) dim over ("data", "fsdp")."""
        return batch_sharding(self.mesh)

    @property
    def replicated(self) -> NamedSharding:
        return replicated(self.mesh)

    @property
    def batch_shards(self) -> int:
        return batch_shards(self.mesh)

    def check_batch(self, key: str, size: int) -> None:
        """Refuse a batch of `size` rows (config key `key`) that the batch shards (mesh data x
        fsdp) do not divide, saying what to set.

        Raises:
          ConfigError: naming `key`, its value, the mesh and the nearest batch that fits.
        """
        shards = self.batch_shards
        if size % shards:
            fit = -(-size // shards) * shards
            raise ConfigError(
                f"{key}={size} is not a multiple of the mesh's batch shards, data x fsdp = "
                f"{shards} (mesh {dict(self.mesh.shape)} over {self.mesh.devices.size} devices): "
                f"set {key} to a multiple of {shards} (e.g. --set {key}={fit}), or put fewer "
                "devices on mesh.data x mesh.fsdp (the rest on mesh.tensor)")

    def check_attention(self, attention: str) -> None:
        """Refuse `model.attention: cudnn` on a mesh that holds no GPU, before anything is
        loaded or compiled (`models.attention_kernels`).

        Raises:
          ConfigError: naming the field, its value and the mesh's platform.
        """
        platform = next(iter(self.mesh.devices.flat)).platform
        if attention == "cudnn" and platform not in ("gpu", "cuda"):
            raise ConfigError(f"model.attention=cudnn needs GPU devices, but this run's mesh "
                              f"holds {platform} devices: set model.attention to auto (the "
                              "backend's kernel where the shapes allow) or reference")

    @property
    def constraint_mesh(self) -> Optional[Mesh]:
        """The mesh for in-jit sharding constraints; None on one device (plain single-device
        programs, exactly as without a mesh)."""
        return self.mesh if self.mesh.devices.size > 1 else None

    def sharding_fn(self, path: str, shape) -> NamedSharding:
        """`load_model(sharding_fn=...)`: the named-rule sharding of one param."""
        return NamedSharding(self.mesh, param_spec(path, shape, self.mesh))

    def shardings(self, tree: Any) -> Any:
        """Shardings of params, or of any pytree holding them (train states), by the rules."""
        return tree_shardings(tree, self.mesh)

    def replicate(self, tree: Any) -> Any:
        """Small host values (RNG key, KL controller) -> replicated on every device."""
        if self.abstract:
            return shapes_of(tree, lambda _: self.replicated)
        return jax.device_put(jax.tree.map(np.asarray, tree), self.replicated)

    def create_state(self, params: Any, tx: optax.GradientTransformation) -> TrainState:
        """`TrainState.create(params, tx)` built on the devices: Adam moments come out sharded
        like their params (never materialised whole); the param buffers are donated."""
        def create(p):
            return TrainState.create(p, tx)

        out = self.shardings(jax.eval_shape(create, params))
        if self.abstract:
            return shapes_of(jax.eval_shape(create, params), out)
        return jax.jit(create, out_shardings=out, donate_argnums=0)(params)

    # --- batches ---------------------------------------------------------------------------
    def row_range(self, global_rows: int) -> tuple[int, int]:
        """This process's rows `[lo, hi)` of a batch of `global_rows` (all when abstract)."""
        return (0, global_rows) if self.abstract else row_range(self.by_row, global_rows)

    def put_rows(self, local: np.ndarray, global_shape: Sequence[int]) -> jax.Array:
        """This process's rows -> the global batch-sharded array."""
        if self.abstract:
            return jax.ShapeDtypeStruct(tuple(global_shape), np.asarray(local).dtype,
                                        sharding=self.by_row)
        return put_rows(local, self.by_row, global_shape)

    # --- host offload of frozen params -----------------------------------------------------
    def can_offload(self) -> bool:
        """Whether every device of the mesh has pinned host memory (TPU, GPU, and CPU in
        jax >= 0.4.3x all do)."""
        try:
            return all(HOST_MEMORY in {m.kind for m in d.addressable_memories()}
                       for d in self.mesh.devices.flat if d.process_index == jax.process_index())
        except (AttributeError, NotImplementedError):
            return False

    def offload(self, params: Any) -> Any:
        """Params -> pinned host memory, same layout (no-op when unsupported or params None)."""
        if params is None or not self.can_offload():
            return params
        host = jax.tree.map(lambda s: s.with_memory_kind(HOST_MEMORY), self.shardings(params))
        return shapes_of(params, host) if self.abstract else jax.device_put(params, host)

    def onload(self, params: Any) -> Any:
        """A device-memory copy of (possibly offloaded) params, in their rule shardings."""
        if params is None:
            return None
        if self.abstract:  # already in device memory: the same buffers, as device_put gives
            on_device = all(getattr(x.sharding, "memory_kind", None) in (None, "device")
                            for x in jax.tree.leaves(params))
            return params if on_device else shapes_of(params, self.shardings(params))
        return jax.device_put(params, self.shardings(params))


def shapes_of(tree: Any, shardings: Any) -> Any:
    """`jax.ShapeDtypeStruct`s of every leaf of `tree` (arrays, numpy values or structs) with
    the shardings `shardings` (a same-structure tree, or a function of the leaf)."""
    def one(x, sharding):
        x = x if hasattr(x, "shape") and hasattr(x, "dtype") else np.asarray(x)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    if callable(shardings):
        return jax.tree.map(lambda x: one(x, shardings(x)), tree)
    return jax.tree.map(one, tree, shardings)
