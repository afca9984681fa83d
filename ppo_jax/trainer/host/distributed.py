"""Multi-host start-up: `jax.distributed.initialize` from the config or the environment."""

from __future__ import annotations

import jax


def initialize(dist) -> None:
    """Join a multi-process run when `distributed.enabled` is set.

    With `coordinator_address`, `num_processes` and `process_id` given, they are passed on; left
    empty, JAX detects them from the environment TPU pods and SLURM set.
    """
    if not dist.enabled:
        return
    kwargs = {}
    if dist.coordinator_address:
        kwargs["coordinator_address"] = dist.coordinator_address
    if dist.num_processes is not None:
        kwargs["num_processes"] = dist.num_processes
    if dist.process_id is not None:
        kwargs["process_id"] = dist.process_id
    jax.distributed.initialize(**kwargs)
