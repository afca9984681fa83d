"""The experts' grouped matmul on jax's megablox kernels (`models.grouped_matmul`) computes what
`jax.lax.ragged_dot` computes, values and gradients, run on CPU by Pallas' TPU interpreter
(`pltpu.force_tpu_interpret_mode`): a tiny expert FFN with an empty expert and padding rows,
tiles that split K and N unevenly, and the MoE block on a 4-device CPU mesh (`dispatch`'s
shard_map, unchecked for varying axes). Which kernel runs where is `use_megablox`.
Compiled for TPU: tests/aot/test_grouped_matmul_tpu.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu.megablox import ops as megablox

from ppo_jax.models.grouped_matmul import Tiling, _tile, grouped_matmul, row_tile, use_megablox
from ppo_jax.models.moe_dispatch import expert_ffn
from ppo_jax.parallel import make_mesh
from tests.xla_env import xla_flags

ROOT = Path(__file__).resolve().parents[2]
T, K_SLOTS, E, D, F = 20, 2, 4, 32, 24


def _ffn_inputs(dtype):
    rng = np.random.default_rng(0)
    # every token on two of the first three experts: expert 3 gets no row (an empty group)
    experts = np.stack([rng.choice(3, K_SLOTS, replace=False) for _ in range(T)]).astype(np.int32)
    x = rng.standard_normal((T, D))
    weights = rng.random((T, K_SLOTS))
    gate, up = (rng.standard_normal((E, D, F)) * 0.2 for _ in range(2))
    down = rng.standard_normal((E, F, D)) * 0.2
    return jnp.asarray(experts), *(jnp.asarray(a, dtype) for a in (x, weights, gate, up, down))


def _ffn_value_and_grad(megablox_kernel, experts, *args):
    def loss(x, weights, gate, up, down):
        y = expert_ffn(x, experts, weights, gate, up, down, jax.nn.silu, megablox_kernel)
        return jnp.sum(jnp.sin(y.astype(jnp.float32))), y

    return jax.jit(jax.value_and_grad(loss, argnums=range(5), has_aux=True))(*args)


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_megablox_expert_ffn_equals_ragged_dot_in_values_and_gradients(dtype, tol):
    """T*k = 40 rows: the row tile is 48, so 8 zero rows pad the kernel's input (in no group)
    and expert 3 has no row; its weight gradients must be 0, as ragged_dot's."""
    experts, *args = _ffn_inputs(dtype)
    assert row_tile(T * K_SLOTS, E) == 48
    want = _ffn_value_and_grad(False, experts, *args)
    with pltpu.force_tpu_interpret_mode():
        got = _ffn_value_and_grad(True, experts, *args)
    (_, y), grads = got
    assert y.dtype == dtype and y.shape == (T, D)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        np.testing.assert_allclose(g, w, atol=tol * max(1.0, np.abs(w).max()), rtol=0)
    for name, g in zip(("gate", "up", "down"), grads[2:]):
        assert not np.asarray(g[3], np.float32).any(), name
        assert np.asarray(g[:3], np.float32).any(), name


def test_each_kernel_gets_its_own_tiles_and_uneven_k_and_n_tiles_are_exact():
    """K = 300 and N = 200 over 128-wide tiles (a partial last tile each way): the forward,
    the input gradient (K and N swapped) and the weight gradient all read `Tiling` with their
    own dims; values and gradients equal ragged_dot's."""
    rng = np.random.default_rng(1)
    m, k, n = 64, 300, 200
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((3, k, n)) / np.sqrt(k), jnp.float32)
    sizes = jnp.array([10, 0, 54], jnp.int32)
    tiling = Tiling(16, 128)
    assert tiling(m, k, n) == (16, 128, 128)

    def loss(fn):
        return jax.jit(jax.value_and_grad(lambda x, w: jnp.sum(jnp.sin(fn(x, w))), (0, 1)))

    want = loss(lambda x, w: jax.lax.ragged_dot(x, w, sizes))(x, w)
    with pltpu.force_tpu_interpret_mode():
        got = loss(lambda x, w: megablox.gmm(x, w, sizes, jnp.float32, tiling))(x, w)
    for g, w_ in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w_), atol=2e-5 * m * n, rtol=1e-4)


@pytest.mark.parametrize("dim, cap, tile", [(192, 1024, 192), (768, 1024, 768),
                                            (2048, 1024, 1024), (1536, 1024, 768),
                                            (1152, 512, 384), (1100, 1024, 1024)])
def test_k_and_n_tiles_are_whole_dims_or_dividing_multiples_of_128(dim, cap, tile):
    assert _tile(dim, cap) == tile


@pytest.mark.parametrize("rows, groups, tm", [(4096, 128, 128), (65536, 128, 512),
                                              (20000, 64, 512), (8192, 32, 256), (40, 4, 48),
                                              (100, 128, 112), (3, 8, 16)])
def test_the_row_tile_follows_the_mean_group_size_within_128_to_512(rows, groups, tm):
    assert row_tile(rows, groups) == tm


def test_ragged_dot_runs_on_cpu_and_megablox_on_one_tpu_devices_work():
    cpu = make_mesh(data=1, fsdp=1, tensor=1, devices=jax.devices()[:1])
    assert not use_megablox(None, per_device=False)
    assert not use_megablox(cpu, per_device=True)
    pytest.importorskip("libtpu")
    from ppo_jax.aot.topology import resolve_slice, slice_devices

    chips = slice_devices(resolve_slice("v5p-8"))
    tpu4 = make_mesh(data=1, fsdp=2, tensor=2, devices=chips)
    tpu1 = make_mesh(data=1, fsdp=1, tensor=1, devices=chips[:1])
    assert use_megablox(tpu4, per_device=True)  # inside dispatch's shard_map
    assert not use_megablox(tpu4, per_device=False)  # XLA partitions ragged_dot, not Mosaic
    assert use_megablox(tpu1, per_device=False)


def test_a_bad_operand_shape_is_refused():
    with pytest.raises(ValueError, match=r"lhs \[M, K\] and rhs \[G, K, N\]"):
        grouped_matmul(jnp.zeros((4, 3)), jnp.zeros((2, 5, 6)), jnp.array([2, 2], jnp.int32))


MESH_SCRIPT = r'''
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from jax.experimental.pallas import tpu as pltpu
import ppo_jax.models.moe_dispatch as moe_dispatch
from ppo_jax.models.moe import SparseMoeBlock
from ppo_jax.models.tiny_random import tiny_config
from ppo_jax.parallel import make_mesh

E, D, F, B, L = 8, 32, 48, 4, 10
cfg = tiny_config(96, model_type="qwen3_moe", qk_norm=True, num_experts=E, num_experts_per_tok=2,
                  moe_intermediate_size=F, norm_topk_prob=True, sparse_layers=(True,),
                  num_layers=1, hidden_size=D)
graphdef, state = nnx.split(SparseMoeBlock(cfg, nnx.Rngs(0)))
rng = np.random.default_rng(0)
x = jnp.asarray(rng.standard_normal((B, L, D)), jnp.float32)
w = jnp.asarray(rng.standard_normal((B, L, D)), jnp.float32)
mask = np.ones((B, L), np.int32)
mask[1, :3] = 0

def loss(s, x, mesh):
    out, stats = nnx.merge(graphdef, s)(x, mask, None, mesh)
    # the replicated router statistics too: their cotangents cross the unchecked shard_map
    return jnp.sum(out * w) + jnp.sum(stats.probs * jnp.arange(E)) + jnp.sum(stats.counts)

step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), static_argnums=2)
want = step(state, x, None)
mesh = make_mesh(data=1, fsdp=2, tensor=2, devices=jax.devices()[:4])
moe_dispatch.use_megablox = lambda mesh, per_device: per_device  # as on a TPU mesh
with pltpu.force_tpu_interpret_mode():
    got = step(state, x, mesh)
jaxpr = str(jax.make_jaxpr(loss, static_argnums=2)(state, x, mesh))
assert "pallas_call[" in jaxpr and "ragged_dot" not in jaxpr
leaves = jax.tree.leaves
assert len(leaves(got)) == len(leaves(want)) == 6
for a, b in zip(leaves(got), leaves(want)):
    tol = 1e-5 * max(1.0, float(np.abs(b).max()))
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=tol)
print("ok")
'''


def test_the_moe_block_on_a_mesh_with_megablox_equals_one_device_with_ragged_dot():
    """`dispatch` on fsdp=2 x tensor=2 CPU devices, megablox forced on (interpreted), against
    the block on one device with ragged_dot: output loss and every gradient (experts, router,
    input), so the unchecked shard_map's transposes are right."""
    env = dict(os.environ, XLA_FLAGS=xla_flags(4), PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", MESH_SCRIPT], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and proc.stdout.endswith("ok\n"), out[-4000:]
