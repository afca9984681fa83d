"""The static batch: single-turn sampling with one preallocated KV cache, as one jitted call.

Prompts are left-padded `[B, P]`; the cache holds `S = P + max_new_tokens - 1` slots shared by
all rows. One prefill call writes the prompt and gives the first token (each distinct prompt
once when `samples_per_prompt` > 1: `rollout.prefill`); a `lax.while_loop` then runs each
sampled token through the model to sample the next (N tokens: the prefill and N - 1 one-token
passes), stopping early once every row has emitted a stop token. Positions come from
the attention mask (docs/contracts.md), so left padding never changes a row's distribution.

Draws (filters, one key per sample and position, the draw's log-prob) are `rollout.draws`',
shared with the paged engine (`rollout.engine`), so both give the same tokens under one key.
This static batch is `generation.engine: static` for single-turn responses; multi-turn
episodes run the engine's turn loop (`rollout.sampler.Sampler`).
"""

from __future__ import annotations

from dataclasses import fields
from functools import partial
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ppo_jax.models.functional import Model
from ppo_jax.parallel.mesh import shard_rows
from ppo_jax.rollout.prefill import check_groups, prefill_cache, shard_cache
from ppo_jax.rollout.draws import SamplingSettings, draw, empty_routes, sample_keys

def int_setting(name: str, value, minimum: int) -> int:
    """`value` as an int >= `minimum`; ValueError naming `name` otherwise (bools refused)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name}={value!r} must be an int")
    if value < minimum:
        raise ValueError(f"{name}={value} must be >= {minimum}")
    return int(value)


def token_id(name: str, value, vocab_size: int) -> int:
    """`value` as a token id in [0, vocab_size); ValueError naming `name` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name}: {value!r} is not an int token id")
    if not 0 <= value < vocab_size:
        raise ValueError(f"{name}: {value} is outside the vocabulary [0, {vocab_size})")
    return int(value)


def _check_prompts(prompt_ids, prompt_mask, vocab_size: int) -> None:
    """Shapes and dtypes always; values (ids in the vocabulary, 0/1 left-padded masks) when the
    arrays are concrete (not traced inside a caller's jit) and fully addressable."""
    if prompt_ids.ndim != 2 or prompt_ids.shape != prompt_mask.shape:
        raise ValueError(f"prompt_ids {tuple(prompt_ids.shape)} and prompt_mask "
                         f"{tuple(prompt_mask.shape)} must both be [B, P]")
    if prompt_ids.shape[1] == 0:
        raise ValueError(f"prompt_ids {tuple(prompt_ids.shape)}: prompts need at least one column")
    if not jnp.issubdtype(prompt_ids.dtype, jnp.integer):
        raise ValueError(f"prompt_ids must be integer, got {prompt_ids.dtype}")
    if not (jnp.issubdtype(prompt_mask.dtype, jnp.integer) or prompt_mask.dtype == bool):
        raise ValueError(f"prompt_mask must be integer or bool (1 = real token), got "
                         f"{prompt_mask.dtype}")
    if any(isinstance(x, jax.core.Tracer) or not getattr(x, "is_fully_addressable", True)
           for x in (prompt_ids, prompt_mask)):
        return
    ids, mask = np.asarray(prompt_ids), np.asarray(prompt_mask).astype(np.int64)
    bad = np.argwhere((ids < 0) | (ids >= vocab_size))
    if len(bad):
        r, c = bad[0]
        raise ValueError(f"prompt_ids[{r}, {c}] = {ids[r, c]} is outside the vocabulary "
                         f"[0, {vocab_size}) ({len(bad)} such entries; padding positions are "
                         "embedded too, so the pad id must be a real token)")
    if not np.isin(mask, (0, 1)).all():
        raise ValueError(f"prompt_mask must hold 0 and 1 only, got values "
                         f"{np.unique(mask)[:8].tolist()}")
    right_padded = np.flatnonzero(np.diff(mask, axis=1).min(axis=1, initial=0) < 0)
    if right_padded.size:
        r = right_padded[0]
        raise ValueError(f"prompts must be left-padded (padding first, then the prompt): row {r} "
                         f"has padding after a real token (prompt_mask[{r}] = {mask[r].tolist()})")
    empty = np.flatnonzero(mask.sum(axis=1) == 0)
    if empty.size:
        raise ValueError(f"row {empty[0]} of prompt_mask is all 0: every row needs a prompt token")


def prompt_arrays(prompt_ids, prompt_mask, vocab_size: int):
    """Nested lists as numpy arrays (arrays stay as they are), checked (`_check_prompts`)."""
    prompt_ids = prompt_ids if hasattr(prompt_ids, "ndim") else np.asarray(prompt_ids)
    prompt_mask = prompt_mask if hasattr(prompt_mask, "ndim") else np.asarray(prompt_mask)
    _check_prompts(prompt_ids, prompt_mask, vocab_size)
    return prompt_ids, prompt_mask


def check_settings(cfg, prompt_width: int, max_new_tokens, temperature, top_k, top_p, greedy,
                   stop_token_ids, pad_token_id, cache_dtype) -> dict:
    """Validate the static settings; returns them normalised for `_generate`."""
    out = {"max_new_tokens": int_setting("max_new_tokens", max_new_tokens, 1),
           "top_k": int_setting("top_k", top_k, 0), "greedy": bool(greedy)}
    if not isinstance(temperature, (int, float, np.number)) or not 0 < temperature < np.inf:
        if not greedy:
            raise ValueError(f"temperature={temperature!r} must be a finite number > 0 "
                             "(greedy=True for argmax)")
        temperature = 1.0  # unused when greedy
    if not isinstance(top_p, (int, float, np.number)) or not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p!r} must be in (0, 1] (1 = off)")
    if isinstance(stop_token_ids, (str, bytes)) or not hasattr(stop_token_ids, "__iter__"):
        raise ValueError(f"stop_token_ids={stop_token_ids!r} must be a sequence of token ids")
    out["stop_token_ids"] = tuple(token_id("stop_token_ids", t, cfg.vocab_size)
                                 for t in stop_token_ids)
    out["pad_token_id"] = token_id("pad_token_id", pad_token_id, cfg.vocab_size)
    if cache_dtype is not None:
        try:
            dt = jnp.dtype(cache_dtype)
        except TypeError:
            raise ValueError(f"cache_dtype={cache_dtype!r} is not a dtype") from None
        if not jnp.issubdtype(dt, jnp.floating):
            raise ValueError(f"cache_dtype={cache_dtype!r} must be a float dtype")
        cache_dtype = dt.name
    total = prompt_width + out["max_new_tokens"]
    if cfg.model_type == "gpt2" and total > cfg.max_position_embeddings:
        raise ValueError(f"prompt width {prompt_width} + max_new_tokens {out['max_new_tokens']} "
                         f"= {total} exceeds GPT-2's {cfg.max_position_embeddings} learned "
                         "positions")
    return {**out, "temperature": float(temperature), "top_p": float(top_p),
            "cache_dtype": cache_dtype}


@partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "samples_per_prompt",
                                   "cache_dtype", "mesh"))
def _prefill_jit(graphdef, params, prompt_ids, prompt_mask, *, max_new_tokens,
                 samples_per_prompt, cache_dtype, mesh):
    return prefill_cache(nnx.merge(graphdef, params), prompt_ids, prompt_mask,
                         max_new_tokens=max_new_tokens, samples_per_prompt=samples_per_prompt,
                         cache_dtype=cache_dtype, mesh=mesh)


def prefill(graphdef, params, prompt_ids, prompt_mask, *, max_new_tokens: int,
            samples_per_prompt: int = 1, cache_dtype=None, mesh=None):
    """The sampler's prefill alone, jitted: what `generate` samples its first token from.

    Args: as `generate` (`prompt_ids`, `prompt_mask` `[B, P]`).
    Returns:
      `(logits [B, V], cache KVCache [num_layers, B, P + N - 1, num_kv_heads, head_dim])`:
      the last prompt position's logits and the cache with the prompt in slots [0, P).
    Raises:
      ValueError: as `generate` for the prompts, `max_new_tokens` and `samples_per_prompt`.
    """
    cfg = nnx.merge(graphdef, params).cfg
    prompt_ids, prompt_mask = prompt_arrays(prompt_ids, prompt_mask, cfg.vocab_size)
    n = check_groups(prompt_ids, prompt_mask, samples_per_prompt)
    settings = check_settings(cfg, prompt_ids.shape[1], max_new_tokens, 1.0, 0, 1.0, True, (),
                              0, cache_dtype)
    logits, cache, _ = _prefill_jit(
        graphdef, params, jnp.asarray(prompt_ids), jnp.asarray(prompt_mask),
        max_new_tokens=settings["max_new_tokens"], samples_per_prompt=n,
        cache_dtype=settings["cache_dtype"], mesh=mesh)
    return logits, cache


class _Decoded(NamedTuple):
    """The decode loop's record: tokens and their log-probs `[B, N]`, the response mask, the
    last drawn token `[B]`, which rows are done `[B]`, and the experts each fed token went
    through `[B, N, moe_layers, k]` (None unless recorded)."""

    tokens: jax.Array
    logprobs: jax.Array
    mask: jax.Array
    token: jax.Array
    done: jax.Array
    routes: jax.Array | None = None


@partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "temperature", "top_k", "top_p",
                                   "greedy", "stop_token_ids", "pad_token_id", "cache_dtype",
                                   "samples_per_prompt", "mesh", "record_routes"))
def _generate(graphdef, params, prompt_ids, prompt_mask, rng, first_row, *, max_new_tokens,
              temperature,
              top_k, top_p, greedy, stop_token_ids, pad_token_id, cache_dtype, samples_per_prompt,
              mesh, record_routes):
    model = nnx.merge(graphdef, params)
    batch, prompt_len = prompt_ids.shape
    rows = partial(shard_rows, mesh=mesh)
    logits, cache, mask = prefill_cache(model, prompt_ids, prompt_mask,
                                        max_new_tokens=max_new_tokens,
                                        samples_per_prompt=samples_per_prompt,
                                        cache_dtype=cache_dtype, mesh=mesh)
    stops = jnp.asarray(stop_token_ids if stop_token_ids else (-1,), jnp.int32)
    row_keys = sample_keys(rng, first_row + jnp.arange(batch, dtype=jnp.int32))

    def sample_at(t, logits, rec: _Decoded) -> _Decoded:
        """Draw token t of every row (pad once a row is done) and record it."""
        token, logp = draw(logits, row_keys, t, temperature=temperature, top_k=top_k,
                           top_p=top_p, greedy=greedy)
        token = jnp.where(rec.done, pad_token_id, token)
        return _Decoded(rows(rec.tokens.at[:, t].set(token)),
                        rows(rec.logprobs.at[:, t].set(jnp.where(rec.done, 0.0, logp))),
                        rows(rec.mask.at[:, t].set((~rec.done).astype(jnp.int32))), token,
                        rows(rec.done | jnp.isin(token, stops)), rec.routes)

    def record_routes_at(t, routing, rec: _Decoded) -> _Decoded:
        """The experts token t of every live row went through (-1 for done rows)."""
        if rec.routes is None:
            return rec
        experts = jnp.where(rec.done[:, None, None], -1, routing.experts[:, 0])
        return rec._replace(routes=rows(rec.routes.at[:, t].set(experts.astype(rec.routes.dtype))))

    def cond(state):  # another token is wanted and some row is still going
        t, _, _, rec = state
        return (t + 1 < max_new_tokens) & ~jnp.all(rec.done)

    def body(state):  # run token t through the model, then sample token t + 1
        t, cache, mask, rec = state
        slot = prompt_len + t
        mask = mask.at[:, slot].set(1)
        hidden, cache, routing = model.backbone.run(rec.token[:, None], mask, cache=cache,
                                                    cache_index=slot, mesh=mesh)
        rec = record_routes_at(t, routing, rec)
        rec = sample_at(t + 1, rows(model.lm_head(hidden[:, 0])), rec)
        return t + 1, shard_cache(cache, mesh), rows(mask), rec

    shape = (batch, max_new_tokens)
    empty = _Decoded(rows(jnp.full(shape, pad_token_id, jnp.int32)),
                     rows(jnp.zeros(shape, jnp.float32)), rows(jnp.zeros(shape, jnp.int32)),
                     jnp.zeros((batch,), jnp.int32), rows(jnp.zeros((batch,), bool)),
                     empty_routes((batch,), max_new_tokens, model.cfg) if record_routes else None)
    init = (jnp.int32(0), cache, mask, sample_at(0, logits, empty))
    rec = jax.lax.while_loop(cond, body, init)[3]
    out = rec.tokens, rec.mask, rec.logprobs
    return out if rec.routes is None else (*out, rec.routes)


def generate(graphdef, params, prompt_ids, prompt_mask, rng, *, max_new_tokens: int,
             temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, greedy: bool = False,
             stop_token_ids: Sequence[int] = (), pad_token_id: int = 0, cache_dtype=None,
             samples_per_prompt: int = 1, mesh=None, return_logprobs: bool = False,
             first_row: int = 0, record_routes: bool = False):
    """Sample responses for a batch of left-padded prompts in one jitted call.

    Args:
      graphdef, params: a split `CausalLM`.
      prompt_ids: `[B, P]` int32, left-padded; every id (padding included) in [0, vocab).
      prompt_mask: `[B, P]` int or bool, 1 on real prompt tokens: zeros then ones in each row,
        at least one 1.
      rng: PRNG key (`jax.random.key` / `PRNGKey`); may be None when greedy.
      max_new_tokens: N, the response length (static int >= 1).
      temperature, top_k, top_p, greedy: sampling settings (static; top_k=0 / top_p=1 = off;
        temperature is ignored when greedy).
      stop_token_ids: tokens that end a row (e.g. the tokenizer's EOS); each row stops on its
        own; the loop ends early once every row has stopped.
      pad_token_id: written after a row's stop token (a token of the vocabulary).
      cache_dtype: KV cache float dtype (default: the model's compute dtype).
      samples_per_prompt: n (static int >= 1 dividing B): the rows come in adjacent groups of n
        copies of one prompt (`check_groups`); the prefill runs on the B/n distinct prompts and
        its cache and first-token logits are repeated to the n rows of each group (`prefill`).
        The draws are those of the repeated path: the same tokens under the same key.
      mesh: a `jax.sharding.Mesh` (static) to lay the rows of every per-row array (tokens,
        masks, logits, KV cache) over its ("data", "fsdp") axes and the KV heads over
        "tensor"; None (single device) adds no constraint. Params keep whatever sharding they
        come with (`ppo_jax.parallel.tree_shardings`).

      return_logprobs: also return the log-prob of each drawn token (`draws.draw`).
      first_row: the batch row of this call's first row, for the draws' keys (a batch answered
        in sub-batches draws the tokens of the whole batch; traced, no recompile).
      record_routes: with an MoE model, also return the experts each response token was fed
        through (`draws.Generation.routes`); a dense model records none.

    Returns:
      `(response_ids [B, N] int32, response_mask [B, N] int32)`, and with `return_logprobs`
      `logprobs [B, N]` float32 (0 after a row's stop), then with `record_routes` (MoE; with
      `return_logprobs` only) the routes `[B, N, moe_layers, k]` int16; the mask is 1 on every generated token
      up to and including the first stop token, 0 after it. N tokens take the prefill and
      N - 1 one-token passes (the last token is not fed back). Token t of row b is drawn with
      the key `fold_in(fold_in(rng, first_row + b), t)`, as in `rollout.draws`.

    Raises:
      ValueError: malformed shapes, dtypes or settings, ids outside the vocabulary, a mask that
        is not 0/1 left padding (value checks only on concrete arrays, not under a caller's
        jit), or more positions than GPT-2's table, a bad `samples_per_prompt` or a group of
        rows that is not one prompt (`check_groups`); all before compiling.
    """
    cfg = nnx.merge(graphdef, params).cfg
    prompt_ids, prompt_mask = prompt_arrays(prompt_ids, prompt_mask, cfg.vocab_size)
    n = check_groups(prompt_ids, prompt_mask, samples_per_prompt)
    settings = check_settings(cfg, prompt_ids.shape[1], max_new_tokens, temperature, top_k,
                              top_p, greedy, stop_token_ids, pad_token_id, cache_dtype)
    if rng is None:
        if not greedy:
            raise ValueError("rng is required for sampling (greedy=False)")
        rng = jax.random.PRNGKey(0)
    elif not is_key(rng):
        raise ValueError(f"rng must be a PRNG key (jax.random.key or jax.random.PRNGKey), got "
                         f"{type(rng).__name__} {getattr(rng, 'shape', '')}")
    out = _generate(graphdef, params, jnp.asarray(prompt_ids), jnp.asarray(prompt_mask), rng,
                    jnp.int32(first_row), samples_per_prompt=n, mesh=mesh,
                    record_routes=record_routes and bool(getattr(cfg, "num_moe_layers", 0)),
                    **settings)
    return out if return_logprobs else out[:2]


def is_key(rng) -> bool:
    """A typed key (`jax.random.key`) or a raw uint32 `[..., 2]` one (`PRNGKey`)."""
    dtype = getattr(rng, "dtype", None)
    if dtype is None:
        return False
    if jnp.issubdtype(dtype, jax.dtypes.prng_key):
        return True
    return dtype == jnp.uint32 and tuple(rng.shape[-1:]) == (2,)


def generate_kwargs(settings: SamplingSettings) -> dict:
    """`generate`'s keyword settings from single-turn `SamplingSettings` (every field but
    `turns`, which the static batch does not play)."""
    return {f.name: getattr(settings, f.name) for f in fields(settings) if f.name != "turns"}


def sample(model: Model, prompt_ids, prompt_mask, rng, *, settings: SamplingSettings):
    """`generate` with a `Model` and single-turn `SamplingSettings`: `(response_ids,
    response_mask, logprobs)` `[B, N]` for `[B, P]` left-padded prompts (the draws' log-probs,
    float32), then the routes when `settings.record_routes` and the model is an MoE."""
    return generate(model.graphdef, model.params, prompt_ids, prompt_mask, rng,
                    return_logprobs=True, **generate_kwargs(settings))
