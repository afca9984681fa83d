"""The sparse mixture-of-experts MLP of Qwen3-MoE: a softmax router, top-k experts computed as a
grouped matmul, router replay, and the load-balancing loss.

Per token x `[D]`: `p = softmax(x W_gate)` over E experts (float32), the k largest `p_e` are
the token's experts and their probabilities its gate values (divided by their sum when
`norm_topk_prob`); the output is `sum_e g_e * down_e(act(gate_e(x)) * up_e(x))`. Source:
transformers `models/qwen3_moe/modeling_qwen3_moe.py` (`Qwen3MoeTopKRouter`,
`Qwen3MoeExperts`, `Qwen3MoeSparseMoeBlock`); Shazeer et al. 2017 (top-k gating).

The experts run as one grouped matmul (`jax.lax.ragged_dot`, or megablox's kernels on TPU:
`models.grouped_matmul`) over the T*k (token, expert) rows sorted by expert: every row is
computed, no token is dropped, there is no capacity factor.
Shapes stay static under jit (the group sizes are data, the row count is T*k). On a mesh each
device routes and runs its own rows (`models.moe_dispatch`, which holds `expert_ffn`).

Router replay ("R3": verl, NeMo-RL, slime): `routes [..., k]` gives each token's experts; the
gate values are still the router's probabilities gathered at those experts (renormalised when
`norm_topk_prob`), so the router gets its gradient. A token whose `routes[..., 0] < 0` is
routed by the router.

Param paths under a sparse layer's `mlp/` (layer axis first when stacked):
  gate/kernel [D, E]              the router (HF `mlp.gate.weight` [E, D] transposed)
  experts/gate_proj [E, D, F]     experts/up_proj [E, D, F]     experts/down_proj [E, F, D]
(HF `mlp.experts.{j}.{gate,up,down}_proj.weight`, each `[out, in]`; F = moe_intermediate_size).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from ppo_jax.models.config import ModelConfig
from ppo_jax.models.grouped_matmul import use_megablox
from ppo_jax.models.layers import activation
from ppo_jax.models.moe_dispatch import dispatch, expert_ffn, splits_rows


class Routing(NamedTuple):
    """The routing of one backbone call over its M sparse layers.

    experts: `[B, L, M, k]` int32, the experts each token used at each sparse layer (the
      replayed ones where `routes` gave them); feed it back as `routes` to replay it.
    aux_loss: float32 scalar, transformers' `load_balancing_loss_func` over the call's real
      tokens and all M layers, not multiplied by `router_aux_loss_coef`.
    """

    experts: jax.Array
    aux_loss: jax.Array


class RouterStats(NamedTuple):
    """One sparse layer's routing: `experts [B, L, k]` int32 (used), and over the real tokens
    `counts [E]` (how often each expert is in the router's own top-k) and `probs [E]` (the sum
    of the router's probabilities), both float32: `load_balancing_loss`'s per-layer sums."""

    experts: jax.Array
    counts: jax.Array
    probs: jax.Array


def route(logits: jax.Array, k: int, norm_topk_prob: bool, routes: jax.Array | None = None):
    """Top-k routing (transformers `Qwen3MoeTopKRouter.forward`).

    logits `[T, E]` (any float dtype); routes None or `[T, k]` int32 (a row with
    `routes[:, 0] < 0` keeps the router's choice). Returns `(weights [T, k] float32, experts
    [T, k] int32, probs [T, E] float32, top [T, k] int32)`: the gate values and experts used,
    the router's softmax and its own top-k (for the load-balancing loss).
    """
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    top_p, top = jax.lax.top_k(probs, k)
    experts = top.astype(jnp.int32)
    weights = top_p
    if routes is not None:
        replay = (routes[:, :1] >= 0)
        experts = jnp.where(replay, routes.astype(jnp.int32), experts)
        weights = jnp.take_along_axis(probs, experts, axis=-1)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts, probs, top.astype(jnp.int32)


def router_stats(experts: jax.Array, probs: jax.Array, top: jax.Array,
                 token_mask: jax.Array) -> RouterStats:
    """A layer's `RouterStats` from `route`'s outputs (flat `[T, ...]`) and `token_mask [T]`
    (1 for a real token), as `load_balancing_loss_func` accumulates them per layer."""
    num_experts, k = probs.shape[-1], top.shape[-1]
    m = token_mask.astype(jnp.float32)
    counts = jax.ops.segment_sum(jnp.repeat(m, k), top.reshape(-1), num_segments=num_experts)
    return RouterStats(experts, counts, jnp.sum(probs * m[:, None], axis=0))


def load_balancing_loss(counts: jax.Array, probs: jax.Array, rows: jax.Array) -> jax.Array:
    """Switch Transformer's load-balancing loss (Fedus et al. 2021, eqs. 4-6), as transformers'
    `load_balancing_loss_func` pools it over layers: `E * sum_e (counts_e / rows) *
    (probs_e / rows)`.

    counts, probs `[E]`: `RouterStats` summed over the layers; rows: the real tokens times the
    number of layers. 0 when rows is 0 (transformers divides by zero). float32 scalar.
    """
    rows = jnp.maximum(jnp.asarray(rows, jnp.float32), 1.0)
    return counts.shape[-1] * jnp.sum((counts / rows) * (probs / rows))


class Experts(nnx.Module):
    """E SwiGLU experts as stacked params `gate_proj`, `up_proj [E, D, F]`, `down_proj
    [E, F, D]` (N(0, 0.02) init, `cfg.param_dtype`)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        e, d, f = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        init, pd = nnx.initializers.normal(0.02), cfg.jnp_param_dtype
        self.gate_proj = nnx.Param(init(rngs.params(), (e, d, f), pd))
        self.up_proj = nnx.Param(init(rngs.params(), (e, d, f), pd))
        self.down_proj = nnx.Param(init(rngs.params(), (e, f, d), pd))


class SparseMoeBlock(nnx.Module):
    """The sparse MLP of one layer: router `gate` + `experts` (transformers
    `Qwen3MoeSparseMoeBlock`)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.gate = nnx.Linear(cfg.hidden_size, cfg.num_experts, use_bias=False,
                               dtype=cfg.jnp_dtype, param_dtype=cfg.jnp_param_dtype,
                               kernel_init=nnx.initializers.normal(0.02), rngs=rngs)
        self.experts = Experts(cfg, rngs)
        self.k, self.norm_topk_prob, self.act = (cfg.num_experts_per_tok, cfg.norm_topk_prob,
                                                 cfg.hidden_act)

    def __call__(self, x: jax.Array, token_mask: jax.Array, routes: jax.Array | None = None,
                 mesh=None):
        """x `[B, L, D]`, token_mask `[B, L]` (1 = real token), routes None or `[B, L, k]`
        int32 -> `(out [B, L, D] in x's dtype, RouterStats)`. mesh: None, or a static
        `jax.sharding.Mesh` whose batch axes then split the rows: each device routes and
        computes its own tokens (`moe_dispatch.dispatch`); same values, stats summed over
        the devices. Raises ValueError: see `moe_dispatch.splits_rows`."""
        if splits_rows(mesh, x.shape[0]):
            out, experts, counts, probs = dispatch(self, mesh, x, token_mask, routes)
            return out, RouterStats(experts, counts, probs)
        return self.local(x, token_mask, routes,
                          megablox_kernel=use_megablox(mesh, per_device=False))

    def local(self, x: jax.Array, token_mask: jax.Array, routes: jax.Array | None = None,
              tensor_axis: str | None = None, megablox_kernel: bool = False):
        """`__call__` over the tokens at hand (all of them, or one device's inside
        `shard_map`). tensor_axis: inside `shard_map`, the mesh axis the experts' FFN width is
        split over; their outputs are partial sums, `psum`'d over it. megablox_kernel
        (static): the experts' grouped matmul on megablox's TPU kernels (`expert_ffn`)."""
        b, l, d = x.shape
        flat = x.reshape(b * l, d)
        logits = self.gate(flat)  # in the compute dtype, as transformers' F.linear
        weights, experts, probs, top = route(
            logits, self.k, self.norm_topk_prob,
            None if routes is None else routes.reshape(b * l, self.k))
        e = self.experts
        dt = x.dtype
        out = expert_ffn(flat, experts, weights.astype(logits.dtype), e.gate_proj[...].astype(dt),
                         e.up_proj[...].astype(dt), e.down_proj[...].astype(dt),
                         activation(self.act), megablox_kernel)
        if tensor_axis is not None:
            out = jax.lax.psum(out, tensor_axis)
        stats = router_stats(experts.reshape(b, l, self.k), probs, top, token_mask.reshape(-1))
        return out.reshape(b, l, d), stats
