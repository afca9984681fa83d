"""Packed forward passes (`rollout.packing`): the plan places each sequence's real tokens once,
within its own shard's rows, and the packed passes give the padded passes' log-probs,
entropies, values and MoE aux loss on every real response token, and their gradients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ppo_jax.models import init_model, split_model
from ppo_jax.models.tiny_random import TINY_MOE, tiny_config
from ppo_jax.rollout.forward import critic_values, policy_logprobs, policy_logprobs_and_values
from ppo_jax.rollout.packing import (
    balanced_order, first_fit_decreasing, pack, plan_packing, plan_token_budget, row_bucket,
)

VOCAB, P, N = 64, 6, 10


def rollout(q_lens, r_lens, seed=0):
    """Left-padded prompts and right-padded responses of the given real lengths."""
    rng = np.random.default_rng(seed)
    b = len(q_lens)
    q = rng.integers(3, VOCAB, (b, P)).astype(np.int32)
    r = rng.integers(3, VOCAB, (b, N)).astype(np.int32)
    qm = (np.arange(P)[None] >= P - np.asarray(q_lens)[:, None]).astype(np.int32)
    rm = (np.arange(N)[None] < np.asarray(r_lens)[:, None]).astype(np.int32)
    return q * qm, qm, r * rm, rm


Q_LENS, R_LENS = [6, 2, 4, 3, 5, 1, 6, 2], [10, 1, 3, 0, 7, 2, 4, 10]


def test_balanced_order_evens_the_blocks_and_keeps_every_row():
    lengths = np.array([10, 9, 1, 1, 8, 2, 2, 7])
    order = balanced_order(lengths, 2)
    assert sorted(order) == list(range(8))
    totals = lengths[order].reshape(4, 2).sum(1)
    assert sorted(totals) == [9, 10, 10, 11]  # LPT: 10+1, 9+1, 8+2, 7+2


def test_first_fit_decreasing_by_hand_and_a_sequence_longer_than_a_row_refused():
    assert first_fit_decreasing(np.array([3, 7, 5, 2, 4]), 8) == [[1], [2, 0], [4, 3]]
    assert [row_bucket(n, 64) for n in range(1, 11)] == [1, 2, 3, 4, 5, 6, 7, 8, 10, 10]
    assert [row_bucket(n, 64) for n in (17, 20, 21, 33, 40, 41)] == [20, 20, 24, 40, 40, 48]
    assert row_bucket(5, 5) == 5
    with pytest.raises(ValueError, match="sequence 1 has 9 tokens, more than the packed row's 8"):
        first_fit_decreasing(np.array([3, 9]), 8)


@pytest.mark.parametrize("shards", [1, 2])
def test_the_plan_puts_every_real_token_once_in_its_own_shard(shards):
    q, qm, r, rm = rollout(Q_LENS, R_LENS)
    _, plan = plan_packing(Q_LENS, R_LENS, prompt_width=P, response_width=N, micro_batch_size=4,
                           shards=shards)
    ids = np.concatenate([q, r], 1)
    for j in range(2):  # micro-batches of 4 rows
        mb = jax.tree.map(lambda x: x[j], plan)
        packed = np.asarray(pack(jnp.asarray(ids[4 * j:4 * j + 4]), mb)).reshape(shards, -1)
        seg = np.asarray(mb.segments).reshape(shards, -1)
        per = 4 // shards
        for s in range(shards):
            rows = range(4 * j + s * per, 4 * j + (s + 1) * per)
            want = sorted(t for i in rows for t in ids[i][np.concatenate([qm[i], rm[i]]) == 1])
            assert sorted(packed[s][seg[s] > 0]) == want  # the shard's tokens, each once
            # the LM head's list: each real response token once, read at the slot before it
            head_src, head_dst = (np.asarray(x[s]) for x in (mb.head_src, mb.head_dst))
            real = head_dst < per * N
            want = [(i - rows[0]) * N + t for i in rows for t in range(R_LENS[i])]
            assert sorted(head_dst[real]) == want
            flat = np.asarray(packed[s])
            for slot, d in zip(head_src[real], head_dst[real]):
                i, t = rows[0] + d // N, d % N
                before = r[i][t - 1] if t else q[i][-1]  # the token before response token t
                assert flat[slot] == before
    assert plan.src.shape[2] <= 4 // shards


@pytest.fixture(scope="module")
def actor():
    return split_model(init_model(tiny_config(VOCAB), seed=3))


def test_packed_log_probs_entropy_and_gradients_equal_the_padded_pass(actor):
    graphdef, params = actor
    batch = tuple(jnp.asarray(x) for x in rollout(Q_LENS, R_LENS))
    plan = jax.tree.map(lambda x: jnp.asarray(x[0]), plan_packing(
        Q_LENS, R_LENS, prompt_width=P, response_width=N, micro_batch_size=8, shards=2)[1])
    mask = batch[3].astype(jnp.float32)

    def loss(p, packing):
        lp, ent = policy_logprobs(graphdef, p, *batch, with_entropy=True, packing=packing,
                                  temperature=0.7)
        return jnp.sum((lp + 0.1 * ent) * mask), (lp, ent)

    (l0, (lp0, e0)), g0 = jax.value_and_grad(loss, has_aux=True)(params, None)
    (l1, (lp1, e1)), g1 = jax.jit(jax.value_and_grad(loss, has_aux=True))(params, plan)
    assert plan.src.shape[1] == 3  # shard 1 packs its 4 sequences in 3 rows
    real = np.asarray(mask) == 1
    np.testing.assert_allclose(np.asarray(lp1)[real], np.asarray(lp0)[real], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(e1)[real], np.asarray(e0)[real], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(l1, l0, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


@pytest.mark.slow  # default-run budget: the dense policy pass stays in it
def test_packed_values_and_the_shared_critic_equal_the_padded_pass():
    batch = tuple(jnp.asarray(x) for x in rollout(Q_LENS, R_LENS, seed=1))
    plan = jax.tree.map(lambda x: jnp.asarray(x[0]), plan_packing(
        Q_LENS, R_LENS, prompt_width=P, response_width=N, micro_batch_size=8)[1])
    real = np.asarray(batch[3]) == 1
    critic = split_model(init_model(tiny_config(VOCAB), kind="value", seed=4))
    v0, v1 = (critic_values(*critic, *batch, packing=pk) for pk in (None, plan))
    np.testing.assert_allclose(np.asarray(v1)[real], np.asarray(v0)[real], rtol=1e-5, atol=1e-6)
    shared = split_model(init_model(tiny_config(VOCAB), kind="causal_lm_value", seed=5))
    out0, out1 = (policy_logprobs_and_values(*shared, *batch, packing=pk) for pk in (None, plan))
    for a, b in zip(out1, out0):
        np.testing.assert_allclose(np.asarray(a)[real], np.asarray(b)[real], rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # default-run budget
def test_a_packed_moe_pass_replays_routes_and_counts_each_token_once():
    graphdef, params = split_model(init_model(tiny_config(VOCAB, **TINY_MOE), seed=6))
    batch = tuple(jnp.asarray(x) for x in rollout(Q_LENS, R_LENS, seed=2))
    routes = jnp.asarray(np.random.default_rng(0).integers(0, 8, (8, N, 2, 2)), jnp.int32)
    plan = jax.tree.map(lambda x: jnp.asarray(x[0]), plan_packing(
        Q_LENS, R_LENS, prompt_width=P, response_width=N, micro_batch_size=8, shards=2)[1])
    real = np.asarray(batch[3]) == 1
    (lp0, aux0), (lp1, aux1) = (policy_logprobs(graphdef, params, *batch, routes=routes,
                                                with_aux=True, packing=pk) for pk in (None, plan))
    np.testing.assert_allclose(np.asarray(lp1)[real], np.asarray(lp0)[real], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(aux1, aux0, rtol=1e-6)


@pytest.mark.parametrize("shards", [1, 2])
def test_token_budget_micro_batches_hold_each_row_once_within_the_budget(shards):
    """`plan_token_budget`: each minibatch's rows are in exactly one of its micro-batches' places,
    each shard's sequences fill at most `rows_per_micro` rows of P + N slots with exactly their
    tokens, and the places past them are absent (index M)."""
    rng = np.random.default_rng(0)
    P, N, M, rpm = 5, 11, 8, 2
    q, r = rng.integers(1, P + 1, 16), rng.integers(0, N + 1, 16)
    micro, plan = plan_token_budget(q, r, prompt_width=P, response_width=N, mini_batch_size=M,
                                    rows_per_micro=rpm, shards=shards)
    n_mb, n_micro, places = micro.shape
    assert n_mb == 2 and plan.src.shape[:4] == (n_mb, n_micro, shards, rpm)
    k = places // shards
    for g in range(n_mb):
        held = micro[g][micro[g] < M]
        assert sorted(held) == list(range(M))  # every row once
        for j in range(n_micro):
            for s in range(shards):
                idx = micro[g, j, s * k:(s + 1) * k]
                real = idx[idx < M] + g * M
                seg = plan.segments[g, j, s]
                assert (seg > 0).sum() == (q + r)[real].sum()
                assert (idx[len(real):] == M).all()  # absent places come last
    assert n_micro == row_bucket(n_micro, M)  # a bucketed shape


def test_a_token_budget_with_no_row_of_room_is_refused():
    with pytest.raises(ValueError, match="rows_per_micro 0"):
        plan_token_budget([3], [4], prompt_width=4, response_width=4, mini_batch_size=1,
                          rows_per_micro=0)


@pytest.mark.parametrize("shards", [1, 2])
def test_a_token_budget_above_the_minibatch_compiles_only_the_rows_it_fills(shards):
    """A budget of 10**6 rows plans exactly as a budget of the largest minibatch's packed rows a
    shard (counted here from the bins' token sums, greedy first-fit decreasing), instead of a
    plan of 10**6 empty rows (an update that ran out of memory on a tiny model)."""
    rng = np.random.default_rng(1)
    P, N, M = 5, 11, 8
    q, r = rng.integers(1, P + 1, 16), rng.integers(0, N + 1, 16)
    most = 0
    for g in range(0, 16, M):  # first-fit decreasing, written out: rows of P + N slots
        free = []
        for n in sorted((q + r)[g:g + M], reverse=True):
            j = next((j for j, f in enumerate(free) if f >= n), None)
            if j is None:
                free.append(P + N - n)
            else:
                free[j] -= n
        most = max(most, len(free))
    needed = -(-most // shards)
    huge = plan_token_budget(q, r, prompt_width=P, response_width=N, mini_batch_size=M,
                             rows_per_micro=10**6, shards=shards)
    exact = plan_token_budget(q, r, prompt_width=P, response_width=N, mini_batch_size=M,
                              rows_per_micro=needed, shards=shards)
    assert huge[1].src.shape[3] == row_bucket(needed, -(-M // shards)) == needed
    assert huge[0].shape[1] == 1  # one micro-batch a minibatch
    np.testing.assert_array_equal(huge[0], exact[0])
    for a, b in zip(jax.tree.leaves(huge[1]), jax.tree.leaves(exact[1])):
        np.testing.assert_array_equal(a, b)
