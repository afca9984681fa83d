"""The rollout side of the asynchronous step (`ppo.max_staleness` = s > 0, docs/async_rl.md):
the paged engine on the rollout group streams batches (`rollout.stream`) while the trainer
learns, up to s + 1 batches ahead, and the trainer refuses what is too stale.

    driver = AsyncRollout(stream, order=..., rng=..., next_step=1, last_step=steps, ...)
    driver.fill()                        # up to s + 1 batches submitted
    batch = driver.take(step)            # the step's batch: rounds until it is finished
    ...                                  # the experience pass and the update dispatched
    driver.pump()                        # rounds until the next step's batch is finished
    driver.set_params(params, version)   # after the update and the weight sync
    driver.fill()

The loop is cooperative, not a thread. JAX dispatches the trainer's programs asynchronously,
so the rollout group decodes while the trainer's devices run them; the host runs the stream's
scheduling rounds in between. What is submitted, and the chunk at which new weights come in,
depend on the stream's state alone, never on timing: every process of a multi-controller run
takes the same decisions (a thread would switch weights at a different chunk on each process,
and their programs would diverge), and a run is reproducible.

Bounded staleness. Step j (the trainer at version j - 1, the number of updates so far) takes
the batch tagged j. Batch j + s is submitted after update j - 1, once the stream holds the
weights of version j - 1, and its tokens are drawn by that version or a later one (preemption
restarts a response under the weights of the moment), so when step j + s takes it, it is at
most s versions behind. The refusal (`refuse_stale`) is the guard of that bound, AReaL's
admission rule (Fu et al. 2025, arXiv:2505.24298, staleness eta): it refuses nothing in a run
that follows this schedule.

Resume. A checkpoint holds the prompt order's position and the run's key as of the batch last
TAKEN (each `Submitted` carries its own), not the batches submitted ahead. The batches in
flight at a stop are dropped; a resumed run submits them again, the same prompts with the same
keys, drawn under the checkpoint's weights.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from ppo_jax.core.staleness import sample_staleness, staleness_metrics
from ppo_jax.rollout.stream import RolloutStream, StreamedBatch, StreamStats
from ppo_jax.trainer.data.order import DataOrder
from ppo_jax.trainer.stages.ppo.step_data import PromptBatch


@dataclass(frozen=True)
class Submitted:
    """A batch handed to the stream: the step that takes it, its prompts (on the trainer's
    mesh), its update key, and the run's key and the prompt order's position after it (what
    the state and a checkpoint hold once the batch is taken)."""

    step: int
    prompts: PromptBatch
    update_key: jax.Array
    rng: jax.Array
    position: int


@dataclass(frozen=True)
class Taken:
    """The batch a step takes: its `Submitted` record, the stream's `StreamedBatch` (on the
    rollout group), the seconds the trainer waited for it, and (set by the trainer) each
    sample's staleness, `[B]` int32 on the trainer's rows."""

    submitted: Submitted
    batch: StreamedBatch
    wait_s: float
    staleness: Any = None


class AsyncRollout:
    """The stream and the batches submitted to it (module doc).

    Args:
      stream: a `rollout.stream.RolloutStream` of capacity s + 1 on the rollout group.
      order: the prompt order at the position of the last batch taken (a copy: it runs ahead).
      rng: the run's key as of that batch.
      next_step: the step the next submitted batch is for (the trainer's step count + 1).
      last_step: no batch is submitted for a step after it (`train.steps`).
      max_staleness: s >= 1.
      draw: `order -> PromptBatch`, the next prompts at the engine's prompt width (advances it).
      split_keys: `key -> (next key, sampling key, update key)`, the synchronous step's.
      to_rollout: `(ids, mask, key) -> (ids, mask, key)` on the rollout mesh.
      by_row: the trainer's row sharding (`refuse`'s output), or None.
    """

    def __init__(self, stream: RolloutStream, *, order: DataOrder, rng, next_step: int,
                 last_step: int, max_staleness: int, draw: Callable[[DataOrder], PromptBatch],
                 split_keys: Callable, to_rollout: Callable, by_row=None):
        self.stream, self.order, self.rng = stream, order, rng
        self.next_step, self.last_step, self.max_staleness = next_step, last_step, max_staleness
        self.draw, self.split_keys, self.to_rollout = draw, split_keys, to_rollout
        self.refuse = jax.jit(partial(refuse_stale, max_staleness=max_staleness),
                              out_shardings=by_row)  # `refuse_stale` on the trainer's rows
        self.pending: deque[Submitted] = deque()
        self.ready: dict[int, StreamedBatch] = {}
        self._seen = _snapshot(stream.stats)

    def fill(self) -> None:
        """Submit batches until s + 1 are submitted and not taken (none past `last_step`)."""
        while len(self.pending) <= self.max_staleness and self.next_step <= self.last_step:
            prompts = self.draw(self.order)
            self.rng, gen_key, update_key = self.split_keys(self.rng)
            ids, mask, key = self.to_rollout(prompts.ids, prompts.mask, gen_key)
            self.stream.submit(ids, mask, key, tag=self.next_step)
            self.pending.append(Submitted(self.next_step, prompts, update_key, self.rng,
                                          self.order.position))
            self.next_step += 1

    def run_until(self, step: int) -> None:
        """Scheduling rounds until the batch of `step` is finished.

        Raises:
          RuntimeError: that batch was never submitted (nothing left in flight).
        """
        while step not in self.ready:
            if not self.stream.in_flight:
                raise RuntimeError(f"the batch of step {step} is not in the stream")
            for batch in self.stream.step():
                self.ready[batch.tag] = batch

    def take(self, step: int) -> Taken:
        """The batch of `step`, the oldest submitted: rounds until it is finished.

        Raises:
          RuntimeError: the oldest submitted batch is for another step.
        """
        if not self.pending or self.pending[0].step != step:
            have = self.pending[0].step if self.pending else None
            raise RuntimeError(f"step {step} takes its batch, but the oldest submitted is for "
                               f"step {have}")
        t0 = time.perf_counter()
        self.run_until(step)
        return Taken(self.pending.popleft(), self.ready.pop(step), time.perf_counter() - t0)

    def pump(self) -> None:
        """Rounds until the next step's batch is finished (none when nothing is submitted):
        called while the trainer's devices run the update."""
        if self.pending:
            self.run_until(self.pending[0].step)

    def set_params(self, params: Any, version: int) -> None:
        """The rollout copy of update `version`, taken in at the stream's next round."""
        self.stream.set_params(params, version)

    def stream_metrics(self) -> dict:
        """The stream's work since the last call (`rollout/*`, floats): prefills, decode
        chunks and their mean slot occupancy, preemptions, weight switches, KV recomputes,
        drain chunks (no partial rollouts) and chunks that mixed rows of several batches."""
        now = _snapshot(self.stream.stats)
        d = {k: now[k] - self._seen[k] for k in now}
        self._seen = now
        return {"rollout/prefills": d["prefills"], "rollout/decode_chunks": d["chunks"],
                "rollout/slot_occupancy": d["occupancy"] / max(d["chunks"], 1),
                "rollout/preemptions": d["preemptions"], "rollout/weight_switches": d["switches"],
                "rollout/kv_refills": d["refills"], "rollout/drain_chunks": d["drain_chunks"],
                "rollout/mixed_chunks": d["mixed_chunks"]}


def _snapshot(stats: StreamStats) -> dict:
    e = stats.engine
    return {"prefills": float(e.prefills), "chunks": float(e.chunks),
            "occupancy": float(e.slot_occupancy), "preemptions": float(e.preemptions),
            **{k: float(getattr(stats, k)) for k in
               ("switches", "refills", "drain_chunks", "mixed_chunks")}}


def refuse_stale(action_mask: jax.Array, staleness: jax.Array, max_staleness: int) -> jax.Array:
    """The losses' mask with every token of a too-stale sample set to 0.

    A sample is refused when ``staleness[b] > max_staleness`` (AReaL's bound eta, Fu et al.
    2025): none of its tokens enters the policy or value loss or their normalisers. Its
    reward, and with groups its share of the group baseline, were computed before and stay.

    Args:
      action_mask: ``[B, N]`` int, the experience's action mask.
      staleness: ``[B]`` int, ``core.sample_staleness``.
      max_staleness: s >= 0 (static).

    Returns:
      ``[B, N]`` of ``action_mask``'s dtype.
    """
    keep = (staleness <= max_staleness)[:, None]
    return jnp.where(keep, action_mask, jnp.zeros_like(action_mask))


def staleness_figures(versions: np.ndarray, width: int, current_version: int,
                      max_staleness: int) -> tuple[np.ndarray, dict]:
    """Each sample's staleness and the batch's figures, on the host.

    Args:
      versions: ``[B, N]`` int32, the stream's per-token policy versions (-1 past a row's last
        token: the real tokens are ``versions >= 0``), the whole batch.
      width: the response columns kept (the bucket width the responses were cut to).
      current_version: the trainer's version (its number of updates).
      max_staleness: s.

    Returns:
      ``(staleness [B] int32, metrics)``: ``core.staleness_metrics``' ``rollout/staleness_*``,
      ``rollout/version_spread`` and ``rollout/mixed_version_frac``, and ``rollout/refused``,
      the samples beyond s (floats).
    """
    versions = np.asarray(versions)[:, :width]
    mask = versions >= 0
    staleness = np.asarray(jax.device_get(sample_staleness(versions, mask, current_version)))
    figures = jax.device_get(staleness_metrics(staleness, versions, mask))
    metrics = {k: float(v) for k, v in figures.items()}
    metrics["rollout/refused"] = float(np.sum(staleness > max_staleness))
    return staleness, metrics

