"""The paged engine's host side: the page pool's counts and order, and the scheduler's admission,
page sharing within a group, growth, retirement and preemption (plain Python, no devices)."""

from __future__ import annotations

import numpy as np
import pytest

from ppo_jax.models.paged_cache import TRASH_PAGE
from ppo_jax.rollout.page_pool import PagePool, PoolExhausted
from ppo_jax.rollout.scheduler import ReplicaScheduler, pages_for


def test_pool_hands_out_lowest_pages_first_and_never_the_trash_page():
    pool = PagePool(6)
    assert pool.take(3) == [1, 2, 3]
    pool.release([2])
    assert pool.take(2) == [2, 4]
    assert pool.num_free == 1 and TRASH_PAGE not in pool.take(1)
    with pytest.raises(PoolExhausted):
        pool.take(1)


def test_a_shared_page_is_free_only_after_its_last_holder_releases_it():
    pool = PagePool(4)
    page = pool.take(1)
    pool.share(page, 2)  # three holders
    pool.release(page)
    pool.release(page)
    assert pool.num_free == 2
    pool.release(page)
    assert pool.num_free == 3
    with pytest.raises(ValueError, match="not held"):
        pool.release(page)


def sched(lens, **kw):
    args = dict(group_size=1, slots=4, num_pages=20, page_size=4, max_new_tokens=10, chunk=3)
    args.update(kw)
    return ReplicaScheduler(lens, **args)


def test_a_group_shares_its_full_prompt_pages_and_copies_the_partial_one():
    s = sched([6, 6, 6], group_size=3, slots=3)  # 6 tokens: one full page of 4 + a partial one
    (adm,) = s.admit()
    assert adm.rows == (0, 1, 2) and adm.slots == (0, 1, 2)
    full, partial = adm.prompt_pages
    assert [seq.pages[0] for seq in s.slots] == [full] * 3  # shared
    own = [seq.pages[1] for seq in s.slots]
    assert own[0] == partial and len(set(own)) == 3  # each sample its own partial page
    assert adm.copies == ((partial, own[1]), (partial, own[2]))
    assert s.pool.refs[full] == 3


def test_growth_gives_each_sequence_the_pages_its_next_chunk_writes():
    s = sched([5], chunk=3)
    s.admit()
    s.grow()
    (seq,) = [x for x in s.slots if x is not None]
    # the first chunk feeds positions 5, 6, 7 (response tokens 0-2): 8 tokens, 2 pages
    assert len(seq.pages) == pages_for(8, 4) == 2
    s.retire(np.array([4, 0, 0, 0]), np.zeros(4, bool))
    s.grow()  # positions 8..10 next: 11 tokens, 3 pages
    assert len(seq.pages) == 3
    s.retire(np.array([10, 0, 0, 0]), np.array([True, False, False, False]))
    assert s.final == {0: 10} and s.pool.num_free == 19 and s.finished


def test_admission_waits_for_free_slots_and_pages_in_queue_order():
    s = sched([4, 4, 4], slots=2, num_pages=5)  # 4 free pages: 2 per sequence with growth
    assert [a.rows for a in s.admit()] == [(0,), (1,)]
    assert s.admit() == []  # no slot free
    s.grow()
    s.retire(np.array([3, 1, 0, 0])[:2], np.array([True, False]))
    assert [a.rows for a in s.admit()] == [(2,)]


def test_when_growth_exceeds_the_pool_the_youngest_is_preempted_and_queued_first():
    s = sched([4, 4], slots=2, num_pages=6, chunk=4, max_new_tokens=12)
    s.admit()  # 2 + 2 pages
    s.grow()
    s.retire(np.array([5, 5]), np.zeros(2, bool))
    preempted = s.grow()  # each wants 3 pages, 5 exist: the younger one gives its pages back
    assert preempted == [1] and s.queue[0] == (1,) and s.preemptions == 1
    assert len(s.slots[0].pages) == 3 and s.slots[1] is None


def test_the_same_inputs_give_the_same_decisions():
    def run():
        s = sched([3, 7, 2, 5, 6, 1], slots=3, num_pages=8, chunk=2, max_new_tokens=6)
        log, rng = [], np.random.default_rng(0)
        while not s.finished:
            log.append([a.rows for a in s.admit()])
            log.append(s.grow())
            lengths = np.array([0 if x is None else min(x.length + 2, 6) for x in s.slots])
            done = np.array([x is not None and (l >= 6 or rng.random() < 0.3)
                             for x, l in zip(s.slots, lengths)])
            log.append([x.pages[:] if x else None for x in s.slots])
            s.retire(lengths, done)
        return log, s.final

    assert run() == run()
