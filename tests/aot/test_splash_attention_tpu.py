"""The splash attention path compiled for TPU on this CPU host (`aot.topology` devices): a
model's backbone gradient over a v5p mesh (rows over data, heads over tensor) runs jax's
splash kernels, forward and both backward kernels, segmented, under the shard_map; and
`sequence_kernel` picks splash for a TPU mesh only where the kernel takes the call."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from ppo_jax.aot.topology import resolve_slice, slice_devices
from ppo_jax.models import split_model
from ppo_jax.models.attention_kernels import sequence_kernel
from ppo_jax.models.config import ModelConfig
from ppo_jax.models.heads import init_model
from ppo_jax.models.tiny_random import tiny_config
from ppo_jax.rollout.forward import policy_logprobs
from ppo_jax.rollout.packing import PackedRows

pytest.importorskip("libtpu")

SPLASH = {"splash_mha_fwd_segmented_residuals", "splash_mha_dq_segmented_no_residuals",
          "splash_mha_dkv_segmented_no_residuals"}


@functools.lru_cache(maxsize=None)
def _mesh(name: str = "v5p-8", shape=(2, 1, 2)):
    devices = np.asarray(slice_devices(resolve_slice(name))).reshape(shape)
    return jax.sharding.Mesh(devices, ("data", "fsdp", "tensor"))


def _kernels(cfg: ModelConfig, mesh, rows: int = 4, length: int = 200) -> set[str]:
    """The splash kernel names in the compiled gradient of a backbone pass."""
    graphdef, params = split_model(nnx.eval_shape(lambda: init_model(cfg, seed=0)))
    rep = NamedSharding(mesh, P())
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep), params)
    ids = jax.ShapeDtypeStruct((rows, length), jnp.int32,
                               sharding=NamedSharding(mesh, P(("data", "fsdp"))))

    def loss(params, ids, mask):
        hidden = nnx.merge(graphdef, params).backbone.run(ids, mask, mesh=mesh)[0]
        return jnp.sum(hidden.astype(jnp.float32))

    text = jax.jit(jax.grad(loss)).trace(params, ids, ids).lower().compile().as_text()
    return set(re.findall(r"splash_mha_[a-z_]+", text))


@pytest.mark.slow  # ~5 s each; the packed policy gradient below covers the window-less case
@pytest.mark.parametrize("window", [(), (0, 4)])
def test_a_backbone_gradient_compiles_with_the_splash_kernels_under_the_shard_map(window):
    """tiny-random Llama (4 heads over 2 KV heads, head_dim 16) in bfloat16, L = 200 (padded to
    256 in the kernel), with and without per-layer sliding windows (traced in the scan)."""
    cfg = tiny_config(96).replace(dtype="bfloat16", sliding_windows=window)
    assert _kernels(cfg, _mesh()) == SPLASH


def test_the_packed_policy_gradient_compiles_with_the_splash_kernels():
    """`ppo.packing`'s pass for TPU: 8 rows of prompt 64 + response 136 packed into 2 shards x
    4 rows of 200 slots (the widest plan: as many packed rows as padded ones), the actor's
    log-prob gradient over them on the v5p mesh runs the splash kernels."""
    mesh = _mesh()
    rep, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P(("data", "fsdp")))
    cfg = tiny_config(96, dtype="bfloat16")
    graphdef, params = split_model(nnx.eval_shape(lambda: init_model(cfg, seed=0)))
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep), params)
    batch, prompt, new, shards = 8, 64, 136, 2

    def ids(shape, sharding=rows):
        return jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding)

    per = batch // shards
    plan = PackedRows(src=ids((shards, per, prompt + new), rep),
                      segments=ids((shards, per, prompt + new), rep),
                      dst=ids((shards, per, new), rep))

    def loss(params, q, qm, r, rm, plan):
        return jnp.sum(policy_logprobs(graphdef, params, q, qm, r, rm, mesh=mesh, packing=plan))

    args = (params, ids((batch, prompt)), ids((batch, prompt)), ids((batch, new)),
            ids((batch, new)), plan)
    text = jax.jit(jax.grad(loss)).trace(*args).lower().compile().as_text()
    assert set(re.findall(r"splash_mha_[a-z_]+", text)) == SPLASH


@pytest.mark.slow  # ~4 s
def test_the_reference_keeps_the_einsum_path():
    cfg = tiny_config(96).replace(dtype="bfloat16", attention="reference")
    assert _kernels(cfg, _mesh()) == set()


def test_auto_picks_splash_on_a_tpu_mesh_where_the_kernel_takes_the_call():
    mesh = _mesh()
    shapes = dict(length=200, num_heads=4, num_kv_heads=2, head_dim=64)
    assert sequence_kernel("auto", mesh, rows=4, dtype=jnp.bfloat16, **shapes) == "splash"
    assert sequence_kernel("auto", mesh, rows=4, dtype=jnp.float32, **shapes) == "splash"
    # 3 rows do not split over data = 2; float16 is not a kernel dtype
    assert sequence_kernel("auto", mesh, rows=3, dtype=jnp.bfloat16, **shapes) == "reference"
    assert sequence_kernel("auto", mesh, rows=4, dtype=jnp.float16, **shapes) == "reference"
    assert sequence_kernel("auto", mesh, rows=4, dtype=jnp.bfloat16,
                           **dict(shapes, head_dim=300)) == "reference"


@pytest.mark.parametrize("rows", [4, 2])
def test_the_flop_counters_count_the_splash_kernels_at_their_dense_bound(rows):
    """The gradient of `splash_attention` over `rows` rows of L = 200 (256 in the kernel), 4
    heads of 64 over 2 KV heads, split (data 2, tensor 2): forward 2, dq 3 and dkv 4 matmuls
    of `[256, 256] x 64` per head, `2 * 9 * rows * 4 * 256 * 256 * 64` in all (jaxpr walk), a
    quarter of it per chip (HLO walk). With 2 rows each chip's kernels see one row, which
    Pallas' batching squeezes out of their operands."""
    from ppo_jax.aot.flops import jaxpr_matmul_flops
    from ppo_jax.aot.hlo_cost import program_costs
    from ppo_jax.models.splash_attention import splash_attention

    mesh = _mesh()
    rep = NamedSharding(mesh, P())

    def loss(q, k, v, mask):
        return jnp.sum(splash_attention(q, k, v, mask, None, mesh=mesh).astype(jnp.float32))

    args = [jax.ShapeDtypeStruct(s, d, sharding=rep) for s, d in (
        ((rows, 200, 4, 64), jnp.bfloat16), ((rows, 200, 2, 64), jnp.bfloat16),
        ((rows, 200, 2, 64), jnp.bfloat16), ((rows, 200), jnp.int32))]
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    want = 2 * 9 * rows * 4 * 256 * 256 * 64
    di = 2 * rows * 4 * 256 * 64  # the backward's rowsum(o * do), an einsum outside the kernels
    assert jaxpr_matmul_flops(jax.make_jaxpr(grad)(*args))[0] == want + di
    compiled = grad.trace(*args).lower().compile()
    assert program_costs(compiled.as_text()).matmul_flops == want / 4


@pytest.mark.slow  # ~110 s on 2 loaded cores
@pytest.mark.parametrize("chip", ["v4-8", "v5e-8", "v5p-8", "v6e-8"])
@pytest.mark.parametrize("dtype,head_dim,heads,kv_heads", [
    (jnp.float32, 256, 8, 4), (jnp.bfloat16, 256, 8, 4), (jnp.float32, 128, 16, 16),
    (jnp.bfloat16, 64, 9, 3)])
def test_the_512_blocks_fit_each_chips_vmem(chip, dtype, head_dim, heads, kv_heads):
    """L = 1024 takes 512-wide q and kv blocks; forward and gradient compile on every chip
    (Mosaic checks the kernels' scoped VMEM), float32 head_dim 256 included."""
    from ppo_jax.models.splash_attention import splash_attention

    one = jax.sharding.SingleDeviceSharding(slice_devices(resolve_slice(chip))[0])

    def loss(q, k, v, mask):
        return jnp.sum(splash_attention(q, k, v, mask, None).astype(jnp.float32))

    args = [jax.ShapeDtypeStruct(s, d, sharding=one) for s, d in (
        ((2, 1024, heads, head_dim), dtype), ((2, 1024, kv_heads, head_dim), dtype),
        ((2, 1024, kv_heads, head_dim), dtype), ((2, 1024), jnp.int32))]
    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(*args).lower().compile().as_text()
    assert set(re.findall(r"splash_mha_[a-z_]+", text)) == SPLASH
