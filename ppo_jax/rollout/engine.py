"""The paged rollout engine (`generation.engine: paged`): a KV cache in pages, a fixed number of
decode slots and continuous batching. It also runs the turn loop of multi-turn episodes for
both engines: static multi-turn is this engine with one page per row (`static_layout`).

    engine = PagedEngine(graphdef, cfg, sampling, EngineSettings(...), batch=256, prompt_width=64)
    out = engine.generate(params, prompt_ids, prompt_mask, key)  # a `draws.Generation`
    stream = engine.stream(params, version=0)  # batches sharing the slots: `rollout.stream`

A batch of B rows (adjacent groups of n samples of one prompt) is answered by R replicas, one
per row block of the mesh's batch axes (`data` x `fsdp`; R = 1 on one device): replica r owns
rows [r B / R, (r + 1) B / R), its own slots and its own pool of pages, and its slots and pages
live on its devices, so no decode step moves pages or rows between devices. On the host, one
`scheduler.ReplicaScheduler` per replica admits groups into free slots (prefill into pages,
`engine_programs.prefill_program`), the devices run a decode chunk of up to k tokens in every
slot (`decode_program`), finished sequences free their slots and pages, and the loop repeats
until every row is answered. The tokens equal those `rollout.static_batch` draws under the
same key: both draw token t of row b with the key (step key, b, t), see `rollout.draws`.

With `SamplingSettings.turns` the engine plays multi-turn episodes: a turn that ends hands its
tokens to its environment and waits, holding its slot and pages, while the other slots go on
decoding; at the first chunk boundary its answer is ready, the observation is prefilled into
its pages (`rollout.turns`). With several processes each hands over its own rows' turns and
the answers are exchanged at each boundary, so all run the same programs (`turns.TurnLoop`).

Shapes stay static: the prefill compiles once per admitted-group count bucket (powers of two)
and the decode chunk once per page-table width bucket (`decode_buckets` widths up to the
longest sequence's pages): attention reads the pages the longest live sequence holds, not
the whole cache. Sources: Kwon et al. 2023 (vLLM: PagedAttention, continuous batching,
recompute preemption); Yu et al. 2022 (Orca: iteration-level scheduling).
"""

from __future__ import annotations

import math
from functools import partial
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from ppo_jax.models.functional import Model
from ppo_jax.models.paged_cache import TRASH_PAGE, init_paged_cache
from ppo_jax.parallel.host import allgather_json, local_rows, owned_rows, put_rows, row_range
from ppo_jax.parallel.mesh import BATCH_AXES, batch_shards
from ppo_jax.rollout.engine_layout import EngineSettings, EngineStats, engine_layout
from ppo_jax.rollout.draws import Generation, SamplingSettings
from ppo_jax.rollout.engine_programs import (
    Admission, Resumption, decode_program, decode_width_buckets, empty_state, finalize,
    pick_width, prefill_program, resume_program,
)
from ppo_jax.rollout.scheduler import Admitted, ReplicaScheduler, pages_for
from ppo_jax.rollout.static_batch import is_key
from ppo_jax.rollout.stream import RolloutStream
from ppo_jax.rollout.turns import (
    TurnCallback, TurnLoop, TurnRecord, TurnService, checked_settings, episodes_of, turn_service,
)

STATIC_DECODE_CHUNK = 8  # static multi-turn: tokens decoded between two host rounds
IDLE_WAIT_S = 1.0  # every live slot waits for its environment: the longest block (one process)
IDLE_POLL_S = 0.02  # the same with several processes: they exchange answers this often


def turn_rows(mesh, batch: int) -> tuple[int, int]:
    """`(start, stop)`: the rows of a B-row batch whose turns this process hands to its
    environment in an engine on `mesh` (None: one device): the row blocks of the mesh's batch
    axes it holds and no lower process holds (`parallel.host.owned_rows`); all B with one
    process. The episode driver plays the same rows."""
    sharding = None if mesh is None else NamedSharding(mesh, P(BATCH_AXES))
    return owned_rows(sharding, batch)


def static_layout(batch: int, prompt_width: int, max_new_tokens: int) -> EngineSettings:
    """The engine settings of `generation.engine: static` with turns: static multi-turn is the
    engine with one page per row. Every row has its own slot (`max_concurrent` = B) and one
    page holds its whole sequence (`page_size` = P + N; the pool: B pages and the trash page),
    one page-table width, attention by the reference gather: the static batch's cache, cut
    per row, with the engine's turn loop."""
    return EngineSettings(page_size=prompt_width + max_new_tokens, num_pages=0,
                          max_concurrent=batch, decode_chunk=STATIC_DECODE_CHUNK,
                          decode_buckets=1, attention="reference")


class PagedEngine:
    """The engine for one model, sampling settings and batch shape (module doc).

    Args:
      graphdef, cfg: the actor's graph (a model with `backbone` and `lm_head`) and its
        `ModelConfig`.
      sampling: `draws.SamplingSettings` (its `mesh` lays the engine out); with `turns`, the
        engine plays multi-turn episodes (`generate` then takes an `on_turn_end`).
      settings: `EngineSettings` (`static_layout` for the static cache layout).
      batch, prompt_width: B rows of prompts P wide per `generate` call.
      cache_dtype: the pool's dtype (default the model's compute dtype).

    Raises:
      ValueError: bad sampling settings (`turns.checked_settings`); see `engine_layout`; all
        before any compile.
    """

    def __init__(self, graphdef, cfg, sampling: SamplingSettings, settings: EngineSettings, *,
                 batch: int, prompt_width: int, cache_dtype=None):
        self.graphdef, self.cfg, self.settings, self.mesh = graphdef, cfg, settings, sampling.mesh
        self.sampling = checked_settings(sampling, cfg, prompt_width)
        self.turns = self.sampling.turns is not None
        self.layout = engine_layout(settings, batch=batch, prompt_width=prompt_width,
                                    max_new_tokens=sampling.max_new_tokens,
                                    group_size=sampling.samples_per_prompt,
                                    replicas=batch_shards(self.mesh), turns=self.turns)
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
        lay, d, kernel = self.layout, self.sampling, self.settings.attention
        self._prompt_lens = jax.jit(lambda m: jnp.sum(m.astype(jnp.int32), axis=1),
                                    out_shardings=rep)
        routes_of = self.cfg if d.record_routes and getattr(self.cfg, "num_moe_layers", 0) else None
        self.routes_of = routes_of  # the config whose routes are recorded (None: none)
        self._empty = jax.jit(partial(empty_state, lay.replicas, lay.slots, lay.rows,
                                      d.max_new_tokens, d.pad_token_id, routes_of),
                              out_shardings=(rows, rows))
        self._new_cache = jax.jit(partial(init_paged_cache, self.cfg, lay.replicas, lay.pages,
                                          self.settings.page_size, self.cache_dtype,
                                          self.head_major), out_shardings=pool)
        self._prefill = jax.jit(partial(prefill_program, settings=d), donate_argnums=(1, 2, 3),
                                out_shardings=(pool, rows, rows))
        self._decode = jax.jit(partial(decode_program, settings=d, kernel=kernel,
                                       chunk=self.settings.decode_chunk),
                               donate_argnums=(1, 2, 3),
                               out_shardings=(pool, rows, rows, rep, rep, rep, rep))
        self._resume = jax.jit(partial(resume_program, settings=d, kernel=kernel),
                               donate_argnums=(1, 2, 3),
                               out_shardings=(pool, rows, rows))
        self._finalize = jax.jit(partial(finalize, pad_token_id=d.pad_token_id),
                                 out_shardings=(rows,) * (3 if routes_of is None else 4))

    def _put(self, x: np.ndarray):
        """A host array (the same on every host) -> a replicated device array."""
        if self.mesh is None:
            return jnp.asarray(x)
        sharding = NamedSharding(self.mesh, P())
        return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])

    # ------------------------------------------------------------------ one batch
    def generate(self, params, prompt_ids, prompt_mask, step_key,
                 on_turn_end: Optional[TurnCallback | TurnService] = None):
        """Answer every row of a batch.

        Args:
          params: the actor's params (any layout; the rollout copy of `trainer`'s step).
          prompt_ids, prompt_mask: `[B, P]` int32, left-padded, batch rows (on the mesh: split
            over the batch axes), B and P as given to the constructor; rows in adjacent groups
            of n = `samples_per_prompt` copies of a prompt.
          step_key: the step's PRNG key (replicated); None when greedy.
          on_turn_end: with turns, the environment: a `turns.TurnService` (asynchronous: its
            answers are taken in at whichever chunk boundary they are ready), or a callable
            `on_turn_end(rows, turn_tokens)` answered at once: `rows` the batch rows whose
            turn ended, `turn_tokens` each one's turn as a list of token ids (from its first
            drawn token to the stop token / the last token of the stop sequence); one answer
            per row: None ends the episode; a list of token ids (the observation; [] is
            allowed) is appended and the model's next turn follows it. At a row's
            `max_turns`-th turn end it is still asked (to let the environment score the turn)
            and the row ends whatever it says. With several processes each is asked only
            about the rows `turn_rows` gives it. Required with turns, refused without.

        Returns:
          a `draws.Generation` `[B, N]`, with the tokens, mask and log-probs the static batch
          draws under the same key, and with turns its `episodes`. `self.last_stats` holds the
          call's `EngineStats`.

        Raises:
          ValueError: prompts of another shape than the engine's; `on_turn_end` missing or not
            callable with turns, given without; its bad answers (naming the row).
        """
        lay = self.layout
        if tuple(prompt_ids.shape) != (self.batch, self.prompt_width):
            raise ValueError(f"prompts {tuple(prompt_ids.shape)}; this engine was built for "
                             f"{(self.batch, self.prompt_width)}")
        if self.turns != (on_turn_end is not None):
            raise ValueError(f"on_turn_end={on_turn_end!r}: a multi-turn engine (settings with "
                             "turns) needs a callable, a single-turn one takes none")
        turns = self._turn_loop(on_turn_end) if self.turns else None
        step_key = self._key(step_key)
        model = Model(self.graphdef, params)
        lens = np.asarray(jax.device_get(self._prompt_lens(prompt_mask)))
        scheds = [ReplicaScheduler(lens[r * lay.rows:(r + 1) * lay.rows], group_size=lay.group_size,
                                   slots=lay.slots, num_pages=lay.pages,
                                   page_size=self.settings.page_size,
                                   max_new_tokens=self.sampling.max_new_tokens,
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
            cache, state, responses = self._round(model, cache, state, responses, scheds,
                                                  step_key, stats, turns)
        final = np.array([[s.final[i] for i in range(lay.rows)] for s in scheds], np.int32)
        stats.preemptions = sum(s.preemptions for s in scheds)
        stats.slot_occupancy /= max(stats.chunks, 1)
        self.last_stats = stats
        out = self._finalize(responses, self._put(final))
        if self.turns:
            return self._episodes(turns.record, out, final.reshape(-1))
        return Generation(*out[:3], None, out[3] if len(out) == 4 else None)

    def stream(self, params, version: int = 0, *, max_batches_in_flight: int = 2,
               partial_rollouts: bool = True, kv_on_switch: str = "recompute") -> RolloutStream:
        """A `rollout.stream.RolloutStream` over this engine: batches submitted one after
        another share the slots (up to `max_batches_in_flight` at once), and new weights of a
        policy `version` reach the live sequences at chunk boundaries (`partial_rollouts`,
        `kv_on_switch`: see that module). Its programs are its own but the prefill and
        decode, which it shares with `generate`.

        Raises:
          ValueError: see `RolloutStream`.
        """
        return RolloutStream(self, params, version, max_batches_in_flight=max_batches_in_flight,
                             partial_rollouts=partial_rollouts, kv_on_switch=kv_on_switch)

    def _turn_loop(self, on_turn_end) -> TurnLoop:
        """The batch's `turns.TurnLoop`: its service, the rows this process owns, the exchange
        between processes (none with one)."""
        exchange = allgather_json if jax.process_count() > 1 else (lambda v: [v])
        return TurnLoop(self.batch, self.layout.rows, self.sampling, turn_service(on_turn_end),
                        turn_rows(self.mesh, self.batch), exchange, self.cfg.vocab_size)

    def _round(self, model, cache, state, responses, scheds, step_key, stats: EngineStats,
               turns: Optional[TurnLoop]):
        """One host round after admission: a decode chunk of the live slots that do not wait
        for their environment, or, when every live slot waits, a wait for an answer
        (`TurnService.wait`: `IDLE_POLL_S` with several processes, which then exchange); then
        the new turn ends handed over and the ready answers taken in (`turns.TurnLoop`), the
        slots they resume fed their observations."""
        if turns is None:
            return self._chunk(model, cache, state, responses, scheds, step_key, stats)[:3]
        waiting = turns.pending_mask(len(scheds), self.layout.slots)
        if waiting.any() and not (np.stack([s.live() for s in scheds]) & ~waiting).any():
            turns.service.wait(IDLE_POLL_S if jax.process_count() > 1 else IDLE_WAIT_S)
            held = []
        else:
            cache, state, responses, held = self._chunk(model, cache, state, responses, scheds,
                                                        step_key, stats, waiting)
        if any(held):
            turns.hand_over(held, scheds, lambda: local_rows(responses.tokens),
                            self._first_replica())
        if turns.pending:
            before = len(turns.pending)
            resumes = turns.take_answers(scheds)
            stats.turn_rounds += int(len(turns.pending) < before)
            if any(resumes):
                cache, state, responses = self._resume(model, cache, state, responses,
                                                       self._resumption(resumes), step_key)
        return cache, state, responses

    def _first_replica(self) -> int:
        """The first replica whose rows this process holds (0 with one process)."""
        if jax.process_count() == 1:
            return 0
        return row_range(self._sharding(P(BATCH_AXES)), self.layout.replicas)[0]

    def _key(self, step_key):
        """The step's key, checked; None only when greedy (a fixed key, never read)."""
        if step_key is None:
            if not self.sampling.greedy:
                raise ValueError("step_key is required for sampling (greedy=False)")
            return self._put(np.asarray(jax.random.PRNGKey(0)))
        if not is_key(step_key):
            raise ValueError(f"step_key must be a PRNG key (jax.random.key or PRNGKey), got "
                             f"{type(step_key).__name__} {getattr(step_key, 'shape', '')}")
        return step_key

    def _episodes(self, record: TurnRecord, out, lengths: np.ndarray) -> Generation:
        """The finished multi-turn batch, observations and action mask written on the host
        (`turns.episodes_of`) into this process's rows, laid out by row; `lengths [B]` every
        row's response length."""
        rows = self._sharding(P(BATCH_AXES))
        first = row_range(rows, self.batch)[0] if rows is not None else 0
        ids, mask, logp, episodes = episodes_of(record, *(local_rows(x) for x in out[:3]),
                                                lengths, first)
        if rows is None:
            put = jnp.asarray
        else:
            put = lambda x: put_rows(x, rows, (self.batch, *x.shape[1:]))  # noqa: E731
        return Generation(put(ids), put(mask), put(logp),
                          episodes._replace(action_mask=put(episodes.action_mask)),
                          out[3] if len(out) == 4 else None)

    def _resumption(self, resumes: list[list]) -> Resumption:
        """Replica r's resuming slots `(slot, fed tokens, pages)` as one `Resumption`: K slots
        per replica (a live-slot bucket), W tokens (a power of two), Wp pages (a page-table
        width bucket); padding: slot index past the last, trash pages."""
        lay = self.layout
        k = pick_width(self.slot_buckets, max(len(r) for r in resumes))
        longest = max(len(fed) for r in resumes for _, fed, _ in r)
        width = 1 << max(0, math.ceil(math.log2(longest)))
        pages = pick_width(self.widths, max(len(p) for r in resumes for _, _, p in r))
        slots = np.full((lay.replicas, k), lay.slots, np.int32)
        tokens = np.full((lay.replicas, k, width), self.sampling.pad_token_id, np.int32)
        counts = np.ones((lay.replicas, k), np.int32)
        table = np.full((lay.replicas, k, pages), TRASH_PAGE, np.int32)
        for r, items in enumerate(resumes):
            for i, (slot, fed, held) in enumerate(items):
                slots[r, i], counts[r, i] = slot, len(fed)
                tokens[r, i, :len(fed)], table[r, i, :len(held)] = fed, held
        return Resumption(*(self._put(x) for x in (slots, tokens, counts, table)))

    def _chunk(self, model, cache, state, responses, scheds, step_key, stats: EngineStats,
               waiting: Optional[np.ndarray] = None):
        """Grow every live sequence's pages, run one decode chunk over the live slots but the
        `waiting` ones (`[R, S]`: their turns wait for an environment), retire what finished;
        returns the state and, per replica, the slots whose turn ended or still waits
        (multi-turn)."""
        for s in scheds:
            if s.grow() and self.turns:
                raise RuntimeError("the multi-turn engine preempted a sequence: its pool is "
                                   "smaller than engine_layout's check allows")
        live = np.stack([s.live() for s in scheds])
        if not live.any():
            raise RuntimeError("the paged engine admitted nothing with every slot free: the "
                               "pool cannot hold the next group (engine_layout's check failed)")
        stats.peak_pages = max(stats.peak_pages, max(s.pool.num_pages - 1 - s.pool.num_free
                                                     for s in scheds))
        decoding = live if waiting is None else live & ~waiting
        width = pick_width(self.widths, max(s.max_pages() for s in scheds))
        rows = pick_width(self.slot_buckets, int(decoding.sum(axis=1).max()))
        slots = np.full((len(scheds), rows), self.layout.slots, np.int32)  # packed, then padding
        for r, s in enumerate(scheds):
            used = np.flatnonzero(decoding[r])
            slots[r, :len(used)] = used
        table = np.stack([s.page_table(width)[np.minimum(ix, self.layout.slots - 1)]
                          for s, ix in zip(scheds, slots)])
        packed = np.take_along_axis(decoding, np.minimum(slots, self.layout.slots - 1), axis=1)
        packed &= slots < self.layout.slots
        cache, state, responses, lengths, done, waiting, steps = self._decode(
            model, cache, state, responses, self._put(slots), self._put(table), self._put(packed),
            step_key)
        lengths, done, waiting, steps = jax.device_get((lengths, done, waiting, steps))
        held = [s.retire(lengths[r], done[r], waiting[r]) for r, s in enumerate(scheds)]
        stats.chunks += 1
        stats.steps += int(steps)
        stats.row_steps += int(steps) * rows * len(scheds)
        stats.widths[width] = stats.widths.get(width, 0) + 1
        stats.slot_occupancy += float(live.mean())
        stats.rows[rows] = stats.rows.get(rows, 0) + 1
        return cache, state, responses, held

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
        times. Each item is a dict with keys "name", "fn", "args", "per_step" and
        "while_trips". The first is the prefill admitting a full set of slots, called `rounds`
        times. The second is the decode chunk of k steps at the widest page table, called
        `rounds * ceil((N - 1) / k)` times. With turns, the third is the resume after an
        observation, every slot at once, `rounds * (max_turns - 1)` times."""
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
        chunks = rounds * -(-(self.sampling.max_new_tokens - 1) // k)
        table = host((lay.replicas, lay.slots, self.widths[-1]))
        live, slots = host((lay.replicas, lay.slots), bool), host((lay.replicas, lay.slots))
        out = [
            {"name": "engine_prefill", "fn": self._prefill, "per_step": rounds, "while_trips": 1,
             "args": (model, cache, state, responses, prompt_ids, prompt_mask, admission,
                      step_key)},
            {"name": "engine_decode", "fn": self._decode, "per_step": chunks, "while_trips": k,
             "args": (model, cache, state, responses, slots, table, live, step_key)},
        ]
        if self.turns:  # every slot resumes after each turn but the last, W = N tokens at most
            n, width = self.sampling.max_new_tokens, self.widths[-1]
            fed = 1 << max(0, math.ceil(math.log2(n)))
            per_slot = (lay.replicas, lay.slots)
            resumption = Resumption(host(per_slot), host((*per_slot, fed)), host(per_slot),
                                    host((*per_slot, width)))
            out.append({"name": "engine_resume", "fn": self._resume, "while_trips": 1,
                        "per_step": rounds * (self.sampling.turns.max_turns - 1),
                        "args": (model, cache, state, responses, resumption, step_key)})
        return out
