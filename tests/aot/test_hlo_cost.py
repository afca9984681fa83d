"""Per-chip costs from the compiled TPU program with loop trip counts (issue 22, trap 1):
XLA's cost_analysis counts a loop body once; `aot.hlo_cost` counts it as often as it runs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from ppo_jax.aot.hlo_cost import program_costs
from ppo_jax.aot.topology import resolve_slice, slice_devices

pytest.importorskip("libtpu")
D = 512


@pytest.fixture(scope="module")
def mesh8():
    devices = slice_devices(resolve_slice("v5e-8"))
    return jax.make_mesh((8,), ("x",), devices=devices, axis_types=(AxisType.Auto,))


def compile_on(mesh, fn, *specs):
    args = [jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=NamedSharding(mesh, spec))
            for shape, spec in specs]
    return jax.jit(fn).lower(*args).compile()


def one_chip(mesh8):
    return jax.make_mesh((1,), ("x",), devices=list(mesh8.devices.flat)[:1],
                         axis_types=(AxisType.Auto,))


def scanned(length):
    def f(w, x):
        return jax.lax.scan(lambda c, _: (jnp.tanh(c @ w), None), x, None, length=length)[0]
    return f


def test_a_scan_body_counts_once_per_iteration(mesh8):
    mesh = one_chip(mesh8)
    c = compile_on(mesh, scanned(10), ((D, D), P()), ((256, D), P()))
    costs = program_costs(c.as_text())
    assert costs.matmul_flops == 10 * 2 * 256 * D * D
    assert [n for n, _ in costs.loops] == [10] and costs.unknown_loops == 0
    # the trap this module exists for: XLA's own count sees one iteration
    assert c.cost_analysis()["flops"] < 2 * (2 * 256 * D * D)


def test_nested_scans_multiply_their_trip_counts(mesh8):
    def f(w, x):
        def outer(c, _):
            return scanned(5)(w, c), None
        return jax.lax.scan(outer, x, None, length=3)[0]

    c = compile_on(one_chip(mesh8), f, ((D, D), P()), ((128, D), P()))
    assert program_costs(c.as_text()).matmul_flops == 15 * 2 * 128 * D * D


def test_a_loop_that_may_stop_early_counts_its_upper_bound(mesh8):
    def f(w, x):
        def cond(s):
            i, c = s
            return (i < 7) & (jnp.max(c) < 1e9)
        return jax.lax.while_loop(cond, lambda s: (s[0] + 1, jnp.tanh(s[1] @ w)), (0, x))[1]

    c = compile_on(one_chip(mesh8), f, ((D, D), P()), ((128, D), P()))
    costs = program_costs(c.as_text())
    assert costs.matmul_flops == 7 * 2 * 128 * D * D and costs.unknown_loops == 0


def test_batched_matmuls_written_as_convolutions_count_exactly(mesh8):
    c = compile_on(one_chip(mesh8), lambda a, b: jnp.einsum("bij,bjk->bik", a, b),
                   ((4, 64, 256), P()), ((4, 256, 32), P()))
    assert program_costs(c.as_text()).matmul_flops == 2 * 4 * 64 * 256 * 32


def test_collectives_inside_a_loop_are_counted_per_iteration(mesh8):
    """FSDP-style: w sharded over 8 chips is all-gathered for each of the 10 matmuls."""
    c = compile_on(mesh8, scanned(10), ((D, D), P("x")), ((1024, D), P("x")))
    costs = program_costs(c.as_text())
    gathers = costs.collectives["all-gather"]
    assert gathers["count"] == 10
    assert gathers["bytes"] == 10 * D * D * 2  # the whole bf16 kernel on every chip
    assert costs.matmul_flops == 10 * 2 * (1024 // 8) * D * D  # each chip its rows


def test_roofline_time_is_flops_at_peak_or_bytes_at_bandwidth(mesh8):
    c = compile_on(one_chip(mesh8), lambda a, b: a @ b, ((4096, 4096), P()), ((4096, 4096), P()))
    costs = program_costs(c.as_text(), peak_flops=1e12, hbm_bandwidth=1e15)
    assert costs.compute_seconds == pytest.approx(2 * 4096 ** 3 / 1e12, rel=0.01)
    slow_memory = program_costs(c.as_text(), peak_flops=1e18, hbm_bandwidth=1e9)
    assert slow_memory.compute_seconds == pytest.approx(3 * 4096 * 4096 * 2 / 1e9, rel=0.05)


def test_a_scatter_into_a_loop_carried_buffer_counts_its_updates_not_the_buffer(mesh8):
    """The paged KV cache's per-layer writes (`models.paged_cache.write_pages`): XLA scatters
    into the carried pool in place, so each of the 10 iterations moves its 8 updated rows, not
    the whole pool (counted whole: 14.8 GB against the pool's 0.67 GB)."""
    def f(pool, upd):
        pages = jnp.arange(8, dtype=jnp.int32) * 7

        def body(c, i):
            return c.at[i, pages, 3].set(upd), None
        return jax.lax.scan(body, pool, jnp.arange(10, dtype=jnp.int32))[0]

    c = compile_on(one_chip(mesh8), f, ((10, 4096, 16, 4, 128), P()), ((8, 4, 128), P()))
    costs = program_costs(c.as_text(), peak_flops=1e12, hbm_bandwidth=1e12)
    whole = 10 * 4096 * 16 * 4 * 128 * 2
    assert [n for n, _ in costs.loops] == [10]
    assert costs.bytes < 2.5 * whole  # the pool in and out once, the updates per iteration
