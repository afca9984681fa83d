"""How tokens are drawn: the sampling settings, the draw (filters, one key per sample, the draw's
log-prob), and what a sampler returns (`Generation`).

Both cache layouts draw here: `rollout.static_batch` holds one KV cache for the whole batch,
`rollout.engine` holds KV pages. Batch row b = i * n + j holds sample j of prompt i. Its token
at response position t is drawn with the key `fold_in(fold_in(step_key, b), t)`, so a
sequence's tokens depend on its row, its position and the step's key only, never on which
slot, chunk or sub-batch ran it: both layouts draw the same tokens from the same logits.

Sampling filters (temperature, top-k, top-p) follow transformers' logits warpers
(`TemperatureLogitsWarper`, `TopKLogitsWarper`, `TopPLogitsWarper`); greedy is argmax. The
filtered distribution is used only to draw: the log-prob returned with a token is that of the
full distribution at the temperature, the quantity the trainer recomputes
(`core.logprobs_from_logits`), so the two can be compared (the rollout/trainer mismatch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax.sharding import Mesh


@dataclass(frozen=True)
class TurnSettings:
    """When a multi-turn episode's turn ends (static): `stop_sequences`, token-id tuples matched
    on the last drawn tokens of the turn (the ids of `</calc>` as the model spells it: ids, not
    text, so list each spelling the tokenizer may give), besides the stop tokens; and
    `max_turns` (>= 1), the turns after which a row ends whatever its environment says."""

    stop_sequences: tuple[tuple[int, ...], ...]
    max_turns: int


@dataclass(frozen=True)
class SamplingSettings:
    """The static settings of one sampling call (hashable: a static jit argument), built from
    the config (`stages.ppo.settings.sampling_settings`).

    max_new_tokens: N, the response budget (action and observation tokens with turns).
    temperature, top_k, top_p, greedy: the draw's filters (`draw`; top_k 0 / top_p 1 = off).
    stop_token_ids: tokens that end a row (with `turns`, a turn). pad_token_id: written after
      a row's last token. samples_per_prompt: n, rows in adjacent groups of n copies of one
      prompt, prefilled once. mesh: lays the rows out (None: one device).
    turns: None for single-turn responses; a `TurnSettings` for multi-turn episodes (the
      sampler then takes an `on_turn_end`, `rollout.turns`).
    record_routes: also record the experts each response token goes through in an MoE
      model (`Generation.routes`, for router replay: `model.router_replay: rollout`).
    """

    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    greedy: bool
    stop_token_ids: tuple[int, ...]
    pad_token_id: int
    samples_per_prompt: int
    mesh: Optional[Mesh]
    turns: Optional[TurnSettings]
    record_routes: bool


class Generation(NamedTuple):
    """What a sampler returns for B rows and N response columns (device arrays `[B, N]`).

    response_ids int32 (pad after the last token); response_mask int32, 1 through the last
    written token (a prefix mask: the forward passes' contract, `rollout.forward`); logprobs
    float32, each draw's log-prob (`draw`), 0 elsewhere. episodes: None single-turn; with
    turns, the `rollout.turns.Episodes` (action mask, turns, turn ends, ended). routes: None,
    or with `SamplingSettings.record_routes` the experts of every MoE layer each response
    token was fed through, `[B, N, moe_layers, k]` int16 (`models.moe.Routing.experts`), -1
    where none was fed (after a row's end, and the last column: a token is drawn from the
    pass that feeds the one before it).
    """

    response_ids: jax.Array
    response_mask: jax.Array
    logprobs: jax.Array
    episodes: Optional[Any]
    routes: Optional[jax.Array] = None


ROUTE_DTYPE = jnp.int16  # expert indices (< 32768 experts): half the bytes of int32


def empty_routes(rows: tuple[int, ...], columns: int, cfg) -> Optional[jax.Array]:
    """`[*rows, columns, moe_layers, k]` of -1 (ROUTE_DTYPE) for the routes of a model of
    `cfg` (a `ModelConfig`), or None for a dense model."""
    if not getattr(cfg, "num_moe_layers", 0):
        return None
    shape = (*rows, columns, cfg.num_moe_layers, cfg.num_experts_per_tok)
    return jnp.full(shape, -1, ROUTE_DTYPE)


_NEG = -1e30  # finite "minus infinity" for filtered logits


def filter_logits(logits: jax.Array, *, temperature: float = 1.0, top_k: int = 0,
                  top_p: float = 1.0) -> jax.Array:
    """Temperature, then top-k, then top-p (nucleus) filtering of `[B, V]` float32 logits.

    top_k = 0 and top_p = 1.0 switch the filters off. Top-p keeps the smallest set of most
    probable tokens whose total probability reaches `top_p` (always at least one token), as
    transformers' `TopPLogitsWarper`. Returns `[B, V]` float32 with filtered entries at -1e30.
    """
    logits = logits.astype(jnp.float32) / temperature
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, _NEG, logits)
    if top_p < 1.0:
        sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]  # descending
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs  # probability of strictly better tokens
        keep_sorted = mass_before < top_p
        keep_sorted = keep_sorted.at[:, 0].set(True)
        # threshold = smallest kept logit per row
        threshold = jnp.min(jnp.where(keep_sorted, sorted_logits, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < threshold, _NEG, logits)
    return logits


def sample_keys(step_key: jax.Array, rows: jax.Array) -> jax.Array:
    """`[B]` keys, one per sample: `fold_in(step_key, row)` for each batch row in `rows [B]`."""
    return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(step_key, rows.astype(jnp.uint32))


def draw(logits: jax.Array, row_keys: jax.Array, t, *, temperature: float = 1.0, top_k: int = 0,
         top_p: float = 1.0, greedy: bool = False) -> tuple[jax.Array, jax.Array]:
    """Draw response token `t` of every row from `[B, V]` logits.

    Args:
      logits: `[B, V]` (any float dtype; filtered in float32).
      row_keys: `[B]` keys from `sample_keys`; t: the response position, a scalar or `[B]`
        int32 (each row's own position).
      temperature, top_k, top_p, greedy: as `filter_logits`; greedy draws the argmax.

    Returns:
      `(tokens [B] int32, logprobs [B] float32)`: the draws, each with its log-prob under the
      unfiltered distribution `log_softmax(logits / temperature)`.
    """
    logits = logits.astype(jnp.float32)
    if greedy:
        tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    else:
        t = jnp.broadcast_to(jnp.asarray(t, jnp.uint32), row_keys.shape[:1])
        keys = jax.vmap(jax.random.fold_in)(row_keys, t)
        filtered = filter_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p)
        tokens = jax.vmap(jax.random.categorical)(keys, filtered).astype(jnp.int32)
    logp = jax.nn.log_softmax(logits / temperature, axis=-1)
    return tokens, jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
