"""Right-padded token rows packed (`rollout.packing.plan_rows`, `unpack_last`: stages 1 and 2):
`unpack` gives the output at each token that predicts the next one, `unpack_last` the output at
each row's last real token, whatever the shards, checked by hand on the packed ids themselves."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ppo_jax.rollout.packing import pack, packed_rows, plan_rows, unpack, unpack_last

L = 5
LENGTHS = [4, 2, 3, 1]
# row i holds 10 i + t at token t (its first LENGTHS[i] slots are real), -1 on padding
IDS = np.where(np.arange(L)[None] < np.array(LENGTHS)[:, None],
               10 * np.arange(4)[:, None] + np.arange(L)[None], -1).astype(np.int32)


def test_first_fit_decreasing_rows_by_hand():
    # longest first: 4 opens row 0, 3 opens row 1, 2 fits row 1 (room 2), 1 fits row 0 (room 1)
    plan = jax.tree.map(lambda x: x[0], plan_rows(LENGTHS, length=L, micro_batch_size=4))
    ids, segments = packed_rows(jnp.asarray(IDS), plan)
    np.testing.assert_array_equal(ids, [[0, 1, 2, 3, 30], [20, 21, 22, 10, 11]])
    np.testing.assert_array_equal(segments, [[1, 1, 1, 1, 2], [1, 1, 1, 2, 2]])


@pytest.mark.parametrize("shards", [1, 2])
def test_unpack_reads_the_token_before_each_target_and_unpack_last_the_last_token(shards):
    plan = jax.tree.map(lambda x: x[0], plan_rows(LENGTHS, length=L, micro_batch_size=4,
                                                  shards=shards))
    packed = pack(jnp.asarray(IDS), plan, fill=-1)  # the ids stand in for a pass's outputs
    # entry t: token t (it predicts t + 1) for t < n - 1; later entries repeat token n - 2
    # (a one-token row: its only token)
    np.testing.assert_array_equal(unpack(packed, plan), [[0, 1, 2, 2], [10, 10, 10, 10],
                                                         [20, 21, 21, 21], [30, 30, 30, 30]])
    np.testing.assert_array_equal(unpack_last(packed, plan, L), [3, 11, 22, 30])
    # with a trailing feature axis, as hidden states [S * R, W, D]
    both = jnp.stack([packed, -packed], -1)
    np.testing.assert_array_equal(unpack_last(both, plan, L), [[3, -3], [11, -11], [22, -22],
                                                               [30, -30]])
    # one shard: 4 + 1 and 3 + 2; two: 4 and 2 alone (4 + 2 > 5), 3 + 1 (the other row empty)
    assert plan.src.shape == (shards, 2, L)


def test_a_row_with_no_token_is_refused():
    with pytest.raises(ValueError, match="row 1 has no real token to pack"):
        plan_rows([3, 0], length=L, micro_batch_size=2)
