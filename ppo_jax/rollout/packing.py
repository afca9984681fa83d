"""Packed sequences for the forward passes over prompt + response (`ppo.packing`).

A padded micro-batch holds each sequence in a row `[P + N]`: the prompt left-padded to P, the
response right-padded to N. With heavy-tailed response lengths, half its slots can be padding,
and every slot pays the full attention and MLP cost. Packing moves each sequence's real tokens
into rows of `width` slots, several sequences a row, each row's sequences told apart by
segment ids (1, 2, ...; 0 on padding), which the models read from the attention mask
(`models.kv_cache.positions_from_mask`, `same_segment`): attention stays within a segment and
positions restart at each one. The outputs come back to the padded `[B, N]` layout the losses
and estimators read, so their math does not change.

The plan is made on the host from the sequences' lengths (`plan_packing`, first-fit
decreasing: Johnson 1973), the device gathers (`pack`, `unpack`). With a mesh, each device
packs only its own rows of the micro-batch (`shards`: the rows split over ("data", "fsdp") in
contiguous blocks, as `parallel.shard_rows` splits them), so the gathers never cross devices.
Right-padded token rows (stages 1 and 2: `sft.packing`, `reward_model.packing`) are planned by
`plan_rows`; `unpack_last` reads each sequence's output at its last real token.
The number of rows a shard packs into is rounded up to one of four sizes an octave
(`row_bucket`), so a run compiles a few shapes, not one per batch. Anchors that pack: verl
`use_remove_padding`, OpenRLHF `packing_samples`, TRL `padding_free`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


@struct.dataclass
class PackedRows:
    """Where one micro-batch's tokens go, for `pack` and `unpack` (int32 arrays; S shards, R
    packed rows a shard, W slots a row, m rows of the micro-batch, L = P + N).

    src: `[S, R, W]`, each packed slot's index into its shard's `[m / S * L]` flattened
      sequence slots; `m / S * L` (one past the end) on padding.
    segments: `[S, R, W]`, 1, 2, ... the sequence's number within its row; 0 on padding.
    dst: `[S, m / S, N]`, the packed slot (index into the shard's `[R * W]`) whose output is
      read for response token t: the slot of the token before it. Any slot past the response.
    head_src, head_dst: `[S, C]`, the real response tokens only, C a shard's most (rounded by
      `row_bucket`): the packed slot each is read at, and its index into the shard's
      `[m / S * N]` response slots (`m / S * N` on padding). The LM head runs over these
      (`gather_response`, `scatter_response`), not over the padded `[m, N]`. None in a plan
      built by hand: the head then reads `unpack`'s `[m, N]`.
    """

    src: jax.Array
    segments: jax.Array
    dst: jax.Array
    head_src: Any = None
    head_dst: Any = None


def first_fit_decreasing(lengths: np.ndarray, width: int) -> list[list[int]]:
    """Bins of sequence indices, each bin's lengths summing to at most `width`: longest first,
    each into the first bin with room (Johnson 1973; at most 11/9 OPT + 1 bins).

    Raises:
      ValueError: a sequence is longer than `width`, naming both.
    """
    lengths = np.asarray(lengths)
    if lengths.size and lengths.max() > width:
        i = int(np.argmax(lengths))
        raise ValueError(f"sequence {i} has {int(lengths[i])} tokens, more than the packed row's "
                         f"{width}")
    bins, room = [], []
    for i in np.argsort(-lengths, kind="stable"):
        n = int(lengths[i])
        slot = next((b for b, r in enumerate(room) if r >= n), None)
        if slot is None:
            bins.append([]), room.append(width)
            slot = len(bins) - 1
        bins[slot].append(int(i))
        room[slot] -= n
    return bins


def row_bucket(needed: int, most: int) -> int:
    """Packed rows a shard compiles for: `needed` itself up to 8, above that rounded up to a
    multiple of an eighth of the next power of two (9 -> 10, 17 -> 20, 33 -> 40: four shapes an
    octave, at most 1/8 of a power of two wasted), at most `most` (`needed` <= `most`)."""
    power = 1 << max(needed - 1, 0).bit_length()  # the least power of two >= needed
    step = max(power // 8, 1)
    return min(-(-needed // step) * step, most)


def shard_plan(query_lengths, response_lengths, prompt_width: int, response_width: int,
               width: int, rows: int, bins: list[list[int]] | None = None):
    """`(src [R, W], segments [R, W], dst [m, N])` of one shard's m sequences (`PackedRows`),
    from their real prompt lengths (right-aligned in P slots) and response lengths (from slot
    0 of N), into `rows` rows of `width` slots: the rows `bins` (lists of sequence indices;
    default `first_fit_decreasing`). A sequence in no bin is read from slot 0 (an absent
    place of a token-budget micro-batch, `plan_token_budget`).

    Raises:
      ValueError: a sequence longer than `width`, or more rows needed than `rows`.
    """
    q, r = np.asarray(query_lengths, np.int64), np.asarray(response_lengths, np.int64)
    m, seq = len(q), prompt_width + response_width
    bins = first_fit_decreasing(q + r, width) if bins is None else bins
    if len(bins) > rows:
        raise ValueError(f"{m} sequences need {len(bins)} packed rows; the plan has {rows}")
    src = np.full((rows, width), m * seq, np.int32)
    segments = np.zeros((rows, width), np.int32)
    dst = np.zeros((m, response_width), np.int32)
    head = []  # (packed slot, response slot) of each real response token
    for row, members in enumerate(bins):
        at = 0
        for k, i in enumerate(members):
            n_q, n_r = int(q[i]), int(r[i])
            slots = np.concatenate([np.arange(prompt_width - n_q, prompt_width),
                                    prompt_width + np.arange(n_r)]) + i * seq
            src[row, at:at + n_q + n_r] = slots
            segments[row, at:at + n_q + n_r] = k + 1
            # response token t is read where the sequence's token before it sits
            before = row * width + at + n_q - 1
            dst[i] = before + np.minimum(np.arange(response_width), max(n_r - 1, 0))
            head.append(np.stack([before + np.arange(n_r), i * response_width + np.arange(n_r)], 1))
            at += n_q + n_r
    return src, segments, dst, np.concatenate(head or [np.zeros((0, 2), np.int64)])


def _stacked(planned: list, lead: tuple) -> PackedRows:
    """The `PackedRows` of `shard_plan` outputs, one a shard, leaves `[*lead, ...]`: the head's
    token lists padded to the longest, rounded up by `row_bucket`."""
    src, seg, dst = (np.stack([p[f] for p in planned]).reshape(*lead, *planned[0][f].shape)
                     for f in range(3))
    none = dst.shape[-2] * dst.shape[-1]  # a shard's m / S * N: the padding index
    c = row_bucket(max(max(len(p[3]) for p in planned), 1), none)
    head = np.zeros((len(planned), c, 2), np.int64)
    head[..., 1] = none
    for n, p in enumerate(planned):
        head[n, :len(p[3])] = p[3]
    head = head.reshape(*lead, c, 2).astype(np.int32)
    return PackedRows(src=src, segments=seg, dst=dst, head_src=head[..., 0],
                      head_dst=head[..., 1])


def balanced_order(lengths, block: int) -> np.ndarray:
    """A permutation of the rows that gives every consecutive `block` of them a near-equal
    token total: longest first, each to the least-loaded block with a free place (greedy LPT,
    Graham 1969, with equal block sizes). Packed, the blocks then need near-equal rows, and
    the largest, which sets every block's shape, is near the mean."""
    lengths = np.asarray(lengths)
    n = len(lengths) // block
    totals, members = np.zeros(n), [[] for _ in range(n)]
    for i in np.argsort(-lengths, kind="stable"):
        free = [j for j in range(n) if len(members[j]) < block]
        j = min(free, key=lambda k: totals[k])
        members[j].append(int(i))
        totals[j] += lengths[i]
    return np.concatenate(members).astype(np.int32)


def plan_packing(query_lengths, response_lengths, *, prompt_width: int, response_width: int,
                 micro_batch_size: int, shards: int = 1, width: int | None = None,
                 balance: int | None = None) -> tuple[np.ndarray, PackedRows]:
    """The order of the rows and the `PackedRows` of every micro-batch, stacked: leaves
    `[n_micro, S, ...]`.

    Args:
      query_lengths, response_lengths: `[B]` int, each row's real prompt tokens (left-padded:
        the last ones of its P) and real response tokens (the first ones of its N), in the
        order the micro-batches take the rows (B a multiple of `micro_batch_size`).
      prompt_width, response_width: P and N of the padded rows.
      micro_batch_size: m, rows per forward pass; a multiple of `shards`.
      shards: S, the devices the rows of a micro-batch are split over.
      width: W, slots of a packed row; default P + N (every sequence fits).
      balance: None, or a number of rows (a multiple of m) within which the rows may change
        places: each such group is reordered (`balanced_order`) so that its micro-batches and
        shards hold near-equal tokens. A minibatch's micro-batches only add up its loss (the
        normalisers are the minibatch's), so this changes no value.

    Returns:
      `(order [B] int32, plan)`: the micro-batches take rows `order` (the identity without
      `balance`).

    Raises:
      ValueError: a sequence longer than W (naming both), or sizes that do not divide.
    """
    q, r = np.asarray(query_lengths), np.asarray(response_lengths)
    width = prompt_width + response_width if width is None else int(width)
    if len(q) % micro_batch_size or micro_batch_size % shards or (balance or 0) % micro_batch_size:
        raise ValueError(f"batch {len(q)}, micro_batch_size {micro_batch_size}, {shards} shards "
                         f"and balance {balance} do not divide")
    per = micro_batch_size // shards
    order = np.arange(len(q), dtype=np.int32)
    if balance:
        order = np.concatenate([g + balanced_order((q + r)[g:g + balance], per)
                                for g in range(0, len(q), balance)]).astype(np.int32)
    q, r = q[order], r[order]
    blocks = [(q[i:i + per], r[i:i + per]) for i in range(0, len(q), per)]
    needed = max(len(first_fit_decreasing(a + b, width)) for a, b in blocks)
    rows = row_bucket(needed, max(per, needed))
    planned = [shard_plan(a, b, prompt_width, response_width, width, rows) for a, b in blocks]
    return order, _stacked(planned, (len(q) // micro_batch_size, shards))


@struct.dataclass
class PackedBatch:
    """A batch's packing: `order`, the rows in the order its micro-batches take them (`[B]`
    int32; the update's: `[ppo_epochs, B]`, each epoch's), and `rows`, the micro-batches'
    `PackedRows` (leaves `[n_micro, ...]`; the update's: `[ppo_epochs, n_minibatches,
    n_micro, ...]`). `micro`: None (each micro-batch takes the next `micro_batch_size` rows of
    `order`), or with a token budget each micro-batch's places, `[ppo_epochs, n_minibatches,
    n_micro, K]` int32 indices into its minibatch's rows, the minibatch size on an absent
    place (`plan_token_budget`)."""

    order: jax.Array
    rows: PackedRows
    micro: Any = None


def _deal(bins: list[list[int]], groups: int, per_group: int) -> list[list[list[int]]]:
    """`bins` dealt to `groups` groups of at most `per_group` bins, the bins holding the most
    sequences first, each to the group with the fewest sequences and room (LPT): every group's
    sequence count, which sets the micro-batch's padded width K, stays near the mean."""
    out, counts = [[] for _ in range(groups)], np.zeros(groups, np.int64)
    for b in sorted(bins, key=len, reverse=True):
        j = min((g for g in range(groups) if len(out[g]) < per_group), key=lambda g: counts[g])
        out[j].append(b)
        counts[j] += len(b)
    return out


def plan_token_budget(query_lengths, response_lengths, *, prompt_width: int,
                      response_width: int, mini_batch_size: int, rows_per_micro: int,
                      shards: int = 1) -> tuple[np.ndarray, PackedRows]:
    """Micro-batches by a token budget (`ppo.micro_batch_tokens`; verl's dynamic batch size):
    each minibatch's sequences packed first-fit decreasing into rows of P + N slots, and the
    rows dealt to micro-batches of `rows_per_micro` rows a shard, so a micro-batch holds as
    many sequences as fit its rows; of fewer rows where the largest minibatch packs into fewer
    (its rows over the shards, rounded up by `row_bucket`), so a budget above a minibatch
    computes no empty rows. Every micro-batch of the batch has the same shapes: the
    largest number of micro-batches a minibatch needs and of sequences a shard holds, each
    rounded up by `row_bucket`; an unneeded micro-batch is empty.

    Args:
      query_lengths, response_lengths: `[B]` int, real prompt / response tokens of each row, in
        the order the minibatches take them (B a multiple of `mini_batch_size`).
      prompt_width, response_width: P and N of the padded rows.
      mini_batch_size: M, rows a minibatch.
      rows_per_micro: packed rows (of P + N slots) a shard computes in one pass.
      shards: S, the devices a micro-batch's rows are split over.

    Returns:
      `(micro [n_mb, n_micro, S * K] int32, plan)`: micro-batch j of minibatch g takes the
      minibatch's rows `micro[g, j]` (M on an absent place), shard s the K from `s * K`;
      `plan` the `PackedRows` of each, leaves `[n_mb, n_micro, S, ...]`.

    Raises:
      ValueError: a sequence longer than P + N, or sizes that do not divide.
    """
    q, r = np.asarray(query_lengths, np.int64), np.asarray(response_lengths, np.int64)
    width, mini = prompt_width + response_width, mini_batch_size
    if len(q) % mini or rows_per_micro < 1:
        raise ValueError(f"batch {len(q)}, mini_batch_size {mini} and rows_per_micro "
                         f"{rows_per_micro} do not divide")
    binned = [[[g + i for i in b] for b in first_fit_decreasing((q + r)[g:g + mini], width)]
              for g in range(0, len(q), mini)]
    # a budget above the largest minibatch would compile rows no sequence fills
    rows_per_micro = min(rows_per_micro,
                         row_bucket(-(-max(map(len, binned)) // shards), -(-mini // shards)))
    per_micro = shards * rows_per_micro
    # per minibatch: [n_micro * S] groups of bins (minibatch row indices)
    dealt = [_deal(bins, -(-len(bins) // per_micro) * shards, rows_per_micro) for bins in binned]
    n_micro = row_bucket(max(len(d) for d in dealt) // shards, mini)
    k = row_bucket(max(sum(map(len, grp)) for d in dealt for grp in d), mini)
    micro = np.full((len(dealt), n_micro * shards, k), mini, np.int32)
    planned = []
    for g, groups in enumerate(dealt):
        for j in range(n_micro * shards):
            grp = groups[j] if j < len(groups) else []
            rows = [i for b in grp for i in b]
            at = {i: n for n, i in enumerate(rows)}
            micro[g, j, :len(rows)] = np.asarray(rows, np.int64) - g * mini
            lengths = [np.zeros(k, np.int64), np.zeros(k, np.int64)]
            lengths[0][:len(rows)], lengths[1][:len(rows)] = q[rows], r[rows]
            planned.append(shard_plan(*lengths, prompt_width, response_width, width,
                                      rows_per_micro, bins=[[at[i] for i in b] for b in grp]))
    return (micro.reshape(len(dealt), n_micro, shards * k),
            _stacked(planned, (len(dealt), n_micro, shards)))


def heavy_tailed_lengths(n: int, longest: int, mean_over_max: float, seed: int = 0) -> np.ndarray:
    """`[n]` int64 lengths in [1, longest], log-normal (sigma 1: the shape reported for
    reasoning RL's responses), scaled so the longest is `longest` and the mean is
    `mean_over_max * longest` (bisection on the scale). The lengths a plan is shaped for before
    any data exists (`--compile-for`, `bench/packing.py`)."""
    raw = np.random.default_rng(seed).lognormal(0.0, 1.0, n)
    lo, hi, out = 1e-3, 1e3, None
    for _ in range(60):
        scale = (lo * hi) ** 0.5
        out = np.clip(np.round(raw / raw.max() * longest * scale), 1, longest)
        lo, hi = (scale, hi) if out.mean() / longest < mean_over_max else (lo, scale)
    return out.astype(np.int64)


def plan_rows(lengths, *, length: int, micro_batch_size: int, shards: int = 1,
              width: int | None = None) -> PackedRows:
    """The `PackedRows` of right-padded rows `[B, L]`, each row's n real tokens in slots
    0 .. n-1 (the token rows of SFT and the reward model): leaves `[B / micro_batch_size, S,
    ...]`.

    A row is `plan_packing`'s sequence with a one-token prompt and an (n - 1)-token response,
    so `unpack` gives `[m, L - 1, ...]` whose entry t is the output at token t: the one that
    predicts token t + 1, as the padded pass's `out[:, :-1]` on every t < n - 1 (later entries
    repeat token n - 2's). `unpack_last` reads the output at each row's last real token.

    Args:
      lengths: `[B]` int, real tokens of each row, in the order the micro-batches take them
        (balance them first with `balanced_order` where rows may change places).
      length: L, slots of a padded row.
      micro_batch_size, shards, width: as `plan_packing` (W default L).

    Raises:
      ValueError: a row with no real token, or see `plan_packing`.
    """
    n = np.asarray(lengths, np.int64)
    if n.size and n.min() < 1:
        raise ValueError(f"row {int(np.argmin(n))} has no real token to pack")
    return plan_packing(np.ones_like(n), n - 1, prompt_width=1, response_width=length - 1,
                        micro_batch_size=micro_batch_size, shards=shards, width=width)[1]


def fill_figures(plan: PackedRows, lengths, width: int, prefix: str = "packing/") -> dict:
    """A plan's figures, floats: `{prefix}rows` (packed rows a micro-batch, all shards),
    `{prefix}fill` (real tokens over the packed slots) and `{prefix}padded_fill` (real tokens
    over the slots of the padded rows, `width` each), for the planned sequences' `lengths`
    (all of them: an update's plan covers every epoch)."""
    n_micro, shards, rows, slots = plan.src.shape
    real = float(np.sum(lengths))
    return {f"{prefix}rows": float(shards * rows),
            f"{prefix}fill": real / (n_micro * shards * rows * slots),
            f"{prefix}padded_fill": real / (len(lengths) * width)}


def pack(x: jax.Array, plan: PackedRows, fill=0) -> jax.Array:
    """`[m, L, ...]` padded sequence slots -> `[S * R, W, ...]` packed rows (`fill` on
    padding), each shard gathering from its own `m / S` rows."""
    s, rows, width = plan.src.shape
    m, length = x.shape[:2]
    flat = x.reshape(s, m // s * length, *x.shape[2:])
    flat = jnp.concatenate([flat, jnp.full_like(flat[:, :1], fill)], axis=1)  # the padding slot
    out = jax.vmap(lambda a, i: a[i])(flat, plan.src)
    return out.reshape(s * rows, width, *x.shape[2:])


def unpack(y: jax.Array, plan: PackedRows) -> jax.Array:
    """`[S * R, W, ...]` outputs of packed rows -> `[m, N, ...]`, response token t of each row
    taking the output at its `dst` slot."""
    s, rows, width = plan.src.shape
    flat = y.reshape(s, rows * width, *y.shape[2:])
    out = jax.vmap(lambda a, i: a[i])(flat, plan.dst)
    return out.reshape(-1, plan.dst.shape[-1], *y.shape[2:])


def unpack_last(y: jax.Array, plan: PackedRows, length: int) -> jax.Array:
    """`[S * R, W, ...]` outputs of packed rows -> `[m, ...]`, each sequence's output at its
    last real token (where a reward model reads its score; `models.heads.last_real_index` of
    the padded row). `length`: L, slots of a padded sequence (`pack`'s `x.shape[1]`).

    A sequence's tokens sit in consecutive slots in their order, so its last token is the
    largest slot whose `src` falls in its `[i * L, (i + 1) * L)`; a sequence with no token
    reads slot 0."""
    s, rows, width = plan.src.shape
    per = plan.dst.shape[1]
    owner = plan.src.reshape(s, rows * width) // length  # per (out of range) on padding
    slots = jnp.arange(rows * width, dtype=jnp.int32)
    last = jax.vmap(lambda o: jnp.zeros(per, jnp.int32).at[o].max(slots, mode="drop"))(owner)
    flat = y.reshape(s, rows * width, *y.shape[2:])
    out = jax.vmap(lambda a, i: a[i])(flat, last)
    return out.reshape(s * per, *y.shape[2:])


def packed_rows(ids: jax.Array, plan: PackedRows) -> tuple[jax.Array, jax.Array]:
    """`(ids, segment ids)` `[S * R, W]` int32 of padded `[m, L]` sequences: the models' input
    for a packed pass (the segment ids are its attention mask)."""
    s, rows, width = plan.segments.shape
    return pack(ids, plan), plan.segments.reshape(s * rows, width)


def gather_response(y: jax.Array, plan: PackedRows) -> jax.Array:
    """`[S * R, W, ...]` outputs of packed rows -> `[S, C, ...]`, the output each real response
    token is read at (`PackedRows.head_src`; padding reads slot 0)."""
    s, rows, width = plan.src.shape
    flat = y.reshape(s, rows * width, *y.shape[2:])
    return jax.vmap(lambda a, i: a[i])(flat, plan.head_src)


def scatter_response(x: jax.Array, plan: PackedRows) -> jax.Array:
    """`[S, C, ...]` per real response token -> `[m, N, ...]`, 0 on every other slot (the
    padding of `head_dst` is dropped)."""
    s, per, n = plan.dst.shape
    out = jnp.zeros((s, per * n, *x.shape[2:]), x.dtype)
    out = jax.vmap(lambda o, i, v: o.at[i].set(v, mode="drop"))(out, plan.head_dst, x)
    return out.reshape(s * per, n, *x.shape[2:])
