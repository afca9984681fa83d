"""The host side of `ppo.packing`: the plans (`rollout.packing.PackedRows`) of the experience
pass and of the update, from each row's real prompt and response lengths.

The experience pass takes the batch's rows in order, `ppo.micro_batch_size` a chunk. The
update takes them in each epoch's permutation (`update.epoch_permutations` of the step's update
key, the one `ppo_update` draws), `ppo.mini_batch_size` a minibatch and `ppo.micro_batch_size`
a micro-batch, so its plan follows that order: the same rows meet in the same micro-batches as
in the padded update, and the losses, normalisers and gradients are the padded update's.
One row count serves every micro-batch of a program (the largest needed, rounded up to a power
of two: `rollout.packing.row_bucket`), so a run compiles a few shapes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ppo_jax.rollout.forward import Rollout
from ppo_jax.rollout.packing import PackedRows, plan_packing
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

    def _plan(self, q, r, rollout: Rollout) -> PackedRows:
        return plan_packing(q, r, prompt_width=rollout.query_ids.shape[1],
                            response_width=rollout.response_ids.shape[1],
                            micro_batch_size=self.micro, shards=self.shards)

    def experience(self, rollout: Rollout, lengths) -> tuple[PackedRows, dict]:
        """The experience pass's plan (leaves `[B / micro, ...]`, replicated) and its
        figures (`fill_figures`, prefix `packing/experience_`)."""
        plan = self._plan(*lengths, rollout)
        return self.place.replicate(plan), fill_figures(plan, *lengths, rollout, "experience")

    def update(self, rollout: Rollout, lengths, update_key) -> tuple[PackedRows, dict]:
        """The update's plan (leaves `[ppo_epochs, n_minibatches, n_micro, ...]`, replicated)
        for the epochs' permutations of `update_key`, and its figures (`packing/update_`)."""
        q, r = lengths
        batch = len(q)
        perms = np.asarray(jax.device_get(self._perms(update_key, batch))).reshape(-1)
        plan = self._plan(q[perms], r[perms], rollout)
        shape = (self.epochs, batch // self.mini, self.mini // self.micro)
        stacked = jax.tree.map(lambda x: x.reshape(*shape, *x.shape[1:]), plan)
        return (self.place.replicate(stacked),
                fill_figures(plan, q[perms], r[perms], rollout, "update"))


def fill_figures(plan: PackedRows, q, r, rollout: Rollout, name: str) -> dict:
    """`packing/{name}_rows` (packed rows a micro-batch, all shards), `packing/{name}_fill`
    (real tokens over packed slots) and `packing/{name}_padded_fill` (real tokens over the
    padded rows' slots), floats."""
    n_micro, shards, rows, width = plan.src.shape
    real = float(np.sum(q) + np.sum(r))
    padded = len(q) * (rollout.query_ids.shape[1] + rollout.response_ids.shape[1])
    return {f"packing/{name}_rows": float(shards * rows),
            f"packing/{name}_fill": real / (n_micro * shards * rows * width),
            f"packing/{name}_padded_fill": real / padded}
