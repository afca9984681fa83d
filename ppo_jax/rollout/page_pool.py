"""The free pages of one replica's KV pool, with reference counts (host side).

Page 0 is the trash page (`models.paged_cache.TRASH_PAGE`): held forever, never handed out.
Pages are handed out lowest id first, so the same requests in the same order give the same
pages on every host. A page shared by the n samples of a prompt (its full prompt pages) holds
a count of n and returns to the pool when the last of them releases it.
"""

from __future__ import annotations

import heapq

from ppo_jax.models.paged_cache import TRASH_PAGE


class PoolExhausted(RuntimeError):
    """More pages were asked for than the pool has free (a scheduler bug: it checks first)."""


class PagePool:
    """`num_pages` pages (the trash page included) of one replica; see the module doc."""

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"a pool needs the trash page and at least one more, got {num_pages}")
        self.num_pages = num_pages
        self.refs = [0] * num_pages
        self.refs[TRASH_PAGE] = 1
        self._free = [p for p in range(num_pages) if p != TRASH_PAGE]
        heapq.heapify(self._free)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self, count: int) -> list[int]:
        """`count` free pages (lowest ids first), each with a count of 1.

        Raises:
          PoolExhausted: fewer than `count` pages are free.
        """
        if count > len(self._free):
            raise PoolExhausted(f"{count} pages asked for, {len(self._free)} free")
        pages = [heapq.heappop(self._free) for _ in range(count)]
        for p in pages:
            self.refs[p] = 1
        return pages

    def share(self, pages, times: int = 1) -> None:
        """Add `times` holders to each of `pages` (the samples of a group share its prompt)."""
        for p in pages:
            self.refs[p] += times

    def release(self, pages) -> None:
        """Drop one holder of each of `pages`; a page with none left is free again."""
        for p in pages:
            if p == TRASH_PAGE or self.refs[p] <= 0:
                raise ValueError(f"page {p} is not held (count {self.refs[p]})")
            self.refs[p] -= 1
            if self.refs[p] == 0:
                heapq.heappush(self._free, p)
