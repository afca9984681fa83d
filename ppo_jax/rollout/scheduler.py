"""The paged engine's scheduler, on the host: which prompts enter which slots, which pages each
sequence holds, which sequences finished or must give their pages back.

One `ReplicaScheduler` per replica (a data-parallel row block of the batch, `rollout.engine`).
Its inputs are the prompt lengths and, after each decode chunk, the lengths and done flags of
its slots, read from a replicated device array: the same values on every host, so every host
takes the same decisions (no host-local timing or randomness enters).

A cycle (driven by `rollout.engine`): `retire` the finished sequences (their pages and slots
come free), `admit` waiting groups into free slots (one prefill per group: the n samples share
the prompt's full pages; each gets its own copy of the last, partial page), `grow` every live
sequence's pages to what the next decode chunk of k tokens writes, then run the chunk.
A group is admitted only when its slots and pages fit beside the growth the live sequences
need, in queue order. When growth alone exceeds the pool (more live sequences than pages for
them), the youngest sequence is preempted: its pages are released and it is queued again at
the front, to be recomputed from its prompt. Its tokens come out the same, since every draw is
keyed by (row, position) (`rollout.draws`), and the oldest sequence always fits (the pool
holds one sequence of the maximum length: `engine.engine_layout` refuses a smaller one), so
every batch finishes.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from ppo_jax.models.paged_cache import TRASH_PAGE
from ppo_jax.rollout.page_pool import PagePool, PoolExhausted


@dataclass
class LiveSequence:
    """A live sequence: its batch row (local to the replica), prompt length, pages (the page
    table row, shared prompt pages first), response tokens drawn so far and admission order."""

    row: int
    prompt_len: int
    pages: list[int]
    length: int
    age: int


@dataclass(frozen=True)
class Admitted:
    """One group entering its slots: its rows (sample 0 first) and their slots, the pages its
    prompt is written to by the prefill (the shared full pages, then sample 0's partial page),
    and the `(source, destination)` page copies that give samples 1..n-1 their partial page."""

    rows: tuple[int, ...]
    slots: tuple[int, ...]
    prompt_pages: tuple[int, ...]
    copies: tuple[tuple[int, int], ...]


def pages_for(tokens: int, page_size: int) -> int:
    """Pages that hold `tokens` tokens."""
    return -(-tokens // page_size)


class ReplicaScheduler:
    """Slots, pages and the queue of one replica (module doc).

    Args:
      prompt_lens: the real prompt length of each of the replica's rows (adjacent groups of
        `group_size` rows hold one prompt).
      group_size: n, samples per prompt; slots: decode slots; num_pages: pool pages (the trash
        page included); page_size; max_new_tokens: N; chunk: k, tokens per decode chunk.
    """

    def __init__(self, prompt_lens: Sequence[int], *, group_size: int, slots: int,
                 num_pages: int, page_size: int, max_new_tokens: int, chunk: int):
        self.n, self.page_size, self.max_new, self.chunk = group_size, page_size, max_new_tokens, chunk
        self.pool = PagePool(num_pages)
        self.slots: list[Optional[LiveSequence]] = [None] * slots
        self.prompt_lens: dict[int, int] = {}  # row -> prompt length, once queued
        self.queue: deque[tuple[int, ...]] = deque()
        self.final: dict[int, int] = {}  # row -> response length, once finished
        self.preemptions = 0
        self._age = 0
        self.enqueue(0, prompt_lens)

    def enqueue(self, first_row: int, prompt_lens: Sequence[int]) -> None:
        """Queue rows `first_row, first_row + 1, ...` with these prompt lengths, in groups of
        n, behind the rows already queued (a stream's next batch: `rollout.stream`)."""
        if len(prompt_lens) % self.n:
            raise ValueError(f"{len(prompt_lens)} rows are not whole groups of {self.n}")
        for i, length in enumerate(prompt_lens):
            self.prompt_lens[first_row + i] = int(length)
        rows = range(first_row, first_row + len(prompt_lens), self.n)
        self.queue.extend(tuple(range(g, g + self.n)) for g in rows)

    # ------------------------------------------------------------------ page arithmetic
    def need_after_chunk(self, prompt_len: int, length: int) -> int:
        """Pages a sequence holds once the next chunk has written its tokens: it feeds the
        tokens at positions prompt_len + length - 1 onwards, k of them, never past the last
        fed token (position prompt_len + N - 2)."""
        last = min(prompt_len + length - 1 + self.chunk, prompt_len + self.max_new - 1)
        return pages_for(max(last, prompt_len), self.page_size)

    def group_need(self, prompt_len: int, n: int) -> int:
        """Pages that admitting a group of n takes, its first chunk's growth included."""
        full, partial = divmod(prompt_len, self.page_size)
        grown = self.need_after_chunk(prompt_len, 1)
        return full + n * (grown - full)

    def growth_reserve(self) -> int:
        """Pages the live sequences still need for the next chunk."""
        return sum(max(0, self.need_after_chunk(s.prompt_len, s.length) - len(s.pages))
                   for s in self.slots if s is not None)

    # ------------------------------------------------------------------ the cycle
    def retire(self, lengths: np.ndarray, done: np.ndarray,
               waiting: Optional[np.ndarray] = None) -> list[int]:
        """Read the slots' lengths and done flags `[S]` after a chunk; finished sequences
        record their length and release their pages and slot. A done slot whose turn ended
        (`waiting`, multi-turn) keeps both: it waits for its environment at this chunk
        boundary. Returns the waiting slots."""
        held = []
        for i, s in enumerate(self.slots):
            if s is None:
                continue
            s.length = int(lengths[i])
            if waiting is not None and waiting[i]:
                held.append(i)
            elif done[i]:
                self.end(i, s.length)
        return held

    def end(self, slot: int, length: int) -> None:
        """The sequence in `slot` is finished with `length` response columns: its pages and
        slot come free."""
        s = self.slots[slot]
        self.final[s.row] = length
        self.pool.release(s.pages)
        self.slots[slot] = None

    def extend(self, slot: int, tokens: int) -> list[int]:
        """Give the waiting sequence in `slot` the pages of `tokens` more fed tokens (its last
        drawn token and an observation) and count the observation's columns and the next
        draw in its length; returns its pages. The pool must hold them (`engine_layout`
        sizes a multi-turn pool so that it always does)."""
        s = self.slots[slot]
        first = s.prompt_len + s.length - 1  # the position of the last drawn token
        while len(s.pages) < pages_for(first + tokens, self.page_size):
            s.pages += self.pool.take(1)
        s.length += tokens
        return s.pages

    def admit(self) -> list[Admitted]:
        """Admit waiting groups, in queue order, while their slots and pages fit."""
        out = []
        while self.queue:
            rows = self.queue[0]
            free = [i for i, s in enumerate(self.slots) if s is None]
            prompt_len = self.prompt_lens[rows[0]]
            need = self.group_need(prompt_len, len(rows)) + self.growth_reserve()
            if len(free) < len(rows) or self.pool.num_free < need:
                break
            self.queue.popleft()
            out.append(self._place(rows, free[:len(rows)], prompt_len))
        return out

    def _place(self, rows: tuple[int, ...], slots: list[int], prompt_len: int) -> Admitted:
        n, full = len(rows), prompt_len // self.page_size
        shared = self.pool.take(full)
        self.pool.share(shared, n - 1)
        own = self.pool.take(n) if prompt_len % self.page_size else []
        for i, (row, slot) in enumerate(zip(rows, slots)):
            self.slots[slot] = LiveSequence(row, prompt_len, shared + own[i:i + 1], 1, self._age)
            self._age += 1
        copies = tuple((own[0], own[i]) for i in range(1, len(own)))
        return Admitted(tuple(rows), tuple(slots), tuple(shared + own[:1]), copies)

    def grow(self) -> list[int]:
        """Give every live sequence the pages of its next chunk, oldest first, preempting the
        youngest when the pool runs out; returns the preempted rows."""
        preempted = []
        for slot in sorted((i for i, s in enumerate(self.slots) if s is not None),
                           key=lambda i: self.slots[i].age):
            s = self.slots[slot]
            if s is None:  # preempted by an older sequence's growth
                continue
            while len(s.pages) < self.need_after_chunk(s.prompt_len, s.length):
                if self.pool.num_free == 0:
                    victim = self._youngest()
                    preempted.append(self.slots[victim].row)
                    self._preempt(victim)
                    if victim == slot:
                        break
                    continue
                s.pages += self.pool.take(1)
        return preempted

    def _youngest(self) -> int:
        live = [i for i, s in enumerate(self.slots) if s is not None]
        if not live:
            raise PoolExhausted("no sequence left to preempt")
        return max(live, key=lambda i: self.slots[i].age)

    def _preempt(self, slot: int) -> None:
        s = self.slots[slot]
        self.pool.release(s.pages)
        self.slots[slot] = None
        self.queue.appendleft((s.row,))
        self.preemptions += 1

    # ------------------------------------------------------------------ views for the device
    @property
    def finished(self) -> bool:
        return not self.queue and all(s is None for s in self.slots)

    def live(self) -> np.ndarray:
        """`[S]` bool: the slots holding a sequence."""
        return np.array([s is not None for s in self.slots], bool)

    def max_pages(self) -> int:
        """The most pages a live sequence holds (0 with none)."""
        return max((len(s.pages) for s in self.slots if s is not None), default=0)

    def page_table(self, width: int) -> np.ndarray:
        """`[S, width]` int32: each slot's first `width` pages, the trash page after them and in
        empty slots."""
        table = np.full((len(self.slots), width), TRASH_PAGE, np.int32)
        for i, s in enumerate(self.slots):
            if s is not None:
                if len(s.pages) > width:
                    raise ValueError(f"slot {i} holds {len(s.pages)} pages, view is {width} wide")
                table[i, :len(s.pages)] = s.pages
        return table
