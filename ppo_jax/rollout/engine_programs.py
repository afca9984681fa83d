"""The paged engine's device programs: prefill admitted groups into their pages and slots, decode
a chunk of k tokens in every live slot, and gather the responses (`rollout.engine` runs them).

Every array has a leading replica axis R (one replica per row block of the mesh's batch axes):
slots `[R, S]`, responses `[R, B / R, N]` (replica r answers batch rows r * B / R ...), the
pool `[layers, R, pages, ...]` (`models.paged_cache`). Slot state, pages and responses stay on
the devices for the whole batch; the host sends page tables and admissions, and reads back
only the slots' lengths and done flags after each chunk.

A stream of batches (`rollout.stream`) holds a ring of C batches' rows: responses
`[R, C B / R, N]`, replica r's rows of block c at local rows c B / R ..., and one step key per
block (`step_key` `[C]`): each row is drawn with its own batch's key and batch row
(`_row_keys`), so a streamed batch's tokens are those of `generate` under its key.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import struct

from ppo_jax.models.functional import Model
from ppo_jax.models.paged_cache import PagedKVCache, PagedView
from ppo_jax.rollout.draws import SamplingSettings, draw, empty_routes, sample_keys


def _draw(s: SamplingSettings, logits, keys, t):
    return draw(logits, keys, t, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                greedy=s.greedy)


def _turn_ends(s: SamplingSettings, responses: "Responses", rows, column, turn_start, token):
    """`[R, X]` bool: the token just recorded at `(rows, column)` ends a turn (single-turn: the
    row): a stop token, or the last of a stop sequence whose k tokens (columns column - k + 1 ..
    column of the responses) lie inside the turn (column - k + 1 >= turn_start)."""
    hit = jnp.isin(token, jnp.asarray(s.stop_token_ids or (-1,), jnp.int32))
    take = jax.vmap(lambda x, r, c: x[r, c])  # per replica: [B/R, N] at [X], [X]
    for seq in (s.turns.stop_sequences if s.turns is not None else ()):
        first = column - len(seq) + 1
        match = first >= turn_start
        for i, tok in enumerate(seq):
            cols = jnp.clip(first + i, 0, responses.tokens.shape[2] - 1)
            match = match & (take(responses.tokens, rows, cols) == tok)
        hit = hit | match
    return hit


@struct.dataclass
class SlotState:
    """Per slot `[R, S]`: the last drawn token (not yet fed), its position in the sequence, the
    slot's batch row (local to the replica), response columns written, whether it is done; for
    multi-turn rows, the first column of the current turn and whether its last token ended the
    turn (the slot is then done until the host answers: `resume_program`)."""

    token: jax.Array
    position: jax.Array
    row: jax.Array
    length: jax.Array
    done: jax.Array
    turn_start: jax.Array
    waiting: jax.Array


@struct.dataclass
class Responses:
    """Tokens and their log-probs `[R, B / R, N]`, written as they are drawn; with routes
    recorded, the experts each token went through when it was fed `[R, B / R, N, moe_layers,
    k]` (-1: not fed), else None."""

    tokens: jax.Array
    logprobs: jax.Array
    routes: Optional[jax.Array] = None


@struct.dataclass
class Admission:
    """The groups one prefill admits, G per replica (padded; `valid` False for padding), n
    samples each (groups of one after a preemption: the other samples invalid).

    group_rows `[R, G]` (local row of sample 0), prompt_pages `[R, G, Wp]`, and per sample
    `[R, G, n]`: rows (local), slots, valid, copy_src / copy_dst (the partial prompt page each
    later sample copies; the trash page for none)."""

    group_rows: jax.Array
    prompt_pages: jax.Array
    rows: jax.Array
    slots: jax.Array
    valid: jax.Array
    copy_src: jax.Array
    copy_dst: jax.Array


def empty_state(replicas: int, slots: int, rows: int, max_new_tokens: int, pad_token_id: int,
                routes_of=None):
    """`(SlotState, Responses)` of an empty engine: every slot done, responses all pad; routes
    all -1 for the `ModelConfig` `routes_of` (None: none recorded)."""
    z, no = jnp.zeros((replicas, slots), jnp.int32), jnp.zeros((replicas, slots), bool)
    shape = (replicas, rows, max_new_tokens)
    routes = None if routes_of is None else empty_routes((replicas, rows), max_new_tokens,
                                                         routes_of)
    return (SlotState(z, z, z, z, jnp.ones((replicas, slots), bool), z, no),
            Responses(jnp.full(shape, pad_token_id, jnp.int32), jnp.zeros(shape, jnp.float32),
                      routes))


def _rows_of(x: jax.Array) -> jax.Array:
    """`[R, X, ...]` -> `[R * X, ...]`."""
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _global_rows(local_rows: jax.Array, rows_per_replica: int) -> jax.Array:
    """Local rows `[R, ...]` -> batch rows `r * B / R + local` (the draws' keys)."""
    r = jnp.arange(local_rows.shape[0], dtype=jnp.int32).reshape(-1, *[1] * (local_rows.ndim - 1))
    return r * rows_per_replica + local_rows


def is_key_ring(step_key: jax.Array) -> bool:
    """Whether `step_key` is a stack of keys `[C]` (one per block of a stream's ring), not one
    key: a typed key array of rank 1, or raw uint32 keys of rank 2 (static: shapes only)."""
    typed = jnp.issubdtype(step_key.dtype, jax.dtypes.prng_key)
    return step_key.ndim == (1 if typed else 2)


def _row_keys(step_key: jax.Array, local_rows: jax.Array, rows_per_replica: int) -> jax.Array:
    """`[R * X]` keys of the samples at local rows `[R, X]`: `fold_in(key, batch row)`
    (`draws.sample_keys`). With one step key the local rows are one batch's; with a ring of
    C keys (`is_key_ring`), local row c B / R + i of replica r is row r B / R + i of the batch
    in block c, drawn with block c's key."""
    if not is_key_ring(step_key):
        return sample_keys(step_key, _rows_of(_global_rows(local_rows, rows_per_replica)))
    per_block = rows_per_replica // step_key.shape[0]
    batch_rows = _global_rows(local_rows % per_block, per_block)
    keys = step_key[_rows_of(local_rows // per_block)]
    return jax.vmap(jax.random.fold_in)(keys, _rows_of(batch_rows).astype(jnp.uint32))


def _record(responses: Responses, rows, t, tokens, logprobs, keep) -> Responses:
    """Write `tokens`, `logprobs` at `(replica, rows, t)` (each `[R, X]`) where `keep`."""
    n_rows = responses.tokens.shape[1]
    rows = jnp.where(keep, rows, n_rows)  # out of range: dropped

    def one(resp_t, resp_l, r, tt, tok, lp):
        return resp_t.at[r, tt].set(tok, mode="drop"), resp_l.at[r, tt].set(lp, mode="drop")

    tok, lp = jax.vmap(one)(responses.tokens, responses.logprobs, rows, t, tokens, logprobs)
    return responses.replace(tokens=tok, logprobs=lp)


def _record_routes(responses: Responses, rows, columns, routing, keep) -> Responses:
    """Write the experts of the tokens fed at `(replica, rows, columns)` (each `[R, X]`) where
    `keep`: `routing.experts` `[R * X, 1, moe_layers, k]` of the pass (None: no MoE)."""
    if responses.routes is None or routing is None:
        return responses
    n_rows = responses.routes.shape[1]
    rows = jnp.where(keep, rows, n_rows)  # out of range: dropped
    experts = routing.experts.reshape(*rows.shape, *routing.experts.shape[2:])
    put = jax.vmap(lambda r, x, i, c: r.at[i, c].set(x.astype(r.dtype), mode="drop"))
    return responses.replace(routes=put(responses.routes, experts, rows, columns))


def _copy_pages(cache: PagedKVCache, src: jax.Array, dst: jax.Array) -> PagedKVCache:
    """Every layer's page `src[r, i]` copied to `dst[r, i]` (`[R, X]`; trash to trash: none)."""
    replica = jnp.arange(src.shape[0], dtype=jnp.int32)[:, None]  # explicit: see write_pages
    return cache.replace(kv=cache.kv.at[:, replica, dst].set(cache.kv[:, replica, src]))


def _prefill_logits(model, cache: PagedKVCache, ids, mask, pages, mesh):
    """The admitted prompts `[R, G, P]` through the model into their pages -> logits of each
    prompt's last position `[R, G, V]`, the cache."""
    replicas, groups, width = ids.shape
    mask = _rows_of(mask)
    view = PagedView(pages, jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0), mask > 0,
                     mask.sum(axis=1), "reference", mesh, whole_pages=True)
    hidden, cache = model.backbone(_rows_of(ids), None, cache=cache, paged=view)
    logits = model.lm_head(hidden[:, -1])
    return logits.reshape(replicas, groups, -1), cache


def prefill_program(model: Model, cache: PagedKVCache, state: SlotState, responses: Responses,
                    prompt_ids, prompt_mask, admission: Admission, step_key, *,
                    settings: SamplingSettings):
    """Admit groups: prompts `[B, P]` (left-padded, batch rows) -> the admitted groups' prompts
    in their pages, the later samples' partial pages copied, each sample's first token drawn
    (key of its batch row, position 0) into its slot and its response row.

    Returns `(cache, state, responses)`."""
    s, a = settings, admission
    replicas, rows = state.token.shape[0], responses.tokens.shape[1]
    local = lambda x: x.reshape(replicas, rows, *x.shape[1:])  # noqa: E731
    take = jax.vmap(lambda x, i: x[i])
    ids = take(local(prompt_ids.astype(jnp.int32)), a.group_rows)
    mask = take(local(prompt_mask.astype(jnp.int32)), a.group_rows) * a.valid[:, :, :1]
    logits, cache = _prefill_logits(model.merge(), cache, ids, mask, a.prompt_pages, s.mesh)
    cache = _copy_pages(cache, a.copy_src.reshape(replicas, -1), a.copy_dst.reshape(replicas, -1))
    n = a.rows.shape[2]
    sample_logits = jnp.repeat(logits, n, axis=1)  # [R, G * n, V]
    keys = _row_keys(step_key, a.rows.reshape(replicas, -1), rows)
    token, logp = _draw(s, _rows_of(sample_logits), keys, 0)
    token, logp = token.reshape(replicas, -1), logp.reshape(replicas, -1)
    valid, sample_rows = a.valid.reshape(replicas, -1), a.rows.reshape(replicas, -1)
    prompt_len = jnp.repeat(mask.sum(axis=2), n, axis=1)
    zero = jnp.zeros_like(token)
    responses = _record(responses, sample_rows, zero, token, logp, valid)
    turn_end = _turn_ends(s, responses, sample_rows, zero, zero, token)
    done = turn_end | (s.max_new_tokens <= 1)
    slots = jnp.where(valid, a.slots.reshape(replicas, -1), state.token.shape[1])
    put = jax.vmap(lambda x, i, v: x.at[i].set(v, mode="drop"))
    state = SlotState(put(state.token, slots, token), put(state.position, slots, prompt_len),
                      put(state.row, slots, sample_rows), put(state.length, slots, zero + 1),
                      put(state.done, slots, done), put(state.turn_start, slots, zero),
                      put(state.waiting, slots, turn_end & (s.turns is not None)))
    return cache, state, responses


def _decode_step(model, cache, state: SlotState, responses: Responses, page_table, live,
                 step_key, s: SamplingSettings, kernel: str):
    """Feed every active slot's last token, draw the next one, record it."""
    replicas, slots = state.token.shape
    active = live & ~state.done
    position = jnp.where(active, state.position, 0)
    view = PagedView(page_table, _rows_of(position)[:, None], _rows_of(active)[:, None],
                     _rows_of(position) + 1, kernel, s.mesh)
    hidden, cache, routing = model.backbone.run(_rows_of(state.token)[:, None], None,
                                                cache=cache, paged=view)
    responses = _record_routes(responses, state.row, state.length - 1, routing, active)
    logits = model.lm_head(hidden[:, 0])
    rows_per_replica = responses.tokens.shape[1]
    keys = _row_keys(step_key, state.row, rows_per_replica)
    token, logp = _draw(s, logits, keys, _rows_of(state.length))
    token, logp = token.reshape(replicas, slots), logp.reshape(replicas, slots)
    responses = _record(responses, state.row, state.length, token, logp, active)
    turn_end = _turn_ends(s, responses, state.row, state.length, state.turn_start, token)
    ended = turn_end | (state.length + 1 >= s.max_new_tokens)
    step = active.astype(jnp.int32)
    state = SlotState(jnp.where(active, token, state.token), state.position + step, state.row,
                      state.length + step, state.done | (active & ended), state.turn_start,
                      state.waiting | (active & turn_end & (s.turns is not None)))
    return cache, state, responses


def _take_slots(state: SlotState, slots) -> SlotState:
    """The slots `slots [R, K]` of `state` (an index past the last slot: a done slot)."""
    take = jax.vmap(lambda x, i: x.at[i].get(mode="fill", fill_value=0))
    sub = jax.tree.map(lambda x: take(x, slots), state)
    return sub.replace(done=sub.done | (slots >= state.done.shape[1]))


def _put_slots(state: SlotState, slots, sub: SlotState) -> SlotState:
    """`state` with its slots `slots [R, K]` replaced by `sub` (indices past the end: none)."""
    put = jax.vmap(lambda x, i, v: x.at[i].set(v, mode="drop"))
    return jax.tree.map(lambda x, v: put(x, slots, v), state, sub)


def decode_program(model: Model, cache: PagedKVCache, state: SlotState, responses: Responses,
                   slots, page_table, live, step_key, *, settings: SamplingSettings, kernel: str,
                   chunk: int):
    """Up to `chunk` one-token steps of the slots `slots [R, K]` (the host's live slots, packed
    first, padded with an index past the last slot; K a bucket: the model runs on K rows, not
    on every slot), `live [R, K]` and `page_table [R, K, W]` (every page the chunk writes) of
    the same slots, stopping early when none is active; `kernel` the attention over the pages
    ("reference" | "pallas"). Returns `(cache, state, responses,
    lengths [R, S], done [R, S], waiting [R, S], steps)` (steps: the one-token steps run,
    int32)."""
    module = model.merge()
    full, state = state, _take_slots(state, slots)

    def cond(carry):
        i, _, st, _ = carry
        return (i < chunk) & jnp.any(live & ~st.done)

    def body(carry):
        i, c, st, resp = carry
        c, st, resp = _decode_step(module, c, st, resp, page_table, live, step_key, settings,
                                    kernel)
        return i + 1, c, st, resp

    steps, cache, state, responses = jax.lax.while_loop(cond, body, (jnp.int32(0), cache, state,
                                                                    responses))
    state = _put_slots(full, slots, state)
    return cache, state, responses, state.length, state.done, state.waiting, steps


@struct.dataclass
class Resumption:
    """The multi-turn slots that resume after an observation, K per replica (padding: an index
    past the last slot). slots `[R, K]`; tokens `[R, K, W]`: the turn's last drawn token (not
    yet fed) then the observation's m tokens, padded; counts `[R, K]` = m + 1; page_table
    `[R, K, Wp]`: every page of the slot through its last observation token."""

    slots: jax.Array
    tokens: jax.Array
    counts: jax.Array
    page_table: jax.Array


def resume_program(model: Model, cache: PagedKVCache, state: SlotState, responses: Responses,
                   resumption: Resumption, step_key, *, settings: SamplingSettings, kernel: str):
    """Feed each resuming slot's last drawn token and its observation (m tokens) into its pages
    in one forward call (a chunked prefill at the slot's own positions: nothing before them is
    re-encoded), then draw the first token of its next turn at column length + m with the key
    of its batch row (`rollout.draws`). The observation's columns are left to the host (it
    knows them; `rollout.turns`); the slot's length, position and turn start move past them.

    Returns `(cache, state, responses)`."""
    s, z = settings, resumption
    replicas, k, width = z.tokens.shape
    sub = _take_slots(state, z.slots)
    valid = z.slots < state.token.shape[1]
    counts = jnp.where(valid, z.counts, 1)
    j = jnp.arange(width, dtype=jnp.int32)
    positions = sub.position[..., None] + j
    write = valid[..., None] & (j < counts[..., None])
    view = PagedView(z.page_table, _rows_of(positions), _rows_of(write),
                     _rows_of(sub.position + counts), kernel, s.mesh)
    lm = model.merge()
    hidden, cache, routing = lm.backbone.run(_rows_of(z.tokens), None, cache=cache, paged=view)
    if routing is not None and responses.routes is not None:  # the fed token and observation
        cols = sub.length[..., None] - 1 + j
        routing = routing._replace(experts=routing.experts.reshape(
            replicas * k * width, 1, *routing.experts.shape[2:]))
        flat = lambda x: x.reshape(replicas, k * width)  # noqa: E731
        responses = _record_routes(responses, flat(jnp.broadcast_to(sub.row[..., None], cols.shape)),
                                   flat(cols), routing, flat(write))
    last = jnp.take_along_axis(hidden, (_rows_of(counts) - 1)[:, None, None], axis=1)[:, 0]
    column = sub.length + counts - 1  # the observation's m columns, then this draw
    keys = _row_keys(step_key, sub.row, responses.tokens.shape[1])
    token, logp = _draw(s, lm.lm_head(last), keys, _rows_of(column))
    token, logp = token.reshape(replicas, k), logp.reshape(replicas, k)
    responses = _record(responses, sub.row, column, token, logp, valid)
    turn_end = _turn_ends(s, responses, sub.row, column, column, token)
    done = turn_end | (column + 1 >= s.max_new_tokens)
    sub = SlotState(token, sub.position + counts, sub.row, column + 1, done, column,
                    turn_end & (s.turns is not None))
    return cache, _put_slots(state, jnp.where(valid, z.slots, state.token.shape[1]), sub), responses


def refill_program(model: Model, cache: PagedKVCache, state: SlotState, responses: Responses,
                   prompt_ids, prompt_mask, slots, page_table, *, settings: SamplingSettings):
    """Recompute the keys and values of the slots `slots [R, K]` (padding: an index past the
    last slot) under `model`, after a weight switch (`rollout.stream`, partial rollouts with
    `kv_on_switch="recompute"`): each slot's prompt and every drawn token but the last (the
    next decode step feeds it) run as one prefill from position 0 into its pages
    `page_table [R, K, W]` (W pages hold P + N - 1 tokens). The row is laid out left-padded
    (prompt, then the drawn tokens) so the prefill's whole-page write applies; nothing is
    drawn, the slot state is unchanged. prompt_ids, prompt_mask: the rows' prompts `[R * rows,
    P]` in the responses' row order. Returns the cache."""
    replicas, rows = state.token.shape[0], responses.tokens.shape[1]
    sub, valid = _take_slots(state, slots), slots < state.token.shape[1]
    local = lambda x: x.reshape(replicas, rows, *x.shape[1:]).astype(jnp.int32)  # noqa: E731
    take = jax.vmap(lambda x, i: x[i])
    drawn = take(responses.tokens, sub.row)[..., :-1]  # [R, K, N - 1]: the last is never fed
    fed = jnp.arange(drawn.shape[-1], dtype=jnp.int32) < (sub.length - 1)[..., None]
    ids = jnp.concatenate([take(local(prompt_ids), sub.row), drawn], axis=-1)
    mask = jnp.concatenate([take(local(prompt_mask), sub.row), fed.astype(jnp.int32)], axis=-1)
    mask = mask * valid[..., None]
    width = ids.shape[-1]  # roll each row right past its unfed columns: left-padded
    shift = jnp.where(valid, drawn.shape[-1] - (sub.length - 1), 0)
    source = (jnp.arange(width, dtype=jnp.int32) - shift[..., None]) % width
    ids, mask = (jnp.take_along_axis(x, source, axis=-1) for x in (ids, mask))
    mask = _rows_of(mask)
    view = PagedView(page_table, jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0), mask > 0,
                     mask.sum(axis=1), "reference", settings.mesh, whole_pages=True)
    _, cache = model.merge().backbone(_rows_of(ids), None, cache=cache, paged=view)
    return cache


def write_block(ring: jax.Array, block, rows: jax.Array, *, replicas: int) -> jax.Array:
    """A batch's rows `[B, ...]` (replica r's rows r B / R ...) written into block `block`
    (int32, traced) of a ring `[R * C * B / R, ...]` laid out as a stream's responses: replica
    r's C blocks of B / R rows each, one after another."""
    per = rows.shape[0] // replicas
    shaped = ring.reshape(replicas, -1, per, *ring.shape[1:])  # [R, C, B / R, ...]
    new = rows.reshape(replicas, 1, per, *rows.shape[1:]).astype(ring.dtype)
    start = (0, block) + (0,) * (shaped.ndim - 2)
    return jax.lax.dynamic_update_slice(shaped, new, start).reshape(ring.shape)


def finalize_block(responses: Responses, block, lengths, pad_token_id: int):
    """`finalize` of block `block` (int32, traced) of a ring's responses `[R, C B / R, N]`,
    given its rows' final lengths `[R, B / R]`: the outputs `[B, N]` of that block's batch."""
    per = lengths.shape[1]
    part = jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, block * per, per, axis=1),
                        responses)
    return finalize(part, lengths, pad_token_id)


def finalize(responses: Responses, lengths, pad_token_id: int):
    """Responses `[R, B / R, N]` and each row's final length `[R, B / R]` -> `(response_ids,
    response_mask, logprobs)` `[B, N]`: tokens after a row's length are pad, log-probs 0;
    then the routes `[B, N, moe_layers, k]` (-1 after the length) when recorded."""
    n = responses.tokens.shape[2]
    mask = jnp.arange(n, dtype=jnp.int32) < lengths[..., None]
    tokens = jnp.where(mask, responses.tokens, pad_token_id)
    logprobs = jnp.where(mask, responses.logprobs, 0.0)
    out = _rows_of(tokens), _rows_of(mask.astype(jnp.int32)), _rows_of(logprobs)
    if responses.routes is None:
        return out
    routes = jnp.where(mask[..., None, None], responses.routes, -1).astype(responses.routes.dtype)
    return (*out, _rows_of(routes))


def decode_width_buckets(max_pages: int, buckets: int) -> tuple[int, ...]:
    """The page-table widths the decode program compiles for: `buckets` evenly spaced widths up
    to `max_pages` (the fewest that hold the longest live sequence is used each chunk). The
    same rule sizes the live-slot buckets (up to the slots of a replica)."""
    buckets = max(1, min(buckets, max_pages))
    return tuple(sorted({-(-max_pages * (i + 1) // buckets) for i in range(buckets)}))


def pick_width(widths: tuple[int, ...], need: int) -> int:
    """The smallest of `widths` >= need (the last when none is)."""
    return next((w for w in widths if w >= need), widths[-1])
