"""The process environment of a run's entry point, set before jax starts a backend.

`quiet_tpu_probe`: with libtpu installed (`pip install -e .[tpu]`, for `--compile-for`) and no
JAX_PLATFORMS set, jax tries the TPU backend at start-up on every host. On a host without TPU
chips libtpu then looks for a TPU VM's metadata, finds none and prints a page of "E0000 ...
INVALID_ARGUMENT ... TPU_WORKER_HOSTNAMES" errors before jax falls back to the CPU or GPU: a
newcomer's first screen. Telling libtpu it runs alone on one host (what it would find on a
one-chip VM) keeps its probe silent; the backend it then fails to start (no chips) is skipped
exactly as before.
"""

from __future__ import annotations

import glob
import os

# libtpu's own settings for one host alone: no metadata server query, this host the only worker
QUIET_PROBE = (("TPU_SKIP_MDS_QUERY", "1"), ("TPU_WORKER_HOSTNAMES", "localhost"),
               ("TPU_HOST_BOUNDS", "1,1,1"))


def tpu_chips_attached() -> bool:
    """Whether this host has TPU chips: jax's own PCI count, else the TPU device files
    (`/dev/accel*` up to v5e, `/dev/vfio/<n>` from v5p)."""
    try:
        from jax._src import hardware_utils  # imports no backend

        return hardware_utils.num_available_tpu_chips_and_device_id()[0] > 0
    except Exception:  # noqa: BLE001 - a jax without it: look at the device files
        return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def quiet_tpu_probe(environ=os.environ) -> bool:
    """Set `QUIET_PROBE` (keeping any value already set) when jax would probe for a TPU that
    is not there: JAX_PLATFORMS unset and no TPU chips attached. Call it at a process's start,
    before jax starts a backend, and not for `--compile-for` (`aot.topology` sets libtpu's
    environment for the slice it describes). Returns whether it set anything."""
    if environ.get("JAX_PLATFORMS") or tpu_chips_attached():
        return False
    for key, value in QUIET_PROBE:
        environ.setdefault(key, value)
    return True
