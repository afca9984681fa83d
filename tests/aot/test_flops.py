"""The project's jaxpr FLOP count applied to jitted functions (`aot.flops.count_flops`), XLA's
count beside it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from ppo_jax.aot.flops import count_flops, jaxpr_matmul_flops


def test_counted_flops_of_a_matmul_are_2mnk():
    m, k, n = 3, 5, 7
    c = count_flops(jax.jit(lambda x, y: x @ y), jnp.ones((m, k)), jnp.ones((k, n)))
    assert c["flops"] == 2 * m * n * k and c["loops"] == 0
    assert c["xla_flops"] == pytest.approx(2 * m * n * k)


def test_counted_flops_of_a_gradient_are_three_matmuls():
    """d/dx and d/dw of sum(x @ w): forward, g w^T and x^T g, each 2 M N K (the 6N rule)."""
    m, k, n = 4, 6, 3
    grad = jax.jit(jax.grad(lambda x, w: (x @ w).sum(), argnums=(0, 1)))
    assert count_flops(grad, jnp.ones((m, k)), jnp.ones((k, n)))["flops"] == 3 * 2 * m * n * k


def test_scan_bodies_count_per_iteration_but_xla_counts_them_once():
    """Why the benchmarks count from the jaxpr: XLA's cost analysis counts a while body once."""
    layers, b, d = 6, 8, 16

    def stack(x, w):
        return jax.lax.scan(lambda h, wi: (h @ wi, None), x, w)[0]

    c = count_flops(jax.jit(stack), jnp.ones((b, d)), jnp.ones((layers, d, d)))
    assert c["flops"] == layers * 2 * b * d * d
    assert c["xla_flops"] < c["flops"] / 2


def test_batched_dots_and_the_costlier_cond_branch():
    bt, i, j, k = 2, 3, 4, 5

    def f(p, a, b, c):
        ab = jnp.einsum("bij,bjk->bik", a, b)
        return jax.lax.cond(p, lambda: ab, lambda: ab @ c)

    args = (True, jnp.ones((bt, i, j)), jnp.ones((bt, j, k)), jnp.ones((k, k)))
    got = count_flops(jax.jit(f), *args, with_xla=False)
    assert got["flops"] == 2 * bt * i * j * k + 2 * bt * i * k * k and got["xla_flops"] is None


def test_while_loops_are_reported():
    def f(x):
        return jax.lax.while_loop(lambda c: c[1] < 3, lambda c: (c[0] @ c[0], c[1] + 1), (x, 0))[0]

    c = count_flops(jax.jit(f), jnp.ones((4, 4)), with_xla=False)
    assert c == {"flops": 2 * 4 ** 3, "loops": 1, "xla_flops": None}



def test_a_grouped_matmul_counts_each_row_against_its_own_group_only():
    """MoE experts (`jax.lax.ragged_dot`): 12 rows of width 8, each through one of 4 groups'
    8 x 6 matrices: 2 x 12 x 8 x 6, not x 4; its gradient is three such products (the weight
    gradient sums each group over its own rows)."""
    x, w = jnp.ones((12, 8)), jnp.ones((4, 8, 6))
    sizes = jnp.array([5, 0, 3, 4], jnp.int32)

    def f(x, w):
        return jax.lax.ragged_dot(x, w, sizes).sum()

    assert jaxpr_matmul_flops(jax.make_jaxpr(f)(x, w))[0] == 2 * 12 * 8 * 6
    grad = jax.make_jaxpr(jax.grad(f, argnums=(0, 1)))(x, w)
    assert jaxpr_matmul_flops(grad)[0] == 3 * 2 * 12 * 8 * 6


def test_megablox_kernels_count_their_rows_not_one_tile():
    """The experts on TPU (`models.grouped_matmul`, megablox's gmm / tgmm: a pallas_call whose
    kernel holds one tile's dot): forward, input and weight gradient, each 2 M K N, with M the
    256 rows (two row tiles, no padding) and K, N wider than one tile."""
    from ppo_jax.models.grouped_matmul import grouped_matmul

    m, k, n = 256, 2048, 1536
    x, w = jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((4, k, n), jnp.bfloat16)
    sizes = jax.ShapeDtypeStruct((4,), jnp.int32)

    def f(x, w, sizes):
        return grouped_matmul(x, w, sizes, megablox_kernel=True).astype(jnp.float32).sum()

    assert jaxpr_matmul_flops(jax.make_jaxpr(f)(x, w, sizes))[0] == 2 * m * k * n
    grad = jax.make_jaxpr(jax.grad(f, argnums=(0, 1)))(x, w, sizes)
    assert jaxpr_matmul_flops(grad)[0] == 3 * 2 * m * k * n


def test_a_shard_map_body_counts_once_per_device_of_its_manual_axes():
    """Inside `shard_map` shapes are one device's: the experts' dispatch (`moe_dispatch`) runs
    a device's rows there, so the body is counted x the manual axes' devices (2 x 3 here; the
    auto axis "c" stays global in the body) and the count equals the unsplit matmul's."""
    mesh = jax.sharding.AbstractMesh((2, 3, 5), ("a", "b", "c"))
    x, w = jax.ShapeDtypeStruct((12, 8), jnp.float32), jax.ShapeDtypeStruct((8, 10), jnp.float32)
    sharded = jax.shard_map(lambda x, w: x @ w, mesh=mesh, in_specs=(P(("a", "b")), P()),
                            out_specs=P(("a", "b")), axis_names={"a", "b"})
    assert jaxpr_matmul_flops(jax.make_jaxpr(sharded)(x, w))[0] == 2 * 12 * 8 * 10
    grad = jax.make_jaxpr(jax.grad(lambda x, w: sharded(x, w).sum(), argnums=(0, 1)))(x, w)
    assert jaxpr_matmul_flops(grad)[0] == 3 * 2 * 12 * 8 * 10


def test_the_paged_attention_kernel_counts_the_dense_attention_over_its_page_tables():
    """The engine's decode attention on TPU (`paged_attention_tpu`, jax's Pallas
    `ragged_paged_attention`): its kernel jaxpr holds one grid step, so the call is counted as
    `paged_cache.paged_attention_reference` computes it (every row's query against its whole
    page table: q k^T and p v), the reference path's own count."""
    from ppo_jax.models.paged_attention_tpu import pallas_decode_attention
    from ppo_jax.models.paged_cache import PagedView, paged_attention_reference

    replicas, rows, heads, kv_heads, hd, page, width, pages = 2, 4, 4, 2, 128, 16, 4, 40
    q = jax.ShapeDtypeStruct((replicas * rows, 1, heads, hd), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((replicas, pages, page, 2 * kv_heads, hd), jnp.bfloat16)
    view = PagedView(jax.ShapeDtypeStruct((replicas, rows, width), jnp.int32),
                     jax.ShapeDtypeStruct((replicas * rows, 1), jnp.int32),
                     jax.ShapeDtypeStruct((replicas * rows, 1), jnp.bool_),
                     jax.ShapeDtypeStruct((replicas * rows,), jnp.int32))
    dense = 4 * replicas * rows * heads * hd * width * page
    kernel = jax.make_jaxpr(lambda q, kv, v: pallas_decode_attention(q, kv, v, None))(q, kv, view)
    reference = jax.make_jaxpr(lambda q, kv, v: paged_attention_reference(q, kv, v))(q, kv, view)
    assert jaxpr_matmul_flops(kernel)[0] == dense == jaxpr_matmul_flops(reference)[0]
