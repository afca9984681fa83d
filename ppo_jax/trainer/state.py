"""Train state of a trained model (actor or critic): a pytree of arrays, nothing else.

The graph definition and the optax transformation are static and live beside the state (they
are rebuilt from the config on resume); the state itself is what orbax writes.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct


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
