"""The order a run reads its data in: a fresh permutation per epoch from a seed, resumable
from the number of rows handed out (the checkpoint's data position)."""

from __future__ import annotations

import numpy as np


class DataOrder:
    """Deterministic, resumable order over the rows of a data set (PPO prompts, SFT rows,
    preference pairs).

    The order of epoch `e` is a permutation drawn from `seed + e`; `position` counts prompts
    handed out since the start, so a checkpoint that stores it resumes the same order. With
    several processes, each takes its own contiguous slice of every global batch.
    """

    def __init__(self, size: int, seed: int, shuffle: bool = True, position: int = 0):
        if size <= 0:
            raise ValueError(f"data set is empty (size={size})")
        self.size, self.seed, self.shuffle, self.position = size, seed, shuffle, position
        self._cached: tuple[int, np.ndarray] | None = None

    def _order(self, epoch: int) -> np.ndarray:
        if self._cached is None or self._cached[0] != epoch:
            order = (np.random.default_rng(self.seed + epoch).permutation(self.size)
                     if self.shuffle else np.arange(self.size))
            self._cached = (epoch, order)
        return self._cached[1]

    def next_indices(self, batch_size: int, process_index: int = 0, process_count: int = 1) -> np.ndarray:
        """Indices of the next global batch (this process's slice of it); advances position."""
        out = []
        for k in range(self.position, self.position + batch_size):
            epoch, offset = divmod(k, self.size)
            out.append(self._order(epoch)[offset])
        self.position += batch_size
        per = batch_size // process_count
        return np.asarray(out[process_index * per:(process_index + 1) * per], dtype=np.int64)
