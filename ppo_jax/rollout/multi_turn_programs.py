"""The multi-turn sampler's device programs: the prefill with the first draw, and a segment of
one-token passes that runs until every row is done or some row's turn has ended
(`rollout.multi_turn` runs them and answers the turns on the host).

Every row advances in lockstep, one response column per pass, as in `rollout.sampler`: the pass
at column t feeds token t of every row into cache slot P + t and writes column t + 1. A row
whose columns up to `forced_end` hold an observation (written there by the host) takes that
token instead of a draw (an action mask of 0, a log-prob of 0), so the observation goes through
the same passes into the same KV cache, right after the turn that asked for it: no holes in the
sequence, no per-row cache index, no re-encoding of the history. The price: an observation of
k tokens costs its row k one-token passes (run alongside the other rows' decoding) where a
prefill would take one; a chunked prefill of observations needs a cache index per row (the next
step, and what the paged engine's pages would give).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import struct

from ppo_jax.models.functional import Model
from ppo_jax.parallel.mesh import shard_rows
from ppo_jax.rollout.prefill import prefill_cache, shard_cache
from ppo_jax.rollout.sampling import draw, sample_keys


@struct.dataclass
class TurnState:
    """The loop's record between passes (B rows, N response columns, S = P + N - 1 slots).

    t `[]` int32: the column of the last written token (not yet fed to the model).
    attention `[B, S]` int32: the attention mask of the cache slots (prompt, then responses).
    tokens `[B, N]` int32 (pad where unwritten), logprobs `[B, N]` float32 (the draws'; 0 on
      observations and padding), response_mask / action_mask `[B, N]` int32 (every written
      token / drawn tokens only).
    done `[B]` bool: the row writes no more tokens (its later columns stay as they are).
    waiting `[B]` bool: the row's last drawn token ended a turn; the host answers it.
    forced_end `[B]` int32: columns below it are forced (an observation already in `tokens`).
    turn_start `[B]` int32: the first column of the row's current assistant turn.
    """

    t: jax.Array
    attention: jax.Array
    tokens: jax.Array
    logprobs: jax.Array
    response_mask: jax.Array
    action_mask: jax.Array
    done: jax.Array
    waiting: jax.Array
    forced_end: jax.Array
    turn_start: jax.Array


def turn_ends_at(tokens: jax.Array, c, turn_start: jax.Array, stop_sequences) -> jax.Array:
    """`[B]` bool: the tokens of columns `[c - k + 1, c]` of `tokens [B, N]` equal one of the
    static `stop_sequences` (each of length k) and lie inside the row's current turn
    (`c - k + 1 >= turn_start [B]`): a window compare per sequence."""
    hit = jnp.zeros(tokens.shape[:1], bool)
    for seq in stop_sequences:
        k = len(seq)
        if k > tokens.shape[1]:
            continue  # longer than the response: it never fits
        start = c - k + 1
        window = jax.lax.dynamic_slice_in_dim(tokens, jnp.maximum(start, 0), k, axis=1)
        hit = hit | ((start >= turn_start) & jnp.all(window == jnp.asarray(seq, jnp.int32), 1))
    return hit


def write_column(state: TurnState, c, logits: jax.Array, row_keys: jax.Array,
                 settings) -> TurnState:
    """Column c of every row from the logits `[B, V]` of column c - 1 (the prefill's for c = 0):
    a draw (key `fold_in(row_key, c)`, `sampling.draw`) where the row is live and not forced, its
    forced token where `c < forced_end`, nothing where it is done. A drawn stop token or a drawn
    token that completes a stop sequence sets `waiting`."""
    s, rows = settings, partial(shard_rows, mesh=settings.mesh)
    drawn, logp = draw(logits, row_keys, c, temperature=s.temperature, top_k=s.top_k,
                       top_p=s.top_p, greedy=s.greedy)
    live = ~state.done
    act = live & (c >= state.forced_end)
    tokens = rows(state.tokens.at[:, c].set(jnp.where(act, drawn, state.tokens[:, c])))
    stops = jnp.asarray(s.stop_token_ids or (-1,), jnp.int32)
    ends = jnp.isin(drawn, stops) | turn_ends_at(tokens, c, state.turn_start, s.stop_sequences)
    return state.replace(
        t=jnp.asarray(c, jnp.int32), tokens=tokens,
        logprobs=rows(state.logprobs.at[:, c].set(jnp.where(act, logp, 0.0))),
        response_mask=rows(state.response_mask.at[:, c].set(
            jnp.where(live, 1, state.response_mask[:, c]))),
        action_mask=rows(state.action_mask.at[:, c].set(act.astype(jnp.int32))),
        waiting=rows(act & ends))


def start_program(model: Model, prompt_ids, prompt_mask, rng, first_row, *, settings):
    """Prefill `[B, P]` left-padded prompts (each distinct prompt once with samples_per_prompt
    > 1, `rollout.prefill`) and write column 0 -> `(TurnState, KVCache [layers, B, S, KVH, hd])`."""
    s = settings
    batch = prompt_ids.shape[0]
    rows = partial(shard_rows, mesh=s.mesh)
    logits, cache, attention = prefill_cache(model.merge(), prompt_ids, prompt_mask,
                                             max_new_tokens=s.max_new_tokens,
                                             samples_per_prompt=s.samples_per_prompt,
                                             cache_dtype=None, mesh=s.mesh)
    shape, zeros = (batch, s.max_new_tokens), rows(jnp.zeros((batch,), jnp.int32))
    empty = TurnState(jnp.int32(0), attention, rows(jnp.full(shape, s.pad_token_id, jnp.int32)),
                      rows(jnp.zeros(shape, jnp.float32)), rows(jnp.zeros(shape, jnp.int32)),
                      rows(jnp.zeros(shape, jnp.int32)), rows(jnp.zeros((batch,), bool)),
                      rows(jnp.zeros((batch,), bool)), zeros, zeros)
    keys = sample_keys(rng, first_row + jnp.arange(batch, dtype=jnp.int32))
    return write_column(empty, 0, logits, keys, s), cache


def segment_program(model: Model, state: TurnState, cache, rng, first_row, *, settings):
    """One-token passes until every row is done, some row waits for its environment or the
    last column is written -> `(TurnState, KVCache)`. Returns at once when a row already
    waits. Each pass feeds column t of every row at cache slot P + t and writes column t + 1
    (`write_column`)."""
    s = settings
    lm = model.merge()
    batch, n = state.tokens.shape
    prompt_len = state.attention.shape[1] - n + 1
    rows = partial(shard_rows, mesh=s.mesh)
    keys = sample_keys(rng, first_row + jnp.arange(batch, dtype=jnp.int32))

    def cond(carry):
        st = carry[0]
        return (st.t + 1 < n) & ~jnp.all(st.done) & ~jnp.any(st.waiting)

    def body(carry):
        st, cache = carry
        slot = prompt_len + st.t
        attention = rows(st.attention.at[:, slot].set(1))
        token = jax.lax.dynamic_index_in_dim(st.tokens, st.t, axis=1, keepdims=True)
        hidden, cache = lm.backbone(token, attention, cache=cache, cache_index=slot)
        st = write_column(st.replace(attention=attention), st.t + 1,
                          rows(lm.lm_head(hidden[:, 0])), keys, s)
        return st, shard_cache(cache, s.mesh)

    return jax.lax.while_loop(cond, body, (state, cache))


start = jax.jit(start_program, static_argnames=("settings",))
segment = jax.jit(segment_program, static_argnames=("settings",), donate_argnames=("cache",))
