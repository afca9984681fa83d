"""DAPO (ppo_jax.core.dapo): the overlong penalty's three pieces and their boundaries; dynamic
sampling's group selection (informative first, in order; filled in order; static shapes).
Hand-checked values, with and without ``jax.jit`` (chex variants)."""

import functools

import chex
import jax.numpy as jnp
import numpy as np
import pytest

from ppo_jax import core


class OverlongPenaltyTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_penalty_is_zero_then_linear_over_the_buffer_then_minus_the_factor(self):
        # max_length 10, buffer 4: free up to 6 tokens, then -1/4 per token, -1 from 11 on
        lengths = jnp.array([0, 5, 6, 7, 8, 9, 10, 11, 50], jnp.int32)
        want = np.array([0, 0, 0, -0.25, -0.5, -0.75, -1, -1, -1])
        for factor in (1.0, 2.0):
            fn = self.variant(functools.partial(core.overlong_penalty, max_length=10, buffer=4,
                                                penalty_factor=factor))
            got = fn(lengths)
            assert got.dtype == jnp.float32 and got.shape == (9,)
            np.testing.assert_allclose(got, factor * want, rtol=1e-6, atol=0)

    @chex.variants(with_jit=True, without_jit=True)
    def test_zero_buffer_turns_the_penalty_off_and_a_full_buffer_starts_at_zero_length(self):
        lengths = jnp.array([0, 3, 10, 12], jnp.int32)
        off = self.variant(functools.partial(core.overlong_penalty, max_length=10, buffer=0))
        np.testing.assert_array_equal(off(lengths), np.zeros(4))
        full = self.variant(functools.partial(core.overlong_penalty, max_length=10, buffer=10))
        np.testing.assert_allclose(full(lengths), [0.0, -0.3, -1.0, -1.0], rtol=1e-6)

    @chex.variants(with_jit=True, without_jit=True)
    def test_traced_penalty_factor(self):
        fn = self.variant(lambda f: core.overlong_penalty(jnp.array([7, 12]), max_length=10, buffer=4,
                                                          penalty_factor=f))
        np.testing.assert_allclose(fn(jnp.float32(0.5)), [-0.125, -0.5], rtol=1e-6)


def test_overlong_penalty_rejects_bad_settings():
    lengths = jnp.array([1, 2], jnp.int32)
    for kw, msg in [(dict(max_length=10, buffer=-1), "buffer must be a static int >= 0"),
                    (dict(max_length=10, buffer=11), "buffer=11 must be <= max_length=10"),
                    (dict(max_length=10, buffer=2.0), "buffer must be a static int"),
                    (dict(max_length=0, buffer=0), "max_length must be a static int >= 1"),
                    (dict(max_length=10, buffer=jnp.int32(4)), "buffer must be a static int"),
                    (dict(max_length=10, buffer=4, penalty_factor=-1.0), "penalty_factor must be >= 0")]:
        with pytest.raises(ValueError, match=msg):
            core.overlong_penalty(lengths, **kw)
    with pytest.raises(ValueError, match="lengths must be an integer array"):
        core.overlong_penalty(jnp.array([1.0]), max_length=10, buffer=4)
    with pytest.raises(ValueError, match="lengths must have rank 1"):
        core.overlong_penalty(jnp.ones((2, 2), jnp.int32), max_length=10, buffer=4)


# 5 groups of 3: groups 0 and 3 have all-equal scores, group 4 a NaN, 1 and 2 differ
SCORES = jnp.array([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.5, 0.5, 0.25, -2.0, -2.0, -2.0, 1.0, jnp.nan, 0.0])


class DynamicSamplingTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_informative_groups_are_those_whose_scores_differ(self):
        fn = self.variant(functools.partial(core.informative_groups, num_groups=5, samples_per_prompt=3))
        np.testing.assert_array_equal(fn(SCORES), [False, True, True, False, False])
        # exact comparison: one ulp of difference is informative
        tiny = jnp.array([1.0, np.nextafter(np.float32(1.0), np.float32(2.0)), 3.0, 3.0], jnp.float32)
        fn2 = self.variant(functools.partial(core.informative_groups, num_groups=2, samples_per_prompt=2))
        np.testing.assert_array_equal(fn2(tiny), [True, False])

    @chex.variants(with_jit=True, without_jit=True)
    def test_select_drops_exactly_the_zero_variance_groups_when_enough_are_informative(self):
        informative = jnp.array([False, True, False, True, True, False])
        index, count = self.variant(functools.partial(core.select_groups, keep=3))(informative)
        assert index.dtype == jnp.int32 and index.shape == (3,)
        np.testing.assert_array_equal(index, [1, 3, 4])
        assert int(count) == 3
        index, count = self.variant(functools.partial(core.select_groups, keep=2))(informative)
        np.testing.assert_array_equal(index, [1, 3])  # the first informative ones, in order
        assert int(count) == 2

    @chex.variants(with_jit=True, without_jit=True)
    def test_too_few_informative_groups_are_filled_with_the_first_uninformative_in_order(self):
        informative = jnp.array([False, True, False, True, True, False])
        index, count = self.variant(functools.partial(core.select_groups, keep=5))(informative)
        np.testing.assert_array_equal(index, [1, 3, 4, 0, 2])
        assert int(count) == 3

    @chex.variants(with_jit=True, without_jit=True)
    def test_all_and_none_informative(self):
        select = self.variant(functools.partial(core.select_groups, keep=3))
        index, count = select(jnp.ones(4, bool))
        np.testing.assert_array_equal(index, [0, 1, 2])
        assert int(count) == 3
        index, count = select(jnp.zeros(4, bool))
        np.testing.assert_array_equal(index, [0, 1, 2])
        assert int(count) == 0

    @chex.variants(with_jit=True, without_jit=True)
    def test_selected_groups_gather_their_adjacent_rows(self):
        def pipeline(scores):
            informative = core.informative_groups(scores, 5, 3)
            index, count = core.select_groups(informative, 3)
            return core.group_rows(index, 3), count

        rows, count = self.variant(pipeline)(SCORES)
        assert rows.dtype == jnp.int32
        # groups 1, 2 (informative), then 0 (the first uninformative)
        np.testing.assert_array_equal(rows, [3, 4, 5, 6, 7, 8, 0, 1, 2])
        assert int(count) == 2
        np.testing.assert_array_equal(self.variant(functools.partial(core.group_rows, samples_per_prompt=3))(
            jnp.array([2, 0])), [6, 7, 8, 0, 1, 2])


def test_dynamic_sampling_rejects_bad_shapes_and_counts():
    with pytest.raises(ValueError, match=r"scores must have shape \(6,\)"):
        core.informative_groups(jnp.zeros(5), 2, 3)
    with pytest.raises(ValueError, match="samples_per_prompt must be a static int >= 1"):
        core.informative_groups(jnp.zeros(2), 2, 0)
    with pytest.raises(ValueError, match="keep=4 must be <= the number of groups 3"):
        core.select_groups(jnp.ones(3, bool), 4)
    with pytest.raises(ValueError, match="keep must be a static int >= 1"):
        core.select_groups(jnp.ones(3, bool), 0)
    with pytest.raises(ValueError, match="informative must have rank 1"):
        core.select_groups(jnp.ones((2, 3), bool), 1)
    with pytest.raises(ValueError, match="group_index must be an integer array"):
        core.group_rows(jnp.zeros(2), 3)
