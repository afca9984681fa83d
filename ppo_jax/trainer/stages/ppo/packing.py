"""The host side of `ppo.packing`: the plans (`rollout.packing.PackedRows`) of the experience
pass and of the update, from each row's real prompt and response lengths.

The experience pass may take the batch's rows in any order (each row's outputs are its own):
its plan balances the tokens of its `ppo.micro_batch_size` chunks over the whole batch. The
update takes each epoch's permutation (`update.epoch_permutations` of the step's update key,
the one the padded update draws) in minibatches of `ppo.mini_batch_size`; its plan keeps every
minibatch's rows and only rearranges them among the minibatch's micro-batches, whose losses
add up to the minibatch's (the normalisers are the minibatch's): the same losses, gradients
and stats as the padded update. One row count serves every micro-batch of a program (the
largest needed, rounded: `rollout.packing.row_bucket`), so a run compiles a few shapes;
balancing the micro-batches keeps that largest near the mean.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ppo_jax.rollout.forward import Rollout
from ppo_jax.rollout.packing import PackedBatch, PackedRows, plan_packing
from ppo_jax.trainer.stages.ppo.update import epoch_permutations


class Packer:
    """Plans for one run's batches (module doc).

    Args:
      place: the trainer's `Placement`: the plans go to its devices, replicated.
      micro_batch_size, mini_batch_size, ppo_epochs: `ppo.*`.
    """

    def __init__(self, place, *, micro_batch_size: int, mini_batch_size: int, ppo_epochs: int):
        self.place, self.epochs = place, ppo_epochs
        self.micro, self.mini = micro_batch_size, mini_batch_size
        shards = place.batch_shards
        # each device packs its own rows when the batch axes split a micro-batch evenly
        self.shards = shards if micro_batch_size % shards == 0 else 1
        rep = place.replicated
        self._lengths = jax.jit(lambda qm, rm: (jnp.sum(qm != 0, 1), jnp.sum(rm != 0, 1)),
                                out_shardings=rep)
        self._perms = jax.jit(lambda key, batch: epoch_permutations(key, ppo_epochs, batch),
                              static_argnums=1, out_shardings=rep)

    def lengths(self, rollout: Rollout) -> tuple[np.ndarray, np.ndarray]:
        """`(prompt lengths, response lengths)` `[B]` of the whole batch, on every process."""
        return jax.device_get(self._lengths(rollout.query_mask, rollout.response_mask))

    def _plan(self, q, r, rollout: Rollout, balance: int):
        return plan_packing(q, r, prompt_width=rollout.query_ids.shape[1],
                            response_width=rollout.response_ids.shape[1],
                            micro_batch_size=self.micro, shards=self.shards, balance=balance)

    def experience(self, rollout: Rollout, lengths) -> tuple[PackedBatch, dict]:
        """The experience pass's `PackedBatch` (replicated) and its figures (`fill_figures`,
        prefix `packing/experience_`)."""
        q, r = lengths
        order, plan = self._plan(q, r, rollout, balance=len(q))
        return (self.place.replicate(PackedBatch(order, plan)),
                fill_figures(plan, q, r, rollout, "experience"))

    def update(self, rollout: Rollout, lengths, update_key) -> tuple[PackedBatch, dict]:
        """The update's `PackedBatch` (order `[ppo_epochs, B]`, rows `[ppo_epochs,
        n_minibatches, n_micro, ...]`, replicated) for the epochs' permutations of
        `update_key`, and its figures (`packing/update_`)."""
        q, r = lengths
        batch = len(q)
        perms = np.asarray(jax.device_get(self._perms(update_key, batch))).reshape(-1)
        order, plan = self._plan(q[perms], r[perms], rollout, balance=self.mini)
        shape = (self.epochs, batch // self.mini, self.mini // self.micro)
        stacked = jax.tree.map(lambda x: x.reshape(*shape, *x.shape[1:]), plan)
        rows = perms[order].reshape(self.epochs, batch).astype(np.int32)
        return (self.place.replicate(PackedBatch(rows, stacked)),
                fill_figures(plan, q, r, rollout, "update"))


def fill_figures(plan: PackedRows, q, r, rollout: Rollout, name: str) -> dict:
    """`packing/{name}_rows` (packed rows a micro-batch, all shards), `packing/{name}_fill`
    (real tokens over packed slots) and `packing/{name}_padded_fill` (real tokens over the
    padded rows' slots), floats."""
    n_micro, shards, rows, width = plan.src.shape
    passes = n_micro * shards * plan.dst.shape[2] // len(q)  # the update plans every epoch
    real = float(np.sum(q) + np.sum(r)) * passes
    padded = passes * len(q) * (rollout.query_ids.shape[1] + rollout.response_ids.shape[1])
    return {f"packing/{name}_rows": float(shards * rows),
            f"packing/{name}_fill": real / (n_micro * shards * rows * width),
            f"packing/{name}_padded_fill": real / padded}
