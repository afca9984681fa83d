"""Batched autoregressive sampling with a preallocated KV cache, as one jitted call.

Prompts are left-padded `[B, P]`; the cache holds `S = P + max_new_tokens` slots shared by all
rows. One prefill call writes the prompt, then a `lax.while_loop` samples one token per row and
feeds it back, stopping early once every row has emitted a stop token. Positions come from the
attention mask (docs/contracts.md), so left padding never changes a row's distribution.

Sampling filters (temperature, top-k, top-p) follow transformers' logits warpers
(`TemperatureLogitsWarper`, `TopKLogitsWarper`, `TopPLogitsWarper`); greedy is argmax. The
filtered distribution is used only to draw tokens: PPO recomputes log-probs from the full
distribution (`rollout.scoring`).
"""

from __future__ import annotations

from functools import partial
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from ppo_jax.models.kv_cache import KVCache, init_cache
from ppo_jax.parallel.mesh import shard_rows

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


def sample_tokens(logits: jax.Array, rng: jax.Array, *, temperature: float = 1.0, top_k: int = 0,
                  top_p: float = 1.0, greedy: bool = False) -> jax.Array:
    """Draw one token per row from `[B, V]` logits -> `[B]` int32."""
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    filtered = filter_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p)
    return jax.random.categorical(rng, filtered, axis=-1).astype(jnp.int32)


def _shard_cache(cache: KVCache, mesh) -> KVCache:
    """KV cache `[layers, B, S, KVH, hd]` laid out like the activations: rows over the batch
    axes, KV heads over `tensor` (the column-parallel k/v projections produce them there)."""
    return KVCache(*(shard_rows(c, mesh, axis=1, dims={3: "tensor"}) for c in cache))


def _check(prompt_ids, prompt_mask, max_new_tokens, temperature, top_k, top_p, stop_token_ids):
    if prompt_ids.ndim != 2 or prompt_ids.shape != prompt_mask.shape:
        raise ValueError(f"prompt_ids {tuple(prompt_ids.shape)} and prompt_mask "
                         f"{tuple(prompt_mask.shape)} must both be [B, P]")
    if not jnp.issubdtype(prompt_ids.dtype, jnp.integer):
        raise ValueError(f"prompt_ids must be integer, got {prompt_ids.dtype}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    if not temperature > 0:
        raise ValueError(f"temperature={temperature} must be > 0 (use greedy=True for argmax)")
    if top_k < 0 or not 0 < top_p <= 1:
        raise ValueError(f"top_k={top_k} must be >= 0 and top_p={top_p} in (0, 1]")
    if any(not isinstance(t, int) for t in stop_token_ids):
        raise ValueError(f"stop_token_ids={stop_token_ids!r} must be ints")


@partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "temperature", "top_k", "top_p",
                                   "greedy", "stop_token_ids", "pad_token_id", "cache_dtype",
                                   "mesh"))
def _generate(graphdef, params, prompt_ids, prompt_mask, rng, *, max_new_tokens, temperature,
              top_k, top_p, greedy, stop_token_ids, pad_token_id, cache_dtype, mesh):
    model = nnx.merge(graphdef, params)
    batch, prompt_len = prompt_ids.shape
    total = prompt_len + max_new_tokens
    rows = partial(shard_rows, mesh=mesh)
    cache = _shard_cache(init_cache(model.cfg, batch, total, cache_dtype), mesh)
    mask = rows(jnp.concatenate([prompt_mask.astype(jnp.int32),
                                 jnp.zeros((batch, max_new_tokens), jnp.int32)], axis=1))

    hidden, cache = model.backbone(rows(prompt_ids.astype(jnp.int32)), mask, cache=cache,
                                   cache_index=0)
    logits = rows(model.lm_head(hidden[:, -1]))
    stops = jnp.asarray(stop_token_ids if stop_token_ids else (-1,), jnp.int32)

    def cond(state):
        t, _, _, _, _, _, done, _ = state
        return (t < max_new_tokens) & ~jnp.all(done)

    def body(state):
        t, cache, mask, logits, tokens, resp_mask, done, rng = state
        rng, key = jax.random.split(rng)
        token = sample_tokens(logits, key, temperature=temperature, top_k=top_k, top_p=top_p,
                              greedy=greedy)
        token = jnp.where(done, pad_token_id, token)
        tokens = tokens.at[:, t].set(token)
        resp_mask = resp_mask.at[:, t].set((~done).astype(jnp.int32))
        done = done | jnp.isin(token, stops)
        slot = prompt_len + t
        mask = mask.at[:, slot].set(1)
        hidden, cache = model.backbone(token[:, None], mask, cache=cache, cache_index=slot)
        return (t + 1, _shard_cache(cache, mesh), rows(mask), rows(model.lm_head(hidden[:, 0])),
                rows(tokens), rows(resp_mask), rows(done), rng)

    init = (jnp.int32(0), cache, mask, logits,
            rows(jnp.full((batch, max_new_tokens), pad_token_id, jnp.int32)),
            rows(jnp.zeros((batch, max_new_tokens), jnp.int32)), rows(jnp.zeros((batch,), bool)), rng)
    _, _, _, _, tokens, resp_mask, _, _ = jax.lax.while_loop(cond, body, init)
    return tokens, resp_mask


def generate(graphdef, params, prompt_ids, prompt_mask, rng, *, max_new_tokens: int,
             temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, greedy: bool = False,
             stop_token_ids: Sequence[int] = (), pad_token_id: int = 0, cache_dtype=None,
             mesh=None):
    """Sample responses for a batch of left-padded prompts in one jitted call.

    Args:
      graphdef, params: a split `CausalLM`.
      prompt_ids: `[B, P]` int32, left-padded.
      prompt_mask: `[B, P]` int32, 1 on real prompt tokens.
      rng: PRNG key (unused when greedy).
      max_new_tokens: N, the response length (static).
      temperature, top_k, top_p, greedy: sampling settings (static; top_k=0 / top_p=1 = off).
      stop_token_ids: tokens that end a row (e.g. the tokenizer's EOS); each row stops on its
        own; the loop ends early once every row has stopped.
      pad_token_id: written after a row's stop token.
      cache_dtype: KV cache dtype (default: the model's compute dtype).
      mesh: a `jax.sharding.Mesh` (static) to lay the rows of every per-row array (tokens,
        masks, logits, KV cache) over its ("data", "fsdp") axes and the KV heads over
        "tensor"; None (single device) adds no constraint. Params keep whatever sharding they
        come with (`ppo_jax.parallel.tree_shardings`).

    Returns:
      `(response_ids [B, N] int32, response_mask [B, N] int32)`; the mask is 1 on every
      generated token up to and including the first stop token, 0 after it.

    Raises:
      ValueError: malformed shapes or settings (before compiling).
    """
    stop_token_ids = tuple(int(t) for t in stop_token_ids)
    _check(prompt_ids, prompt_mask, max_new_tokens, temperature, top_k, top_p, stop_token_ids)
    return _generate(graphdef, params, jnp.asarray(prompt_ids), jnp.asarray(prompt_mask), rng,
                     max_new_tokens=int(max_new_tokens), temperature=float(temperature),
                     top_k=int(top_k), top_p=float(top_p), greedy=bool(greedy),
                     stop_token_ids=stop_token_ids, pad_token_id=int(pad_token_id),
                     cache_dtype=None if cache_dtype is None else jnp.dtype(cache_dtype).name,
                     mesh=mesh)


def bucket_length(length: int, buckets: Sequence[int] = (16, 32, 64, 128, 256, 512, 1024, 2048,
                                                          4096, 8192)) -> int:
    """The smallest bucket >= length (prompt widths are padded to buckets so a run compiles a
    bounded number of shapes). Raises ValueError when length exceeds the largest bucket."""
    for b in buckets:
        if length <= b:
            return b
    raise ValueError(f"length {length} exceeds the largest bucket {buckets[-1]}")


def pad_prompts_to(prompt_ids, prompt_mask, width: int, pad_token_id: int):
    """Left-pad `[B, P]` prompts to `[B, width]` (numpy or jax arrays). Raises ValueError if P > width."""
    p = prompt_ids.shape[1]
    if p > width:
        raise ValueError(f"prompt width {p} exceeds the bucket width {width}")
    pad = ((0, 0), (width - p, 0))
    return (jnp.pad(jnp.asarray(prompt_ids), pad, constant_values=pad_token_id),
            jnp.pad(jnp.asarray(prompt_mask), pad, constant_values=0))
