"""GPT-2 backbone: learned absolute positions, pre-LayerNorm blocks, gelu_new MLP.

Positions are `max(cumsum(mask) - 1, 0)` of the attention mask, so left padding does not shift
them; HF GPT-2 uses `arange` unless `position_ids` is passed. Kernels keep the HF
`Conv1D` layout `[in, out]` (no transpose on load). Source: transformers
`models/gpt2/modeling_gpt2.py`; Radford et al. 2019.

Param paths (layer axis first in every `layers/...` leaf):
  wte/embedding [V, D]   wpe/embedding [P, D]
  layers/ln_1/{scale,bias} [N, D]   layers/attn/c_attn/{kernel [N, D, 3D], bias}
  layers/attn/c_proj/{kernel, bias}  layers/ln_2/{scale,bias}
  layers/mlp/c_fc/{kernel [N, D, F], bias}  layers/mlp/c_proj/{kernel [N, F, D], bias}
  ln_f/{scale,bias} [D]
  .../{c_attn,c_proj,c_fc}/lora_a [N, in, r], lora_b [N, r, out] when LoRA is on (`models.lora`)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ppo_jax.models.config import ModelConfig
from ppo_jax.models.kv_cache import KVCache
from ppo_jax.models.paged_cache import PagedKVCache, PagedView
from ppo_jax.models.lora import linear
from ppo_jax.models.layers import (
    Context, LayerNorm, activation, attend, forward_context, scan_layers, stacked,
)


def _linear(cfg: ModelConfig, name: str, din: int, dout: int, rngs: nnx.Rngs):
    return linear(cfg, name, din, dout, bias=True, rngs=rngs)


class GPT2Attention(nnx.Module):
    """Fused-qkv multi-head attention (`c_attn` -> split q, k, v; `c_proj` out)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d = cfg.hidden_size
        self.c_attn = _linear(cfg, "c_attn", d, 3 * d, rngs)
        self.c_proj = _linear(cfg, "c_proj", d, d, rngs)
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim

    def __call__(self, x, ctx: Context, window, cache: KVCache | None, layer):
        b, l, d = x.shape
        q, k, v = jnp.split(self.c_attn(x), 3, axis=-1)
        shape = (b, l, self.num_heads, self.head_dim)
        q, k, v = q.reshape(shape), k.reshape(shape), v.reshape(shape)
        out, cache = attend(cache, layer, q, k, v, ctx)
        return self.c_proj(out), cache


class GPT2MLP(nnx.Module):
    """`c_proj(act(c_fc(x)))` with act = gelu_new by default."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.c_fc = _linear(cfg, "c_fc", cfg.hidden_size, cfg.intermediate_size, rngs)
        self.c_proj = _linear(cfg, "c_proj", cfg.intermediate_size, cfg.hidden_size, rngs)
        self.act = cfg.hidden_act

    def __call__(self, x):
        return self.c_proj(activation(self.act)(self.c_fc(x)))


class GPT2Block(nnx.Module):
    """`x + attn(ln_1(x))`, then `x + mlp(ln_2(x))`, as transformers' `GPT2Block`."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        pd = cfg.jnp_param_dtype
        self.ln_1 = LayerNorm(cfg.hidden_size, cfg.norm_eps, param_dtype=pd)
        self.attn = GPT2Attention(cfg, rngs)
        self.ln_2 = LayerNorm(cfg.hidden_size, cfg.norm_eps, param_dtype=pd)
        self.mlp = GPT2MLP(cfg, rngs)

    def __call__(self, x, ctx: Context, window, cache: KVCache | None, layer):
        del window
        h, cache = self.attn(self.ln_1(x), ctx, None, cache, layer)
        x = x + h
        x = x + self.mlp(self.ln_2(x))
        return x, cache


class GPT2Backbone(nnx.Module):
    """Token + position embedding -> N scanned `GPT2Block`s -> `ln_f`.

    `__call__(input_ids [B, L] int32, attention_mask [B, S] int32, *, cache=None,
    cache_index=None, paged=None) -> (hidden [B, L, D] in cfg.dtype, cache)`; over a
    `PagedKVCache`, `paged` (a `PagedView`) gives positions and pages. Positions past
    `max_position_embeddings - 1` are clipped to the last row of the position table.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        if cfg.model_type != "gpt2":
            raise ValueError(f"GPT2Backbone does not support model_type {cfg.model_type!r}")
        self.cfg = cfg
        kw = dict(dtype=cfg.jnp_dtype, param_dtype=cfg.jnp_param_dtype,
                  embedding_init=nnx.initializers.normal(0.02), rngs=rngs)
        self.wte = nnx.Embed(cfg.vocab_size, cfg.hidden_size, **kw)
        self.wpe = nnx.Embed(cfg.max_position_embeddings, cfg.hidden_size, **kw)
        self.layers = stacked(lambda r: GPT2Block(cfg, r), cfg.num_layers, rngs)
        self.ln_f = LayerNorm(cfg.hidden_size, cfg.norm_eps, param_dtype=cfg.jnp_param_dtype)

    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array, *,
                 cache: KVCache | PagedKVCache | None = None, cache_index=None,
                 paged: PagedView | None = None, mesh=None):
        cfg = self.cfg  # mesh: read by a no-cache call's attention kernel (layers.make_context)
        input_ids, ctx = forward_context(cfg, input_ids, attention_mask, cache, cache_index,
                                         paged, rope=False, mesh=mesh)
        positions = jnp.minimum(ctx.positions, cfg.max_position_embeddings - 1)
        x = self.wte(input_ids) + self.wpe(positions)
        x, cache = scan_layers(cfg, self.layers, x.astype(cfg.jnp_dtype), ctx, cache)
        return self.ln_f(x), cache

    def run(self, input_ids: jax.Array, attention_mask: jax.Array, *,
            cache: KVCache | PagedKVCache | None = None, cache_index=None,
            paged: PagedView | None = None, routes=None, mesh=None):
        """`(hidden, cache, None)`: `__call__` in the form MoE backbones share (`models.moe`);
        a dense model has no routing, `routes` must be None and `mesh` is unused."""
        if routes is not None:
            raise ValueError("routes were given to a dense gpt2 backbone (no MoE layer)")
        return (*self(input_ids, attention_mask, cache=cache, cache_index=cache_index,
                      paged=paged), None)

    def embedding_matrix(self) -> jax.Array:
        """`[V, D]` token embedding (the tied LM head)."""
        return self.wte.embedding[...]
