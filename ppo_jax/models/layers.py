"""Building blocks shared by the decoders: norms, RoPE, masked GQA attention with a KV cache,
activations, per-layer remat and the scan over stacked layers.

Numerics follow transformers' PyTorch code: RMSNorm and LayerNorm are computed in float32 and
cast back (`LlamaRMSNorm`), attention softmax is in float32 (`eager_attention_forward`), RoPE
uses the `rotate_half` convention (`apply_rotary_pos_emb`). Masked scores are a large negative
finite number, so fully masked query rows stay finite.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ppo_jax.models.attention import MASK_VALUE, dot_attention  # noqa: F401 (re-exported)
from ppo_jax.models.attention_kernels import cudnn_attention, sequence_kernel
from ppo_jax.models.grouped_matmul import platform_of
from ppo_jax.models.splash_attention import splash_attention
from ppo_jax.models.config import ModelConfig
from ppo_jax.models.kv_cache import KVCache, slot_layout
from ppo_jax.models.paged_cache import (
    PagedKVCache, PagedView, paged_attention_reference, write_pages,
)

@jax.custom_jvp
def silu(x: jax.Array) -> jax.Array:
    """`x / (1 + exp(-x))`, the form PyTorch's CPU kernel evaluates.

    On XLA:CPU this is closer to the exact value than `x * logistic(x)`: on SmolLM2-135M it cuts
    the float32 logit error against a float64 reference from 1.5e-4 to 1.3e-4, and the gap to
    transformers from 1.4e-4 to 1.0e-4. The derivative is written with a stable sigmoid, so
    `exp(-x)` overflowing to inf (x < -88) gives silu = -0 and a finite gradient.
    """
    return x / (1 + jnp.exp(-x))


@silu.defjvp
def _silu_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    s = jax.nn.sigmoid(x)
    return silu(x), t * (s * (1 + x * (1 - s)))


ACTIVATIONS: dict[str, Callable] = {
    "silu": silu,
    "swish": silu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "relu": jax.nn.relu,
}


def activation(name: str) -> Callable:
    """Elementwise activation by its HF `hidden_act` / `activation_function` name. Raises ValueError."""
    if name not in ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r}; supported: {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class RMSNorm(nnx.Module):
    """`x / sqrt(mean(x^2) + eps) * scale`, with statistics in float32.

    As transformers' `LlamaRMSNorm` does, it normalises in float32, casts to the input dtype,
    then scales. Source: Zhang & Sennrich 2019."""

    def __init__(self, dim: int, eps: float, *, param_dtype, rngs: nnx.Rngs | None = None):
        del rngs
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.scale[...].astype(x.dtype) * normed.astype(x.dtype)


class LayerNorm(nnx.Module):
    """LayerNorm with scale and bias, statistics in float32 (Ba et al. 2016; torch `nn.LayerNorm`)."""

    def __init__(self, dim: int, eps: float, *, param_dtype, rngs: nnx.Rngs | None = None):
        del rngs
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype))
        self.bias = nnx.Param(jnp.zeros((dim,), param_dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
        y = y * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)
        return y.astype(x.dtype)


def rope_inv_freq(cfg: ModelConfig, local: bool = False) -> np.ndarray:
    """`[head_dim // 2]` float32 inverse frequencies `theta^(-2i/d)` (Su et al. 2021), with
    "linear" (divide by factor) or "llama3" scaling (transformers `_compute_llama3_parameters`).

    local: the sliding-window layers' table, `theta = cfg.rope_local_theta` and no scaling
    (Gemma 3's `rope_local_base_freq`, transformers `Gemma3RotaryEmbedding`)."""
    dim = cfg.head_dim
    theta = cfg.rope_local_theta if local else cfg.rope_theta
    inv = 1.0 / (np.float32(theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))
    inv = inv.astype(np.float32)
    if local:
        return inv
    if cfg.rope_type == "linear":
        inv = inv / np.float32(cfg.rope_factor)
    elif cfg.rope_type == "llama3":
        factor, lo, hi = cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
        old_len = cfg.rope_original_max_position_embeddings
        low_wl, high_wl = old_len / lo, old_len / hi
        wavelen = 2 * np.pi / inv
        scaled = np.where(wavelen > low_wl, inv / factor, inv)
        smooth = (old_len / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
        inv = np.where(medium, smoothed, scaled).astype(np.float32)
    return inv


def rope_cos_sin(cfg: ModelConfig, positions: jax.Array,
                 local: bool = False) -> tuple[jax.Array, jax.Array]:
    """positions `[B, L]` int -> cos, sin `[B, L, head_dim]` float32 (halves duplicated, HF
    layout); `local`: the sliding-window layers' table (`rope_inv_freq`)."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(rope_inv_freq(cfg, local))
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x `[B, L, H, hd]`, cos/sin `[B, L, hd]` -> rotated x (float32 math, x.dtype out)."""
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    out = x32 * cos[:, :, None, :] + rotated * sin[:, :, None, :]
    return out.astype(x.dtype)


class Context(NamedTuple):
    """Per-call tensors shared by every layer (computed once, outside the layer scan).

    positions `[B, L]`, allowed `[B, L, S]` bool, q_slots `[L]`, k_slots `[S]`,
    cos/sin `[B, L, hd]` float32 or None (GPT-2), cache_index int32 scalar; with a paged cache
    `paged` is the call's `PagedView` and allowed / q_slots / k_slots are None (the pages'
    mask follows `paged.positions` and `paged.kv_lens`). cos_local / sin_local: the
    sliding-window layers' tables when `cfg.rope_local_theta` is set (Gemma 3), else None
    (`layer_rope` picks per layer). kernel (static): the attention of a no-cache call,
    "reference", "splash" or "cudnn" (`attention_kernels.sequence_kernel`); segments: its
    `[B, S]` attention mask (the splash kernel's segment ids); mesh (static): the run's mesh or
    None; windows (static): the model's `sliding_windows`.
    """

    positions: jax.Array
    allowed: jax.Array
    q_slots: jax.Array
    k_slots: jax.Array
    cos: jax.Array | None
    sin: jax.Array | None
    cache_index: jax.Array
    paged: PagedView | None = None
    cos_local: jax.Array | None = None
    sin_local: jax.Array | None = None
    kernel: str = "reference"
    segments: jax.Array | None = None
    mesh: object = None
    windows: tuple = ()


def rope_tables(cfg: ModelConfig, positions: jax.Array, rope: bool) -> tuple:
    """`(cos, sin, cos_local, sin_local)` of `Context` for `positions [B, L]`: all None
    without RoPE (GPT-2), the local pair None without `cfg.rope_local_theta`."""
    if not rope:
        return None, None, None, None
    local = (rope_cos_sin(cfg, positions, local=True) if cfg.rope_local_theta is not None
             else (None, None))
    return (*rope_cos_sin(cfg, positions), *local)


def layer_rope(ctx: Context, window) -> tuple[jax.Array, jax.Array]:
    """The `(cos, sin)` of one layer: the local tables for a sliding-window layer (`window`, an
    int32 scalar, traced in the layer scan, > 0) when the context has them, else the global."""
    if window is None or ctx.cos_local is None:
        return ctx.cos, ctx.sin
    local = window > 0
    return jnp.where(local, ctx.cos_local, ctx.cos), jnp.where(local, ctx.sin_local, ctx.sin)


def make_context(cfg: ModelConfig, attention_mask, length: int, cache_index, rope: bool,
                 mesh=None, cached: bool = True) -> Context:
    """Positions from the mask, the attention pattern and the RoPE tables for L new tokens;
    without a cache (`cached` False) also the attention kernel (`attention_kernels`), which
    reads `mesh` (static, None or the run's)."""
    positions, allowed, q_slots, k_slots = slot_layout(attention_mask, length, cache_index)
    cos, sin, cos_local, sin_local = rope_tables(cfg, positions, rope)
    idx = jnp.asarray(0 if cache_index is None else cache_index, jnp.int32)
    kernel = "reference" if cached else sequence_kernel(
        cfg.attention, mesh, rows=attention_mask.shape[0], length=length,
        num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
        dtype=cfg.jnp_dtype)
    return Context(positions, allowed, q_slots, k_slots, cos, sin, idx, None, cos_local,
                   sin_local, kernel, attention_mask, mesh, tuple(cfg.sliding_windows))


def write_and_read_cache(cache: KVCache | None, layer, k_new, v_new, cache_index):
    """Write `[B, L, KVH, hd]` k/v at `(layer, :, cache_index)`; return this layer's full k/v.

    Without a cache the new k/v are returned as they are (S == L).
    """
    if cache is None:
        return k_new, v_new, None
    start = (layer, jnp.int32(0), cache_index, jnp.int32(0), jnp.int32(0))
    kc = jax.lax.dynamic_update_slice(cache.k, k_new[None].astype(cache.k.dtype), start)
    vc = jax.lax.dynamic_update_slice(cache.v, v_new[None].astype(cache.v.dtype), start)
    return kc[layer], vc[layer], KVCache(kc, vc)


def paged_attention(q: jax.Array, cache: PagedKVCache, layer, view: PagedView, window=None,
                    scale: float | None = None):
    """Attention of `q [R * S, L, H, hd]` over layer `layer`'s pages: jax's Pallas
    `ragged_paged_attention` (TPU; a token-major pool) when `view.kernel == "pallas"` and the
    call decodes one token per row, else `paged_cache.paged_attention_reference`; scores
    scaled by `scale` (None: `hd ** -0.5`). `[R * S, L, H * hd]` out."""
    if view.kernel == "pallas" and q.shape[1] == 1 and not cache.head_major:
        from ppo_jax.models.paged_attention_tpu import pallas_decode_attention  # TPU only

        return pallas_decode_attention(q, cache.kv[layer], view, window, scale=scale)
    return paged_attention_reference(q, cache.kv[layer], view, window, cache.head_major,
                                     scale=scale)


def sequence_attention(q, k, v, ctx: Context, window=None, scale: float | None = None):
    """A no-cache call's attention on `ctx.kernel`: the splash kernel over the mask's segment
    ids (Pallas interpret mode off TPU) or cuDNN; `[B, L, H * hd]` out (`attention_kernels`)."""
    if ctx.kernel == "splash":
        return splash_attention(q, k, v, ctx.segments, window, windows=ctx.windows, scale=scale,
                                mesh=ctx.mesh, interpret=platform_of(ctx.mesh) != "tpu")
    return cudnn_attention(q, k, v, ctx.allowed, window, ctx.q_slots, ctx.k_slots, scale=scale)


def attend(cache, layer, q, k, v, ctx: Context, window=None, scale: float | None = None):
    """Write this call's `k, v [B, L, KVH, hd]` to the cache and attend `q [B, L, H, hd]` over
    it: the dense `KVCache` (or none) through `dot_attention`, a `PagedKVCache` through
    `paged_attention`, a no-cache call on `ctx.kernel` (`sequence_attention`) unless it is the
    reference; scores scaled by `scale` (None: `hd ** -0.5`; Gemma 3 passes
    `cfg.attn_scale`). Returns `(out [B, L, H * hd], cache)`."""
    if isinstance(cache, PagedKVCache):
        cache = write_pages(cache, layer, ctx.paged, k, v)
        return paged_attention(q, cache, layer, ctx.paged, window, scale), cache
    if cache is None and ctx.kernel != "reference":
        return sequence_attention(q, k, v, ctx, window, scale), None
    k_all, v_all, cache = write_and_read_cache(cache, layer, k, v, ctx.cache_index)
    out = dot_attention(q, k_all.astype(q.dtype), v_all.astype(q.dtype), ctx.allowed,
                        window=window, q_slots=ctx.q_slots, k_slots=ctx.k_slots, scale=scale)
    return out, cache


def remat_layer(fn: Callable, remat: str) -> Callable:
    """Wrap a per-layer function in `jax.checkpoint` according to `ModelConfig.remat`."""
    if remat == "none":
        return fn
    policy = None if remat == "full" else getattr(jax.checkpoint_policies, remat)
    return jax.checkpoint(fn, policy=policy, prevent_cse=False)


def stacked(make_layer: Callable[[nnx.Rngs], nnx.Module], num_layers: int, rngs: nnx.Rngs):
    """Create `num_layers` layers as ONE module whose params have a leading layer axis."""

    @nnx.split_rngs(splits=num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(r):
        return make_layer(r)

    return make(rngs)


def scan_layers(cfg: ModelConfig, layers: nnx.Module, x: jax.Array, ctx: Context,
                cache: KVCache | None):
    """Run stacked `layers` over `x` with `jax.lax.scan`; compile time does not grow with depth.

    Each layer is called as `layer(x, ctx, window, cache, layer_index) -> (x, cache)`; the full
    cache rides in the carry so each step writes only its new slots in place. Returns (x, cache).
    """
    def call(layer, h, window, c, index, _):
        return (*layer(h, ctx, window, c, index), None)

    x, cache, _ = scan_layer_run(cfg, layers, x, cache, call)
    return x, cache


def scan_layer_run(cfg: ModelConfig, layers: nnx.Module, x: jax.Array, cache, call: Callable,
                   first: int = 0, per_layer=None):
    """Run a stack of n layers, decoder layers `[first, first + n)`, with `jax.lax.scan`.

    `call(layer, x, window, cache, layer_index, per_layer_slice) -> (x, cache, out)` runs one
    merged layer; `per_layer` is None or a pytree whose leaves have the layer axis first (the
    replayed routes of a run of sparse layers). Each layer is wrapped in `cfg.remat`. Returns
    `(x, cache, outs)`, the outs stacked along a leading layer axis.
    """
    graphdef, state = nnx.split(layers)
    n = jax.tree_util.tree_leaves(state)[0].shape[0]
    windows = jnp.asarray(cfg.sliding_windows[first:first + n] or (0,) * n, jnp.int32)
    use_window = bool(cfg.sliding_windows)

    def body(carry, xs):
        h, c = carry
        layer_state, window, index, extra = xs
        layer = nnx.merge(graphdef, layer_state)
        h, c, out = call(layer, h, window if use_window else None, c, index, extra)
        return (h, c), out

    body = remat_layer(body, cfg.remat)
    xs = (state, windows, jnp.arange(first, first + n, dtype=jnp.int32), per_layer)
    (x, cache), outs = jax.lax.scan(body, (x, cache), xs)
    return x, cache, outs


def forward_context(cfg: ModelConfig, input_ids, attention_mask, cache, cache_index,
                    paged: PagedView | None, rope: bool, mesh=None):
    """`(input_ids int32, ctx)` of one backbone call: checked (`check_inputs`) with positions
    from the attention mask, or, over a `PagedKVCache`, with positions from `paged` (the
    attention mask is not read). mesh: the run's (static), for a no-cache call's attention
    kernel. Raises ValueError on inconsistent shapes."""
    if paged is None:
        input_ids, attention_mask = check_inputs(input_ids, attention_mask, cache, cache_index)
        return input_ids, make_context(cfg, attention_mask, input_ids.shape[1], cache_index, rope,
                                       mesh, cached=cache is not None)
    input_ids = jnp.asarray(input_ids, jnp.int32)
    if not isinstance(cache, PagedKVCache) or paged.positions.shape != input_ids.shape:
        raise ValueError(f"a PagedView needs a PagedKVCache and positions {paged.positions.shape}"
                         f" shaped like input_ids {input_ids.shape}")
    cos, sin, cos_local, sin_local = rope_tables(cfg, paged.positions, rope)
    return input_ids, Context(paged.positions, None, None, None, cos, sin, jnp.int32(0), paged,
                              cos_local, sin_local)


def check_inputs(input_ids, attention_mask, cache, cache_index):
    """Shape checks shared by the backbones. Raises ValueError with the offending shapes."""
    if input_ids.ndim != 2 or attention_mask.ndim != 2:
        raise ValueError(f"input_ids {input_ids.shape} and attention_mask {attention_mask.shape} "
                         "must both be [B, L] / [B, S]")
    if cache is None and attention_mask.shape != input_ids.shape:
        raise ValueError(f"without a cache attention_mask {attention_mask.shape} must match "
                         f"input_ids {input_ids.shape}")
    if cache is not None:
        if cache_index is None:
            raise ValueError("cache_index is required when a cache is given")
        if attention_mask.shape[1] != cache.k.shape[2]:
            raise ValueError(f"attention_mask {attention_mask.shape} must cover all "
                             f"{cache.k.shape[2]} cache slots")
    return jnp.asarray(input_ids, jnp.int32), jnp.asarray(attention_mask, jnp.int32)
