"""Action tokens among a response's tokens: the PPO math over actions only.

A multi-turn response holds the model's sampled tokens (actions) and, between its turns, an
environment's observation tokens (context: a tool's result, a verifier's feedback). The
`action_mask` `[B, T]` is 1 on actions and 0 on observations and padding. Observations get no
policy loss, no KL, no entropy term and no advantage, and they count in no normaliser: the
losses and reductions take the action mask as their `mask`.

GAE across an observation steps over action tokens only: gamma and lambda discount once per
action token, and an observation in the middle of a response adds no step, no reward and no
value. This is verl's choice (`compute_gae_advantage_return`, "skip values and TD-error on
observation tokens"): the value after the last action token of a turn is the value of the first
action token of the next turn. The same holds for every registered reward shaping and advantage
estimator: `compact_actions` moves each row's action tokens to the front, in order (a stable
permutation), the unchanged estimator runs on that prefix-masked batch, and `expand_actions`
puts the results back in place (0 on observations). A row whose actions already form a prefix
(every single-turn response) is left where it is: the permutation is the identity.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ppo_jax.core import validation as V


def action_order(action_mask: jax.Array) -> jax.Array:
    """`[B, T]` int32: for each row, the columns of its action tokens in order, then the other
    columns in order (a stable sort of `action_mask == 0`).

    Raises ValueError: `action_mask` not a `[B, T]` 0/1 array.
    """
    valid = V.as_valid("action_mask", action_mask)
    if valid.ndim != 2:
        raise ValueError(f"action_mask must be [B, T], got shape {tuple(valid.shape)}")
    return jnp.argsort(~valid, axis=1, stable=True).astype(jnp.int32)


def compact_actions(x: jax.Array, order: jax.Array) -> jax.Array:
    """`x [B, T, ...]` with each row's columns taken in `order` (`action_order`): its action
    tokens first. The action mask itself compacts to a prefix mask."""
    idx = order.reshape(order.shape + (1,) * (x.ndim - 2))
    return jnp.take_along_axis(x, idx, axis=1)


def expand_actions(x: jax.Array, order: jax.Array) -> jax.Array:
    """The inverse of `compact_actions`: `x [B, T, ...]` in compacted column order back to the
    response's columns."""
    inverse = jnp.argsort(order, axis=1).astype(jnp.int32)
    return compact_actions(x, inverse)
