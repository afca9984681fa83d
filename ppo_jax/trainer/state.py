"""Train state of a trained model (actor, critic, SFT or reward model), and the one place a
model's params are split into trained and frozen leaves and joined back.

The graph definition and the optax transformation are static and live beside the state (they
are rebuilt from the config on resume); the state itself is what orbax writes.

Which leaves train is a filter over param paths (levanter's `is_trainable`):
`loading.lora.is_trained` (with LoRA: the adapters and a value / score head; without: every
leaf). `split_trainable` applies it once, at load; the state holds the trained leaves, the
frozen ones (a LoRA base) sit beside it. `full_params` joins them for a forward pass and
`loss_of_trained` turns a loss of the whole params into a loss of the trained leaves, the
function `jax.grad` differentiates. Every caller goes through these two, so the join has one home.

Why the frozen leaves are not fields of the state: the update donates the train states
(`donate_argnums`), and a donation covers a whole argument. A LoRA base is shared, with no copy,
by the reference model (and a LoRA critic's backbone), so it must stay a separate, undonated
argument; it is also never written to a checkpoint.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import struct

from ppo_jax.models.lora import join, split_params


@struct.dataclass
class TrainState:
    """step: int32 scalar (optimiser steps taken); params: nested dict of arrays;
    opt_state: the optax state of `params`."""

    step: jax.Array
    params: Any
    opt_state: Any

    @classmethod
    def create(cls, params, tx: optax.GradientTransformation) -> "TrainState":
        return cls(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))

    def apply_gradients(self, grads, tx: optax.GradientTransformation) -> "TrainState":
        """One optimiser step with `grads` (same tree as params)."""
        updates, opt_state = tx.update(grads, self.opt_state, self.params)
        params = optax.apply_updates(self.params, updates)
        return self.replace(step=self.step + 1, params=params, opt_state=opt_state)


def split_trainable(params: dict, is_trainable: Callable[[str], bool]) -> tuple[dict, dict]:
    """`(trained, frozen)`: the leaves of a nested params dict whose path (`"a/b/kernel"`)
    `is_trainable` accepts, and the rest; the same arrays, no copy (`models.lora.split_params`).
    """
    return split_params(params, is_trainable)


def full_params(frozen: dict | None, trained: dict) -> dict:
    """A model's whole params: its trained leaves (a `TrainState`'s params) joined with its
    frozen ones (`{}` or None: none); the same arrays, no copy, cheap inside a jitted function.

    Raises ValueError: a leaf in both.
    """
    return join(frozen or {}, trained)


def loss_of_trained(fn: Callable, frozen: dict | None) -> Callable:
    """`fn(params, *args)`, a function of a model's whole params, as `g(trained, *args)`, a
    function of its trained leaves alone: `jax.grad(g)` gives gradients of the trained leaves
    only, and no gradient is formed for the frozen ones."""

    def loss(trained, *args, **kwargs):
        return fn(full_params(frozen, trained), *args, **kwargs)

    return loss
