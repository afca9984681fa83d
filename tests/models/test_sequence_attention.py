"""The full-sequence attention kernels against the reference `dot_attention` on packed rows
(segment ids 1, 1, 2, 2, 0, ...) and left-padded 0/1 rows: jax's splash kernel in Pallas
interpret mode on CPU (values and gradients, GQA, static and traced sliding windows, a whole
model's logits), cuDNN's argument construction through `jax.nn.dot_product_attention`'s XLA
implementation, and which kernel `sequence_kernel` picks on each backend. Outputs are compared
on real queries only: a pad query reads the pads before it on the kernels and every real key
in the reference, and no loss reads it (`models.splash_attention`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ppo_jax.models import split_model
from ppo_jax.models.attention import dot_attention
from ppo_jax.models.attention_kernels import cudnn_attention, sequence_kernel
from ppo_jax.models.config import ModelConfig
from ppo_jax.models.functional import causal_lm_logits
from ppo_jax.models.heads import init_model
from ppo_jax.models.kv_cache import slot_layout
from ppo_jax.models.splash_attention import padded_length, splash_attention, splash_pattern

from hf_tiny import HF_CONFIGS
from test_segments import LENGTHS, gemma3, packed


def _mask(length: int = 150) -> jnp.ndarray:
    """Row 0 packs two segments (5:60, 60:140) between pads; row 1 is a left-padded 0/1 row."""
    mask = np.zeros((2, length), np.int32)
    mask[0, 5:60], mask[0, 60:140] = 1, 2
    mask[1, 20:] = 1
    return jnp.asarray(mask)


def _qkv(heads=4, kv_heads=2, hd=32, length=150, dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(2, length, heads, hd))
    k, v = (rng.normal(size=(2, length, kv_heads, hd)) for _ in range(2))
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


def _reference(q, k, v, mask, window=None, scale=None):
    _, allowed, q_slots, k_slots = slot_layout(mask, mask.shape[1])
    w = None if window is None else jnp.int32(window)
    return dot_attention(q, k, v, allowed, window=w, q_slots=q_slots, k_slots=k_slots,
                         scale=scale)


def _real(x, mask):
    return jnp.where((mask != 0)[..., None], x, 0)


@pytest.mark.parametrize("window", [0, 7])
def test_the_splash_pattern_is_the_slot_layout_on_real_queries(window):
    """causal & same segment ids (& window) = `slot_layout`'s allowed on every real query."""
    mask = _mask(40)
    _, allowed, q_slots, k_slots = slot_layout(mask, 40)
    if window:
        allowed = allowed & ((q_slots[:, None] - k_slots[None, :]) < window)[None]
    real = (mask != 0)[:, :, None]
    np.testing.assert_array_equal(real & splash_pattern(mask, window), real & allowed)
    assert padded_length(150) == 256 and padded_length(256) == 256


@pytest.mark.parametrize("window", [pytest.param(None, marks=pytest.mark.slow), 7])
def test_splash_equals_the_reference_on_packed_gqa_rows(window):
    """H = 4 over KVH = 2, L = 150 (padded to 256 inside), two segments and pads in row 0:
    values to 1e-5 in float32, and the gradients of a loss over real queries."""
    q, k, v = _qkv()
    mask = _mask()
    out = splash_attention(q, k, v, mask, window, interpret=True)
    ref = _reference(q, k, v, mask, window)
    np.testing.assert_allclose(_real(out, mask), _real(ref, mask), atol=2e-5)

    w = jnp.asarray(np.random.default_rng(1).normal(size=out.shape), jnp.float32)
    splash_grads = jax.grad(lambda *a: jnp.sum(_real(splash_attention(
        *a, mask, window, interpret=True), mask) * w), argnums=(0, 1, 2))(q, k, v)
    ref_grads = jax.grad(lambda *a: jnp.sum(_real(_reference(*a, mask, window), mask) * w),
                         argnums=(0, 1, 2))(q, k, v)
    for got, want in zip(splash_grads, ref_grads):
        np.testing.assert_allclose(got, want, atol=5e-5)


def test_a_traced_window_picks_the_models_static_one_under_the_meshs_shard_map():
    """Inside jit the window is traced (the layer scan's); 0 and 7 each give their reference,
    with Gemma 3's kind of scale (not hd ** -0.5), through the shard_map of a (one-device)
    mesh with the run's axes."""
    q, k, v = _qkv()
    mask = _mask()
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1, 1),
                             ("data", "fsdp", "tensor"))
    run = jax.jit(lambda w: splash_attention(q, k, v, mask, w, windows=(7, 0), scale=0.2,
                                             mesh=mesh, interpret=True))
    for window in (0, 7):
        np.testing.assert_allclose(_real(run(jnp.int32(window)), mask),
                                   _real(_reference(q, k, v, mask, window, 0.2), mask),
                                   atol=2e-5)


@pytest.mark.parametrize("window", [None, 5])
def test_cudnn_arguments_give_the_reference_through_xla(window):
    """`cudnn_attention`'s mask / is_causal / scale, run by jax's XLA implementation."""
    q, k, v = _qkv(length=64)
    mask = _mask(64)
    _, allowed, q_slots, k_slots = slot_layout(mask, 64)
    w = None if window is None else jnp.int32(window)
    out = cudnn_attention(q, k, v, allowed, w, q_slots, k_slots, scale=0.3, implementation="xla")
    np.testing.assert_allclose(_real(out, mask), _real(_reference(q, k, v, mask, window, 0.3),
                                                       mask), atol=1e-5)


@pytest.mark.parametrize("name", [pytest.param("llama_tied", marks=pytest.mark.slow),
                                  pytest.param("mistral_window", marks=pytest.mark.slow),
                                  "gemma3"])
def test_a_model_on_splash_gives_the_reference_logits_on_packed_rows(name):
    """A whole forward with `attention: splash` (interpret mode): GQA (4 over 2 heads),
    Mistral's window of 4 in every layer, Gemma 3's local / global layers and scale."""
    hf = gemma3() if name == "gemma3" else HF_CONFIGS[name]()
    cfg = ModelConfig.from_hf(hf, dtype="float32", attention="reference")
    graphdef, params = split_model(init_model(cfg, seed=1))
    splash_graphdef, _ = split_model(init_model(cfg.replace(attention="splash"), seed=1))
    ids, seg, _ = packed(LENGTHS)
    logits = jax.jit(causal_lm_logits, static_argnums=0)
    real = (seg != 0)[..., None]
    np.testing.assert_allclose(np.where(real, logits(splash_graphdef, params, ids, seg), 0),
                               np.where(real, logits(graphdef, params, ids, seg), 0),
                               atol=2e-5)


def test_auto_picks_the_reference_on_cpu_and_refuses_cudnn_there():
    shapes = dict(rows=4, length=64, num_heads=4, num_kv_heads=2, head_dim=32,
                  dtype=jnp.bfloat16)
    assert sequence_kernel("auto", None, **shapes) == "reference"
    assert sequence_kernel("splash", None, **shapes) == "splash"
    with pytest.raises(ValueError, match=r"attention='cudnn' \(model.attention\) needs a GPU"):
        sequence_kernel("cudnn", None, **shapes)
