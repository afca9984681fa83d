"""The Pallas decode attention over pages (`paged_attention_tpu`): what it hands jax's
`ragged_paged_attention` gives `paged_attention_reference`, and it compiles for TPU chips.

Pallas' TPU interpret mode does not run this kernel in jax 0.10.2 (see the module docstring), so
the numbers are checked in three links: jax's own `ref_ragged_paged_attention` (the kernel's
specification) equals `paged_attention_reference`; a jittable plain-JAX stand-in of the kernel's
decode contract equals `ref_ragged_paged_attention`; and the wrapper run over that stand-in
(page-id shifts, lengths, heads, windows, mesh split) equals `paged_attention_reference`. The
kernel itself is compiled by libtpu for a v5e chip and a 2x2 slice (no TPU runs it here).

Run as a script (`python test_paged_attention_tpu.py mesh`, 8 fake CPU devices) it checks the
shard_map split over a data x fsdp x tensor mesh.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ref_ragged_paged_attention

from ppo_jax.models import paged_attention_tpu as pat
from ppo_jax.models.paged_attention_tpu import (
    BlockSizes, block_sizes, pallas_decode_attention, unsupported_reason,
)
from ppo_jax.models.heads import init_model
from ppo_jax.models.paged_cache import PagedView, init_paged_cache, paged_attention_reference
from ppo_jax.models.tiny_random import tiny_config
from tests.xla_env import xla_flags

HD, PAGE, WIDTH, PAGES = 128, 16, 4, 40  # head_dim 128: the only one the kernel takes
MIB = 2 ** 20


def _case(replicas, heads, kv_heads, dtype=jnp.float32, seed=0, rows=4):
    """Random pool, distinct random page tables (never the trash page), kv lengths from 1 to a
    full table, positions = kv_len - 1 (decode): `(q, kv, view)`."""
    rng = np.random.default_rng(seed)
    table = np.stack([rng.permutation(np.arange(1, PAGES))[:rows * WIDTH].reshape(rows, WIDTH)
                      for _ in range(replicas)]).astype(np.int32)
    lens = rng.integers(1, WIDTH * PAGE + 1, replicas * rows).astype(np.int32)
    lens[0], lens[-1] = 1, WIDTH * PAGE
    q = rng.normal(size=(replicas * rows, 1, heads, HD))
    kv = rng.normal(size=(replicas, PAGES, PAGE, 2 * kv_heads, HD))
    view = PagedView(jnp.asarray(table), jnp.asarray(lens - 1)[:, None],
                     jnp.ones((replicas * rows, 1), bool), jnp.asarray(lens))
    return jnp.asarray(q, dtype), jnp.asarray(kv, dtype), view


def _standin(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale,
             sliding_window=None, num_kv_pages_per_block, num_queries_per_block,
             vmem_limit_bytes, **_):
    """`ragged_paged_attention` for one query per sequence, in plain JAX (jittable); it reads
    the query of sequence i at `cu_q_lens[i]` and answers only the first `num_seqs` ones."""
    n, heads, hd = q.shape
    width, page_size, kv_heads = page_indices.shape[1], kv_pages.shape[1], kv_pages.shape[2] // 2
    assert 0 < num_kv_pages_per_block <= width and 0 < num_queries_per_block <= n
    assert vmem_limit_bytes >= 16 * MIB and q.dtype == kv_pages.dtype
    assert sliding_window is None or sliding_window > 0
    pages = kv_pages[page_indices].reshape(n, width * page_size, 2 * kv_heads, hd)
    k = jnp.repeat(pages[:, :, 0::2], heads // kv_heads, axis=2)
    v = jnp.repeat(pages[:, :, 1::2], heads // kv_heads, axis=2)
    qs = q[cu_q_lens[:-1]]
    scores = jnp.einsum("nhd,nkhd->nhk", qs, k, preferred_element_type=jnp.float32) * sm_scale
    j, pos = jnp.arange(width * page_size), kv_lens[:, None] - 1
    allowed = (j <= pos) & (jnp.arange(n)[:, None] < num_seqs[0])
    if sliding_window is not None:
        allowed = allowed & (pos - j < sliding_window)
    probs = jax.nn.softmax(jnp.where(allowed[:, None], scores, -1e30), axis=-1)
    return jnp.einsum("nhk,nkhd->nhd", probs.astype(v.dtype), v).astype(q.dtype)


def _one_replica_args(q, kv, view):
    s = view.page_table.shape[1]
    return (q[:s, 0], kv[0], view.kv_lens[:s], view.page_table[0],
            jnp.arange(s + 1, dtype=jnp.int32), jnp.asarray([s], jnp.int32))


@pytest.mark.parametrize("heads, kv_heads", [(8, 2), (4, 4)])
@pytest.mark.parametrize("window", [None, 20])
def test_jax_reference_kernel_equals_the_paged_reference(heads, kv_heads, window):
    q, kv, view = _case(1, heads, kv_heads)
    want = paged_attention_reference(q, kv, view, None if window is None else jnp.int32(window))
    got = ref_ragged_paged_attention(*_one_replica_args(q, kv, view), sm_scale=HD ** -0.5,
                                     sliding_window=window)
    np.testing.assert_allclose(np.asarray(got).reshape(want.shape), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 20])
def test_the_standin_is_the_kernels_decode_contract(window):
    q, kv, view = _case(1, 8, 2, seed=1)
    args = _one_replica_args(q, kv, view)
    want = ref_ragged_paged_attention(*args, sm_scale=HD ** -0.5, sliding_window=window)
    got = jax.jit(lambda *a: _standin(*a, sm_scale=HD ** -0.5, sliding_window=window,
                                      num_kv_pages_per_block=2, num_queries_per_block=4,
                                      vmem_limit_bytes=16 * MIB))(*args)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


@pytest.fixture
def standin(monkeypatch):
    """The stand-in in place of the kernel; the list of the static arguments of its calls."""
    calls = []

    def counted(*args, **kwargs):
        calls.append({k: v for k, v in kwargs.items() if k != "sm_scale"})
        return _standin(*args, **kwargs)

    monkeypatch.setattr(pat, "ragged_paged_attention", counted)
    return calls


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("heads, kv_heads, dtype, tol", [
    (8, 2, jnp.float32, 1e-5), (4, 4, jnp.float32, 1e-5), (8, 8, jnp.bfloat16, 2e-2)])
@pytest.mark.parametrize("window", [None, 20])
def test_the_decode_call_equals_the_paged_reference(standin, jit, replicas, heads, kv_heads,
                                                    dtype, tol, window):
    """bfloat16: the reference and the stand-in round probabilities to bfloat16 at different
    points, so they agree to ~1e-2."""
    q, kv, view = _case(replicas, heads, kv_heads, dtype, seed=replicas)
    fn = jax.jit(lambda *a: pallas_decode_attention(*a, window)) if jit else (
        lambda *a: pallas_decode_attention(*a, window))
    got = fn(q, kv, view)
    assert {c["sliding_window"] for c in standin} == {window}
    want = paged_attention_reference(q, kv, view, None if window is None else jnp.int32(window))
    assert got.shape == (q.shape[0], 1, heads * HD) and got.dtype == q.dtype
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               atol=tol, rtol=tol)


@pytest.mark.parametrize("window", [0, 8, 20, WIDTH * PAGE])
def test_a_traced_window_runs_the_reference_only_where_it_bites(standin, monkeypatch, window):
    q, kv, view = _case(2, 8, 2, seed=3)
    want = paged_attention_reference(q, kv, view, jnp.int32(window))
    got = jax.jit(lambda *a: pallas_decode_attention(*a))(q, kv, view, jnp.int32(window))
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    # with the reference made wrong, only a window that bites sees it
    monkeypatch.setattr(pat, "paged_attention_reference", lambda q, *a, **k: jnp.zeros_like(want))
    zeros = jax.jit(lambda *a: pallas_decode_attention(*a))(q, kv, view, jnp.int32(window))
    assert bool(np.all(np.asarray(zeros) == 0)) == (0 < window < WIDTH * PAGE)


def _decode_logits(model, kernel, steps=5, rows=3, width=2):
    """Prefill 6-token prompts into pages (reference attention), then `steps` greedy one-token
    steps with `kernel`: the logits of every step `[steps + 1, rows, V]`."""
    rng = np.random.default_rng(5)
    ids = jnp.asarray(rng.integers(4, 64, (rows, 6)), jnp.int32)
    table = jnp.asarray(np.arange(1, rows * width + 1).reshape(1, rows, width), jnp.int32)
    cache = init_paged_cache(model.cfg, 1, rows * width + 1, PAGE, jnp.float32)
    lens = np.full(rows, 6, np.int32)
    view = PagedView(table, jnp.tile(jnp.arange(6, dtype=jnp.int32), (rows, 1)),
                     jnp.ones((rows, 6), bool), jnp.asarray(lens))
    hidden, cache = model.backbone(ids, None, cache=cache, paged=view)
    logits = [model.lm_head(hidden[:, -1])]
    for t in range(steps):
        token = jnp.argmax(logits[-1], axis=-1)[:, None]
        view = PagedView(table, jnp.asarray(lens + t)[:, None], jnp.ones((rows, 1), bool),
                         jnp.asarray(lens + t + 1), kernel=kernel)
        hidden, cache = model.backbone(token, None, cache=cache, paged=view)
        logits.append(model.lm_head(hidden[:, 0]))
    return jnp.stack(logits)


@pytest.mark.parametrize("windows", [pytest.param((), marks=pytest.mark.slow), (4, 0)])  # budget
def test_a_model_decoding_through_the_kernel_gives_the_reference_logits(standin, windows):
    """Through `layers.paged_attention` (view.kernel = "pallas") inside the model's layer
    scan, where a model with sliding windows hands a traced window (4 bites from step 0)."""
    model = init_model(tiny_config(64, head_dim=HD, sliding_windows=windows), seed=2)
    got = _decode_logits(model, "pallas")
    assert standin and all(c["sliding_window"] is None for c in standin)
    want = _decode_logits(model, "reference")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["qwen3", "gemma3_text"])
def test_qwen3_and_gemma3_decode_through_the_kernel_with_their_attention_scale(
        standin, monkeypatch, family):
    """Qwen3's q/k norms, and Gemma 3's: scores scaled by `query_pre_attn_scalar ** -0.5` (the
    kernel's `sm_scale`), a local layer of window 4 (traced: the reference where it bites) with
    its own RoPE base beside a global one (the kernel)."""
    scales, counted = [], pat.ragged_paged_attention
    monkeypatch.setattr(pat, "ragged_paged_attention",
                        lambda *a, **k: scales.append(k["sm_scale"]) or counted(*a, **k))
    gemma = dict(model_type="gemma3_text", qk_norm=True, hidden_act="gelu_pytorch_tanh",
                 query_pre_attn_scalar=100.0, rope_local_theta=50.0, sliding_windows=(4, 0))
    extra = gemma if family == "gemma3_text" else dict(model_type="qwen3", qk_norm=True)
    model = init_model(tiny_config(64, head_dim=HD, **extra), seed=2)
    got = _decode_logits(model, "pallas")
    assert standin and set(scales) == {(100.0 if family == "gemma3_text" else HD) ** -0.5}
    want = _decode_logits(model, "reference")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


def test_a_row_of_length_zero_reads_nothing_and_returns_zeros(standin):
    q, kv, view = _case(1, 8, 2, seed=4)
    lens = view.kv_lens.at[1].set(0)
    got = pallas_decode_attention(q, kv, view.replace(kv_lens=lens))
    want = paged_attention_reference(q, kv, view)
    np.testing.assert_array_equal(np.asarray(got[1]), 0.0)
    keep = np.arange(q.shape[0]) != 1
    np.testing.assert_allclose(np.asarray(got)[keep], np.asarray(want)[keep], atol=1e-5)


@pytest.mark.parametrize("shape, dtype, tensor, fragment", [
    ((8, 2, 64), "float32", 1, "head_dim=64"),
    ((9, 3, 128), "bfloat16", 1, "can not be XLA fully tiled"),  # SmolLM2-135M's heads
    ((15, 5, 128), "float32", 1, "can not be XLA fully tiled"),  # SmolLM2-360M's heads
    ((8, 8, 128), "float32", 1, "neither a multiple of 8"),
    ((8, 8, 128), "float32", 2, None),  # 4 KV heads per tensor shard
    ((8, 8, 128), "bfloat16", 1, None),
    ((32, 8, 128), "float32", 1, None),
    ((8, 2, 128), "float16", 1, "not float16"),
])
def test_shapes_the_kernel_cannot_take_are_named(shape, dtype, tensor, fragment):
    reason = unsupported_reason(*shape, jnp.dtype(dtype), tensor)
    assert reason is None if fragment is None else fragment in reason


def test_an_unsupported_model_is_refused_before_tracing():
    q, kv, view = _case(1, 8, 2)
    with pytest.raises(ValueError, match="head_dim=64"):
        pallas_decode_attention(q[..., :64], kv[..., :64], view)
    with pytest.raises(ValueError, match="one token per row"):
        pallas_decode_attention(jnp.concatenate([q, q], axis=1), kv, view)


def test_block_sizes_follow_the_vmem_rule():
    # decode of 256 rows, 8 heads over 2 KV heads, 16-token pages: 16 pages a block, 16 MiB
    assert block_sizes(256, 8, 2, 128, 16, 64, jnp.bfloat16) == BlockSizes(16, 32, 16 * MIB)
    assert block_sizes(3, 8, 2, 128, 16, 2, jnp.float32) == BlockSizes(2, 3, 16 * MIB)
    # 256-token pages of 16 combined heads, 32 queries of 4 heads per KV head: q / out blocks
    # 256 KiB + f32 accumulator 256 KiB + l / m 1 MiB = 1.5 MiB; a page: 2 x 1 MiB of buffers
    # + 2 x 128 KiB of scores = 2.25 MiB; (8 - 1.5) / 2.25 -> 2 pages, 6 MiB -> the 16 MiB floor
    big = block_sizes(256, 32, 8, 128, 256, 64, jnp.bfloat16)
    assert big == BlockSizes(2, 32, 16 * MIB)


@pytest.mark.xfail(raises=(jax.errors.JaxRuntimeError, AttributeError, NotImplementedError),
                   strict=False, reason="jax 0.10.2's Pallas TPU interpreter cannot run the "
                   "kernel ('ReshapeTransform' object has no attribute 'indices')")
def test_interpret_mode_equals_the_paged_reference():
    q, kv, view = _case(1, 8, 2)
    got = pallas_decode_attention(q, kv, view, interpret=True)
    np.testing.assert_allclose(got, paged_attention_reference(q, kv, view), atol=1e-5, rtol=1e-5)


@pytest.mark.slow  # default-run budget (13 s); `make test-slow`
def test_a_mesh_split_equals_the_paged_reference():
    env = dict(os.environ, XLA_FLAGS=xla_flags(8), JAX_PLATFORMS="cpu",
               PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.run([sys.executable, str(Path(__file__)), "mesh"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("same: mesh") == 3, proc.stdout


def _mesh_check() -> None:
    """8 fake CPU devices: data 2 x fsdp 2 x tensor 2 over 4 replicas, heads split (2 KV heads)
    and replicated (1 KV head); and one replica a device over data 8; static and traced
    windows."""
    from ppo_jax.parallel.mesh import make_mesh

    pat.ragged_paged_attention = _standin
    for (data, fsdp, tensor), kv_heads in (((2, 2, 2), 2), ((2, 2, 2), 1), ((8, 1, 1), 2)):
        mesh = make_mesh(data, fsdp, tensor)
        q, kv, view = _case(data * fsdp, 8, kv_heads, seed=kv_heads)
        want = paged_attention_reference(q, kv, view, jnp.int32(20))
        view = view.replace(mesh=mesh)
        got = jax.jit(lambda *a: pallas_decode_attention(*a, 20))(q, kv, view)
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
        for window in (20, WIDTH * PAGE):  # traced: the reference, then the kernel
            got = jax.jit(lambda *a: pallas_decode_attention(*a))(q, kv, view, jnp.int32(window))
            want = paged_attention_reference(q, kv, view, jnp.int32(window))
            np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
        print(f"same: mesh {data}x{fsdp}x{tensor}, {kv_heads} KV heads")


# ------------------------------------------------------------------ compiled for TPU chips
def _abstract(mesh, replicas, rows, heads, kv_heads, pages, width, dtype, split_heads):
    """ShapeDtypeStructs of `(q, kv_layer, view)` laid out on `mesh` as the engine lays them."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    batch, h = ("data", "fsdp"), ("tensor" if split_heads else None)

    def sds(shape, dt, *spec):
        return jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, P(*spec)))

    n = replicas * rows
    view = PagedView(sds((replicas, rows, width), jnp.int32, batch),
                     sds((n, 1), jnp.int32, batch), sds((n, 1), jnp.bool_, batch),
                     sds((n,), jnp.int32, batch), kernel="pallas", mesh=mesh)
    return (sds((n, 1, heads, HD), dtype, batch, None, h),
            sds((replicas, pages, PAGE, 2 * kv_heads, HD), dtype, batch, None, None, h), view)


def _compile(mesh, args, window=None):
    with jax.set_mesh(mesh):  # the kernel's lowering reads the chip kind from the mesh
        return jax.jit(lambda *a: pallas_decode_attention(*a)).lower(*args, window).compile()


@pytest.fixture(scope="module")
def v5e_devices():
    pytest.importorskip("libtpu")
    from ppo_jax.aot.topology import resolve_slice, slice_devices

    return slice_devices(resolve_slice("v5e-4"))


# a one-device shard_map is the unmapped program: its second compile finds the first in the
# tests' persistent cache, which cannot load a topology-only executable, and compiles again
@pytest.mark.filterwarnings("ignore:Error reading persistent compilation cache")
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_the_kernel_compiles_for_a_v5e_chip(v5e_devices, dtype):
    from ppo_jax.parallel.mesh import make_mesh

    mesh = make_mesh(1, 1, 1, v5e_devices[:1])
    args = _abstract(mesh, 1, 256, 8, 2, 1025, 64, dtype, split_heads=False)
    traced = jax.ShapeDtypeStruct((), jnp.int32, sharding=args[0].sharding.update(spec=()))
    unmapped = (*args[:2], args[2].replace(mesh=None))  # no shard_map: set_mesh names the chip
    # a traced window: the kernel, or the reference where it bites
    for a, window in ((args, None), (args, traced), (unmapped, None)):
        compiled = _compile(mesh, a, window)
        assert "tpu_custom_call" in compiled.as_text()
        memory = compiled.memory_analysis()
        assert memory is not None
        assert memory.output_size_in_bytes == 256 * 8 * HD * jnp.dtype(dtype).itemsize


def test_the_kernel_compiles_for_a_2x2_slice_without_moving_pages(v5e_devices):
    """fsdp 2 x tensor 2: one replica per fsdp shard, one KV head per tensor shard; the kernel
    reads its shard's pages in place (no collective in the program)."""
    from ppo_jax.parallel.mesh import make_mesh

    mesh = make_mesh(1, 2, 2, v5e_devices)
    args = _abstract(mesh, 2, 128, 8, 2, 513, 32, jnp.bfloat16, split_heads=True)
    compiled = _compile(mesh, args)
    text = compiled.as_text()
    assert "tpu_custom_call" in text
    assert not any(c in text for c in ("all-gather", "all-reduce", "all-to-all",
                                       "collective-permute"))
    memory = compiled.memory_analysis()
    # per chip: a quarter of q's rows x heads out, a quarter of the pool in
    assert memory.output_size_in_bytes == 2 * 128 * 8 * HD * 2 // 4
    assert memory.argument_size_in_bytes >= 2 * 513 * PAGE * 4 * HD * 2 // 4


if __name__ == "__main__" and sys.argv[1:] == ["mesh"]:
    _mesh_check()
