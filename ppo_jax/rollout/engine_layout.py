"""The paged engine's settings and sizes: `EngineSettings` (`generation.*`), the layout one batch
shape gets (`engine_layout`: replicas, slots, pool pages, checked before any compile), the page
size rule of a run, and what one `generate` call did (`EngineStats`); `rollout.engine` runs the
engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from ppo_jax.models.paged_cache import ATTENTION_KERNELS
from ppo_jax.rollout.scheduler import ReplicaScheduler, pages_for

ENGINES = ("static", "paged")
RolloutEngine = Literal[ENGINES]  # generation.engine
AttentionKernel = Literal[ATTENTION_KERNELS]  # generation.attention


@dataclass(frozen=True)
class EngineSettings:
    """The paged engine's own settings, the `generation.*` keys of the same names (built by
    `stages.ppo.settings.engine_settings`); 0 means the default named."""

    page_size: int  # tokens per page
    num_pages: int  # pages in all replicas' pools; 0: the static sampler's KV memory
    max_concurrent: int  # decode slots in all replicas; 0: the batch size
    decode_chunk: int  # tokens per decode chunk between two scheduling rounds
    decode_buckets: int  # page-table widths the decode chunk compiles for
    attention: str  # "reference" (gather the pages) or "pallas" (TPU kernel)


@dataclass(frozen=True)
class EngineLayout:
    """The engine's sizes for one batch shape (`engine_layout`): replicas, rows, slots and
    pool pages per replica (the trash page included), pages of the longest sequence."""

    replicas: int
    rows: int
    slots: int
    pages: int
    max_pages: int
    group_size: int


@dataclass
class EngineStats:
    """What one `generate` call did: prefill calls, decode chunks and decode steps, the rows
    the decode steps ran on, the mean fraction of slots live per chunk, preemptions, the most
    pages in use at once (in one replica)."""

    prefills: int = 0
    chunks: int = 0
    steps: int = 0
    row_steps: int = 0  # sum over decode steps of the rows the model ran on (slot buckets x R)
    slot_occupancy: float = 0.0
    preemptions: int = 0
    peak_pages: int = 0
    turn_rounds: int = 0  # multi-turn: host rounds that answered waiting turns
    widths: dict = field(default_factory=dict)  # page-table width -> decode chunks run at it
    rows: dict = field(default_factory=dict)  # live-slot bucket -> decode chunks run at it


def engine_layout(settings: EngineSettings, *, batch: int, prompt_width: int,
                  max_new_tokens: int, group_size: int, replicas: int,
                  turns: bool = False) -> EngineLayout:
    """Check the settings against one batch shape and size the engine (before any compile).

    A sequence holds at most `prompt_width + max_new_tokens - 1` tokens (the last token is
    never fed back). Each replica's pool must hold the trash page and one sequence of that
    length (and a whole group's first chunk), its slots one group; for multi-turn episodes
    (`turns`), a sequence of that length in every slot (they are never preempted:
    `rollout.turns`).

    Raises:
      ValueError: naming the `generation.*` setting and its value: too few pages; slots not a
        multiple of the replicas or fewer than a group per replica; a replica's rows not whole
        groups; a bad page size, chunk or kernel.
    """
    s, n = settings, group_size
    cache_len = prompt_width + max_new_tokens
    _positive(page_size=s.page_size, decode_chunk=s.decode_chunk, decode_buckets=s.decode_buckets)
    if s.attention not in ATTENTION_KERNELS:
        raise ValueError(f"generation.attention={s.attention!r}; one of {ATTENTION_KERNELS}")
    if batch % replicas or (batch // replicas) % n:
        raise ValueError(f"the batch of {batch} rows over {replicas} replicas (mesh data x fsdp) "
                         f"is not whole groups of samples_per_prompt={n} per replica")
    slots = s.max_concurrent or batch
    if slots % replicas or slots // replicas < n:
        raise ValueError(f"generation.max_concurrent={slots} must be a multiple of the "
                         f"{replicas} replicas (mesh data x fsdp) with at least "
                         f"samples_per_prompt={n} slots each")
    max_pages = pages_for(cache_len - 1, s.page_size)
    pages = (s.num_pages // replicas) if s.num_pages else 1 + (batch // replicas) * max_pages
    probe = ReplicaScheduler([], group_size=n, slots=1, num_pages=2, page_size=s.page_size,
                             max_new_tokens=max_new_tokens, chunk=s.decode_chunk)
    need = 1 + max(max_pages, probe.group_need(prompt_width, n))
    if turns:
        need = max(need, 1 + min(slots, batch) // replicas * max_pages)
    if s.num_pages % replicas or pages < need:
        raise ValueError(f"generation.num_pages={s.num_pages} gives {pages} pages per replica "
                         f"({replicas} replicas, the trash page included); a replica needs "
                         f"{need}: {'every slot' if turns else 'one sequence'} of {cache_len} "
                         f"tokens, or a group of {n} with its first chunk, in pages of "
                         f"{s.page_size}; give at least "
                         f"{need * replicas} (a multiple of {replicas})")
    return EngineLayout(replicas, batch // replicas, slots // replicas, pages, max_pages, n)


def check_page_size(page_size: int, cache_len: int, what: str) -> None:
    """A run's page size must divide its cache length `what` = `cache_len` (the longest
    prompt plus max_new_tokens), so the longest sequence fills whole pages.

    Raises:
      ValueError: naming `generation.page_size`, the cache length and page sizes that fit.
    """
    _positive(page_size=page_size)
    if cache_len % page_size:
        divisors = [d for d in range(1, min(cache_len, 256) + 1) if cache_len % d == 0]
        fits = sorted(sorted(divisors, key=lambda d: abs(d - page_size))[:4])
        raise ValueError(f"generation.page_size={page_size} does not divide the cache length "
                         f"{cache_len} ({what}); page sizes that do: {fits}")


def _positive(**values) -> None:
    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"generation.{name}={v!r} must be an int >= 1")
