"""The sampler's prefill: the prompts run once into a fresh KV cache, shared within a group.

With `samples_per_prompt` = n (GRPO / RLOO groups, `generation.samples_per_prompt`) the rows of a
batch come in adjacent groups of n copies of one prompt (the trainer's `np.repeat`). The prefill
then runs only the B/n distinct prompts (rows 0, n, 2n, ...) and repeats their KV cache and
last-position logits n times along the batch axis before the first token is drawn: the prefix
sharing verl (vLLM's prefix cache) and tunix do by default. The decode loop is unchanged, so the
draws, and with them the tokens under a fixed key, are those of the repeated path.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from ppo_jax.models.kv_cache import KVCache, init_cache
from ppo_jax.parallel.mesh import shard_rows


def shard_cache(cache: KVCache, mesh) -> KVCache:
    """KV cache `[layers, B, S, KVH, hd]` laid out like the activations: rows over the batch
    axes, KV heads over `tensor` (the column-parallel k/v projections produce them there); each
    only where the mesh axes divide the dim (`shard_rows`)."""
    return KVCache(*(shard_rows(c, mesh, axis=1, dims={3: "tensor"}) for c in cache))


def check_groups(prompt_ids, prompt_mask, samples_per_prompt) -> int:
    """Validate `samples_per_prompt` = n for `[B, P]` prompts; returns it as an int.

    n adjacent rows are one group, one prompt: B must be a multiple of n, and on concrete, fully
    addressable arrays (not traced in a caller's jit) every row of a group must equal the
    group's first row in `prompt_ids` and `prompt_mask`, padding included (only that row is run).

    Raises:
      ValueError: n is not an int >= 1, does not divide B, or a group holds different rows (the
        message names the first such group and its rows).
    """
    n = samples_per_prompt
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
        raise ValueError(f"samples_per_prompt={n!r} must be an int")
    if n < 1:
        raise ValueError(f"samples_per_prompt={n} must be >= 1")
    n, batch = int(n), prompt_ids.shape[0]
    if batch % n:
        raise ValueError(f"samples_per_prompt={n} does not divide the batch of {batch} rows "
                         "(rows come in adjacent groups of n copies of one prompt)")
    if n == 1 or any(isinstance(x, jax.core.Tracer) or not getattr(x, "is_fully_addressable", True)
                     for x in (prompt_ids, prompt_mask)):
        return n
    for name, x in (("prompt_ids", prompt_ids), ("prompt_mask", prompt_mask)):
        x = np.asarray(x).reshape(batch // n, n, -1)
        bad = np.flatnonzero((x != x[:, :1]).any(axis=(1, 2)))
        if bad.size:
            g = int(bad[0])
            raise ValueError(f"samples_per_prompt={n}: {name} rows {g * n}..{g * n + n - 1} "
                             f"(group {g}) are not one prompt repeated; each group of {n} "
                             "adjacent rows must hold the same prompt")
    return n


def prefill_cache(model, prompt_ids, prompt_mask, *, max_new_tokens: int,
                  samples_per_prompt: int, cache_dtype, mesh):
    """Inside jit: the prompts into a fresh cache, the first token's logits.

    Args:
      model: a merged `CausalLM`.
      prompt_ids, prompt_mask: `[B, P]` left-padded (checked by the caller); with
        n = `samples_per_prompt` > 1, B/n groups of n identical adjacent rows (`check_groups`).
      max_new_tokens: N; the cache holds S = P + N - 1 slots (the last token is not fed back).
      cache_dtype, mesh: as `static_batch.generate`. The B/n prefill rows are split over the batch
        axes only where those divide them, else replicated (`shard_rows`).

    Returns:
      `(logits [B, V], cache KVCache [layers, B, S, KVH, hd], mask [B, S] int32)`: the last
      prompt position's logits, the cache with the prompt in slots [0, P), the attention mask of
      all S slots (the prompt mask, then zeros). For n > 1 row b holds row `n * (b // n)`'s.
    """
    batch, prompt_len = prompt_ids.shape
    n = samples_per_prompt
    rows = partial(shard_rows, mesh=mesh)
    mask = rows(jnp.concatenate([prompt_mask.astype(jnp.int32),
                                 jnp.zeros((batch, max_new_tokens - 1), jnp.int32)], axis=1))
    cache = shard_cache(init_cache(model.cfg, batch // n, prompt_len + max_new_tokens - 1,
                                   cache_dtype), mesh)
    hidden, cache = model.backbone(rows(prompt_ids[::n].astype(jnp.int32)), rows(mask[::n]),
                                   cache=cache, cache_index=0, mesh=mesh)
    logits = rows(model.lm_head(hidden[:, -1]))
    if n > 1:  # each distinct prompt's cache and logits to the n rows of its group
        logits = rows(jnp.repeat(logits, n, axis=0))
        cache = shard_cache(KVCache(*(jnp.repeat(c, n, axis=1) for c in cache)), mesh)
    return logits, cache, mask
