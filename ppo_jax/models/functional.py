"""Functional use of the NNX models: split once, then pass `(graphdef, params)` to jitted code.

    graphdef, params = split_model(model)          # params: nnx.State of nnx.Param leaves
    logits = causal_lm_logits(graphdef, params, ids, mask)   # [B, L, V] float32

`params` is a pytree (optax, jax.grad, jax.device_put and orbax all take it as is). Each helper
below merges inside the traced function, so nothing is closed over (docs/contracts.md).
Callers may equally write `nnx.merge(graphdef, params)(ids, mask)` themselves.
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx, struct

from ppo_jax.models.kv_cache import KVCache


def split_model(model: nnx.Module) -> tuple[nnx.GraphDef, nnx.State]:
    """`(graphdef, params)` with only `nnx.Param` leaves in params.

    Raises ValueError if the model holds other state (RNG streams, batch stats, ...), which the
    functional API does not carry.
    """
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    if jax.tree_util.tree_leaves(rest):
        raise ValueError(f"model holds non-Param state: {rest}")
    return graphdef, params


@struct.dataclass
class Model:
    """One model as one value: its static graph definition and its params pytree.

    A pytree whose only children are the params: `jax.jit` takes it as one argument, and
    `jax.tree.map(fn, model)` (a sharding per param, `jax.device_put`, an abstract shape)
    gives a `Model` of the same graph, so shardings follow the model by tree-map, not by
    position. `model.merge()` inside a traced function is the `nnx.Module`.
    """

    graphdef: Any = struct.field(pytree_node=False)
    params: Any

    def merge(self) -> nnx.Module:
        return nnx.merge(self.graphdef, self.params)


def causal_lm_forward(graphdef, params, input_ids, attention_mask, *,
                      cache: KVCache | None = None, cache_index=None):
    """CausalLM: -> (logits `[B, L, V]` float32, cache). See `heads.CausalLM.__call__`."""
    return nnx.merge(graphdef, params)(input_ids, attention_mask, cache=cache, cache_index=cache_index)


def causal_lm_logits(graphdef, params, input_ids, attention_mask) -> jax.Array:
    """CausalLM logits `[B, L, V]` float32 for input_ids `[B, L]` int32 / attention_mask `[B, L]`."""
    return nnx.merge(graphdef, params)(input_ids, attention_mask)[0]


def causal_lm_hidden(graphdef, params, input_ids, attention_mask) -> jax.Array:
    """Final hidden states `[B, L, D]` (compute dtype); project a slice with `lm_head_logits`."""
    return nnx.merge(graphdef, params).backbone(input_ids, attention_mask)[0]


def lm_head_logits(graphdef, params, hidden) -> jax.Array:
    """`[..., D]` hidden -> `[..., V]` float32 logits of a CausalLM (e.g. only response positions)."""
    return nnx.merge(graphdef, params).lm_head(hidden)


def values(graphdef, params, input_ids, attention_mask) -> jax.Array:
    """ValueModel: values `[B, L]` float32, one per token (the critic reads query + response)."""
    return nnx.merge(graphdef, params)(input_ids, attention_mask)[0]


def reward_scores(graphdef, params, input_ids, attention_mask) -> jax.Array:
    """RewardModel: scores `[B]` float32, read at the last position whose mask is 1."""
    return nnx.merge(graphdef, params)(input_ids, attention_mask)[0]


def path_str(key_path) -> str:
    """A JAX key path into a params State -> "backbone/layers/attn/q_proj/kernel"."""
    parts = []
    for k in key_path:
        if isinstance(k, jax.tree_util.GetAttrKey):
            if k.name == "value":  # the nnx.Variable's payload
                continue
            parts.append(k.name)
        elif isinstance(k, jax.tree_util.DictKey):
            parts.append(str(k.key))
        elif isinstance(k, jax.tree_util.SequenceKey):
            parts.append(str(k.idx))
        else:
            parts.append(str(k))
    return "/".join(parts)


def param_paths(params: Any) -> Any:
    """Same-structure pytree whose leaves are the path strings of `params`.

    Sharding rules map over it and `params` together with `jax.tree.map`."""
    return jax.tree_util.tree_map_with_path(lambda kp, _: path_str(kp), params)


def flat_params(params: Any) -> dict[str, Any]:
    """`{path string: array}` for every leaf, e.g. `{"backbone/norm/scale": Array[D]}`."""
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    return {path_str(kp): leaf for kp, leaf in leaves}


def count_params(params: Any) -> int:
    """Total number of scalars in the params pytree."""
    return sum(int(x.size) for x in jax.tree_util.tree_leaves(params))
