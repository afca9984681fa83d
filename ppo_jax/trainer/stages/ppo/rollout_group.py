"""The rollout group of the split placement (`generation.placement: split`, docs/async_rl.md):
the sampler and the actor's weights on their own devices, and the two crossings between them
and the trainer.

    sampler = GroupSampler(Sampler(...), rollout=rollout_place, trainer=place)
    out = sampler(actor, prompt_ids, prompt_mask, key, settings)   # generate -> trainer's mesh
    synced = weights.sync(trained, frozen, version=step)           # trainer -> rollout group
    actor = weights.actor                                           # what the sampler runs

Both crossings are `parallel.transfer`: device to device, one batched `jax.device_put` each.
They are the seams of an asynchronous rollout: a background loop can call `GroupSampler` on
the weights of an older version while the trainer updates, and `RolloutWeights.sync` when it
takes a new one. With staleness 0 (the synchronous step, `PPOTrainer.step`) the weights are
synced after every update, so the split step equals the colocated one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional

import jax

from ppo_jax.models.functional import Model
from ppo_jax.parallel.rules import ROLLOUT_RULES, tree_shardings
from ppo_jax.parallel.transfer import transfer, tree_bytes, uncovered
from ppo_jax.rollout.draws import Generation, SamplingSettings
from ppo_jax.rollout.sampler import Sampler
from ppo_jax.rollout.weights import cast_floats, rollout_copy_fn
from ppo_jax.trainer.config import ConfigError
from ppo_jax.trainer.placement import Placement, shapes_of
from ppo_jax.trainer.programs import Program
from ppo_jax.trainer.state import full_params


class GroupSampler:
    """A `rollout.sampler.Sampler` on the rollout group, called as the trainer calls one:
    `(actor, prompt_ids [B, P], prompt_mask [B, P], key, settings, on_turn_end=None) ->
    Generation`. The prompts (by row) and the key (replicated) move to the rollout mesh, the
    sampler runs there on `actor` (the rollout copy, `RolloutWeights.actor`), and its
    `Generation` (response ids, mask, log-probs, routes, an episode's action mask) moves to
    the trainer's rows. Host (numpy) inputs are passed as they are."""

    def __init__(self, sampler: Sampler, *, rollout: Placement, trainer: Placement):
        self.sampler, self.rollout, self.trainer = sampler, rollout, trainer

    @property
    def model_cfg(self):
        return self.sampler.model_cfg

    @property
    def last_stats(self):
        return self.sampler.last_stats

    def records_routes(self, settings: SamplingSettings) -> bool:
        return self.sampler.records_routes(settings)

    def laid_out(self, actor_shardings) -> "GroupSampler":
        """Itself: on the rollout group every call samples from the rollout copy (the
        evaluation too), so there is one layout."""
        return self

    def to_rollout(self, ids, mask, key):
        """`(prompt_ids [B, P], prompt_mask [B, P], key)` on the rollout mesh: the prompts by
        row, the key replicated (host values as they are)."""
        rows, rep = self.rollout.by_row, self.rollout.replicated
        moved = [transfer(x, s) if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) else x
                 for x, s in ((ids, rows), (mask, rows), (key, rep))]
        return tuple(moved)

    def to_trainer(self, out: Generation) -> Generation:
        """The `Generation`'s device arrays (`[B, ...]`, rows first) on the trainer's rows."""
        rows = self.trainer.by_row
        arrays = {k: getattr(out, k) for k in ("response_ids", "response_mask", "logprobs",
                                                "routes") if getattr(out, k) is not None}
        moved = transfer(arrays, {k: rows for k in arrays})
        episodes = out.episodes
        if episodes is not None and isinstance(episodes.action_mask, jax.Array):
            episodes = episodes._replace(action_mask=transfer(episodes.action_mask, rows))
        return out._replace(**moved, episodes=episodes)

    def __call__(self, actor: Model, prompt_ids, prompt_mask, key, settings: SamplingSettings,
                 on_turn_end=None) -> Generation:
        """Generate on the rollout group, then move the outputs to the trainer (class doc).
        Raises what `Sampler.__call__` raises."""
        ids, mask, key = self.to_rollout(prompt_ids, prompt_mask, key)
        out = self.sampler(actor, ids, mask, key, settings, on_turn_end)
        return self.to_trainer(out)

    def programs(self, actor: Model, prompt_ids, prompt_mask, key, settings: SamplingSettings,
                 prefix: str = "") -> list[dict]:
        """`Sampler.programs` with the abstract prompts and key on the rollout mesh."""
        ids, mask, key = self.to_rollout(prompt_ids, prompt_mask, key)
        return self.sampler.programs(actor, ids, mask, key, settings, prefix=prefix)


@dataclass(frozen=True)
class Synced:
    """One weight sync: `bytes` moved (the rollout copy's, one copy of each array; a LoRA
    base counted in the sync that moved it) and the `seconds` it took, blocked on the result."""

    bytes: int
    seconds: float


class RolloutWeights:
    """The actor's weights on the rollout group (module doc), synced by `sync`.

    The trainer lays a copy out on its own mesh as the rollout mesh wants it: cast to
    `generation.param_dtype` (so half the bytes move with bfloat16) and split over `tensor`
    only (`parallel.rules.ROLLOUT_RULES`); `parallel.transfer` then moves each rollout device
    its shard. A LoRA actor's frozen base moves with the first sync only; its adapters with each.

    Args:
      graphdef: the actor's graph. trained, frozen: its trained params and LoRA base ({}
        without), arrays or shapes (only their trees, shapes and dtypes are read).
      trainer, rollout: the two placements. param_dtype: `generation.param_dtype` or None.

    Raises:
      ConfigError: a rollout shard that no trainer device of its process would hold
        (`parallel.transfer.uncovered`), before any compile.
    """

    def __init__(self, graphdef, trained: Any, frozen: Any, *, trainer: Placement,
                 rollout: Placement, param_dtype: Optional[str]):
        self.graphdef, self.param_dtype = graphdef, param_dtype
        self.shardings = {k: tree_shardings(t, rollout.mesh, ROLLOUT_RULES)
                          for k, t in (("trained", trained), ("frozen", frozen))}
        # the trainer's layout of the copy (None: the training params are laid out so already)
        self.copies = {k: rollout_copy_fn(t, trainer.mesh, "tensor", param_dtype)
                       for k, t in (("trained", trained), ("frozen", frozen))}
        self._check(trained, frozen, trainer)
        self.params: dict = {}  # {"trained", "frozen"} on the rollout group, after a sync
        self.version: Optional[int] = None  # the update whose weights `params` hold

    def _check(self, trained, frozen, trainer: Placement) -> None:
        for key, tree in (("trained", trained), ("frozen", frozen)):
            src = tree_shardings(tree, trainer.mesh, ROLLOUT_RULES)
            for x, s, d in zip(jax.tree.leaves(tree), jax.tree.leaves(src),
                               jax.tree.leaves(self.shardings[key])):
                why = uncovered(s, d, x.shape)
                if why is not None:
                    raise ConfigError(f"generation.placement=split: the weight sync cannot stay "
                                      f"inside each process: {why}")

    @property
    def actor(self) -> Model:
        """The actor the sampler runs: the last synced weights (base and adapters joined)."""
        if not self.params:
            raise RuntimeError("RolloutWeights.actor before the first sync")
        return Model(self.graphdef, full_params(self.params["frozen"], self.params["trained"]))

    def _laid_out(self, key: str, tree):
        copy = self.copies[key]
        return tree if copy is None or not jax.tree.leaves(tree) else copy(tree)

    def sync(self, trained: Any, frozen: Any, version: int) -> Synced:
        """Send the actor's weights (`trained`; `frozen` with the first sync only) to the rollout
        group: the trainer's copy, then one transfer, blocked on. Returns the `Synced` figures."""
        t0 = time.perf_counter()
        parts = {"trained": trained} if self.params else {"trained": trained, "frozen": frozen}
        # nothing samples during a sync, so the old copy goes before the new one comes (one
        # copy at a time on the rollout group); with ppo.max_staleness > 0 the stream holds the
        # old one until it takes the new one in, at its next round
        self.params.pop("trained", None)
        moved = transfer({k: self._laid_out(k, t) for k, t in parts.items()},
                         {k: self.shardings[k] for k in parts})
        moved = jax.block_until_ready(moved)
        self.params = {**self.params, **moved}
        self.version = version
        return Synced(bytes=tree_bytes(moved), seconds=time.perf_counter() - t0)

    def place_abstract(self, trained: Any, frozen: Any) -> None:
        """An abstract build's rollout copy: shapes in the rollout dtype and layout."""
        for key, tree in (("trained", trained), ("frozen", frozen)):
            cast = jax.eval_shape(lambda t: cast_floats(t, self.param_dtype), tree)
            self.params[key] = shapes_of(cast, self.shardings[key])

    def programs(self, trained: Any, frozen: Any) -> list[Program]:
        """The trainer's copy programs (`--compile-for`): the trained params' every step, the
        LoRA base's once (calls per step 0)."""
        out = []
        for key, tree, per_step, note in (("trained", trained, 1.0, ""),
                                          ("frozen", frozen, 0.0, "once, with the first sync")):
            if self.copies[key] is not None and jax.tree.leaves(tree):
                name = "rollout_copy" if key == "trained" else "rollout_copy_base"
                out.append(Program(name, self.copies[key], (tree,), per_step=per_step, note=note))
        return out

    def transfers(self) -> list[dict]:
        """The transfers of a sync, for `--compile-for`: `{"name", "bytes", "per_step",
        "note", "receiver_bytes"}` each, `bytes` one copy of the rollout weights in the rollout
        dtype, `receiver_bytes` the most any rollout device receives."""
        out = []
        for key, per_step, note in (("trained", 1.0, "after every update"),
                                    ("frozen", 0.0, "once, with the first sync")):
            tree = self.params.get(key)
            if not jax.tree.leaves(tree):
                continue
            out.append({"name": "weight_sync" if key == "trained" else "weight_sync_base",
                        "bytes": tree_bytes(tree), "per_step": per_step, "note": note,
                        "receiver_bytes": _receiver_bytes(tree)})
        return out


def _receiver_bytes(tree) -> int:
    """The bytes one device of the tree's shardings holds of it (the most any holds)."""
    per_device: dict = {}
    for x in jax.tree.leaves(tree):
        itemsize = jax.numpy.dtype(x.dtype).itemsize
        for device, index in x.sharding.devices_indices_map(x.shape).items():
            n = 1
            for s, dim in zip(index, x.shape):
                lo, hi, _ = s.indices(dim)
                n *= hi - lo
            per_device[device] = per_device.get(device, 0) + n * itemsize
    return max(per_device.values(), default=0)
