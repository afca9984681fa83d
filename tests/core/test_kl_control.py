"""KL controllers: array state, jit-stable updates, fixed stays fixed, error clipped to 0.2."""

import jax
import jax.numpy as jnp
import numpy as np

from ppo_jax import core


def test_state_leaves_are_all_scalar_arrays():
    for state in (core.init_kl_controller("fixed", 0.05),
                  core.init_kl_controller("adaptive", 0.2, target=6.0, horizon=10000)):
        leaves = jax.tree.leaves(state)
        assert len(leaves) == 4 and all(isinstance(x, jax.Array) and x.shape == () for x in leaves)
        assert state.value.dtype == jnp.float32 and state.kind.dtype == jnp.int32


def test_fixed_controller_keeps_its_value_and_shares_the_compiled_update():
    traces = []

    @jax.jit
    def update(state, kl):
        traces.append(1)
        return core.update_kl_controller(state, kl, 256)

    fixed = core.init_kl_controller("fixed", 0.05)
    adaptive = core.init_kl_controller("adaptive", 0.05, target=1.0, horizon=100.0)
    for kl in (100.0, 0.0):
        fixed = update(fixed, jnp.float32(kl))
        adaptive = update(adaptive, jnp.float32(kl))
    assert float(fixed.value) == np.float32(0.05)
    # Proportional error clipped to +0.2 then -0.2, times n_steps / horizon = 2.56.
    np.testing.assert_allclose(adaptive.value, 0.05 * (1 + 0.2 * 2.56) * (1 - 0.2 * 2.56), rtol=1e-6)
    assert len(traces) == 1  # one trace for both kinds and all values


def test_controller_state_rides_through_lax_scan():
    state = core.init_kl_controller("adaptive", 0.1, target=2.0, horizon=1000.0)
    kls = jnp.array([2.2, 2.2, 1.9, 5.0])

    def body(state, kl):
        state = core.update_kl_controller(state, kl, 10)
        return state, state.value

    final, values = jax.lax.scan(body, state, kls)
    expected, want = 0.1, []
    for kl in (2.2, 2.2, 1.9, 5.0):
        expected *= 1 + np.clip(kl / 2.0 - 1, -0.2, 0.2) * 10 / 1000.0
        want.append(expected)
    np.testing.assert_allclose(values, want, rtol=1e-6)
    assert float(final.value) == float(values[-1])
