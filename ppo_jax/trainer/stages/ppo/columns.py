"""Column buckets: each PPO step works on the prompt and response columns its batch uses.

Prompts are left-padded to the widest prompt of the whole set and responses are sampled
`generation.max_new_tokens` wide, but one batch often needs fewer columns: its own widest
prompt, its own longest response. A column that is padding in every row of the batch changes
no value: positions come from the mask (`models.kv_cache.positions_from_mask`), attention never
reads a masked key, and every PPO sum, mean, scan and loss masks its padded tokens. So a step
drops such columns -- the leading all-pad prompt columns before sampling, the trailing all-pad
response columns before experience making and the update -- rounding the width UP to one of a
few fixed bucket widths, so that the jitted functions compile a bounded number of shapes
(`jax.jit` keeps one executable per input shape).
The values agree with the full width's to float rounding, not bit for bit: XLA may reduce a
narrower array in another order.

Bucket widths (`bucket_widths(lo, hi, k)`): `k` evenly spaced widths ending at the full width,
`lo + ceil(i (hi - lo) / k)` for `i = 1..k` (distinct values only). Responses use `lo = 0`,
`hi = max_new_tokens` (`generation.response_buckets`: 40 tokens, 4 buckets -> 10, 20, 30, 40);
prompts use the shortest and the widest prompt of the set (`data.prompt_buckets`), since the
chat template makes every prompt at least that long. Even spacing bounds the wasted columns by
`(hi - lo) / k` and keeps the count of compiled shapes at `k` (at most `k_prompt x k_response`
for experience making and the update); `k = 1` is the full width, the behaviour without buckets.

The one value that depends on the width itself is the constant `T` of the
`seq-mean-token-sum` loss aggregation: the trainer pins it to `max_new_tokens`
(`UpdateSettings.max_response_length`), never the bucket width.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np


def bucket_widths(lo: int, hi: int, buckets: int) -> tuple[int, ...]:
    """The widths a batch may be cut to: `lo + ceil(i (hi - lo) / buckets)`, `i = 1..buckets`.

    Args:
      lo: the narrowest width any batch can need (0 for responses; the shortest prompt).
      hi: the full width (max_new_tokens; the widest prompt of the set), >= 1.
      buckets: number of widths asked for, >= 1 (1: just `hi`).

    Returns:
      Distinct ascending int widths in `(lo, hi]`, the last one `hi` (fewer than `buckets`
      when `hi - lo < buckets`; `(hi,)` when `lo == hi`).

    Raises:
      ValueError: `buckets < 1`, `hi < 1` or `lo` outside `[0, hi]`.
    """
    if isinstance(buckets, bool) or int(buckets) != buckets or buckets < 1:
        raise ValueError(f"buckets={buckets!r} must be an int >= 1")
    if hi < 1 or not 0 <= lo <= hi:
        raise ValueError(f"bucket range lo={lo}, hi={hi}: need 0 <= lo <= hi and hi >= 1")
    span = hi - lo
    widths = {max(lo + -(-i * span // buckets), 1) for i in range(1, int(buckets) + 1)}
    return tuple(sorted(widths))


def bucket_width(length: int, widths: Sequence[int]) -> int:
    """The narrowest of `widths` (ascending) that holds `length` columns; the first width for
    `length` 0 (an array keeps at least one column).

    Raises:
      ValueError: `length` is negative or wider than the last width.
    """
    if length < 0 or length > widths[-1]:
        raise ValueError(f"length {length} is outside [0, {widths[-1]}] (bucket widths {list(widths)})")
    return next(w for w in widths if w >= length)


class PromptColumns:
    """The prompt width of each batch: its widest prompt, rounded up to a bucket.

    `PromptColumns(mask, buckets)` with the whole set's left-padded mask `[N, P]`;
    `width(indices)` is the batch's bucket width `W <= P` (every process passes the indices of
    the WHOLE global batch, which each process knows, so all agree without a collective), and
    `cut(ids, width)` keeps the last `W` columns of left-padded `[n, P]` rows.
    """

    def __init__(self, mask: np.ndarray, buckets: int):
        self.lengths = np.asarray(mask).astype(np.int64).sum(axis=1)  # [N] real tokens per prompt
        self.full = int(np.asarray(mask).shape[1])
        lo = int(self.lengths.min()) if self.lengths.size else self.full
        self.widths = bucket_widths(min(lo, self.full), self.full, buckets)

    def width(self, indices: np.ndarray) -> int:
        """Bucket width of the prompts `indices` (the whole global batch)."""
        return bucket_width(int(self.lengths[np.asarray(indices)].max()), self.widths)

    @staticmethod
    def cut(x: np.ndarray, width: int) -> np.ndarray:
        """`x [n, P]` -> `[n, width]`: the last `width` columns (left padding dropped)."""
        return np.ascontiguousarray(x[:, x.shape[1] - width:])


def _longest(mask: jax.Array) -> jax.Array:
    """`[B, N]` 0/1 mask -> int32 scalar: the most real tokens of any row (the whole batch)."""
    return jnp.max(jnp.sum(mask.astype(jnp.int32), axis=1))


def _narrow(ids: jax.Array, mask: jax.Array, width: int) -> tuple[jax.Array, jax.Array]:
    """The first `width` columns of `[B, N]` response ids and mask."""
    return ids[:, :width], mask[:, :width]


class ResponseColumns:
    """Cut sampled responses to the batch's longest response, rounded up to a bucket.

    `ResponseColumns(max_new_tokens, buckets, by_row, replicated)`: `by_row` / `replicated` are
    the run's batch and replicated shardings. `cols(ids, mask) -> (ids, mask, width)` with
    `ids`, `mask` `[B, N]` int32 (mask 1 on a prefix of each row: up to and including the stop
    token) returns `[B, width]` int32 views of the same rows. The longest response is a jitted
    max over the whole (row-sharded) batch with a replicated result, so with several processes
    every process reads the same global value and cuts to the same width.
    """

    def __init__(self, max_new_tokens: int, buckets: int, by_row=None, replicated=None):
        self.widths = bucket_widths(0, max_new_tokens, buckets)
        kw = {} if by_row is None else {"in_shardings": by_row, "out_shardings": replicated}
        self._longest = jax.jit(_longest, **kw)
        kw = {} if by_row is None else {"in_shardings": (by_row, by_row),
                                        "out_shardings": (by_row, by_row)}
        self._narrow = jax.jit(_narrow, static_argnums=2, **kw)
        kw = {} if by_row is None else {"in_shardings": by_row, "out_shardings": by_row}
        self._narrow_one = jax.jit(lambda x, width: x[:, :width], static_argnums=1, **kw)

    def width(self, mask: jax.Array) -> int:
        """The bucket width of the batch's longest response (a device -> host read of a
        replicated scalar: the same on every process)."""
        return bucket_width(int(jax.device_get(self._longest(mask))), self.widths)

    def __call__(self, ids: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array, int]:
        """`(ids [B, W], mask [B, W], W)`; the inputs themselves when `W` is their width."""
        full = ids.shape[1]
        if len(self.widths) == 1:
            return ids, mask, full
        width = self.width(mask)
        if width == full:
            return ids, mask, full
        ids, mask = self._narrow(ids, mask, width)
        return ids, mask, width

    def cut(self, x: jax.Array, width: int) -> jax.Array:
        """The first `width` columns of another `[B, N]` array of the responses (their
        log-probs), as `__call__` cut the ids."""
        return x if width == x.shape[1] else self._narrow_one(x, width)
