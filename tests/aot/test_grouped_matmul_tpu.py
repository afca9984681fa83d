"""The MoE experts' grouped matmul compiled for TPU on this CPU host (`aot.topology` devices):
XLA:TPU's `ragged_dot` gradient is a dense matmul over every group for the weights, megablox's
(`models.grouped_matmul`) costs the active rows only, by the HLO walk (`aot.hlo_cost`, which
counts megablox's kernels from their operand shapes). The tiles fit each chip's VMEM, and the
MoE block compiles through `dispatch`'s shard_map with the FFN width split over `tensor`."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from ppo_jax.aot.hlo_cost import program_costs
from ppo_jax.aot.topology import resolve_slice, slice_devices
from ppo_jax.models.functional import path_str
from ppo_jax.models.grouped_matmul import grouped_matmul
from ppo_jax.models.moe import SparseMoeBlock
from ppo_jax.models.moe_dispatch import expert_ffn
from ppo_jax.models.tiny_random import tiny_config
from ppo_jax.parallel import make_mesh

pytest.importorskip("libtpu")


@functools.lru_cache(maxsize=None)
def _chip(name: str = "v5p-8"):
    return jax.sharding.SingleDeviceSharding(slice_devices(resolve_slice(name))[0])


def _spec(shape, dtype=jnp.bfloat16, sharding=None):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding or _chip())


def _gmm_grad_flops(megablox_kernel, m, k, n, groups, dtype=jnp.bfloat16, chip="v5p-8"):
    def loss(x, w, sizes):
        return jnp.sum(grouped_matmul(x, w, sizes, megablox_kernel=megablox_kernel)
                       .astype(jnp.float32))

    sh = _chip(chip)
    args = (_spec((m, k), dtype, sh), _spec((groups, k, n), dtype, sh),
            _spec((groups,), jnp.int32, sh))
    compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(*args).compile()
    return program_costs(compiled.as_text()).matmul_flops


def test_the_weight_gradient_of_ragged_dot_is_dense_and_megablox_is_grouped():
    """The lead's case (Qwen3-30B-A3B's expert width): forward, input and weight gradient are
    3 x 2MKN = 3.87e10 with megablox, exactly; ragged_dot's weight gradient multiplies every row
    by all 128 groups (1.68e12)."""
    m, k, n, g = 4096, 2048, 768, 128
    active = 2.0 * m * k * n
    assert _gmm_grad_flops(True, m, k, n, g) == 3 * active
    assert _gmm_grad_flops(False, m, k, n, g) == (2 + g) * active


def test_padding_rows_are_counted_up_to_the_row_tile():
    """100 rows over 128 groups: the row tile is 112, so the kernels take 112 rows."""
    assert _gmm_grad_flops(True, 100, 2048, 192, 128) == 3 * 2.0 * 112 * 2048 * 192


@pytest.mark.slow  # ~70 s on 2 cores
@pytest.mark.parametrize("chip", ["v4-8", "v5e-8", "v5p-8", "v6e-8"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_the_largest_tiles_fit_each_chips_vmem(chip, dtype):
    """512-row tiles (65536 rows / 128 groups) and 1024-wide K and N tiles (512 in float32):
    the compile checks the kernels' scoped VMEM (1024 in float32 fails on v5p, 'Ran out of
    memory in memory space vmem')."""
    assert _gmm_grad_flops(True, 65536, 2048, 2048, 128, dtype, chip) == 3 * 2.0 * 65536 * 2048 ** 2


def test_the_expert_ffn_gradient_costs_its_active_flops_with_a_tensor_split_width():
    """value_and_grad of the SwiGLU experts (gate, up, down) at F = 192 (768 over tensor = 4):
    3 projections x (forward + 2 gradients) x 2 M D F, where ragged_dot spends ~E times it."""
    t, k, d, f, e = 128, 8, 512, 192, 32

    def loss(x, weights, gate, up, down, experts, megablox_kernel):
        y = expert_ffn(x, experts, weights, gate, up, down, jax.nn.silu, megablox_kernel)
        return jnp.sum(y.astype(jnp.float32))

    args = (_spec((t, d)), _spec((t, k)), _spec((e, d, f)), _spec((e, d, f)), _spec((e, f, d)),
            _spec((t, k), jnp.int32))
    active = 9 * 2.0 * t * k * d * f
    flops = {}
    for mb in (True, False):
        step = jax.jit(jax.value_and_grad(loss, argnums=range(5)), static_argnums=6)
        flops[mb] = program_costs(step.lower(*args, mb).compile().as_text()).matmul_flops
    assert active <= flops[True] <= 1.5 * active
    assert flops[False] > e / 4 * active


def test_the_moe_block_compiles_through_dispatch_with_megablox_on_a_v5p_mesh():
    """fsdp=2 x tensor=4 on v5p-16: each chip runs its own 512 (token, expert) rows against all
    experts at F / 4 = 192 columns: 9 megablox kernels (gate, up, down: forward, input and
    weight gradients), within 1.5x of 9 x 2 M D (F / 4) matmul FLOPs (the router adds little)."""
    mesh = make_mesh(data=1, fsdp=2, tensor=4, devices=slice_devices(resolve_slice("v5p-16")))
    e, d, f, b, length, k = 16, 256, 768, 8, 64, 2
    cfg = tiny_config(96, model_type="qwen3_moe", num_experts=e, num_experts_per_tok=k,
                      moe_intermediate_size=f, norm_topk_prob=True, sparse_layers=(True,),
                      num_layers=1, hidden_size=d, dtype="bfloat16")
    graphdef, state = nnx.split(nnx.eval_shape(lambda: SparseMoeBlock(cfg, nnx.Rngs(0))))
    specs = {"experts/gate_proj": P("fsdp", None, "tensor"),
             "experts/up_proj": P("fsdp", None, "tensor"),
             "experts/down_proj": P("fsdp", "tensor", None)}  # as parallel.rules lays them out
    state = jax.tree_util.tree_map_with_path(
        lambda p, a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(
            mesh, specs.get(path_str(p), P()))), state)
    assert state["experts"]["down_proj"].sharding.spec == P("fsdp", "tensor", None)
    rows = NamedSharding(mesh, P(("data", "fsdp")))

    def loss(s, x, mask):
        out, stats = nnx.merge(graphdef, s)(x, mask, None, mesh)
        return jnp.sum(out.astype(jnp.float32) ** 2) + jnp.sum(stats.probs)

    compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(
        state, _spec((b, length, d), sharding=rows),
        _spec((b, length), jnp.int32, sharding=rows)).compile()
    text = compiled.as_text()
    kernels = [line for line in text.splitlines() if 'custom_call_target="tpu_custom_call"' in line]
    assert len(kernels) == 9 and all("jit(gmm)" in ln or "jit(tgmm)" in ln for ln in kernels)
    active = 9 * 2.0 * (b // 2 * length * k) * d * (f // 4)
    assert active <= program_costs(text).matmul_flops <= 1.5 * active
