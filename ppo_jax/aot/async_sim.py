"""A discrete-event simulator of an RL step's schedule: synchronous against asynchronous RL.

Synchronous (what `PPOTrainer.step` does today): every chip samples the whole batch with the
paged engine, then the experience pass and the update run, then the rollout copy of the new
weights is made; the longest response of the batch holds the step. Asynchronous (issue 57): a
rollout group of chips decodes without stopping while a trainer group updates on finished
groups of responses, `max_staleness` policy versions at most behind, with or without partial
rollouts (new weights taken in at the next decode chunk, so a response may span versions, as
AReaL and slime do; without them the engine stops admitting and drains its in-flight
responses before it swaps weights, as verl's fully-async mode "with stale samples" does).

Time advances from one decode chunk of the engine to the next, as the engine's host loop runs
(`rollout.engine`): at each chunk boundary finished sequences free their slots, whole groups
of `group_size` samples are admitted into free slots (a prefill, charged per group), new
weights are taken, and one chunk of `decode_chunk` tokens runs in every live slot, costing
the compiled chunk's seconds at the live-slot bucket the engine would pick. The trainer takes
a batch as soon as `groups` whole groups are finished, oldest policy version first, and
refuses a group more than `max_staleness` versions behind the update it would enter. The
rollout admits a group only while the groups admitted (less those refused) stay within
`(version + max_staleness + 1) x groups` (AReaL's staleness control: Fu et al. 2025, AReaL,
arXiv 2505.24298).
With `max_staleness=0` and the same chips for both, this is the synchronous step.

Pure Python and numpy: costs come from `train.py --compile-for` reports (built by
scripts/simulate_async.py), response lengths from a sampler. Every figure it gives is an
estimate built on compiler estimates of programs that did not run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from ppo_jax.aot.response_lengths import Lengths



@dataclass(frozen=True)
class RolloutCost:
    """The rollout group's engine, in seconds of its compiled programs.

    Attributes:
      chips: chips of the rollout group.
      slots: decode slots over all its replicas (`generation.max_concurrent`).
      decode_chunk: tokens a live slot decodes per chunk (`generation.decode_chunk`, k).
      decode_seconds: `((live fraction, seconds), ...)`: one chunk's seconds with that fraction
        of the slots live, ascending, the last at 1.0; linear in between. The engine runs a
        chunk at the smallest of `decode_buckets` live-slot buckets that holds the live slots.
      prefill_seconds_per_group: the prefill of one admitted group (its `group_size` samples).
      decode_buckets: live-slot buckets of the decode chunk (`generation.decode_buckets`).
      recompute_seconds_per_token: with partial rollouts, the cost per token of recomputing an
        in-flight sequence's KV under new weights (AReaL does; 0 keeps the old KV, as
        PipelineRL's in-flight updates do).
    """

    chips: int
    slots: int
    decode_chunk: int
    decode_seconds: tuple
    prefill_seconds_per_group: float
    decode_buckets: int = 4
    recompute_seconds_per_token: float = 0.0

    def chunk_seconds(self, live: int) -> float:
        """Seconds of one decode chunk with `live` slots live (its live-slot bucket's)."""
        bucket = math.ceil(live * self.decode_buckets / self.slots) / self.decode_buckets
        xs, ys = zip(*self.decode_seconds)
        return float(np.interp(bucket, xs, ys))


@dataclass(frozen=True)
class TrainerCost:
    """The trainer group, in seconds per batch of its compiled programs at full width
    (responses `max_new_tokens` long); a batch cut to a narrower response bucket costs in
    proportion to its columns, prompt + response.

    Attributes:
      chips: chips of the trainer group.
      experience_seconds: the experience pass (log-probs of actor and reference, scores).
      update_seconds: the update (all epochs and minibatches).
      weight_sync_seconds: after an update, the time until the rollout may take the new
        weights (the rollout copy, and on a split the transfer to the rollout group); the
        trainer is busy for it.
    """

    chips: int
    experience_seconds: float
    update_seconds: float
    weight_sync_seconds: float


@dataclass(frozen=True)
class Schedule:
    """How rollout and training interleave.

    Attributes:
      max_staleness: the most policy versions a trained group may be behind its update.
      partial_rollouts: new weights enter in-flight responses at the next chunk boundary;
        without, the rollout stops admitting and drains before it swaps weights.
      colocated: one set of chips does both, taking turns (the synchronous step); needs
        `max_staleness == 0` and the same chips on both sides.
    """

    max_staleness: int
    partial_rollouts: bool = False
    colocated: bool = False


SYNCHRONOUS = Schedule(max_staleness=0, partial_rollouts=False, colocated=True)


@dataclass(frozen=True)
class BatchShape:
    """A batch: `groups` prompts of `group_size` samples per update; prompts `prompt_width`
    columns, responses at most `max_new_tokens`; the trainer cuts a batch to the smallest of
    `response_buckets` widths holding its longest response (`generation.response_buckets`)."""

    groups: int
    group_size: int
    prompt_width: int
    max_new_tokens: int
    response_buckets: int = 4

    def width(self, longest: int) -> int:
        """The response width the trainer cuts a batch to (`bucket_widths(0, N, buckets)`)."""
        n, b = self.max_new_tokens, self.response_buckets
        return next(w for w in (-(-i * n // b) for i in range(1, b + 1)) if w >= longest)


@dataclass(frozen=True)
class FlopModel:
    """Model FLOPs (matmuls, no recomputation: `aot.flops`) per unit of work, for the MFU.

    Attributes:
      decode_per_token: one decoded token (a decode chunk's model FLOPs / (slots x k)).
      prefill_per_sample: one sample's share of a prefill.
      experience_per_row, update_per_row: one row at full width (program FLOPs / rows),
        counted for a response of L tokens in proportion to `prompt_width + L` columns.
      peak_flops_per_chip: the chip's peak bf16 rate.
    """

    decode_per_token: float
    prefill_per_sample: float
    experience_per_row: float
    update_per_row: float
    peak_flops_per_chip: float

    def per_sample(self, length: np.ndarray, shape: BatchShape) -> float:
        """Model FLOPs of samples of `length` tokens (summed): the decode steps after the
        prefill's first token, the prefill, and the experience and update columns they fill."""
        columns = (shape.prompt_width + length) / (shape.prompt_width + shape.max_new_tokens)
        return float(np.sum(self.decode_per_token * (length - 1) + self.prefill_per_sample
                            + (self.experience_per_row + self.update_per_row) * columns))


@dataclass
class SimResult:
    """Steady-state figures over the updates after the warm-up.

    Attributes:
      step_seconds: mean time between two updates' ends.
      tokens_per_step: mean generated tokens of the trained samples per update.
      tokens_per_s_per_chip: those over the step time and all chips of the placement.
      mfu: model FLOPs of the trained samples per step / (chips x peak x step); None without a
        `FlopModel`.
      staleness: `{versions behind: fraction of trained groups}` (0: on-policy).
      refused_fraction: groups refused as too stale, over groups finished.
      max_span: the most policy versions one trained response spanned (partial rollouts).
      rollout_busy, trainer_busy: fractions of the measured time each group computed.
      update_ends: end time of every update, seconds.
    """

    step_seconds: float
    tokens_per_step: float
    tokens_per_s_per_chip: float
    mfu: Optional[float]
    staleness: dict
    refused_fraction: float
    max_span: int
    rollout_busy: float
    trainer_busy: float
    update_ends: list = field(default_factory=list)


@dataclass
class _Group:
    version: int  # the weights of its first token
    lengths: np.ndarray
    left: int  # samples still decoding
    finish: float = math.inf
    last_version: int = 0


class _Engine:
    """The rollout group's state: slots, the groups in flight and the weights version."""

    def __init__(self, cost: RolloutCost, shape: BatchShape):
        if cost.slots % shape.group_size or cost.slots < shape.group_size:
            raise ValueError(f"slots={cost.slots}: not a multiple of the group size "
                             f"{shape.group_size}")
        self.cost, self.shape = cost, shape
        self.group = np.full(cost.slots, -1)  # group id per slot, -1: free
        self.left = np.zeros(cost.slots, np.int64)  # tokens still to decode per slot
        self.done = np.zeros(cost.slots, np.int64)  # tokens decoded so far per slot
        self.version, self.draining, self.busy = 0, False, []

    def live(self) -> np.ndarray:
        return self.group >= 0

    def admit(self, groups: list, t: float) -> float:
        """Prefill `groups` (`_Group`s with ids) into free slots; returns the time after."""
        free = np.flatnonzero(~self.live())
        n = self.shape.group_size
        for i, (gid, g) in enumerate(groups):
            slots = free[i * n:(i + 1) * n]
            self.group[slots], self.left[slots], self.done[slots] = gid, g.lengths - 1, 1
        dt = len(groups) * self.cost.prefill_seconds_per_group
        self.busy.append((t, t + dt))
        return t + dt

    def chunk(self, t: float) -> float:
        """One decode chunk in every live slot; returns the time after it."""
        live = self.live() & (self.left > 0)
        dt = self.cost.chunk_seconds(int(live.sum()))
        step = np.minimum(self.left[live], self.cost.decode_chunk)
        self.left[live] -= step
        self.done[live] += step
        self.busy.append((t, t + dt))
        return t + dt

    def retire(self) -> list:
        """Free the slots whose sequences are done; the ids of their groups, one per sample."""
        finished = self.live() & (self.left <= 0)
        ids = self.group[finished].tolist()
        self.group[finished] = -1
        return ids


def simulate(rollout: RolloutCost, trainer: TrainerCost, schedule: Schedule, shape: BatchShape,
             lengths: Lengths, *, updates: int = 40, warmup: int = 8, seed: int = 0,
             flops: Optional[FlopModel] = None) -> SimResult:
    """Run `updates` updates of `schedule` and measure the steady state after `warmup`.

    Args:
      rollout, trainer: the costs of each side (the same chips when `schedule.colocated`).
      schedule: `SYNCHRONOUS` or an asynchronous `Schedule`.
      shape: batch sizes; lengths: `(rng, n) -> int array [n]` of response lengths in
        `[1, shape.max_new_tokens]` (the first token comes from the prefill).
      updates, warmup: updates simulated; the first `warmup` are not measured (> 0).
      seed: the lengths' generator seed; flops: for the MFU (None: no MFU).

    Returns:
      `SimResult`.

    Raises:
      ValueError: a colocated schedule with staleness or different chips, `warmup` outside
        `[1, updates)`, slots not whole groups. RuntimeError: the schedule deadlocks (the
        rollout can admit nothing and no update can start).
    """
    if schedule.colocated and (schedule.max_staleness or rollout.chips != trainer.chips):
        raise ValueError("colocated: max_staleness must be 0 and both sides the same chips")
    if not 1 <= warmup < updates:
        raise ValueError(f"warmup={warmup}: must be in [1, updates={updates})")
    sim = _Sim(rollout, trainer, schedule, shape, lengths, updates, np.random.default_rng(seed))
    sim.run()
    return sim.result(warmup, flops)


class _Sim:
    """One simulation: the engine's chunk loop, the trainer advanced between chunks."""

    def __init__(self, rollout, trainer, schedule, shape, lengths, updates, rng):
        self.engine = _Engine(rollout, shape)
        self.trainer, self.schedule, self.shape = trainer, schedule, shape
        self.lengths, self.updates, self.rng = lengths, updates, rng
        self.groups: list[_Group] = []
        self.ready: list[int] = []  # finished groups not yet trained or refused
        self.published = [0.0]  # published[v]: when version v reaches the rollout
        self.trainer_free, self.refused = 0.0, 0
        self.trained: list[tuple[float, float, list]] = []  # (start, end, group ids) per update

    def run(self) -> None:
        t = 0.0
        # past the last update too, so the busy fractions see the rollout's whole window
        while len(self.trained) < self.updates or t < self.trained[-1][1]:
            self.advance_trainer(t)
            t = self.take_weights(t)
            t = self.admit(t)
            self.finish_samples(t)  # one-token responses end at their prefill
            if not self.engine.live().any():
                t = self.idle_until(t)
                continue
            t = self.engine.chunk(t)
            self.finish_samples(t)

    # ---------------------------------------------------------------- rollout
    def take_weights(self, t: float) -> float:
        """Take the newest published version: at once with partial rollouts (recomputing the
        in-flight KV if that costs), else once the in-flight responses have drained."""
        newest = max(v for v, at in enumerate(self.published) if at <= t)
        engine = self.engine
        if newest == engine.version:
            return t
        live = engine.live()
        if not self.schedule.partial_rollouts and live.any():
            engine.draining = True
            return t
        engine.version, engine.draining = newest, False
        context = float(np.sum(self.shape.prompt_width + engine.done[live]))
        dt = context * engine.cost.recompute_seconds_per_token
        if dt:
            engine.busy.append((t, t + dt))
        return t + dt

    def admit(self, t: float) -> float:
        """Admit whole groups into free slots within the staleness bound."""
        engine, s = self.engine, self.schedule.max_staleness
        if engine.draining:
            return t
        bound = (engine.version + s + 1) * self.shape.groups + self.refused
        count = min(int((~engine.live()).sum()) // self.shape.group_size,
                    bound - len(self.groups))
        new = []
        for _ in range(max(count, 0)):
            g = _Group(engine.version, np.asarray(self.lengths(self.rng, self.shape.group_size)),
                       self.shape.group_size)
            self.groups.append(g)
            new.append((len(self.groups) - 1, g))
        return engine.admit(new, t) if new else t

    def finish_samples(self, t: float) -> None:
        for gid in self.engine.retire():
            g = self.groups[gid]
            g.left -= 1
            if g.left == 0:
                g.finish, g.last_version = t, self.engine.version
                self.ready.append(gid)

    def idle_until(self, t: float) -> float:
        """Nothing to decode: wait for the next version to be published (the trainer runs
        on what is finished; no new group can finish before the rollout moves again)."""
        later = [at for v, at in enumerate(self.published) if v > self.engine.version]
        if not later:
            self.advance_trainer(math.inf)
            later = [at for v, at in enumerate(self.published) if v > self.engine.version]
        if not later:
            if len(self.trained) >= self.updates:
                return max(t, self.trained[-1][1])
            raise RuntimeError("the schedule deadlocks: the rollout may admit nothing and the "
                               "trainer has too few groups")
        return max(t, min(later))

    # ---------------------------------------------------------------- trainer
    def advance_trainer(self, now: float) -> None:
        """Start every update whose batch is finished and whose trainer is free by `now`:
        at the first moment `groups` groups are finished, take the oldest versions first,
        refusing groups too stale for this update."""
        G, s = self.shape.groups, self.schedule.max_staleness
        while len(self.trained) < self.updates:
            u = len(self.trained)
            fresh = [i for i in self.ready if u - self.groups[i].version <= s]
            self.refused += len(self.ready) - len(fresh)
            self.ready = fresh
            if len(self.ready) < G:
                return
            by_finish = sorted(self.groups[i].finish for i in self.ready)
            start = max(self.trainer_free, by_finish[G - 1])
            if start > now:
                return
            eligible = [i for i in self.ready if self.groups[i].finish <= start]
            take = sorted(eligible, key=lambda i: (self.groups[i].version,
                                                   self.groups[i].finish))[:G]
            taken = set(take)
            self.ready = [i for i in self.ready if i not in taken]
            self.train(u, start, take)

    def train(self, u: int, start: float, take: list) -> None:
        """Run update `u` on groups `take` from `start`; publish version u + 1."""
        longest = max(int(self.groups[i].lengths.max()) for i in take)
        sh, tr = self.shape, self.trainer
        columns = (sh.prompt_width + sh.width(longest)) / (sh.prompt_width + sh.max_new_tokens)
        end = start + (tr.experience_seconds + tr.update_seconds) * columns
        self.trainer_free = end + tr.weight_sync_seconds
        self.published.append(self.trainer_free)
        self.trained.append((start, end, take))

    # ---------------------------------------------------------------- figures
    def result(self, warmup: int, flops: Optional[FlopModel]) -> SimResult:
        ends = [end for _, end, _ in self.trained]
        t0, t1 = ends[warmup - 1], ends[-1]
        n = len(ends) - warmup
        step = (t1 - t0) / n
        measured = self.trained[warmup:]
        groups = [(u + warmup, self.groups[i]) for u, (_, _, take) in enumerate(measured)
                  for i in take]
        tokens = sum(float(g.lengths.sum()) for _, g in groups) / n
        chips = self.engine.cost.chips + (0 if self.schedule.colocated else self.trainer.chips)
        lags = [u - g.version for u, g in groups]
        staleness = {lag: lags.count(lag) / len(lags) for lag in sorted(set(lags))}
        mfu = None
        if flops is not None:
            model = sum(flops.per_sample(g.lengths, self.shape) for _, g in groups) / n
            mfu = model / (chips * flops.peak_flops_per_chip * step)
        finished = sum(1 for g in self.groups if g.left == 0)
        train_busy = sum(_overlap(s, e, t0, t1) for s, e, _ in self.trained)
        roll_busy = sum(_overlap(s, e, t0, t1) for s, e in self.engine.busy)
        if self.schedule.colocated:  # one set of chips: either side computing is busy
            roll_busy = train_busy = roll_busy + train_busy
        return SimResult(
            step_seconds=step, tokens_per_step=tokens, tokens_per_s_per_chip=tokens / step / chips,
            mfu=mfu, staleness=staleness, refused_fraction=self.refused / max(finished, 1),
            max_span=max(g.last_version - g.version for _, g in groups),
            rollout_busy=roll_busy / (t1 - t0), trainer_busy=train_busy / (t1 - t0),
            update_ends=ends)


def _overlap(s: float, e: float, t0: float, t1: float) -> float:
    return max(0.0, min(e, t1) - max(s, t0))
