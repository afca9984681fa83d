"""Continuous generation across batches, with weights that change while sequences decode: the
paged engine (`rollout.engine`) as a stream, the engine side of asynchronous RL.

    stream = engine.stream(params, version=0, max_batches_in_flight=2)
    stream.submit(prompt_ids, prompt_mask, step_key, tag=0)   # queue a batch of B rows
    stream.set_params(new_params, version=1)                  # taken in at a chunk boundary
    for batch in stream.step():                               # one scheduling round
        batch.generation, batch.versions, batch.tag           # a finished batch

`generate` answers one batch and stops; its slots empty out while the batch's longest
responses finish. The stream keeps them full: a ring of C = `max_batches_in_flight` row blocks
(responses `[R, C B / R, N]` on the devices) holds up to C batches at once, each in its own
block, and the scheduler's queue admits the next batch's groups into slots as the previous
batch's sequences free them. A block is reused once its batch is returned. Each row keeps the
keyed draws of its own batch (`engine_programs._row_keys`: the step key of its block, its row
in its batch), so a batch streamed under fixed weights gets exactly `generate`'s tokens under
its key, whatever shares the slots with it. Device programs keep static shapes: the ring,
the slots and the pool are sized once; a round compiles nothing new after the first of each
bucket.

Weights (`set_params`) carry a policy version, and every drawn token records the version that
drew it (`StreamedBatch.versions`) and its log-prob under those weights (the behaviour
log-prob). The three ways of taking new weights in, named after Tong, Li and Sheng,
"Partial Rollout vs Consistent Rollout in LLM RL" (2026):

- `partial_rollouts=True, kv_on_switch="recompute"` (partial rollout, as AReaL's
  interruptible rollout workers, which recompute the KV cache under the new weights: Fu et
  al. 2025, "AReaL", arXiv:2505.24298): at the next chunk boundary every live sequence's
  prompt and drawn tokens are run again under the new weights into its own pages
  (`engine_programs.refill_program`, one prefill of the live slots), and decoding goes on;
  each token after the switch is drawn from the new policy given its whole prefix. Cost: one
  prefill of every live sequence per switch.
- `partial_rollouts=True, kv_on_switch="keep"` (partial rollout with stale KV): the new
  weights decode on top of the keys and values the old ones wrote; no recompute, but the
  tokens after a switch come from neither policy exactly (their recorded log-probs are still
  the ones they were drawn with).
- `partial_rollouts=False` (consistent rollout): admission stops, the live sequences finish
  under the old weights (the drain), then the new weights are taken in: every sequence has a
  single version. Cost: the slots empty out during the drain, as in one `generate` call's tail
  (`StreamStats.drain_chunks` counts those chunks).

Preemption (`rollout.scheduler`) recomputes a sequence from its prompt under the weights of
the moment: its versions start again. Multi-turn episodes are not streamed.
"""

from __future__ import annotations

import weakref
from collections import deque
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from ppo_jax.models.functional import Model
from ppo_jax.models.paged_cache import TRASH_PAGE
from ppo_jax.parallel.mesh import BATCH_AXES
from ppo_jax.rollout.draws import Generation
from ppo_jax.rollout.engine_layout import EngineStats
from ppo_jax.rollout.engine_programs import (
    empty_state, finalize_block, pick_width, refill_program, write_block,
)
from ppo_jax.rollout.scheduler import ReplicaScheduler

KV_ON_SWITCH = ("recompute", "keep")
KvOnSwitch = Literal[KV_ON_SWITCH]  # generation.kv_on_switch


class StreamedBatch(NamedTuple):
    """A finished batch: its `tag` (as submitted), its `generation` (`draws.Generation`
    `[B, N]`: tokens, mask, and each token's log-prob under the weights that drew it) and
    `versions` `[B, N]` int32 numpy: the policy version of the weights that drew each token,
    -1 where the mask is 0."""

    tag: Any
    generation: Generation
    versions: np.ndarray


@dataclass
class StreamStats:
    """What a stream did since it was built. `engine`: the decode figures (`EngineStats`; its
    `slot_occupancy` is summed over chunks: divide by `engine.chunks`); `rounds`: `step`
    calls; `mixed_chunks`: decode chunks whose live slots held rows of two or more batches;
    `switches`: weight versions taken in; `refills`: recompute passes after a switch;
    `drain_chunks`: chunks run while a switch waited for the live sequences (no partial
    rollouts); `batches`: batches returned."""

    engine: EngineStats = field(default_factory=EngineStats)
    rounds: int = 0
    mixed_chunks: int = 0
    switches: int = 0
    refills: int = 0
    drain_chunks: int = 0
    batches: int = 0


class _Submitted(NamedTuple):
    prompt_ids: Any
    prompt_mask: Any
    key: Any
    tag: Any
    lens: np.ndarray  # [B] real prompt lengths
    serial: int  # submission order


class _Programs(NamedTuple):
    """A stream's own jitted programs (the engine's prefill, decode and admissions are
    shared): the empty ring, a zero prompt ring, a batch's prompts into a block, the stack of
    the blocks' keys, the recompute, the gather of a finished block."""

    empty: Any
    zeros: Any
    write: Any
    stack: Any
    refill: Any
    finalize: Any


_PROGRAMS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # engine -> {C: programs}


def _programs(engine, capacity: int) -> _Programs:
    """The programs of streams of `capacity` blocks over `engine`, built once per engine and
    capacity, so a new stream compiles nothing its engine has compiled before."""
    per_engine = _PROGRAMS.setdefault(engine, {})
    if capacity in per_engine:
        return per_engine[capacity]
    e, lay, d = engine, engine.layout, engine.sampling
    rows, rep = e._sharding(P(BATCH_AXES)), e._sharding(P())
    ring = capacity * lay.rows
    out = _Programs(
        empty=jax.jit(partial(empty_state, lay.replicas, lay.slots, ring, d.max_new_tokens,
                              d.pad_token_id, e.routes_of), out_shardings=(rows, rows)),
        zeros=jax.jit(lambda: jnp.zeros((lay.replicas * ring, e.prompt_width), jnp.int32),
                      out_shardings=rows),
        write=jax.jit(partial(write_block, replicas=lay.replicas), donate_argnums=0,
                      out_shardings=rows),
        stack=jax.jit(lambda *keys: jnp.stack(keys), out_shardings=rep),
        refill=jax.jit(partial(refill_program, settings=d), donate_argnums=1,
                       out_shardings=e.cache_sharding()),
        finalize=jax.jit(partial(finalize_block, pad_token_id=d.pad_token_id),
                         out_shardings=(rows,) * (3 if e.routes_of is None else 4)))
    per_engine[capacity] = out
    return out


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


class RolloutStream:
    """A paged engine generating a stream of batches (module doc). Build it with
    `PagedEngine.stream`.

    Args:
      engine: a single-turn `rollout.engine.PagedEngine` (its batch B, prompt width P, slots,
        pool and programs).
      params, version: the actor's params and their policy version (an int).
      max_batches_in_flight: C >= 1, the batches whose rows the ring holds at once (1: the next
        batch enters only once the previous one is returned).
      partial_rollouts: whether new weights reach sequences already decoding (module doc).
      kv_on_switch: with partial rollouts, "recompute" or "keep" the live sequences' keys and
        values at a switch.

    Raises:
      ValueError: a multi-turn engine; C not an int >= 1; an unknown `kv_on_switch`; a version
        that is not an int; recorded MoE routes with `kv_on_switch="recompute"` (the recompute
        would route the fed tokens again; the recorded routes would be the old ones).
    """

    def __init__(self, engine, params, version: int = 0, *, max_batches_in_flight: int = 2,
                 partial_rollouts: bool = True, kv_on_switch: str = "recompute"):
        if engine.turns:
            raise ValueError("a multi-turn engine (sampling settings with turns) cannot stream; "
                             "use generate")
        if not _is_int(max_batches_in_flight) or max_batches_in_flight < 1:
            raise ValueError(f"max_batches_in_flight={max_batches_in_flight!r} must be an int >= 1")
        if kv_on_switch not in KV_ON_SWITCH:
            raise ValueError(f"kv_on_switch={kv_on_switch!r}; one of {KV_ON_SWITCH}")
        if not _is_int(version):
            raise ValueError(f"version={version!r} must be an int")
        if partial_rollouts and kv_on_switch == "recompute" and engine.routes_of is not None:
            raise ValueError("record_routes with partial_rollouts and kv_on_switch='recompute': "
                             "the recompute re-routes the fed tokens; use 'keep' or no partial "
                             "rollouts")
        self.engine, self.capacity = engine, int(max_batches_in_flight)
        self.partial, self.kv_on_switch = bool(partial_rollouts), kv_on_switch
        self.model, self.version = Model(engine.graphdef, params), int(version)
        self.stats = StreamStats()
        self.programs = _programs(engine, self.capacity)
        lay, n = engine.layout, engine.sampling.max_new_tokens
        self.state, self.responses = self.programs.empty()
        self.cache = engine._new_cache()
        self.prompt_ids, self.prompt_mask = self.programs.zeros(), self.programs.zeros()
        self.scheds = [ReplicaScheduler([], group_size=lay.group_size, slots=lay.slots,
                                        num_pages=lay.pages, page_size=engine.settings.page_size,
                                        max_new_tokens=n, chunk=engine.settings.decode_chunk)
                       for _ in range(lay.replicas)]
        self.versions = np.full((lay.replicas, self.capacity * lay.rows, n), -1, np.int32)
        self._free = deque(range(self.capacity))
        self._blocks: dict[int, _Submitted] = {}  # block -> its batch
        self._pending: deque[_Submitted] = deque()
        self._keys: list = [None] * self.capacity
        self._ring_keys = None
        self._switch: Optional[tuple[Any, int]] = None
        self._serial = 0

    # ------------------------------------------------------------------ the caller's side
    def submit(self, prompt_ids, prompt_mask, step_key, tag: Any = None) -> None:
        """Queue a batch: it enters the ring when a block is free, its groups are admitted
        behind those queued before it (FIFO), and it comes back from `step` once every row is
        finished.

        Args:
          prompt_ids, prompt_mask: `[B, P]` int32, left-padded, as `PagedEngine.generate`.
          step_key: the batch's PRNG key (None when greedy), of the same kind as the other
            batches' (`jax.random.key` or `PRNGKey`).
          tag: anything, returned with the batch (e.g. the trainer step it is for).

        Raises:
          ValueError: prompts of another shape than the engine's; a bad key, or a key of
            another kind than the previous batches'.
        """
        e = self.engine
        if tuple(prompt_ids.shape) != (e.batch, e.prompt_width):
            raise ValueError(f"prompts {tuple(prompt_ids.shape)}; this engine was built for "
                             f"{(e.batch, e.prompt_width)}")
        key = e._key(step_key)
        first = next((k for k in [*self._keys, *(s.key for s in self._pending)] if k is not None),
                     None)
        if first is not None and (first.dtype, first.shape) != (key.dtype, key.shape):
            raise ValueError(f"step_key {key.dtype}{tuple(key.shape)}: the stream's keys are "
                             f"{first.dtype}{tuple(first.shape)}; use one kind of key")
        lens = np.asarray(jax.device_get(e._prompt_lens(prompt_mask)))
        self._pending.append(_Submitted(prompt_ids, prompt_mask, key, tag, lens, self._serial))
        self._serial += 1

    def set_params(self, params, version: int) -> None:
        """New weights of policy `version`, taken in at the next `step`'s chunk boundary: with
        partial rollouts at once (the live sequences' keys and values recomputed or kept,
        `kv_on_switch`); without, once the live sequences have finished under the old
        weights (no admission until then). A later call before the switch replaces this one.

        Raises:
          ValueError: `version` not an int, or not above the versions given before.
        """
        newest = self.version if self._switch is None else self._switch[1]
        if not _is_int(version) or version <= newest:
            raise ValueError(f"version={version!r} must be an int above the newest given, "
                             f"{newest}")
        self._switch = (params, int(version))

    def step(self) -> list[StreamedBatch]:
        """One scheduling round: take new weights in (`set_params`), move queued batches into
        free blocks, admit their groups into free slots (FIFO), prefill them, run one decode
        chunk of every live sequence, retire what finished. Returns the batches whose every
        row finished in this round, in submission order ([] if none)."""
        self.stats.rounds += 1
        self._take_switch()
        if self._switch is None:  # no partial rollouts: nothing enters while a switch waits
            self._assign_blocks()
            self._admit()
        if self._live():
            self._decode()
        return self._collect()

    def flush(self) -> list[StreamedBatch]:
        """`step` until every submitted batch is returned; returns them all, in the order they
        finished."""
        out = []
        while self._pending or self._blocks:
            out += self.step()
        return out

    @property
    def in_flight(self) -> int:
        """Batches submitted and not yet returned (in the ring or waiting for a block)."""
        return len(self._pending) + len(self._blocks)

    # ------------------------------------------------------------------ one round
    def _live(self) -> bool:
        return any(s.live().any() for s in self.scheds)

    def _take_switch(self) -> None:
        if self._switch is None or (self._live() and not self.partial):
            return
        (params, version), self._switch = self._switch, None
        self.model, self.version = Model(self.engine.graphdef, params), version
        self.stats.switches += 1
        if self.partial and self.kv_on_switch == "recompute" and self._live():
            self._recompute()

    def _assign_blocks(self) -> None:
        per = self.engine.layout.rows
        while self._pending and self._free:
            batch, block = self._pending.popleft(), self._free.popleft()
            self.prompt_ids = self.programs.write(self.prompt_ids, block, batch.prompt_ids)
            self.prompt_mask = self.programs.write(self.prompt_mask, block, batch.prompt_mask)
            self._keys[block] = batch.key
            # one block: the batch's own key, so the prefill and decode are generate's programs
            self._ring_keys = batch.key if self.capacity == 1 else self.programs.stack(
                *(k if k is not None else batch.key for k in self._keys))
            for r, s in enumerate(self.scheds):
                s.enqueue(block * per, batch.lens[r * per:(r + 1) * per])
            self._blocks[block] = batch

    def _admit(self) -> None:
        e = self.engine
        admitted = [s.admit() for s in self.scheds]
        if not any(admitted):
            return
        self.cache, self.state, self.responses = e._prefill(
            self.model, self.cache, self.state, self.responses, self.prompt_ids,
            self.prompt_mask, e._admission(admitted), self._ring_keys)
        self.stats.engine.prefills += 1
        for r, groups in enumerate(admitted):
            for group in groups:
                for row in group.rows:  # a fresh start (or a preempted row's restart)
                    self.versions[r, row] = -1
                    self.versions[r, row, 0] = self.version

    def _decode(self) -> None:
        """One decode chunk (`PagedEngine._chunk`: grow, decode, retire); the columns each
        sequence drew in it get the current version."""
        per = self.engine.layout.rows
        before = [[(i, s, s.length) for i, s in enumerate(sched.slots) if s is not None]
                  for sched in self.scheds]
        self.stats.mixed_chunks += len({s.row // per for b in before for _, s, _ in b}) > 1
        self.stats.drain_chunks += self._switch is not None
        self.cache, self.state, self.responses, _ = self.engine._chunk(
            self.model, self.cache, self.state, self.responses, self.scheds, self._ring_keys,
            self.stats.engine)
        self.stats.engine.preemptions = sum(s.preemptions for s in self.scheds)
        for r, sched in enumerate(self.scheds):
            for slot, seq, old in before[r]:
                now = seq.length if sched.slots[slot] is seq else sched.final.get(seq.row)
                if now is not None:  # else preempted: it starts again when readmitted
                    self.versions[r, seq.row, old:now] = self.version

    def _recompute(self) -> None:
        """Every live sequence's prompt and drawn tokens run again under the new weights into
        its pages (`refill_program`): the live slots packed into a slot bucket, the widest
        page table; padding rows write only to the trash page."""
        e, lay = self.engine, self.engine.layout
        live = np.stack([s.live() for s in self.scheds])
        k = pick_width(e.slot_buckets, int(live.sum(axis=1).max()))
        slots = np.full((lay.replicas, k), lay.slots, np.int32)
        for r in range(lay.replicas):
            used = np.flatnonzero(live[r])
            slots[r, :len(used)] = used
        table = np.stack([s.page_table(e.widths[-1])[np.minimum(ix, lay.slots - 1)]
                          for s, ix in zip(self.scheds, slots)])
        table[slots >= lay.slots] = TRASH_PAGE
        self.cache = self.programs.refill(self.model, self.cache, self.state, self.responses,
                                          self.prompt_ids, self.prompt_mask, e._put(slots),
                                          e._put(table))
        self.stats.refills += 1

    def _collect(self) -> list[StreamedBatch]:
        """The blocks whose every row finished, gathered and freed, in submission order."""
        per, out = self.engine.layout.rows, []
        for block in sorted(self._blocks, key=lambda b: self._blocks[b].serial):
            rows = range(block * per, (block + 1) * per)
            if all(row in s.final for s in self.scheds for row in rows):
                lengths = np.array([[s.final.pop(row) for row in rows] for s in self.scheds],
                                   np.int32)
                out.append(self._gather(block, lengths))
        return out

    def _gather(self, block: int, lengths: np.ndarray) -> StreamedBatch:
        e, per = self.engine, self.engine.layout.rows
        out = self.programs.finalize(self.responses, block, e._put(lengths))
        n = self.versions.shape[2]
        versions = self.versions[:, block * per:(block + 1) * per].reshape(-1, n).copy()
        versions[np.arange(n) >= lengths.reshape(-1, 1)] = -1
        batch = self._blocks.pop(block)
        self._keys[block] = None
        self._free.append(block)
        self.stats.batches += 1
        return StreamedBatch(batch.tag, Generation(*out[:3], None, out[3] if len(out) == 4
                                                   else None), versions)
