"""The values a PPO step passes between its parts: the prompt batch it draws (`next_prompts`,
`PromptBatch`), what sampling, scoring and learning return (`Sampled`, `Scored`, `Learned`),
what it keeps for the decoded samples (`LastRollout`), its metrics (`step_metrics`), and the
column buckets that cut its batches to the columns they use (`PromptColumns`,
`ResponseColumns`).

Column buckets. Prompts are left-padded to the widest prompt of the whole set and responses
are sampled `generation.max_new_tokens` wide, but one batch often needs fewer columns. A column
that is padding in every row changes no value: positions come from the mask, attention never
reads a masked key, and every PPO sum, mean, scan and loss masks its padded tokens. So a step
drops the leading all-pad prompt columns before sampling and the trailing all-pad response
columns before the experience pass, rounding the width up to one of a few bucket widths so the
jitted programs compile a bounded number of shapes. The values agree with the full width's to
float rounding, not bit for bit: XLA may reduce a narrower array in another order.

Bucket widths: `bucket_widths(lo, hi, k)` gives `k` evenly spaced widths ending at the full
width, `lo + ceil(i (hi - lo) / k)` for `i = 1..k`, distinct values only. Responses use `lo = 0`,
`hi = max_new_tokens` (`generation.response_buckets`: 40 tokens, 4 buckets -> 10, 20, 30, 40);
prompts use the shortest and the widest prompt of the set (`data.prompt_buckets`). Even spacing
bounds the wasted columns by `(hi - lo) / k`; `k = 1` is the full width. The one value that
depends on the width, the constant `T` of `seq-mean-token-sum`, is pinned to `max_new_tokens`
(`UpdateSettings.max_response_length`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ppo_jax.rollout.forward import Rollout
from ppo_jax.trainer.data.order import DataOrder
from ppo_jax.trainer.data.prompts import PromptSet
from ppo_jax.trainer.stages.ppo.experience import Experience


def bucket_widths(lo: int, hi: int, buckets: int) -> tuple[int, ...]:
    """The widths a batch may be cut to: `lo + ceil(i (hi - lo) / buckets)`, `i = 1..buckets`.

    Args:
      lo: the narrowest width any batch can need (0 for responses; the shortest prompt).
      hi: the full width (max_new_tokens; the widest prompt of the set), >= 1.
      buckets: number of widths asked for, >= 1 (1: just `hi`).

    Returns:
      Distinct ascending int widths in `(lo, hi]`, the last one `hi`: fewer than `buckets`
      when `hi - lo < buckets`, only `hi` when `lo == hi`.

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
def _mean_stats(stats: dict) -> dict:
    """Means over epochs x minibatches; the first minibatch's ratio and approxkl (the PPO
    invariant: 1 and 0) when the policy loss reports them."""
    out = {k: float(np.mean(np.asarray(v))) for k, v in stats.items()}
    for key in ("ratio", "approxkl"):
        if key in stats:
            out[f"{key}_first_minibatch"] = float(np.asarray(stats[key])[0, 0])
    return out


@dataclass(frozen=True)
class PromptBatch:
    """The next batch of prompts (`next_prompts`): B rows, the `n` samples of a prompt adjacent.

    Attributes:
      indices: `[B]` the whole batch's prompt indices (every process knows them).
      ids, mask: `[B, W]` int32 on the mesh, left-padded, `W` = `width`.
      width: the prompt columns kept (a bucket width, or the set's full width).
      texts: this process's rows' prompt texts.
      rows: this process's rows' prompt records (their other fields), or None.
    """

    indices: np.ndarray
    ids: jax.Array
    mask: jax.Array
    width: int
    texts: list[str]
    rows: Optional[list[dict]]


def next_prompts(prompts: PromptSet, order: DataOrder, columns: PromptColumns, place, *,
                 batch: int, n: int, bucketed: bool = True) -> PromptBatch:
    """The next `batch // n` prompts of `order`, each repeated `n` times, put on the mesh.

    Column buckets (`stages.ppo.step_data`): with `bucketed`, the batch's widest prompt rounded
    up to a bucket (read from the whole batch's indices, so every process agrees); else the
    set's full width (dynamic sampling concatenates rounds). Advances `order`.
    """
    lo, hi = place.row_range(batch)
    whole = np.repeat(order.next_indices(batch // n), n)
    idx = whole[lo:hi]  # this process's rows
    width = int(columns.width(whole) if bucketed else columns.full)
    ids = place.put_rows(columns.cut(prompts.ids[idx], width), (batch, width))
    mask = place.put_rows(columns.cut(prompts.mask[idx], width), (batch, width))
    return PromptBatch(indices=whole, ids=ids, mask=mask, width=width,
                       texts=[prompts.texts[i] for i in idx], rows=prompt_rows(prompts, idx))


def prompt_rows(prompts: PromptSet, idx) -> Optional[list[dict]]:
    """The prompt records (each prompt's other fields) of prompt indices `idx`, or None when the
    set has none."""
    return None if prompts.rows is None else [prompts.rows[i] for i in idx]


def group_ids(place, batch: int, n: int) -> jax.Array:
    """`[B]` int32 on the mesh: each row's prompt group, `row // n`."""
    lo, hi = place.row_range(batch)
    return place.put_rows((np.arange(batch, dtype=np.int32) // n)[lo:hi], (batch,))


@dataclass
class Sampled:
    """The rollout part of a step: this process's prompt texts, the batch's prompts and
    responses on the mesh (cut to their bucket widths), prompt groups, the ReMax baseline
    scores (or None), the RNG keys for the update and the next step, when it ended, and the
    prompts' rows (their records' other fields) for a reward function that reads them."""

    prompts: list[str]
    rollout: Rollout
    group_ids: jax.Array
    baseline_scores: Optional[jax.Array]
    update_key: jax.Array
    rng: jax.Array
    prompt_width: int
    response_width: int
    end: float
    rows: Optional[list[dict]] = None  # the prompts' rows (record fields) for the reward function
    scores: Optional[jax.Array] = None  # [B], when already scored (dynamic sampling)
    reward_stats: Optional[dict] = None  # the reward means of those scores
    rollout_logprobs: Optional[jax.Array] = None  # [B, N] the sampler's log-probs of its draws
    engine_stats: Optional[dict] = None  # the paged engine's `rollout/*` figures
    action_mask: Optional[jax.Array] = None  # [B, N] multi-turn: 1 on drawn tokens (env.*)
    ended: Optional[jax.Array] = None  # [B] multi-turn: the episodes that ended


@dataclass
class Scored:
    """The experience part: the experience, the updated KL controller, the experience stats and
    token counts (host values), the decoded responses (reward function only), when it ended."""

    experience: Experience
    kl_state: Any
    stats: dict
    tokens: dict
    responses: Optional[list[str]]
    end: float


@dataclass
class Learned:
    """The learning part: the new train states, the update's stats (host arrays `[epochs,
    minibatches]`), whether it was a critic warm-up step, when it ended."""

    actor: Any
    critic: Any
    stats: dict
    critic_warmup: bool
    end: float


@dataclass(frozen=True)
class LastRollout:
    """What a step keeps for its decoded samples (`rewards.sample_records`): this process's
    prompt texts, its decoded responses (None when a reward model scored: decoded on demand),
    the batch's `Rollout` and its `[B]` scores."""

    prompts: list[str]
    responses: Optional[list[str]]
    rollout: Rollout
    scores: jax.Array


def step_metrics(t0: float, sampled: Sampled, scored: Scored, learned: Learned,
                 data_position: int, synced=None) -> dict:
    """The step's metrics (floats) from its three parts: the experience stats, the update's
    means (`_mean_stats`), phase times (`time/generation`, `time/experience`, `time/update`,
    `time/step`, seconds from `t0`), token rates, the data position and the column widths.
    With `synced` (`rollout_group.Synced`, `generation.placement: split`), the weight sync
    after the update: `weights/sync_bytes`, `time/weight_sync` (seconds), inside `time/step`."""
    t_gen, t_score, t_update = sampled.end, scored.end, learned.end
    gen_tokens = float(scored.tokens["response"])
    total_tokens = float(scored.tokens["prompt"]) + gen_tokens
    metrics = {k: float(v) for k, v in scored.stats.items()}
    metrics.update(_mean_stats(learned.stats))
    metrics.update(sampled.engine_stats or {})
    metrics.update({
        "time/generation": t_gen - t0, "time/experience": t_score - t_gen,
        "time/update": t_update - t_score, "time/step": t_update - t0,
        "tokens_per_s/generation": gen_tokens / max(t_gen - t0, 1e-9),
        "tokens_per_s/step": total_tokens / max(t_update - t0, 1e-9),
        "data_position": data_position, "critic_warmup": float(learned.critic_warmup),
        "prompt_width": float(sampled.prompt_width),
        "response_width": float(sampled.response_width),
    })
    if synced is not None:
        metrics.update({"weights/sync_bytes": float(synced.bytes),
                        "time/weight_sync": synced.seconds,
                        "time/step": t_update - t0 + synced.seconds})
    return metrics
