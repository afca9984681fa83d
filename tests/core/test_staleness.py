"""Staleness of asynchronous rollouts (ppo_jax.core.staleness): a hand-checked batch of five
samples drawn by policy versions 3..6, read by a trainer at version 7, with and without
``jax.jit``; bad arguments refused by name."""

import chex
import jax.numpy as jnp
import numpy as np
import pytest

from ppo_jax import core

# five samples, four columns; -1 (and a stray 9) on masked slots must be ignored
VERSIONS = np.array([[6, 6, 6, -1],   # one version, staleness 7 - 6 = 1
                     [3, 3, 5, 6],    # spans 3..6: staleness 4 (the oldest token), mixed
                     [5, 6, 9, -1],   # 9 masked: spans 5..6, staleness 2, mixed
                     [7, -1, -1, -1],  # drawn by the current policy: staleness 0
                     [9, 9, 9, 9]])   # no real token: staleness 0, no spread
MASK = np.array([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]])


class StalenessTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_a_sample_is_as_stale_as_its_oldest_token(self):
        got = self.variant(core.sample_staleness)(jnp.asarray(VERSIONS), jnp.asarray(MASK), 7)
        np.testing.assert_array_equal(got, [1, 4, 2, 0, 0])
        assert got.dtype == jnp.int32

    @chex.variants(with_jit=True, without_jit=True)
    def test_histogram_spread_and_mixed_fraction_of_a_batch(self):
        staleness = jnp.asarray([1, 4, 2, 0, 0], jnp.int32)
        got = self.variant(lambda s, v, m: core.staleness_metrics(s, v, m, bins=3))(
            staleness, jnp.asarray(VERSIONS), jnp.asarray(MASK))
        want = {"rollout/staleness_hist_0": 2 / 5, "rollout/staleness_hist_1": 1 / 5,
                "rollout/staleness_hist_2": 1 / 5, "rollout/staleness_hist_ge3": 1 / 5,
                "rollout/staleness_mean": 7 / 5, "rollout/staleness_max": 4.0,
                "rollout/version_spread": 7 - 3,  # newest real token 7, oldest 3 (9s masked)
                "rollout/mixed_version_frac": 2 / 5}
        assert set(got) == set(want)
        for name, value in want.items():
            np.testing.assert_allclose(got[name], value, rtol=1e-6, err_msg=name)


def test_a_batch_without_real_tokens_has_no_spread():
    v = jnp.full((2, 3), 5, jnp.int32)
    m = jnp.zeros((2, 3), jnp.int32)
    s = core.sample_staleness(v, m, 8)
    np.testing.assert_array_equal(s, [0, 0])
    got = core.staleness_metrics(s, v, m, bins=1)
    assert float(got["rollout/version_spread"]) == 0.0
    assert float(got["rollout/staleness_hist_0"]) == 1.0
    assert float(got["rollout/staleness_hist_ge1"]) == 0.0


@pytest.mark.parametrize("call, message", [
    (lambda: core.sample_staleness(jnp.zeros((2, 3)), MASK[:2, :3], 1),
     "versions must be an integer"),
    (lambda: core.sample_staleness(VERSIONS, MASK[:, :3], 1), r"mask must have shape \(5, 4\)"),
    (lambda: core.sample_staleness(VERSIONS, MASK, jnp.ones(2)),
     "current_version must be a scalar"),
    (lambda: core.staleness_metrics(np.zeros(5, np.int32), VERSIONS, MASK, bins=0), "bins must be"),
    (lambda: core.staleness_metrics(np.zeros(4, np.int32), VERSIONS, MASK), "staleness has 4 rows"),
])
def test_bad_arguments_are_refused_by_name(call, message):
    with pytest.raises(ValueError, match=message):
        call()
