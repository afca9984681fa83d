"""Llama-family decoder backbone: Llama 2/3, Qwen2/2.5, Qwen3 (dense and MoE), Mistral, SmolLM2.

Pre-norm blocks `x + attn(rmsnorm(x))`, `x + mlp(rmsnorm(x))` with grouped-query attention,
RoPE and a SwiGLU MLP, `down(act(gate(x)) * up(x))`. Qwen2 adds optional q/k/v bias; Qwen3 a
per-head RMSNorm over head_dim on q and k before RoPE (`q_norm`, `k_norm`); Mistral and
Qwen2/3's `layer_types` add per-layer sliding windows. Qwen3-MoE replaces the MLP of its
sparse layers (`cfg.sparse_layers`) by the mixture of experts of `models.moe`. Source:
transformers `models/{llama,qwen2,qwen3,qwen3_moe,mistral}/modeling_*.py`; Touvron et al.
2023; Shazeer 2020 (SwiGLU).

Param paths (layer axis first in every `layers/...` leaf):
  embed_tokens/embedding [V, D]
  layers/input_layernorm/scale [N, D]      layers/post_attention_layernorm/scale [N, D]
  layers/attn/{q,k,v,o}_proj/kernel [N, in, out] (+ bias when configured)
  layers/attn/{q,k}_norm/scale [N, head_dim] (Qwen3, `cfg.qk_norm`)
  layers/mlp/{gate,up,down}_proj/kernel [N, in, out]
  .../{q,...,down}_proj/lora_a [N, in, r], lora_b [N, r, out] when LoRA is on (`models.lora`)
  norm/scale [D]
A sparse layer's MLP is `mlp/gate/kernel [N, D, E]` and `mlp/experts/{gate,up,down}_proj
[N, E, ...]` (`models.moe`). A model whose layers are all dense or all sparse keeps the one
`layers/` stack; a mixed one stacks each run of same-kind layers as `layers_{first}/`
(`ModelConfig.layer_runs`), e.g. `layers_0/` (dense layer 0) and `layers_1/` (sparse 1..N-1).
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
    Context, RMSNorm, activation, apply_rope, attend, forward_context, scan_layer_run, stacked,
)
from ppo_jax.models.moe import Routing, SparseMoeBlock, load_balancing_loss


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
    """One pre-norm decoder layer (transformers `LlamaDecoderLayer`); `mlp` is its MLP class."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, mlp=SwiGLU):
        pd = cfg.jnp_param_dtype
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps, param_dtype=pd)
        self.attn = LlamaAttention(cfg, rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps, param_dtype=pd)
        self.mlp = mlp(cfg, rngs)

    def __call__(self, x, ctx: Context, window, cache: KVCache | None, layer):
        h, cache = self.attn(self.input_layernorm(x), ctx, window, cache, layer)
        x = x + h
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, cache


class LlamaMoeBlock(LlamaBlock):
    """A sparse decoder layer: the MLP is a `SparseMoeBlock` (transformers
    `Qwen3MoeDecoderLayer` on a sparse layer). Also takes `token_mask [B, L]`, `routes`
    (None or `[B, L, k]`) and a static `mesh` (None or a `Mesh`: see `SparseMoeBlock`) and
    returns `(x, cache, RouterStats)`."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        super().__init__(cfg, rngs, mlp=SparseMoeBlock)

    def __call__(self, x, ctx: Context, window, cache, layer, token_mask, routes=None,
                 mesh=None):
        h, cache = self.attn(self.input_layernorm(x), ctx, window, cache, layer)
        x = x + h
        y, stats = self.mlp(self.post_attention_layernorm(x), token_mask, routes, mesh)
        return x + y, cache, stats


class LlamaBackbone(nnx.Module):
    """Embedding -> N scanned decoder layers -> final RMSNorm.

    `__call__(input_ids [B, L] int32, attention_mask [B, S] int32, *, cache=None,
    cache_index=None, paged=None, mesh=None) -> (hidden [B, L, D] in cfg.dtype, cache)`; S == L
    without a cache. Over a `PagedKVCache`, `paged` (a `PagedView`) gives positions and pages
    and the mask is not read. `run(..., routes=None)` also returns the MoE `Routing` (None for
    a dense model). `mesh` (static, None or a `jax.sharding.Mesh`; over pages `paged.mesh` when
    None) makes each device compute the experts of its own rows (`moe_dispatch`) and picks a
    no-cache call's attention kernel (`layers.make_context`). Positions come from the mask, so left padding does not shift them; see
    `kv_cache.slot_layout`.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        if not cfg.is_llama_family:
            raise ValueError(f"LlamaBackbone does not support model_type {cfg.model_type!r}")
        self.cfg = cfg
        self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=cfg.jnp_dtype,
                                      param_dtype=cfg.jnp_param_dtype,
                                      embedding_init=nnx.initializers.normal(0.02), rngs=rngs)
        for run in cfg.layer_runs:
            block = LlamaMoeBlock if run.sparse else LlamaBlock
            setattr(self, run.name,
                    stacked(lambda r, b=block: b(cfg, r), run.stop - run.first, rngs))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, param_dtype=cfg.jnp_param_dtype)

    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array, *,
                 cache: KVCache | PagedKVCache | None = None, cache_index=None,
                 paged: PagedView | None = None, mesh=None):
        return self.run(input_ids, attention_mask, cache=cache, cache_index=cache_index,
                        paged=paged, mesh=mesh)[:2]

    def run(self, input_ids: jax.Array, attention_mask: jax.Array, *,
            cache: KVCache | PagedKVCache | None = None, cache_index=None,
            paged: PagedView | None = None, routes: jax.Array | None = None, mesh=None):
        """`__call__` that also returns the routing: `(hidden [B, L, D], cache, Routing |
        None)`. routes: None, or int32 `[B, L, M, k]` (M = `cfg.num_moe_layers`), the experts
        each token uses at each sparse layer; a token/layer with `routes[..., 0] < 0` is routed
        by the router. mesh: see the class docstring. Raises ValueError on inconsistent shapes,
        routes on a dense model, or a mesh without the axes of `parallel.make_mesh`."""
        cfg = self.cfg
        input_ids, ctx = forward_context(cfg, input_ids, attention_mask, cache, cache_index,
                                         paged, rope=True, mesh=mesh)
        x = self.embed_tokens(input_ids).astype(cfg.jnp_dtype)
        routes = _check_routes(cfg, routes, input_ids.shape)
        mask = _token_mask(attention_mask, input_ids.shape, cache_index, paged)
        mesh = paged.mesh if mesh is None and paged is not None else mesh

        def dense(layer, h, window, c, index, _):
            return (*layer(h, ctx, window, c, index), None)

        def sparse(layer, h, window, c, index, r):
            return layer(h, ctx, window, c, index, mask, r, mesh)

        stats, moe = [], 0
        for run in cfg.layer_runs:
            n = run.stop - run.first
            part = None if routes is None or not run.sparse else routes[moe:moe + n]
            x, cache, out = scan_layer_run(cfg, getattr(self, run.name), x, cache,
                                           sparse if run.sparse else dense, run.first, part)
            if run.sparse:
                stats.append(out)
                moe += n
        return self.norm(x), cache, _routing(stats, mask) if stats else None

    def embedding_matrix(self) -> jax.Array:
        """`[V, D]` token embedding (used by a tied LM head)."""
        return self.embed_tokens.embedding[...]


def _check_routes(cfg: ModelConfig, routes, shape) -> jax.Array | None:
    """routes `[B, L, M, k]` -> `[M, B, L, k]` int32 (the scan's layer axis first), or None."""
    if routes is None:
        return None
    want = (*shape, cfg.num_moe_layers, cfg.num_experts_per_tok)
    if not cfg.num_moe_layers or tuple(routes.shape) != want:
        raise ValueError(f"routes has shape {tuple(routes.shape)}; this {cfg.model_type} model "
                         f"takes [B, L, num_moe_layers, num_experts_per_tok] = {want}"
                         + ("" if cfg.num_moe_layers else " (it has no sparse layer)"))
    return jnp.moveaxis(jnp.asarray(routes, jnp.int32), 2, 0)


def _token_mask(attention_mask, shape, cache_index, paged) -> jax.Array:
    """`[B, L]` float32: 1 for the call's real tokens (the new tokens' slots of the mask, 0/1 or
    a packed row's segment ids), all ones over a paged cache, which reads no mask."""
    if paged is not None:
        return jnp.ones(shape, jnp.float32)
    mask = jnp.asarray(attention_mask)
    start = jnp.asarray(0 if cache_index is None else cache_index, jnp.int32)
    return (jax.lax.dynamic_slice_in_dim(mask, start, shape[1], axis=1) != 0).astype(jnp.float32)


def _routing(stats, mask) -> Routing:
    """The call's `Routing` from each sparse run's stacked `RouterStats` (layer axis first)."""
    experts = jnp.concatenate([s.experts for s in stats], axis=0)  # [M, B, L, k]
    counts = sum(jnp.sum(s.counts, axis=0) for s in stats)
    probs = sum(jnp.sum(s.probs, axis=0) for s in stats)
    rows = experts.shape[0] * jnp.sum(mask)
    return Routing(jnp.moveaxis(experts, 0, 2), load_balancing_loss(counts, probs, rows))
