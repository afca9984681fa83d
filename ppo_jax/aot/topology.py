"""TPU slices by name, their devices for ahead-of-time compiles, and the chip figures.

`resolve_slice("v5p-128")` or `resolve_slice("v5p:4x4x4")` -> a `Slice`; `slice_devices(s)` gives
its devices from libtpu's topology description (`jax.experimental.topologies`), one per chip,
spread over the slice's hosts as in a multi-host run; they hold no memory and run nothing,
but `jax.jit(...).lower(...).compile()` compiles for them on a CPU host.

Slice names follow Google's accelerator types: the number counts TensorCores for v4 and v5p
(two per chip: v5p-128 is 64 chips) and chips for v5e and v6e (v5e-256 is 256 chips).

GPU nodes (`h100-8`, `h200-8`; `h100-16` is two nodes of eight) compile through the CUDA PJRT
plugin (`pip install -e .[gpu-aot]`, no GPU or CUDA libraries needed) with an XLA target
config (`aot.gpu_targets`). JAX's allocator takes `XLA_PYTHON_CLIENT_MEM_FRACTION` (default
0.75) of a GPU's memory, so that share is what a program must fit in.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import Optional

from ppo_jax.aot import gpu_targets

GIB = 2 ** 30


class TopologyError(ValueError):
    """An unknown slice name or topology; the message lists the known ones."""


@dataclass(frozen=True)
class Chip:
    """The figures of one TPU chip kind.

    `hbm_bytes` is Google's published capacity; `usable_hbm_bytes` is what the compiler lets a
    program use, so what a program must fit in. It was read from libtpu 0.0.42.1's
    out-of-memory message, "exceeds available HBM (15.75G)". `ici_bandwidth` is the bidirectional
    inter-chip bandwidth per chip (None where Google's page gives none).
    """

    kind: str
    device_kind: str  # what jax reports as `device.device_kind`
    topology_prefix: str  # the name libtpu's topology description takes
    chip_config: str  # "megacore": one device per chip of two TensorCores
    cores_per_chip: int  # how Google's slice names count
    dims: int  # 2D or 3D torus
    hbm_bytes: float
    usable_hbm_bytes: float
    peak_bf16_flops: float
    hbm_bandwidth: float  # bytes / s
    ici_bandwidth: Optional[float]  # bytes / s, bidirectional, per chip (NVLink on a GPU)
    source: str
    platform: str = "tpu"
    target_config: Optional[str] = None  # GPU: the XLA target config to compile for


CHIPS = {
    "v4": Chip("v4", "TPU v4", "v4", "megacore", 2, 3, 32 * GIB, 30.75 * GIB, 275e12, 1200e9, None,
               "https://cloud.google.com/tpu/docs/v4"),
    "v5e": Chip("v5e", "TPU v5 lite", "v5e", "default", 1, 2, 16 * GIB, 15.75 * GIB, 197e12, 819e9,
                400e9, "https://cloud.google.com/tpu/docs/v5e"),
    "v5p": Chip("v5p", "TPU v5", "v5p", "megacore", 2, 3, 95 * GIB, 95.74 * GIB, 459e12, 2765e9,
                1200e9, "https://cloud.google.com/tpu/docs/v5p"),
    "v6e": Chip("v6e", "TPU v6 lite", "v6e", "default", 1, 2, 32 * GIB, 31.25 * GIB, 918e12, 1638e9,
                800e9, "https://cloud.google.com/tpu/docs/v6e"),
}
GPUS = {
    "h100": Chip("h100", "NVIDIA H100 80GB HBM3", "", "", 1, 2, 80e9, gpu_targets.H100_MEMORY,
                 989e12, 3.35e12, 900e9, "https://www.nvidia.com/en-us/data-center/h100/ (SXM)",
                 "cuda", gpu_targets.H100),
    "h200": Chip("h200", "NVIDIA H200", "", "", 1, 2, 141e9, gpu_targets.H200_MEMORY, 989e12,
                 4.8e12, 900e9, "https://www.nvidia.com/en-us/data-center/h200/ (SXM)", "cuda",
                 gpu_targets.H200),
}
GPUS_PER_NODE = 8
# chips -> torus shape of the common single slices (Google's slice tables)
SHAPES_3D = {4: (2, 2, 1), 8: (2, 2, 2), 16: (2, 2, 4), 32: (2, 4, 4), 64: (4, 4, 4),
             128: (4, 4, 8), 256: (4, 8, 8), 512: (8, 8, 8), 1024: (8, 8, 16), 2048: (8, 16, 16),
             4096: (16, 16, 16)}
SHAPES_2D = {1: (1, 1), 4: (2, 2), 8: (2, 4), 16: (4, 4), 32: (4, 8), 64: (8, 8), 128: (8, 16),
             256: (16, 16)}
ALIASES = {"v5litepod": "v5e", "v5lite": "v5e", "v6": "v6e", "v5": "v5p"}


@dataclass(frozen=True)
class Slice:
    """A slice: its name as given, its chip, torus shape and chip count."""

    name: str
    chip: Chip
    shape: tuple[int, ...]

    @property
    def chips(self) -> int:
        return math.prod(self.shape)

    @property
    def usable_hbm_bytes(self) -> float:
        """What one program may use per chip: the compiler's limit on a TPU; on a GPU the share
        JAX's allocator takes (`XLA_PYTHON_CLIENT_MEM_FRACTION`, default 0.75)."""
        if self.chip.platform == "tpu":
            return self.chip.usable_hbm_bytes
        fraction = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", 0.75))
        return self.chip.usable_hbm_bytes * fraction

    @property
    def topology(self) -> str:
        """libtpu's topology name, e.g. "v5p:4x4x4"; "1 x nodes x GPUs" on GPUs."""
        if self.chip.platform == "cuda":
            return "1 x " + " x ".join(map(str, self.shape))
        return f"{self.chip.topology_prefix}:{'x'.join(map(str, self.shape))}"

    @property
    def accelerator_type(self) -> str:
        """Google's accelerator type of a slice with this chip count, e.g. "v5litepod-8"."""
        name = {"v5e": "v5litepod"}.get(self.chip.kind, self.chip.kind)
        return f"{name}-{self.chips * self.chip.cores_per_chip}"

    @property
    def host_bounds(self) -> tuple[int, int, int]:
        """Chips per host: 2x2x1 (four chips a host), or the whole slice when a 2D slice of at
        most 8 chips is one host (v5e-8, v6e-8)."""
        if self.chip.dims == 2 and self.chips <= 8:
            return (*self.shape, 1)
        return (2, 2, 1) if self.chips >= 4 else (*self.shape, 1)[:3]


def _known() -> str:
    names = [f"{k}-{n * c.cores_per_chip}" for k, c in CHIPS.items()
             for n in (SHAPES_3D if c.dims == 3 else SHAPES_2D)]
    return ", ".join(names + ["h100-8", "h200-8 (or N GPUs: h100-1..8, h100-16, ...)"])


def _gpu_slice(name: str, chip: Chip, count: int) -> Slice:
    """N GPUs: one node of N <= 8, or N / 8 nodes of eight."""
    if count <= GPUS_PER_NODE:
        return Slice(name, chip, (1, count))
    if count % GPUS_PER_NODE:
        raise TopologyError(f"--compile-for {name!r}: more than {GPUS_PER_NODE} GPUs must be "
                            f"whole nodes of {GPUS_PER_NODE}")
    return Slice(name, chip, (count // GPUS_PER_NODE, GPUS_PER_NODE))


def resolve_slice(name: str) -> Slice:
    """A `Slice` from Google's name (`v5p-128`, `v5e-8`, `v5litepod-16`, `v6e-256`, `v4-8`) or a
    raw topology (`v5p:4x4x4`, `v5e:16x16`).

    Raises:
      TopologyError: an unknown chip, a count that is not a known slice or not a multiple of
        the cores per chip, or a shape of the wrong rank; the message lists the known names.
    """
    raw = re.fullmatch(r"([a-z0-9]+):(\d+(?:x\d+)+)", name.strip().lower())
    named = re.fullmatch(r"([a-z0-9]+)-(\d+)", name.strip().lower())
    kind = (raw or named).group(1) if (raw or named) else None
    if named and kind in GPUS:
        if int(named.group(2)) < 1:
            raise TopologyError(f"--compile-for {name!r}: a GPU count must be >= 1")
        return _gpu_slice(name, GPUS[kind], int(named.group(2)))
    chip = CHIPS.get(ALIASES.get(kind, kind)) if kind else None
    if chip is None:
        raise TopologyError(f"--compile-for {name!r}: unknown TPU; use a slice name ({_known()}) "
                            f"or a topology such as v5p:4x4x4 or v5e:16x16")
    if raw:
        shape = tuple(int(d) for d in raw.group(2).split("x"))
        if len(shape) != chip.dims or min(shape) < 1:
            raise TopologyError(f"--compile-for {name!r}: a {chip.kind} topology has "
                                f"{chip.dims} dimensions, each >= 1 (e.g. {_example(chip)}); "
                                f"known slices: {_known()}")
        return Slice(name, chip, shape)
    count = int(named.group(2))
    shapes = SHAPES_3D if chip.dims == 3 else SHAPES_2D
    chips, rest = divmod(count, chip.cores_per_chip)
    if rest or chips not in shapes:
        raise TopologyError(f"--compile-for {name!r}: not a known {chip.kind} slice; known: "
                            f"{_known()}; or give a topology such as {_example(chip)}")
    return Slice(name, chip, shapes[chips])


def _example(chip) -> str:
    """A valid raw topology of `chip`'s kind, for error messages."""
    return f"{chip.kind}:2x2x2" if chip.dims == 3 else f"{chip.kind}:2x4"


def gpu_devices(s: Slice) -> list:
    """The compile-only devices of a GPU slice (the CUDA PJRT plugin and an XLA target config).

    Raises:
      TopologyError: the plugin is not installed (`pip install -e .[gpu-aot]`) or fails.
    """
    try:
        from jax.experimental import topologies

        topo = topologies.get_topology_desc(platform="cuda", topology_name="",
                                            topology=s.topology, target_config=s.chip.target_config)
    except Exception as e:  # noqa: BLE001 - a missing plugin is a NotImplementedError or RuntimeError
        raise TopologyError(f"--compile-for {s.name!r}: cannot describe {s.topology} GPUs: "
                            f"{type(e).__name__}: {str(e)[:300]} (the CUDA PJRT plugin: "
                            "pip install -e .[gpu-aot])") from None
    return list(topo.devices)


def slice_devices(s: Slice) -> list:
    """The slice's devices from libtpu's topology description (one per chip, on every host);
    for GPUs, `gpu_devices`.

    Raises:
      TopologyError: libtpu is not installed (`pip install -e .[tpu]`) or rejects the topology.
    """
    if s.chip.platform == "cuda":
        return gpu_devices(s)
    import os

    # libtpu looks for a TPU VM's metadata when it starts; on another host these say there is
    # none (the topology below is explicit, and the compiled programs are the same); with no
    # TPU to guard, several processes may load it at once
    for key, value in (("TPU_SKIP_MDS_QUERY", "1"), ("TPU_WORKER_HOSTNAMES", "localhost"),
                       ("ALLOW_MULTIPLE_LIBTPU_LOAD", "1"),
                       ("TPU_ACCELERATOR_TYPE", s.accelerator_type)):
        os.environ.setdefault(key, value)
    try:
        from jax.experimental import topologies

        topo = topologies.get_topology_desc(platform="tpu", topology_name=s.topology,
                                            chip_config_name=s.chip.chip_config,
                                            chips_per_host_bounds=s.host_bounds, num_slices=1)
    except Exception as e:  # noqa: BLE001 - libtpu's errors are plain RuntimeErrors
        hint = " (libtpu missing? pip install -e .[tpu])" if "tpu" in str(e).lower() else ""
        raise TopologyError(f"--compile-for {s.name!r}: cannot describe topology {s.topology}: "
                            f"{type(e).__name__}: {str(e)[:300]}{hint}") from None
    return list(topo.devices)


def compiler_version(s: Slice) -> tuple[str, str]:
    """`(compiler, version)` that compiles for `s`: libtpu, or the CUDA PJRT plugin."""
    from importlib.metadata import PackageNotFoundError, version

    dists = (("libtpu", "libtpu-nightly") if s.chip.platform == "tpu"
             else ("jax-cuda12-pjrt", "jax-cuda13-pjrt"))
    for dist in dists:
        try:
            return dists[0], version(dist)
        except PackageNotFoundError:
            continue
    return dists[0], "unknown"
