"""Llama-family decoder backbone: Llama 2/3, Qwen2/2.5, Qwen3 (dense), Mistral, SmolLM2.

Pre-norm blocks `x + attn(rmsnorm(x))`, `x + mlp(rmsnorm(x))` with grouped-query attention,
RoPE and a SwiGLU MLP, `down(act(gate(x)) * up(x))`. Qwen2 adds optional q/k/v bias; Qwen3 a
per-head RMSNorm over head_dim on q and k before RoPE (`q_norm`, `k_norm`); Mistral and
Qwen2/3's `layer_types` add per-layer sliding windows. Source: transformers
`models/{llama,qwen2,qwen3,mistral}/modeling_*.py`; Touvron et al. 2023; Shazeer 2020 (SwiGLU).

Param paths (layer axis first in every `layers/...` leaf):
  embed_tokens/embedding [V, D]
  layers/input_layernorm/scale [N, D]      layers/post_attention_layernorm/scale [N, D]
  layers/attn/{q,k,v,o}_proj/kernel [N, in, out] (+ bias when configured)
  layers/attn/{q,k}_norm/scale [N, head_dim] (Qwen3, `cfg.qk_norm`)
  layers/mlp/{gate,up,down}_proj/kernel [N, in, out]
  .../{q,...,down}_proj/lora_a [N, in, r], lora_b [N, r, out] when LoRA is on (`models.lora`)
  norm/scale [D]
"""

from __future__ import annotations

import jax
from flax import nnx

from ppo_jax.models.config import ModelConfig
from ppo_jax.models.kv_cache import KVCache
from ppo_jax.models.paged_cache import PagedKVCache, PagedView
from ppo_jax.models.lora import linear
from ppo_jax.models.layers import (
    Context, RMSNorm, activation, apply_rope, attend, forward_context, scan_layers, stacked,
)


def _linear(cfg: ModelConfig, name: str, din: int, dout: int, bias: bool, rngs: nnx.Rngs):
    return linear(cfg, name, din, dout, bias=bias, rngs=rngs)


class LlamaAttention(nnx.Module):
    """GQA self-attention with RoPE; writes its k/v to the cache when one is given.

    With `cfg.qk_norm` (Qwen3), q `[B, L, H, hd]` and k `[B, L, KVH, hd]` go through an
    RMSNorm over hd before RoPE (HF `modeling_qwen3.Qwen3Attention`); the cached k is normed."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, hd = cfg.hidden_size, cfg.head_dim
        self.q_proj = _linear(cfg, "q_proj", d, cfg.num_heads * hd, cfg.qkv_bias, rngs)
        self.k_proj = _linear(cfg, "k_proj", d, cfg.num_kv_heads * hd, cfg.qkv_bias, rngs)
        self.v_proj = _linear(cfg, "v_proj", d, cfg.num_kv_heads * hd, cfg.qkv_bias, rngs)
        self.o_proj = _linear(cfg, "o_proj", cfg.num_heads * hd, d, cfg.o_bias, rngs)
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, hd
        if cfg.qk_norm:
            pd = cfg.jnp_param_dtype
            self.q_norm = RMSNorm(hd, cfg.norm_eps, param_dtype=pd)
            self.k_norm = RMSNorm(hd, cfg.norm_eps, param_dtype=pd)
        self.qk_norm = cfg.qk_norm

    def __call__(self, x, ctx: Context, window, cache: KVCache | None, layer):
        b, l, _ = x.shape
        q = self.q_proj(x).reshape(b, l, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(b, l, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(b, l, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, ctx.cos, ctx.sin), apply_rope(k, ctx.cos, ctx.sin)
        out, cache = attend(cache, layer, q, k, v, ctx, window)
        return self.o_proj(out), cache


class SwiGLU(nnx.Module):
    """`down_proj(act(gate_proj(x)) * up_proj(x))`, as transformers' `LlamaMLP`."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = _linear(cfg, "gate_proj", d, f, cfg.mlp_bias, rngs)
        self.up_proj = _linear(cfg, "up_proj", d, f, cfg.mlp_bias, rngs)
        self.down_proj = _linear(cfg, "down_proj", f, d, cfg.mlp_bias, rngs)
        self.act = cfg.hidden_act

    def __call__(self, x):
        return self.down_proj(activation(self.act)(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nnx.Module):
    """One pre-norm decoder layer (transformers `LlamaDecoderLayer`)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        pd = cfg.jnp_param_dtype
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps, param_dtype=pd)
        self.attn = LlamaAttention(cfg, rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps, param_dtype=pd)
        self.mlp = SwiGLU(cfg, rngs)

    def __call__(self, x, ctx: Context, window, cache: KVCache | None, layer):
        h, cache = self.attn(self.input_layernorm(x), ctx, window, cache, layer)
        x = x + h
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, cache


class LlamaBackbone(nnx.Module):
    """Embedding -> N scanned `LlamaBlock`s -> final RMSNorm.

    `__call__(input_ids [B, L] int32, attention_mask [B, S] int32, *, cache=None,
    cache_index=None, paged=None) -> (hidden [B, L, D] in cfg.dtype, cache)`; S == L without
    a cache. Over a `PagedKVCache`, `paged` (a `PagedView`) gives positions and pages and the
    mask is not read.
    Positions come from the mask, so left padding does not shift them; see
    `kv_cache.slot_layout`.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        if not cfg.is_llama_family:
            raise ValueError(f"LlamaBackbone does not support model_type {cfg.model_type!r}")
        self.cfg = cfg
        self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=cfg.jnp_dtype,
                                      param_dtype=cfg.jnp_param_dtype,
                                      embedding_init=nnx.initializers.normal(0.02), rngs=rngs)
        self.layers = stacked(lambda r: LlamaBlock(cfg, r), cfg.num_layers, rngs)
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, param_dtype=cfg.jnp_param_dtype)

    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array, *,
                 cache: KVCache | PagedKVCache | None = None, cache_index=None,
                 paged: PagedView | None = None):
        cfg = self.cfg
        input_ids, ctx = forward_context(cfg, input_ids, attention_mask, cache, cache_index,
                                         paged, rope=True)
        x = self.embed_tokens(input_ids).astype(cfg.jnp_dtype)
        x, cache = scan_layers(cfg, self.layers, x, ctx, cache)
        return self.norm(x), cache

    def run(self, input_ids, attention_mask, *, cache=None, cache_index=None, paged=None,
            routes=None):
        """`(hidden, cache, None)`: `__call__` with the routing slot of MoE backbones."""
        if routes is not None:
            raise ValueError("routes were given to a dense backbone (no MoE layer)")
        return (*self(input_ids, attention_mask, cache=cache, cache_index=cache_index,
                      paged=paged), None)

    def embedding_matrix(self) -> jax.Array:
        """`[V, D]` token embedding (used by a tied LM head)."""
        return self.embed_tokens.embedding[...]
