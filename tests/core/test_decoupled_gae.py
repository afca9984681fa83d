"""Decoupled GAE (VC-PPO / VAPO: the critic's returns with their own lambda), VAPO's
length-adaptive policy lambda (one lambda per row, in all three GAE methods), and the critic's
explained variance, each against a float64 numpy reference written here."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ppo_jax import core
from ppo_jax.core import estimators

METHODS = [("chunked", dict(chunk=4)), ("chunked", dict(chunk=32)), ("scan", {}),
           ("scan", dict(unroll=3)), ("associative", {})]
JIT = [pytest.param(lambda f: f, id="eager"), pytest.param(jax.jit, id="jit")]

# rows: full, a prefix of 6, empty, one token, a prefix of 9 with a hole at 2 (8 tokens; GAE
# steps over the hole with zero value and reward), a prefix of 3
MASK = np.array([
    [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1],
    [1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0],
    [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
    [1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
    [1, 1, 0, 1, 1, 1, 1, 1, 1, 0, 0],
    [1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0],
], np.int32)
LAM_ROWS = np.array([0.95, 0.5, 0.3, 1.0, 0.0, 0.8])


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    values = rng.normal(size=MASK.shape)
    rewards = rng.normal(size=MASK.shape)
    values[MASK == 0] = np.nan  # padding may hold anything
    rewards[MASK == 0] = np.inf
    return values, rewards


def _np_gae(values, rewards, mask, gamma, lam_rows):
    """float64 loop over time, one lambda per row: `(advantages, returns)` as compute_gae."""
    v = np.where(mask > 0, values, 0.0).astype(np.float64)
    r = np.where(mask > 0, rewards, 0.0).astype(np.float64)
    b, t = v.shape
    adv = np.zeros((b, t))
    for i in range(b):
        running = 0.0
        for j in reversed(range(t)):
            next_v = v[i, j + 1] if j + 1 < t else 0.0
            delta = r[i, j] + gamma * next_v - v[i, j]
            running = delta + gamma * lam_rows[i] * running
            adv[i, j] = running
    adv = np.where(mask > 0, adv, 0.0)
    return adv, adv + v


@pytest.mark.parametrize("wrap", JIT)
@pytest.mark.parametrize("method,kw", METHODS)
def test_a_per_row_lambda_matches_the_loop_in_every_method(x64, method, kw, wrap):
    values, rewards = _batch()
    fn = wrap(lambda v, r, m, l: core.compute_gae(v, r, m, gamma=0.99, lam=l, method=method, **kw))
    adv, ret = fn(values, rewards, MASK, jnp.asarray(LAM_ROWS))
    want_adv, want_ret = _np_gae(values, rewards, MASK, 0.99, LAM_ROWS)
    assert adv.dtype == jnp.float64
    np.testing.assert_allclose(adv, want_adv, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(ret, want_ret, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("method,kw", METHODS)
def test_a_per_row_lambda_of_equal_values_is_the_scalar_lambda(method, kw):
    values, rewards = (jnp.asarray(x, jnp.float32) for x in _batch(1))
    scalar = core.compute_gae(values, rewards, MASK, gamma=1.0, lam=0.9, method=method, **kw)
    rows = core.compute_gae(values, rewards, MASK, gamma=1.0, lam=jnp.full((6,), 0.9), method=method,
                            **kw)
    for got, want in zip(rows, scalar):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lam", [np.zeros(5), np.zeros((6, 1)), np.zeros((1,)), "0.9"])
def test_a_lambda_neither_scalar_nor_one_per_row_is_refused(lam):
    values, rewards = _batch()
    with pytest.raises(ValueError, match="lam must be"):
        core.compute_gae(values, rewards, MASK, gamma=1.0, lam=lam)


def test_the_length_adaptive_lambda_of_hand_counted_rows(x64):
    """VAPO: lam = 1 - 1 / (alpha l): l = 40, alpha = 0.05 -> 0.5; l = 100 -> 0.8; l <= 20 -> 0
    (clipped from 0 and -1); an empty row 0."""
    lengths = np.array([40, 100, 20, 10, 0, 1000])
    mask = (np.arange(1000)[None] < lengths[:, None]).astype(np.int32)
    lam = core.length_adaptive_lam(mask, 0.05)
    assert lam.shape == (6,) and lam.dtype == jnp.float64
    np.testing.assert_allclose(lam, [0.5, 0.8, 0.0, 0.0, 0.0, 0.98], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(jax.jit(core.length_adaptive_lam)(mask, 0.05), lam, atol=1e-12)
    np.testing.assert_allclose(core.length_adaptive_lam(mask, 1.0), [0.975, 0.99, 0.95, 0.9, 0.0,
                                                                     0.999], rtol=1e-12)


@pytest.mark.parametrize("alpha", [0.0, -0.05])
def test_a_length_alpha_that_is_not_positive_is_refused(alpha):
    with pytest.raises(ValueError, match="alpha must be > 0"):
        core.length_adaptive_lam(MASK, alpha)


def test_a_negative_lam_length_alpha_is_refused_by_decoupled_gae():
    values, rewards = _batch()
    with pytest.raises(ValueError, match="lam_length_alpha must be >= 0"):
        core.decoupled_gae(values, rewards, MASK, gamma=1.0, lam=0.95, lam_length_alpha=-1.0)


@pytest.mark.parametrize("wrap", JIT)
@pytest.mark.parametrize("method,kw", METHODS)
def test_decoupled_gae_takes_advantages_from_the_policy_lambda_and_returns_from_the_critics(
        x64, method, kw, wrap):
    values, rewards = _batch(2)
    fn = wrap(lambda v, r, m: core.decoupled_gae(v, r, m, gamma=1.0, lam=0.95, critic_lam=1.0,
                                                 method=method, **kw))
    adv, ret = fn(values, rewards, MASK)
    want_adv, _ = _np_gae(values, rewards, MASK, 1.0, np.full(6, 0.95))
    _, want_ret = _np_gae(values, rewards, MASK, 1.0, np.full(6, 1.0))
    np.testing.assert_allclose(adv, want_adv, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(ret, want_ret, rtol=1e-12, atol=1e-12)
    # lambda 1, gamma 1: the critic's target is the sum of the rewards still to come
    r0 = np.where(MASK > 0, rewards, 0.0)
    np.testing.assert_allclose(ret, np.where(MASK > 0, np.cumsum(r0[:, ::-1], 1)[:, ::-1], 0),
                               rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("critic_lam", [None, 1.0])
@pytest.mark.parametrize("method,kw", METHODS)
def test_the_length_adaptive_policy_lambda_matches_the_loop(x64, method, kw, critic_lam):
    """With lam_length_alpha > 0 each row's advantages use its own lambda; the returns keep
    critic_lam (None: the scalar lam)."""
    values, rewards = _batch(3)
    adv, ret = core.decoupled_gae(values, rewards, MASK, gamma=0.99, lam=0.95,
                                  critic_lam=critic_lam, lam_length_alpha=0.25, method=method, **kw)
    lengths = MASK.sum(1)  # [11, 6, 0, 1, 8, 3]: lam 1 - 4 / l, clipped
    lam_rows = np.clip(1 - 1 / (0.25 * np.maximum(lengths, 1)), 0, 1) * (lengths > 0)
    np.testing.assert_allclose(lam_rows, [7 / 11, 1 / 3, 0, 0, 1 / 2, 0], atol=1e-15)
    want_adv, _ = _np_gae(values, rewards, MASK, 0.99, lam_rows)
    _, want_ret = _np_gae(values, rewards, MASK, 0.99, np.full(6, 0.95 if critic_lam is None else 1.0))
    np.testing.assert_allclose(adv, want_adv, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(ret, want_ret, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("wrap", JIT)
@pytest.mark.parametrize("method,kw", METHODS)
def test_without_a_critic_lambda_or_length_alpha_the_gae_estimator_is_todays_compute_gae(
        method, kw, wrap):
    """critic_lam None or equal to lam, lam_length_alpha 0: the very same numbers, bit for bit."""
    values, rewards = (jnp.asarray(x, jnp.float32) for x in _batch(4))
    want = wrap(lambda v, r: core.compute_gae(v, r, MASK, gamma=0.99, lam=0.95, method=method,
                                              **kw))(values, rewards)
    for extra in ({}, dict(critic_lam=None, lam_length_alpha=0.0), dict(critic_lam=0.95),
                  dict(critic_lam=0.95, lam_length_alpha=0)):
        got = wrap(lambda v, r: estimators.gae(v, r, MASK, gamma=0.99, lam=0.95, method=method,
                                               **kw, **extra))(values, rewards)
        assert all(np.array_equal(g, w) for g, w in zip(got, want)), extra
        registered = core.get_advantage_estimator("gae")
        got = wrap(lambda v, r: registered(v, r, MASK, gamma=0.99, lam=0.95, method=method, **kw,
                                           **extra))(values, rewards)
        assert all(np.array_equal(g, w) for g, w in zip(got, want)), extra


def test_the_critic_lambda_changes_only_the_returns():
    values, rewards = (jnp.asarray(x, jnp.float32) for x in _batch(5))
    base = estimators.gae(values, rewards, MASK, gamma=1.0, lam=0.95)
    decoupled = estimators.gae(values, rewards, MASK, gamma=1.0, lam=0.95, critic_lam=1.0)
    assert np.array_equal(decoupled[0], base[0])
    assert not np.allclose(decoupled[1], base[1])
    ret = core.compute_gae(values, rewards, MASK, gamma=1.0, lam=1.0)[1]
    assert np.array_equal(decoupled[1], ret)


def _np_explained_variance(values, returns, mask):
    v, r = values[mask > 0], returns[mask > 0]
    return 1 - np.var(r - v) / np.var(r)


def test_explained_variance_matches_numpy_over_valid_tokens(x64):
    values, rewards = _batch(6)
    _, returns = _np_gae(values, rewards, MASK, 1.0, np.ones(6))
    returns = np.where(MASK > 0, returns, np.nan)
    for vals in (values, 0.5 * np.nan_to_num(returns) + 0.1, np.where(MASK > 0, 0.0, np.nan)):
        got = jax.jit(core.explained_variance)(vals, returns, MASK)
        assert got.shape == () and np.isfinite(got)
        np.testing.assert_allclose(got, _np_explained_variance(vals, returns, MASK), rtol=1e-12)
    np.testing.assert_allclose(core.explained_variance(returns, returns, MASK), 1.0)
    assert float(core.explained_variance(np.where(MASK > 0, 0.0, np.nan), returns, MASK)) == \
        pytest.approx(0.0, abs=1e-12)  # zero values: Var(R - 0) = Var(R)


def test_explained_variance_is_zero_when_the_returns_do_not_vary():
    ones = jnp.ones(MASK.shape, jnp.float32)
    assert float(core.explained_variance(0.5 * ones, ones, MASK)) == 0.0
    assert float(core.explained_variance(ones, ones, np.zeros_like(MASK))) == 0.0


def test_explained_variance_is_zero_when_the_returns_vary_only_by_rounding():
    """Every response scored 0.1: float32 returns ``(0.1 - V) + V`` differ in their last bits,
    and the plain ratio of a rounding-level Var(R) is a huge negative number."""
    values = np.random.default_rng(0).uniform(0.0, 1.0, MASK.shape).astype(np.float32)
    returns = (np.float32(0.1) - values) + values
    v, r = values[MASK > 0], returns[MASK > 0]
    assert 0 < np.var(r) < 1e-12 and 1 - np.var(r - v) / np.var(r) < -1e3  # the case is real
    assert float(core.explained_variance(values, returns, MASK)) == 0.0
    # a small but real spread is still measured
    spread = returns + np.float32(1e-3) * np.arange(MASK.shape[1], dtype=np.float32)
    got = float(core.explained_variance(values, spread, MASK))
    want = _np_explained_variance(values.astype(np.float64), spread.astype(np.float64), MASK)
    np.testing.assert_allclose(got, want, rtol=1e-3)
