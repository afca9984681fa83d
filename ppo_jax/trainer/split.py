"""The split placement (`generation.placement: split`): the devices divided into a trainer group
and a rollout group, each with its own mesh (docs/async_rl.md).

    trainer, rollout = split_placement(cfg.mesh, cfg.generation.rollout_devices, devices)

Each of the P processes gives its last `rollout_devices / P` devices to the rollout group, so
every process holds devices of both groups. The trainer's mesh is `mesh.*` over the other
devices; the rollout mesh is (data = rollout_devices / mesh.tensor, fsdp 1, tensor =
mesh.tensor). Both meshes order their devices process-major, so a process's rows of a batch
are the same rows in both groups, and the rollout copy of the weights is split over `tensor`
as the trainer lays it out before sending it: every shard a rollout device needs is one its
own process holds on the trainer side (`parallel.transfer`), and nothing crosses a host.

Groups of whole processes (a host that holds only rollout devices) are refused: every process
runs every program of a multi-controller jax run, and reads the paged engine's scheduling
figures and its own rows of each batch from devices it addresses (docs/async_rl.md lists what
jax answers when tried).
"""

from __future__ import annotations

from typing import Optional, Sequence

import jax

from ppo_jax.parallel import make_mesh
from ppo_jax.trainer.config.schema import ConfigError
from ppo_jax.trainer.placement import Placement

KEY = "generation.rollout_devices"


def split_devices(devices: Sequence, rollout_devices: int) -> tuple[list, list]:
    """`(trainer devices, rollout devices)`: the last `rollout_devices / P` devices of each of
    the P processes go to the rollout group, both lists process-major.

    Raises:
      ConfigError: naming `generation.rollout_devices` when it leaves no trainer device, is not
        a multiple of the process count (whole-process groups), or when the processes hold
        different numbers of devices.
    """
    by_process: dict[int, list] = {}
    for d in devices:
        by_process.setdefault(d.process_index, []).append(d)
    procs, n = len(by_process), rollout_devices
    counts = {len(v) for v in by_process.values()}
    if not 0 < n < len(devices):
        raise ConfigError(f"{KEY}={n} must leave the trainer at least one of the "
                          f"{len(devices)} devices (and be >= 1)")
    if n % procs or len(counts) != 1:
        raise ConfigError(
            f"{KEY}={n} over {procs} processes holding {sorted(counts)} devices each: every "
            "process gives the same number of its devices to the rollout group (groups of whole "
            f"processes are not supported, docs/async_rl.md); set a multiple of {procs}")
    per = n // procs
    trainer = [d for p in sorted(by_process) for d in by_process[p][:-per]]
    rollout = [d for p in sorted(by_process) for d in by_process[p][-per:]]
    return trainer, rollout


def split_placement(mesh_cfg, rollout_devices: int, devices: Optional[Sequence] = None,
                    abstract: bool = False) -> tuple[Placement, Placement]:
    """`(trainer, rollout)` placements over `devices` (default all devices of all processes),
    split by `split_devices`: the trainer's mesh by `mesh_cfg`, the rollout mesh (data = -1,
    fsdp 1, tensor = the trainer mesh's tensor size).

    Raises:
      ConfigError: see `split_devices`; `generation.rollout_devices` not a multiple of the
        trainer mesh's tensor size. ValueError: `mesh_cfg` does not fit the trainer's devices
        (`parallel.resolve_axis_sizes`).
    """
    devices = list(jax.devices() if devices is None else devices)
    trainer_devices, group = split_devices(devices, rollout_devices)
    trainer = Placement.from_config(mesh_cfg, trainer_devices, abstract)
    tensor = trainer.mesh.shape["tensor"]
    if len(group) % tensor:
        raise ConfigError(f"{KEY}={len(group)} is not a multiple of mesh.tensor={tensor}, the "
                          "rollout mesh's tensor axis (the rollout copy is split over tensor as "
                          "the trainer lays it out)")
    return trainer, Placement(make_mesh(-1, 1, tensor, group), abstract)
