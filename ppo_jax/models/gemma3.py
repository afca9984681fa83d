"""Gemma 3 text decoder backbone (`model_type: gemma3_text`, transformers' Gemma3ForCausalLM).

What differs from the Llama family (`llama.py`), from transformers 5.25
`models/gemma3/modeling_gemma3.py` (Gemma Team 2025, "Gemma 3 Technical Report"):
- four RMSNorms per block, `(1 + w)`-scaled (`Gemma3RMSNorm`, weights stored as w, zeros at
  init): `x + post_attention_layernorm(attn(input_layernorm(x)))`, then
  `x + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))`;
- GeGLU MLP, `down(gelu_tanh(gate(x)) * up(x))` (`hidden_activation`, `llama.SwiGLU`'s form);
- token embeddings multiplied by `sqrt(hidden_size)` (`Gemma3TextScaledWordEmbedding`; the
  factor rounded to the embedding's dtype), the tied LM head reading the unscaled table;
- per-head q/k RMSNorm `(1 + w)` over head_dim before RoPE, scores scaled by
  `query_pre_attn_scalar ** -0.5`;
- local (sliding-window) and global layers from `layer_types`, each with its own RoPE table:
  the local layers `rope_local_theta` unscaled, the global ones `rope_theta` (with "linear"
  scaling on Gemma-3-4B and larger). Both tables ride in the `Context`; each layer picks by
  its scanned window (`layers.layer_rope`).
No logit soft-capping: Gemma 3 has none (`gemma3_config` refuses a config that sets it).

Param paths (layer axis first in every `layers/...` leaf), HF names as the Llama family's:
  embed_tokens/embedding [V, D]
  layers/{input_layernorm, post_attention_layernorm, pre_feedforward_layernorm,
          post_feedforward_layernorm}/scale [N, D]
  layers/attn/{q,k,v,o}_proj/kernel [N, in, out] (+ bias with attention_bias)
  layers/attn/{q,k}_norm/scale [N, head_dim]
  layers/mlp/{gate,up,down}_proj/kernel [N, in, out]   (+ lora_a / lora_b, `models.lora`)
  norm/scale [D]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ppo_jax.models.config import ModelConfig
from ppo_jax.models.kv_cache import KVCache
from ppo_jax.models.layers import (
    Context, apply_rope, attend, forward_context, layer_rope, scan_layers, stacked,
)
from ppo_jax.models.llama import SwiGLU
from ppo_jax.models.lora import linear
from ppo_jax.models.paged_cache import PagedKVCache, PagedView


class GemmaRMSNorm(nnx.Module):
    """`x / sqrt(mean(x^2) + eps) * (1 + w)`, all in float32, cast to x's dtype at the end.

    transformers `Gemma3RMSNorm`: unlike `LlamaRMSNorm` (cast, then scale), the scale is
    applied before the cast (transformers PR #29402). `scale` holds w (zeros at init), as the
    HF `weight` does."""

    def __init__(self, dim: int, eps: float, *, param_dtype):
        self.scale = nnx.Param(jnp.zeros((dim,), param_dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * (1.0 + self.scale[...].astype(jnp.float32))).astype(x.dtype)


class Gemma3Attention(nnx.Module):
    """GQA self-attention: q `[B, L, H, hd]` and k `[B, L, KVH, hd]` through a `(1 + w)`
    RMSNorm over hd, then the layer's RoPE (local or global table), scores scaled by
    `cfg.attn_scale`; the cached k is normed and rotated (transformers `Gemma3Attention`)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, hd, pd = cfg.hidden_size, cfg.head_dim, cfg.jnp_param_dtype
        qkv = dict(bias=cfg.qkv_bias, rngs=rngs)
        self.q_proj = linear(cfg, "q_proj", d, cfg.num_heads * hd, **qkv)
        self.k_proj = linear(cfg, "k_proj", d, cfg.num_kv_heads * hd, **qkv)
        self.v_proj = linear(cfg, "v_proj", d, cfg.num_kv_heads * hd, **qkv)
        self.o_proj = linear(cfg, "o_proj", cfg.num_heads * hd, d, bias=cfg.o_bias, rngs=rngs)
        self.q_norm = GemmaRMSNorm(hd, cfg.norm_eps, param_dtype=pd)
        self.k_norm = GemmaRMSNorm(hd, cfg.norm_eps, param_dtype=pd)
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, hd
        self.scale = cfg.attn_scale

    def __call__(self, x, ctx: Context, window, cache: KVCache | PagedKVCache | None, layer):
        b, l, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(b, l, self.num_heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).reshape(b, l, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).reshape(b, l, self.num_kv_heads, self.head_dim)
        cos, sin = layer_rope(ctx, window)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out, cache = attend(cache, layer, q, k, v, ctx, window, self.scale)
        return self.o_proj(out), cache


class Gemma3Block(nnx.Module):
    """One decoder layer with norms before and after attention and MLP (transformers
    `Gemma3DecoderLayer`)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        norm = lambda: GemmaRMSNorm(cfg.hidden_size, cfg.norm_eps, param_dtype=cfg.jnp_param_dtype)
        self.input_layernorm = norm()
        self.attn = Gemma3Attention(cfg, rngs)
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.mlp = SwiGLU(cfg, rngs)
        self.post_feedforward_layernorm = norm()

    def __call__(self, x, ctx: Context, window, cache: KVCache | PagedKVCache | None, layer):
        h, cache = self.attn(self.input_layernorm(x), ctx, window, cache, layer)
        x = x + self.post_attention_layernorm(h)
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        return x, cache


class Gemma3Backbone(nnx.Module):
    """Scaled embedding -> N scanned `Gemma3Block`s -> final `(1 + w)` RMSNorm.

    `__call__(input_ids [B, L] int32, attention_mask [B, S] int32, *, cache=None,
    cache_index=None, paged=None) -> (hidden [B, L, D] in cfg.dtype, cache)`, as
    `LlamaBackbone` (dense `KVCache`, or a `PagedKVCache` read through `paged`, a
    `PagedView`); `run(...)` returns `(hidden, cache, None)`: no expert routing (the MoE
    backbones' API). Positions come from the mask, so left padding does not shift them.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        if cfg.model_type != "gemma3_text":
            raise ValueError(f"Gemma3Backbone does not support model_type {cfg.model_type!r}")
        self.cfg = cfg
        self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden_size,
                                      param_dtype=cfg.jnp_param_dtype,
                                      embedding_init=nnx.initializers.normal(0.02), rngs=rngs)
        self.layers = stacked(lambda r: Gemma3Block(cfg, r), cfg.num_layers, rngs)
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.norm_eps, param_dtype=cfg.jnp_param_dtype)

    def embed(self, input_ids: jax.Array) -> jax.Array:
        """`[B, L]` ids -> `[B, L, D]` in cfg.dtype: the rows times `sqrt(hidden_size)`, that
        factor a float32 rounded to the table's dtype and the product taken in it
        (`Gemma3TextScaledWordEmbedding`: in bfloat16, sqrt(640) = 25.298 becomes 25.25)."""
        rows = self.embed_tokens(input_ids)
        factor = jnp.asarray(np.float32(self.cfg.hidden_size ** 0.5)).astype(rows.dtype)
        return (rows * factor).astype(self.cfg.jnp_dtype)

    def run(self, input_ids: jax.Array, attention_mask: jax.Array, *,
            cache: KVCache | PagedKVCache | None = None, cache_index=None,
            paged: PagedView | None = None, routes=None, mesh=None):
        """`(hidden [B, L, D], cache, None)`; `mesh` (static, None or the run's) is read by
        a no-cache call's attention kernel (`layers.make_context`). Raises ValueError:
        `routes` given (a dense model has no experts to route to), or inconsistent shapes
        (`forward_context`)."""
        if routes is not None:
            raise ValueError("routes were given to a gemma3_text backbone, which has no experts")
        cfg = self.cfg
        input_ids, ctx = forward_context(cfg, input_ids, attention_mask, cache, cache_index,
                                         paged, rope=True, mesh=mesh)
        x, cache = scan_layers(cfg, self.layers, self.embed(input_ids), ctx, cache)
        return self.norm(x), cache, None

    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array, *,
                 cache: KVCache | PagedKVCache | None = None, cache_index=None,
                 paged: PagedView | None = None, mesh=None):
        return self.run(input_ids, attention_mask, cache=cache, cache_index=cache_index,
                        paged=paged, mesh=mesh)[:2]

    def embedding_matrix(self) -> jax.Array:
        """`[V, D]` token embedding, unscaled (the tied LM head's; HF `lm_head.weight`)."""
        return self.embed_tokens.embedding[...]
