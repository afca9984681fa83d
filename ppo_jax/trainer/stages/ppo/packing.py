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

With `ppo.micro_batch_tokens` the update's micro-batches are set by tokens instead
(`rollout.packing.plan_token_budget`): each minibatch packed whole, its rows dealt to
micro-batches of `micro_batch_tokens // (P + N)` rows a device. The shapes (micro-batches a
minibatch, sequences a device) are rounded the same way; each distinct one is a compile of the
update, counted in `packing/update_shapes`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ppo_jax.rollout.forward import Rollout
from ppo_jax.rollout.packing import (
    PackedBatch, PackedRows, fill_figures, heavy_tailed_lengths, plan_packing,
    plan_token_budget,
)
from ppo_jax.trainer.stages.packing import packing_shards
from ppo_jax.trainer.stages.ppo.update import epoch_permutations


class Packer:
    """Plans for one run's batches (module doc).

    Args:
      place: the trainer's `Placement`: the plans go to its devices, replicated.
      micro_batch_size, mini_batch_size, ppo_epochs, micro_batch_tokens: `ppo.*`.
      keep_micro_batches: the update's micro-batches keep the padded update's rows (no
        balancing): for a policy loss computed over each call's tokens (`per_micro_batch`,
        Clip-Cov, KL-Cov), whose value depends on which rows meet.
    """

    def __init__(self, place, *, micro_batch_size: int, mini_batch_size: int, ppo_epochs: int,
                 micro_batch_tokens: int | None = None, keep_micro_batches: bool = False):
        self.place, self.epochs, self.tokens = place, ppo_epochs, micro_batch_tokens
        self.keep = keep_micro_batches
        self.micro, self.mini = micro_batch_size, mini_batch_size
        self.shards = packing_shards(micro_batch_size, place.batch_shards)
        self.shapes: set = set()  # the token-budget update's shapes so far: one compile each
        rep = place.replicated
        self._lengths = jax.jit(lambda qm, rm: (jnp.sum(qm != 0, 1), jnp.sum(rm != 0, 1)),
                                out_shardings=rep)
        self._perms = jax.jit(lambda key, batch: epoch_permutations(key, ppo_epochs, batch),
                              static_argnums=1, out_shardings=rep)

    def lengths(self, rollout: Rollout) -> tuple[np.ndarray, np.ndarray]:
        """`(prompt lengths, response lengths)` `[B]` of the whole batch, on every process."""
        return jax.device_get(self._lengths(rollout.query_mask, rollout.response_mask))

    def plan(self, q, r, rollout: Rollout, balance: int):
        """`rollout.packing.plan_packing` of these lengths (`[B]` numpy) at the rollout's
        widths, this run's micro-batches and shards; rows reordered within groups of
        `balance`."""
        return plan_packing(q, r, prompt_width=rollout.query_ids.shape[1],
                            response_width=rollout.response_ids.shape[1],
                            micro_batch_size=self.micro, shards=self.shards, balance=balance)

    def experience(self, rollout: Rollout, lengths) -> tuple[PackedBatch, dict]:
        """The experience pass's `PackedBatch` (replicated) and its figures (`fill_figures`,
        prefix `packing/experience_`)."""
        q, r = lengths
        order, plan = self.plan(q, r, rollout, balance=len(q))
        return (self.place.replicate(PackedBatch(order, plan)),
                fill_figures(plan, q + r, _width(rollout), "packing/experience_"))

    def update(self, rollout: Rollout, lengths, update_key) -> tuple[PackedBatch, dict]:
        """The update's `PackedBatch` (order `[ppo_epochs, B]`, rows `[ppo_epochs,
        n_minibatches, n_micro, ...]`, replicated) for the epochs' permutations of
        `update_key`, and its figures (`packing/update_`)."""
        q, r = lengths
        batch = len(q)
        perms = np.asarray(jax.device_get(self._perms(update_key, batch)))
        if self.tokens is not None:
            return self.budget(rollout, q, r, perms)
        perms = perms.reshape(-1)
        order, plan = self.plan(q[perms], r[perms], rollout,
                                balance=None if self.keep else self.mini)
        shape = (self.epochs, batch // self.mini, self.mini // self.micro)
        stacked = jax.tree.map(lambda x: x.reshape(*shape, *x.shape[1:]), plan)
        rows = perms[order].reshape(self.epochs, batch).astype(np.int32)
        return (self.place.replicate(PackedBatch(rows, stacked)),
                fill_figures(plan, (q + r)[perms], _width(rollout), "packing/update_"))


    def budget_plan(self, q, r, rollout: Rollout, perms: np.ndarray) -> PackedBatch:
        """The token-budget update's `PackedBatch` (`plan_token_budget`) for the epochs'
        permutations `perms` `[ppo_epochs, B]` of lengths `q`, `r` `[B]`."""
        flat = perms.reshape(-1)
        micro, plan = plan_token_budget(
            q[flat], r[flat], prompt_width=rollout.query_ids.shape[1],
            response_width=rollout.response_ids.shape[1], mini_batch_size=self.mini,
            rows_per_micro=self.tokens // _width(rollout), shards=self.place.batch_shards)
        lead = (self.epochs, perms.shape[1] // self.mini)
        stack = lambda x: x.reshape(*lead, *x.shape[1:])  # noqa: E731
        return PackedBatch(perms.astype(np.int32), jax.tree.map(stack, plan), stack(micro))

    def budget(self, rollout: Rollout, q, r, perms: np.ndarray) -> tuple[PackedBatch, dict]:
        """`update` under `ppo.micro_batch_tokens`. Its figures add
        `packing/update_micro_batches` (a minibatch's), `packing/update_sequences` (a
        micro-batch's places, all devices) and `packing/update_shapes` (distinct update shapes
        so far: its compiles)."""
        packed = self.budget_plan(q, r, rollout, perms)
        self.shapes.add((packed.micro.shape, packed.rows.src.shape))
        flat_rows = PackedRows(*(x.reshape(-1, *x.shape[3:]) for x in (
            packed.rows.src, packed.rows.segments, packed.rows.dst)))
        figures = {**fill_figures(flat_rows, (q + r)[perms.reshape(-1)], _width(rollout),
                                  "packing/update_"),
                   "packing/update_micro_batches": float(packed.micro.shape[2]),
                   "packing/update_sequences": float(packed.micro.shape[3]),
                   "packing/update_shapes": float(len(self.shapes))}
        return self.place.replicate(packed), figures


def _width(rollout: Rollout) -> int:
    return rollout.query_ids.shape[1] + rollout.response_ids.shape[1]


# the response lengths `--compile-for` shapes the packed programs for: mean / max 0.5, the
# heavy tail of reasoning RL (half of a padded batch's response slots are padding)
COMPILE_MEAN_OVER_MAX = 0.5


def abstract_plans(packer: Packer, batch: int, prompt_width: int, new: int):
    """`(experience, update)` `PackedBatch`es of abstract arrays (replicated): the shapes of the
    plans of a batch of full-width prompts and `heavy_tailed_lengths` responses
    (`COMPILE_MEAN_OVER_MAX`), the update's rows in a random order, for `--compile-for`."""
    q = np.full(batch, prompt_width)
    r = heavy_tailed_lengths(batch, new, COMPILE_MEAN_OVER_MAX)
    rollout = Rollout(*(jax.ShapeDtypeStruct((batch, w), jnp.int32)
                        for w in (prompt_width, prompt_width, new, new)))
    exp = PackedBatch(*packer.plan(q, r, rollout, balance=batch))
    perms = np.stack([np.random.default_rng(e).permutation(batch)
                      for e in range(packer.epochs)])
    if packer.tokens is not None:
        upd = packer.budget_plan(q, r, rollout, perms)
    else:
        order, plan = packer.plan(q[perms.reshape(-1)], r[perms.reshape(-1)], rollout,
                                  balance=packer.mini)
        shape = (packer.epochs, batch // packer.mini, packer.mini // packer.micro)
        upd = PackedBatch(order.reshape(packer.epochs, batch),
                          jax.tree.map(lambda x: x.reshape(*shape, *x.shape[1:]), plan))
    rep = packer.place.replicated
    return tuple(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep), b)
                 for b in (exp, upd))
