"""Slice names, their libtpu devices and the usable HBM the compiler reports (issue 22)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from ppo_jax.aot.topology import CHIPS, GIB, TopologyError, resolve_slice, slice_devices

pytest.importorskip("libtpu")


@pytest.mark.parametrize("name, kind, chips, topology", [
    ("v4-8", "v4", 4, "v4:2x2x1"), ("v5p-8", "v5p", 4, "v5p:2x2x1"),
    ("v5p-64", "v5p", 32, "v5p:2x4x4"), ("v5p-128", "v5p", 64, "v5p:4x4x4"),
    ("v5e-8", "v5e", 8, "v5e:2x4"), ("v5litepod-16", "v5e", 16, "v5e:4x4"),
    ("v5e-256", "v5e", 256, "v5e:16x16"), ("v6e-64", "v6e", 64, "v6e:8x8"),
    ("v5p:4x4x8", "v5p", 128, "v5p:4x4x8"), ("v6e:2x4", "v6e", 8, "v6e:2x4"),
])
def test_slice_names_count_chips_as_google_does(name, kind, chips, topology):
    s = resolve_slice(name)
    assert (s.chip.kind, s.chips, s.topology) == (kind, chips, topology)


@pytest.mark.parametrize("name", ["v5p-7", "v5p-6", "v7x-8", "a100-8", "h100-12", "v5e-12",
                                  "v5p:4x4", "v5e:2x2x2", "v5p"])
def test_unknown_slices_are_refused_with_the_known_names(name):
    with pytest.raises(TopologyError, match="v5p-128|nodes of 8"):
        resolve_slice(name)


@pytest.mark.parametrize("name, hint", [("v5e-7", "such as v5e:2x4"), ("v5p-6", "such as v5p:2x2x2"),
                                        ("v5p:0x2x2", "each >= 1"), ("h100-0", "GPU count")])
def test_the_hint_of_a_refused_name_is_a_name_that_works(name, hint):
    with pytest.raises(TopologyError, match=hint):
        resolve_slice(name)
    if "such as" in hint:
        assert resolve_slice(hint.split("such as ")[1]).chips == 8


def test_gpu_nodes_are_eight_gpus_a_host():
    one, two = resolve_slice("h100-8"), resolve_slice("h200-16")
    assert (one.chips, one.topology, one.chip.platform) == (8, "1 x 1 x 8", "cuda")
    assert (two.chips, two.topology) == (16, "1 x 2 x 8")


@pytest.mark.parametrize("name, hosts", [("v5e-8", 1), ("v5p-8", 1), ("v5p-128", 16),
                                         ("v5e-256", 64), ("v4-16", 2)])
def test_devices_span_every_host_of_the_slice(name, hosts):
    s = resolve_slice(name)
    devices = slice_devices(s)
    assert len(devices) == s.chips
    assert len({d.process_index for d in devices}) == hosts
    assert {d.device_kind for d in devices} == {s.chip.device_kind}


@pytest.mark.parametrize("kind", sorted(CHIPS))
def test_usable_hbm_is_what_the_compiler_allows(kind):
    """A program 1.5x the table's usable HBM is refused, and the compiler's message names the
    available HBM the table holds (to its 0.01G rounding)."""
    chip = CHIPS[kind]
    s = resolve_slice(f"{kind}-{chip.cores_per_chip}" if chip.dims == 2 else f"{kind}:2x2x1")
    device = slice_devices(s)[0]
    mesh = jax.make_mesh((1,), ("x",), devices=[device], axis_types=(AxisType.Auto,))
    rows = int(chip.usable_hbm_bytes * 0.75) // (4 * 4096)
    x = jax.ShapeDtypeStruct((rows, 4096), jnp.float32, sharding=NamedSharding(mesh, P()))
    with pytest.raises(Exception, match="RESOURCE_EXHAUSTED") as e:
        jax.jit(lambda a: a * 2).lower(x).compile()
    available = float(str(e.value).split("available HBM (")[1].split("G")[0])
    assert available == pytest.approx(chip.usable_hbm_bytes / GIB, abs=0.006)


def test_a_mesh_axis_that_splits_a_torus_axis_is_laid_out():
    """tensor=4 on v6e-64's 8x8 torus: jax.make_mesh needs whole physical axes per mesh axis and
    refuses; the mesh splits a physical axis instead, and every host still holds one contiguous
    block of every batch (the rows a process feeds)."""
    from ppo_jax.parallel import batch_sharding, make_mesh

    devices = slice_devices(resolve_slice("v6e-64"))
    mesh = make_mesh(1, -1, 4, devices)
    assert dict(mesh.shape) == {"data": 1, "fsdp": 16, "tensor": 4}
    assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in devices)
    index = batch_sharding(mesh).devices_indices_map((64,))
    for host in {d.process_index for d in devices}:
        rows = sorted({r for d, (s,) in index.items() if d.process_index == host
                       for r in range(*s.indices(64)[:2])})
        assert rows == list(range(rows[0], rows[0] + len(rows)))
