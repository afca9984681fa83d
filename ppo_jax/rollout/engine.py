"""The paged rollout engine: a KV cache in pages, a fixed number of decode slots, continuous
batching (`generation.engine: paged`; the static batch of `rollout.sampler` is the reference).

    engine = PagedEngine(graphdef, sampling, EngineSettings(page_size=16, max_concurrent=64),
                         batch=256, prompt_width=64, mesh=mesh)
    response_ids, response_mask, logprobs = engine.generate(params, prompt_ids, prompt_mask, key)

A batch of B rows (adjacent groups of n samples of one prompt) is answered by R replicas, one
per row block of the mesh's batch axes (`data` x `fsdp`; R = 1 on one device): replica r owns
rows [r B / R, (r + 1) B / R), its own slots and its own pool of pages, and its slots and pages
live on its devices, so no decode step moves pages or rows between devices. On the host, one
`scheduler.ReplicaScheduler` per replica admits groups into free slots (prefill into pages,
`engine_programs.prefill_program`), the devices run a decode chunk of up to k tokens in every
slot (`decode_program`), finished sequences free their slots and pages, and the loop repeats
until every row is answered. The tokens equal the static sampler's under the same key: both
draw token t of row b with the key (step key, b, t) (`rollout.sampling`).

Shapes stay static: the prefill compiles once per admitted-group count bucket (powers of two)
and the decode chunk once per page-table width bucket (`decode_buckets` widths up to the
longest sequence's pages): attention reads the pages the longest live sequence holds, not
the whole cache. Sources: Kwon et al. 2023 (vLLM: PagedAttention, continuous batching,
recompute preemption); Yu et al. 2022 (Orca: iteration-level scheduling).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial
from typing import Literal, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from ppo_jax.models.functional import Model
from ppo_jax.models.paged_cache import ATTENTION_KERNELS, TRASH_PAGE, init_paged_cache
from ppo_jax.parallel.mesh import BATCH_AXES, batch_shards
from ppo_jax.rollout.engine_programs import (
    Admission, DrawSettings, decode_program, decode_width_buckets, empty_state, finalize,
    pick_width, prefill_program,
)
from ppo_jax.rollout.scheduler import Admitted, ReplicaScheduler, pages_for

ENGINES = ("static", "paged")
RolloutEngine = Literal[ENGINES]  # generation.engine
AttentionKernel = Literal[ATTENTION_KERNELS]  # generation.attention


@dataclass(frozen=True)
class EngineSettings:
    """The paged engine's own settings (`generation.*`); 0 means the default named."""

    page_size: int = 16  # tokens per page
    num_pages: int = 0  # pages in all replicas' pools; 0: the static sampler's KV memory
    max_concurrent: int = 0  # decode slots in all replicas; 0: the batch size
    decode_chunk: int = 8  # tokens per decode chunk between two scheduling rounds
    decode_buckets: int = 4  # page-table widths the decode chunk compiles for
    attention: str = "reference"  # "reference" (gather the pages) or "pallas" (TPU kernel)


@dataclass(frozen=True)
class EngineLayout:
    """The engine's sizes for one batch shape (`engine_layout`): replicas, rows, slots and
    pool pages per replica (the trash page included), pages of the longest sequence."""

    replicas: int
    rows: int
    slots: int
    pages: int
    max_pages: int
    group_size: int


@dataclass
class EngineStats:
    """What one `generate` call did: prefill calls, decode chunks and decode steps, the rows
    the decode steps ran on, the mean fraction of slots live per chunk, preemptions, the most
    pages in use at once (in one replica)."""

    prefills: int = 0
    chunks: int = 0
    steps: int = 0
    row_steps: int = 0  # sum over decode steps of the rows the model ran on (slot buckets x R)
    slot_occupancy: float = 0.0
    preemptions: int = 0
    peak_pages: int = 0
    widths: dict = field(default_factory=dict)  # page-table width -> decode chunks run at it
    rows: dict = field(default_factory=dict)  # live-slot bucket -> decode chunks run at it


def engine_layout(settings: EngineSettings, *, batch: int, prompt_width: int,
                  max_new_tokens: int, group_size: int, replicas: int) -> EngineLayout:
    """Check the settings against one batch shape and size the engine (before any compile).

    A sequence holds at most `prompt_width + max_new_tokens - 1` tokens (the last token is
    never fed back). Each replica's pool must hold the trash page and one sequence of that
    length (and a whole group's first chunk), its slots one group.

    Raises:
      ValueError: naming the `generation.*` setting and its value: too few pages; slots not a
        multiple of the replicas or fewer than a group per replica; a replica's rows not whole
        groups; a bad page size, chunk or kernel.
    """
    s, n = settings, group_size
    cache_len = prompt_width + max_new_tokens
    _positive(page_size=s.page_size, decode_chunk=s.decode_chunk, decode_buckets=s.decode_buckets)
    if s.attention not in ATTENTION_KERNELS:
        raise ValueError(f"generation.attention={s.attention!r}; one of {ATTENTION_KERNELS}")
    if batch % replicas or (batch // replicas) % n:
        raise ValueError(f"the batch of {batch} rows over {replicas} replicas (mesh data x fsdp) "
                         f"is not whole groups of samples_per_prompt={n} per replica")
    slots = s.max_concurrent or batch
    if slots % replicas or slots // replicas < n:
        raise ValueError(f"generation.max_concurrent={slots} must be a multiple of the "
                         f"{replicas} replicas (mesh data x fsdp) with at least "
                         f"samples_per_prompt={n} slots each")
    max_pages = pages_for(cache_len - 1, s.page_size)
    pages = (s.num_pages // replicas) if s.num_pages else 1 + (batch // replicas) * max_pages
    probe = ReplicaScheduler([], group_size=n, slots=1, num_pages=2, page_size=s.page_size,
                             max_new_tokens=max_new_tokens, chunk=s.decode_chunk)
    need = 1 + max(max_pages, probe.group_need(prompt_width, n))
    if s.num_pages % replicas or pages < need:
        raise ValueError(f"generation.num_pages={s.num_pages} gives {pages} pages per replica "
                         f"({replicas} replicas, the trash page included); a replica needs "
                         f"{need}: one sequence of {cache_len} tokens, or a group of {n} with "
                         f"its first chunk, in pages of {s.page_size}; give at least "
                         f"{need * replicas} (a multiple of {replicas})")
    return EngineLayout(replicas, batch // replicas, slots // replicas, pages, max_pages, n)


def check_page_size(page_size: int, cache_len: int, what: str) -> None:
    """A run's page size must divide its cache length `what` = `cache_len` (the longest
    prompt plus max_new_tokens), so the longest sequence fills whole pages.

    Raises:
      ValueError: naming `generation.page_size`, the cache length and page sizes that fit.
    """
    _positive(page_size=page_size)
    if cache_len % page_size:
        divisors = [d for d in range(1, min(cache_len, 256) + 1) if cache_len % d == 0]
        fits = sorted(sorted(divisors, key=lambda d: abs(d - page_size))[:4])
        raise ValueError(f"generation.page_size={page_size} does not divide the cache length "
                         f"{cache_len} ({what}); page sizes that do: {fits}")


def _positive(**values) -> None:
    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"generation.{name}={v!r} must be an int >= 1")


class PagedEngine:
    """The engine for one model, sampling settings and batch shape (module doc).

    Args:
      graphdef, cfg: the actor's graph (a model with `backbone` and `lm_head`) and its
        `ModelConfig`.
      sampling: a `rollout.sampler.SamplingSettings` (its `mesh` lays the engine out).
      settings: `EngineSettings`.
      batch, prompt_width: B rows of prompts P wide per `generate` call.
      cache_dtype: the pool's dtype (default the model's compute dtype).

    Raises:
      ValueError: see `engine_layout`; all before any compile.
    """

    def __init__(self, graphdef, cfg, sampling, settings: EngineSettings, *, batch: int,
                 prompt_width: int, cache_dtype=None):
        self.graphdef, self.cfg, self.settings, self.mesh = graphdef, cfg, settings, sampling.mesh
        self.layout = engine_layout(settings, batch=batch, prompt_width=prompt_width,
                                    max_new_tokens=sampling.max_new_tokens,
                                    group_size=sampling.samples_per_prompt,
                                    replicas=batch_shards(self.mesh))
        self.draw = DrawSettings(sampling.max_new_tokens, sampling.temperature, sampling.top_k,
                                 sampling.top_p, sampling.greedy, sampling.stop_token_ids,
                                 sampling.pad_token_id, settings.attention, self.mesh)
        self.batch, self.prompt_width, self.cache_dtype = batch, prompt_width, cache_dtype
        self.head_major = settings.attention == "reference"  # the pool's layout (PagedKVCache)
        self.widths = decode_width_buckets(self.layout.max_pages, settings.decode_buckets)
        self.slot_buckets = decode_width_buckets(self.layout.slots, settings.decode_buckets)
        self.last_stats = EngineStats()
        self._build()

    # ------------------------------------------------------------------ layouts and programs
    def _sharding(self, spec) -> Optional[NamedSharding]:
        return None if self.mesh is None else NamedSharding(self.mesh, spec)

    def cache_sharding(self) -> Optional[NamedSharding]:
        """The pool's layout: replicas over the batch axes, KV heads over `tensor` (where it
        divides them)."""
        tensor = self.mesh.shape["tensor"] if self.mesh is not None else 1
        heads = "tensor" if tensor > 1 and self.cfg.num_kv_heads % tensor == 0 else None
        if self.head_major:  # [layers, R, pages, 2 KVH, page, hd]
            return self._sharding(P(None, BATCH_AXES, None, heads))
        return self._sharding(P(None, BATCH_AXES, None, None, heads))

    def _build(self) -> None:
        """The jitted programs; with a mesh, their outputs laid out explicitly (pool and slots
        by replica, the host's reads replicated); pool, slots and responses are donated."""
        rows, rep, pool = self._sharding(P(BATCH_AXES)), self._sharding(P()), self.cache_sharding()
        lay, d = self.layout, self.draw
        self._prompt_lens = jax.jit(lambda m: jnp.sum(m.astype(jnp.int32), axis=1),
                                    out_shardings=rep)
        self._empty = jax.jit(partial(empty_state, lay.replicas, lay.slots, lay.rows,
                                      d.max_new_tokens, d.pad_token_id), out_shardings=(rows, rows))
        self._new_cache = jax.jit(partial(init_paged_cache, self.cfg, lay.replicas, lay.pages,
                                          self.settings.page_size, self.cache_dtype,
                                          self.head_major), out_shardings=pool)
        self._prefill = jax.jit(partial(prefill_program, settings=d), donate_argnums=(1, 2, 3),
                                out_shardings=(pool, rows, rows))
        self._decode = jax.jit(partial(decode_program, settings=d,
                                       chunk=self.settings.decode_chunk),
                               donate_argnums=(1, 2, 3),
                               out_shardings=(pool, rows, rows, rep, rep, rep))
        self._finalize = jax.jit(partial(finalize, pad_token_id=d.pad_token_id),
                                 out_shardings=(rows, rows, rows))

    def _put(self, x: np.ndarray):
        """A host array (the same on every host) -> a replicated device array."""
        if self.mesh is None:
            return jnp.asarray(x)
        sharding = NamedSharding(self.mesh, P())
        return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])

    # ------------------------------------------------------------------ one batch
    def generate(self, params, prompt_ids, prompt_mask, step_key):
        """Answer every row of a batch.

        Args:
          params: the actor's params (any layout; the rollout copy of `trainer`'s step).
          prompt_ids, prompt_mask: `[B, P]` int32, left-padded, batch rows (on the mesh: split
            over the batch axes), B and P as given to the constructor; rows in adjacent groups
            of n = `samples_per_prompt` copies of a prompt.
          step_key: the step's PRNG key (replicated).

        Returns:
          `(response_ids [B, N] int32, response_mask [B, N] int32, logprobs [B, N] float32)`,
          as `rollout.sampler.generate(..., return_logprobs=True)` (the same tokens under the
          same key); `self.last_stats` holds the call's `EngineStats`.
        """
        lay = self.layout
        if tuple(prompt_ids.shape) != (self.batch, self.prompt_width):
            raise ValueError(f"prompts {tuple(prompt_ids.shape)}; this engine was built for "
                             f"{(self.batch, self.prompt_width)}")
        model = Model(self.graphdef, params)
        lens = np.asarray(jax.device_get(self._prompt_lens(prompt_mask)))
        scheds = [ReplicaScheduler(lens[r * lay.rows:(r + 1) * lay.rows], group_size=lay.group_size,
                                   slots=lay.slots, num_pages=lay.pages,
                                   page_size=self.settings.page_size,
                                   max_new_tokens=self.draw.max_new_tokens,
                                   chunk=self.settings.decode_chunk) for r in range(lay.replicas)]
        state, responses = self._empty()
        cache, stats = self._new_cache(), EngineStats()
        while not all(s.finished for s in scheds):
            admitted = [s.admit() for s in scheds]
            if any(admitted):
                cache, state, responses = self._prefill(model, cache, state, responses, prompt_ids,
                                                        prompt_mask, self._admission(admitted),
                                                        step_key)
                stats.prefills += 1
            cache, state, responses = self._chunk(model, cache, state, responses, scheds,
                                                  step_key, stats)
        final = np.array([[s.final[i] for i in range(lay.rows)] for s in scheds], np.int32)
        stats.preemptions = sum(s.preemptions for s in scheds)
        stats.slot_occupancy /= max(stats.chunks, 1)
        self.last_stats = stats
        return self._finalize(responses, self._put(final))

    def _chunk(self, model, cache, state, responses, scheds, step_key, stats: EngineStats):
        """Grow every live sequence's pages, run one decode chunk, retire what finished."""
        for s in scheds:
            s.grow()
        live = np.stack([s.live() for s in scheds])
        if not live.any():
            raise RuntimeError("the paged engine admitted nothing with every slot free: the "
                               "pool cannot hold the next group (engine_layout's check failed)")
        stats.peak_pages = max(stats.peak_pages, max(s.pool.num_pages - 1 - s.pool.num_free
                                                     for s in scheds))
        width = pick_width(self.widths, max(s.max_pages() for s in scheds))
        rows = pick_width(self.slot_buckets, int(live.sum(axis=1).max()))
        slots = np.full((len(scheds), rows), self.layout.slots, np.int32)  # packed, then padding
        for r, s in enumerate(scheds):
            used = np.flatnonzero(live[r])
            slots[r, :len(used)] = used
        table = np.stack([s.page_table(width)[np.minimum(ix, self.layout.slots - 1)]
                          for s, ix in zip(scheds, slots)])
        packed = np.take_along_axis(live, np.minimum(slots, self.layout.slots - 1), axis=1)
        packed &= slots < self.layout.slots
        cache, state, responses, lengths, done, steps = self._decode(
            model, cache, state, responses, self._put(slots), self._put(table), self._put(packed),
            step_key)
        lengths, done, steps = jax.device_get((lengths, done, steps))
        for r, s in enumerate(scheds):
            s.retire(lengths[r], done[r])
        stats.chunks += 1
        stats.steps += int(steps)
        stats.row_steps += int(steps) * rows * len(scheds)
        stats.widths[width] = stats.widths.get(width, 0) + 1
        stats.slot_occupancy += float(live.mean())
        stats.rows[rows] = stats.rows.get(rows, 0) + 1
        return cache, state, responses

    def _admission(self, admitted: list[list[Admitted]]) -> Admission:
        """The replicas' admitted groups as one `Admission`, G per replica rounded up to a
        power of two (padding: invalid groups writing to the trash page)."""
        lay, n = self.layout, self.layout.group_size
        groups = 1 << max(0, math.ceil(math.log2(max(len(a) for a in admitted))))
        width = pages_for(self.prompt_width, self.settings.page_size)
        shape = (lay.replicas, groups)
        group_rows, prompt_pages = np.zeros(shape, np.int32), np.full(shape + (width,), TRASH_PAGE, np.int32)
        rows, slots = np.zeros(shape + (n,), np.int32), np.full(shape + (n,), lay.slots, np.int32)
        valid = np.zeros(shape + (n,), bool)
        src, dst = np.full(shape + (n,), TRASH_PAGE, np.int32), np.full(shape + (n,), TRASH_PAGE, np.int32)
        for r, groups_r in enumerate(admitted):
            for g, adm in enumerate(groups_r):
                k = len(adm.rows)
                group_rows[r, g] = adm.rows[0]
                prompt_pages[r, g, :len(adm.prompt_pages)] = adm.prompt_pages
                rows[r, g, :k], slots[r, g, :k], valid[r, g, :k] = adm.rows, adm.slots, True
                for j, (a, b) in enumerate(adm.copies, start=1):
                    src[r, g, j], dst[r, g, j] = a, b
        return Admission(*(self._put(x) for x in (group_rows, prompt_pages, rows, slots, valid,
                                                  src, dst)))

    # ------------------------------------------------------------------ ahead of time
    def programs(self, params, prompt_ids, prompt_mask, step_key) -> list[dict]:
        """The engine's jitted programs with abstract arguments (`jax.ShapeDtypeStruct`s of
        `params`, prompts and key) for `train.py --compile-for`, at their upper bound: every
        response `max_new_tokens` long, so each replica fills its slots `rounds` = rows / slots
        times. Each item: `{"name", "fn", "args", "per_step", "while_trips"}`: the prefill
        admitting a full set of slots (`rounds` calls), the decode chunk at the widest page
        table (`rounds * ceil((N - 1) / k)` calls of k steps)."""
        lay, k = self.layout, self.settings.decode_chunk
        rep, rows = self._sharding(P()), self._sharding(P(BATCH_AXES))
        abstract = lambda fn, sh: jax.tree.map(  # noqa: E731
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), jax.eval_shape(fn))
        cache = abstract(self._new_cache, self.cache_sharding())
        state, responses = abstract(self._empty, rows)
        groups = lay.slots // lay.group_size
        width = pages_for(self.prompt_width, self.settings.page_size)
        host = lambda shape, dtype=np.int32: jax.ShapeDtypeStruct(shape, dtype, sharding=rep)  # noqa: E731
        per_sample = (lay.replicas, groups, lay.group_size)
        admission = Admission(host((lay.replicas, groups)), host((lay.replicas, groups, width)),
                              host(per_sample), host(per_sample), host(per_sample, bool),
                              host(per_sample), host(per_sample))
        model = Model(self.graphdef, params)
        rounds = -(-lay.rows // lay.slots)
        chunks = rounds * -(-(self.draw.max_new_tokens - 1) // k)
        table = host((lay.replicas, lay.slots, self.widths[-1]))
        live, slots = host((lay.replicas, lay.slots), bool), host((lay.replicas, lay.slots))
        return [
            {"name": "engine_prefill", "fn": self._prefill, "per_step": rounds, "while_trips": 1,
             "args": (model, cache, state, responses, prompt_ids, prompt_mask, admission,
                      step_key)},
            {"name": "engine_decode", "fn": self._decode, "per_step": chunks, "while_trips": k,
             "args": (model, cache, state, responses, slots, table, live, step_key)},
        ]
