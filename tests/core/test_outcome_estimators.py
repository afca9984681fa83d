"""Critic-free advantage estimators (ppo_jax.core.outcome): GRPO, Dr. GRPO, RLOO, REINFORCE++,
REINFORCE++-baseline, ReMax.

Hand-checked worked cases run with and without ``jax.jit`` (chex variants); a float64 plain
numpy loop is the reference on random ragged batches (groups of 4, shuffled ids, a group of
one, an empty row, NaN in masked slots). x64 is enabled only inside the tests that ask for it.
"""

import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ppo_jax.core import outcome

TOL = dict(rtol=1e-6, atol=1e-6)
SQRT_1_3 = math.sqrt(1.0 / 3.0)  # unbiased std of [1, 0, 0, 1]: sqrt(4 * 0.5^2 / 3) = 0.5774



def prefix_mask(lengths, t):
    return (np.arange(t)[None, :] < np.asarray(lengths)[:, None]).astype(np.int32)


def on_tokens(row_values, mask):
    """``[B] -> [B, T]`` expected array: the row's value on its real tokens, 0 elsewhere."""
    return np.where(np.asarray(mask) > 0, np.asarray(row_values, np.float64)[:, None], 0.0)


# Rows 0-3 are one prompt's group [1, 0, 0, 1]; rows 4-5 another, [3, 1]. Ragged masks.
SCORES = jnp.array([1.0, 0.0, 0.0, 1.0, 3.0, 1.0])
GROUPS = jnp.array([0, 0, 0, 0, 1, 1], jnp.int32)
MASK = jnp.asarray(prefix_mask([3, 1, 2, 3, 2, 3], 3))


class WorkedCaseTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_grpo_divides_by_the_unbiased_group_std(self):
        # group 0: mean 0.5, std sqrt((4 * 0.25) / 3) = 0.5774 -> +-0.5 / 0.5774 = +-0.866
        # group 1: mean 2, std sqrt((1 + 1) / 1) = 1.414 -> +-1 / 1.414 = +-0.7071
        adv, ret = self.variant(outcome.grpo)(SCORES, GROUPS, MASK)
        a0, a1 = 0.5 / (SQRT_1_3 + 1e-6), 1.0 / (math.sqrt(2.0) + 1e-6)
        np.testing.assert_allclose(adv, on_tokens([a0, -a0, -a0, a0, a1, -a1], MASK), rtol=1e-5)
        np.testing.assert_allclose(adv[0, 0], 0.866, atol=5e-4)
        np.testing.assert_array_equal(ret, adv)

    @chex.variants(with_jit=True, without_jit=True)
    def test_dr_grpo_only_subtracts_the_group_mean(self):
        adv, ret = self.variant(functools.partial(outcome.grpo, norm_by_std=False))(SCORES, GROUPS, MASK)
        np.testing.assert_allclose(adv, on_tokens([0.5, -0.5, -0.5, 0.5, 1.0, -1.0], MASK), rtol=1e-6)
        np.testing.assert_array_equal(ret, adv)

    @chex.variants(with_jit=True, without_jit=True)
    def test_rloo_subtracts_the_mean_of_the_other_rows(self):
        # group 0: 1 - (0 + 0 + 1) / 3 = 0.667, 0 - (1 + 0 + 1) / 3 = -0.667; group 1: 3 - 1, 1 - 3
        adv, ret = self.variant(outcome.rloo)(SCORES, GROUPS, MASK)
        np.testing.assert_allclose(adv, on_tokens([2 / 3, -2 / 3, -2 / 3, 2 / 3, 2.0, -2.0], MASK), rtol=1e-6)
        np.testing.assert_array_equal(ret, adv)

    @chex.variants(with_jit=True, without_jit=True)
    def test_group_of_one_real_row_gets_zero_advantage(self):
        # Row 0 is alone in group 2; row 1 is in group 0 with row 2, whose mask is empty (padding
        # with a NaN score): it takes no part, so row 1 is alone too. Rows 3, 4: ids -1 and 5
        # are outside [0, B) and each form a group of their own.
        scores = jnp.array([5.0, 2.0, jnp.nan, 7.0, -3.0])
        groups = jnp.array([2, 0, 0, -1, 5], jnp.int32)
        mask = jnp.asarray(prefix_mask([2, 2, 0, 1, 1], 2))
        for fn in (outcome.grpo, functools.partial(outcome.grpo, norm_by_std=False), outcome.rloo):
            adv, ret = self.variant(fn)(scores, groups, mask)
            np.testing.assert_array_equal(adv, np.zeros((5, 2)))
            np.testing.assert_array_equal(ret, np.zeros((5, 2)))

    @chex.variants(with_jit=True, without_jit=True)
    def test_grpo_of_a_tied_group_is_zero(self):
        adv, _ = self.variant(outcome.grpo)(jnp.array([0.3, 0.3, 0.3]), jnp.zeros(3, jnp.int32), jnp.ones((3, 2)))
        np.testing.assert_array_equal(adv, np.zeros((3, 2)))

    @chex.variants(with_jit=True, without_jit=True)
    def test_reinforce_plus_plus_discounts_then_whitens_over_the_batch(self):
        # gamma 0.5: row 0 rewards [0, 0, 1] -> G [0.25, 0.5, 1]; row 1 [0, 1, pad] -> [0.5, 1].
        # Over the 5 real tokens: mean 3.25 / 5 = 0.65, unbiased var
        # (0.16 + 0.0225 + 0.1225 + 0.0225 + 0.1225) / 4 = 0.1125.
        rewards = jnp.array([[0.0, 0.0, 1.0], [0.0, 1.0, jnp.nan]])
        mask = jnp.array([[1, 1, 1], [1, 1, 0]])
        adv, ret = self.variant(functools.partial(outcome.reinforce_plus_plus, gamma=0.5))(rewards, mask)
        g = np.array([[0.25, 0.5, 1.0], [0.5, 1.0, 0.0]])
        np.testing.assert_allclose(ret, g, rtol=1e-6)
        want = np.where(mask > 0, (g - 0.65) / math.sqrt(0.1125 + 1e-8), 0.0)
        np.testing.assert_allclose(adv, want, rtol=1e-5, atol=1e-6)

    @chex.variants(with_jit=True, without_jit=True)
    def test_reinforce_plus_plus_baseline_subtracts_the_group_mean_at_the_last_token(self):
        # KL reward -0.1 per token, scores [2, 0] in one group (mean 1) at the last token:
        # rewards [[-0.1, -0.1 + 2], [-0.1 + 0, pad]]; the last-token rewards 1.9 and -0.1 become
        # 0.9 and -1.1; gamma 1 returns: row 0 [-0.1 + 0.9, 0.9] = [0.8, 0.9], row 1 [-1.1].
        rewards = jnp.array([[-0.1, 1.9], [-0.1, jnp.nan]])
        mask = jnp.array([[1, 1], [1, 0]])
        fn = self.variant(outcome.reinforce_plus_plus_baseline)
        adv, ret = fn(rewards, jnp.array([2.0, 0.0]), jnp.zeros(2, jnp.int32), mask)
        g = np.array([[0.8, 0.9], [-1.1, 0.0]])
        np.testing.assert_allclose(ret, g, rtol=1e-6, atol=1e-7)
        mean = (0.8 + 0.9 - 1.1) / 3
        var = ((0.8 - mean) ** 2 + (0.9 - mean) ** 2 + (-1.1 - mean) ** 2) / 2
        np.testing.assert_allclose(adv, np.where(mask > 0, (g - mean) / math.sqrt(var + 1e-8), 0), rtol=1e-5)

    @chex.variants(with_jit=True, without_jit=True)
    def test_remax_is_undiscounted_returns_minus_the_greedy_baseline(self):
        # row 0 rewards [-0.1, -0.2, 1.0] -> G [0.7, 0.8, 1.0], baseline 0.5 -> [0.2, 0.3, 0.5];
        # row 1 [0.5, pad, pad] -> G [0.5], baseline 1.5 -> [-1.0]. gamma is ignored.
        rewards = jnp.array([[-0.1, -0.2, 1.0], [0.5, jnp.nan, jnp.nan]])
        mask = jnp.array([[1, 1, 1], [1, 0, 0]])
        fn = self.variant(functools.partial(outcome.remax, gamma=0.5))
        adv, ret = fn(rewards, jnp.array([0.5, 1.5]), mask)
        np.testing.assert_allclose(ret, [[0.7, 0.8, 1.0], [0.5, 0.0, 0.0]], rtol=1e-6)
        np.testing.assert_allclose(adv, [[0.2, 0.3, 0.5], [-1.0, 0.0, 0.0]], rtol=1e-5, atol=1e-7)

    @chex.variants(with_jit=True, without_jit=True)
    def test_every_estimator_ignores_unused_keywords(self):
        extra = dict(values=jnp.full((6, 3), jnp.nan), lam=0.95, method="scan", gamma=1.0)
        rewards = jnp.zeros((6, 3))
        calls = [
            lambda: outcome.grpo(SCORES, GROUPS, MASK, **extra),
            lambda: outcome.rloo(SCORES, GROUPS, MASK, **extra),
            lambda: outcome.reinforce_plus_plus(rewards, MASK, **extra),
            lambda: outcome.reinforce_plus_plus_baseline(rewards, SCORES, GROUPS, MASK, **extra),
            lambda: outcome.remax(rewards, SCORES, MASK, **extra),
        ]
        for call in calls:
            adv, ret = self.variant(call)()
            assert adv.shape == ret.shape == (6, 3) and bool(jnp.all(jnp.isfinite(adv)))


# ----------------------------------------------------------------- plain-loop references
def ref_group_members(gids, mask, i):
    b = len(gids)
    if not 0 <= gids[i] < b:
        return [i]
    return [j for j in range(b) if mask[j].any() and gids[j] == gids[i]]


def ref_grpo(scores, gids, mask, norm_by_std, eps=1e-6):
    adv = np.zeros(mask.shape)
    for i in range(len(scores)):
        if not mask[i].any():
            continue
        r = [scores[j] for j in ref_group_members(gids, mask, i)]
        mean = sum(r) / len(r)
        a = scores[i] - mean
        if norm_by_std:
            std = math.sqrt(sum((x - mean) ** 2 for x in r) / (len(r) - 1)) if len(r) > 1 else 0.0
            a = a / (std + eps)
        adv[i] = np.where(mask[i] > 0, a, 0.0)
    return adv


def ref_rloo(scores, gids, mask):
    adv = np.zeros(mask.shape)
    for i in range(len(scores)):
        others = [scores[j] for j in ref_group_members(gids, mask, i) if j != i]
        if mask[i].any() and others:
            adv[i] = np.where(mask[i] > 0, scores[i] - sum(others) / len(others), 0.0)
    return adv


def ref_returns(rewards, mask, gamma):
    out = np.zeros(mask.shape)
    for i in range(mask.shape[0]):
        g = 0.0
        for t in reversed(range(mask.shape[1])):
            g = (rewards[i, t] if mask[i, t] else 0.0) + gamma * g
            out[i, t] = g if mask[i, t] else 0.0
    return out


def ref_whiten(x, mask):
    items = [x[i, t] for i in range(x.shape[0]) for t in range(x.shape[1]) if mask[i, t]]
    n = len(items)
    mean = sum(items) / n
    var = sum((e - mean) ** 2 for e in items) / (n - 1)
    return np.where(mask > 0, (x - mean) / math.sqrt(var + 1e-8), 0.0)


def ref_reinforce_pp(rewards, mask, gamma):
    g = ref_returns(rewards, mask, gamma)
    return ref_whiten(g, mask), g


def ref_reinforce_pp_baseline(rewards, scores, gids, mask, gamma):
    shifted = rewards.copy()
    for i in range(len(scores)):
        real = np.nonzero(mask[i])[0]
        if len(real):
            members = ref_group_members(gids, mask, i)
            shifted[i, real[-1]] -= sum(scores[j] for j in members) / len(members)
    return ref_reinforce_pp(shifted, mask, gamma)


def ref_remax(rewards, baseline, mask):
    g = ref_returns(rewards, mask, 1.0)
    return np.where(mask > 0, g - baseline[:, None], 0.0), g


def random_batch(seed, groups=4, per_group=4, t=12):
    """Shuffled groups of ``per_group`` plus one group of one; row 0 empty (NaN score); NaN in
    every masked reward slot; group 1 tied (std 0)."""
    rng = np.random.default_rng(seed)
    b = groups * per_group + 1
    gids = rng.permutation(np.concatenate([np.repeat(np.arange(groups), per_group), [b - 1]])).astype(np.int32)
    lengths = rng.integers(1, t + 1, size=b)
    lengths[0] = 0
    mask = prefix_mask(lengths, t)
    scores = rng.normal(0.0, 1.5, b)
    scores[gids == 1] = 0.7
    scores[0] = np.nan
    kl = -0.05 * np.abs(rng.normal(0.0, 1.0, (b, t)))
    rewards = kl.copy()
    for i in range(b):
        if lengths[i]:
            rewards[i, lengths[i] - 1] += scores[i]
    rewards[mask == 0] = np.nan
    baseline = rng.normal(0.0, 1.5, b)
    baseline[0] = np.nan
    return dict(rewards=rewards, scores=scores, group_ids=gids, mask=mask, baseline=baseline)


@functools.partial(jax.jit, static_argnames=("norm_by_std",))
def jit_group_estimators(scores, gids, mask, norm_by_std):
    return outcome.grpo(scores, gids, mask, norm_by_std=norm_by_std), outcome.rloo(scores, gids, mask)


@jax.jit
def jit_reward_estimators(rewards, scores, gids, baseline, mask, gamma):
    return (outcome.reinforce_plus_plus(rewards, mask, gamma=gamma),
            outcome.reinforce_plus_plus_baseline(rewards, scores, gids, mask, gamma=gamma),
            outcome.remax(rewards, baseline, mask))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_group_estimators_match_numpy_loops_in_float64(x64, seed):
    d = random_batch(seed)
    for norm_by_std in (True, False):
        (adv, ret), (rloo_adv, rloo_ret) = jit_group_estimators(jnp.asarray(d["scores"]), jnp.asarray(d["group_ids"]),
                                                                jnp.asarray(d["mask"]), norm_by_std)
        assert adv.dtype == jnp.float64
        np.testing.assert_allclose(adv, ref_grpo(d["scores"], d["group_ids"], d["mask"], norm_by_std), **TOL)
        np.testing.assert_array_equal(ret, adv)
        np.testing.assert_allclose(rloo_adv, ref_rloo(d["scores"], d["group_ids"], d["mask"]), **TOL)
        np.testing.assert_array_equal(rloo_ret, rloo_adv)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reward_estimators_match_numpy_loops_in_float64(x64, seed, gamma):
    d = random_batch(seed)
    j = {k: jnp.asarray(v) for k, v in d.items()}
    rpp, rppb, rmx = jit_reward_estimators(j["rewards"], j["scores"], j["group_ids"], j["baseline"], j["mask"], gamma)
    assert rpp[0].dtype == rppb[0].dtype == rmx[0].dtype == jnp.float64
    refs = (ref_reinforce_pp(d["rewards"], d["mask"], gamma),
            ref_reinforce_pp_baseline(d["rewards"], d["scores"], d["group_ids"], d["mask"], gamma),
            ref_remax(d["rewards"], d["baseline"], d["mask"]))
    for name, got, want in zip(("reinforce++", "reinforce++-baseline", "remax"), (rpp, rppb, rmx), refs):
        np.testing.assert_allclose(got[0], want[0], **TOL, err_msg=f"{name} advantages")
        np.testing.assert_allclose(got[1], want[1], **TOL, err_msg=f"{name} returns")


def test_reinforce_plus_plus_baseline_equals_reinforce_plus_plus_on_recentred_rewards():
    d = random_batch(3)
    j = {k: jnp.asarray(v) for k, v in d.items()}
    valid = d["mask"] > 0
    means = np.array([np.mean([d["scores"][k] for k in ref_group_members(d["group_ids"], d["mask"], i)])
                      if valid[i].any() else 0.0 for i in range(len(d["scores"]))])
    at_last = np.arange(d["mask"].shape[1])[None, :] == d["mask"].sum(axis=1, keepdims=True) - 1  # prefix masks
    shifted = jnp.asarray(d["rewards"] - np.where(at_last, means[:, None], 0.0), jnp.float32)
    want = outcome.reinforce_plus_plus(shifted, j["mask"], gamma=0.9)
    got = outcome.reinforce_plus_plus_baseline(j["rewards"].astype(jnp.float32), j["scores"].astype(jnp.float32),
                                               j["group_ids"], j["mask"], gamma=0.9)
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)


def test_remax_equals_discounted_returns_minus_baseline():
    d = random_batch(4)
    j = {k: jnp.asarray(v, jnp.float32) if v.dtype == np.float64 else jnp.asarray(v) for k, v in d.items()}
    adv, ret = outcome.remax(j["rewards"], j["baseline"], j["mask"])
    g = outcome.discounted_returns(j["rewards"], j["mask"], gamma=1.0)
    np.testing.assert_array_equal(ret, g)
    np.testing.assert_allclose(adv, np.where(d["mask"] > 0, g - j["baseline"][:, None], 0.0), rtol=1e-6, atol=1e-6)


def test_masked_slots_are_zero_outputs_float32_and_gradients_finite():
    d = random_batch(5)
    j = {k: jnp.asarray(v, jnp.float32) if v.dtype == np.float64 else jnp.asarray(v) for k, v in d.items()}
    weights = jnp.asarray(np.random.default_rng(0).normal(size=d["mask"].shape), jnp.float32)
    fns = {
        "grpo": (lambda s, r: outcome.grpo(s, j["group_ids"], j["mask"]), "scores"),
        "dr_grpo": (lambda s, r: outcome.grpo(s, j["group_ids"], j["mask"], norm_by_std=False), "scores"),
        "rloo": (lambda s, r: outcome.rloo(s, j["group_ids"], j["mask"]), "scores"),
        "reinforce++": (lambda s, r: outcome.reinforce_plus_plus(r, j["mask"], gamma=0.9), "rewards"),
        "reinforce++-baseline": (lambda s, r: outcome.reinforce_plus_plus_baseline(r, s, j["group_ids"], j["mask"]),
                                 "scores"),
        "remax": (lambda s, r: outcome.remax(r, s, j["mask"]), "rewards"),
    }
    pad = d["mask"] == 0
    for name, (fn, _) in fns.items():
        scores = j["baseline"] if name == "remax" else j["scores"]
        adv, ret = jax.jit(fn)(scores, j["rewards"])
        assert adv.dtype == ret.dtype == jnp.float32, name
        assert np.all(np.asarray(adv)[pad] == 0) and np.all(np.asarray(ret)[pad] == 0), name
        assert np.all(np.isfinite(adv)) and np.all(np.isfinite(ret)), name

        def objective(s, r, fn=fn):
            a, g = fn(s, r)
            return jnp.sum(weights * a) + jnp.sum(weights * g)

        g_scores, g_rewards = jax.jit(jax.grad(objective, argnums=(0, 1)))(scores, j["rewards"])
        assert np.all(np.isfinite(g_scores)) and np.all(np.isfinite(g_rewards)), name
        assert np.all(np.asarray(g_rewards)[pad] == 0), name
        assert float(g_scores[0]) == 0.0, name  # row 0 is empty: its NaN score reaches nothing
        assert np.any(np.asarray(g_scores if fns[name][1] == "scores" else g_rewards) != 0), name


def test_group_ids_for_keeps_a_prompts_samples_together():
    ids = outcome.group_ids_for(3, 2)
    np.testing.assert_array_equal(ids, [0, 0, 1, 1, 2, 2])
    assert ids.dtype == np.int32
    np.testing.assert_array_equal(outcome.group_ids_for(1, 4), [0, 0, 0, 0])
    for bad in ((0, 4), (2, 0), (2.0, 4), (2, True)):
        with pytest.raises(ValueError, match="num_prompts|samples_per_prompt"):
            outcome.group_ids_for(*bad)


def test_bad_shapes_and_dtypes_raise_errors_naming_the_argument():
    s, g, m, r = jnp.zeros(3), jnp.zeros(3, jnp.int32), jnp.ones((3, 2)), jnp.zeros((3, 2))
    cases = [
        ("scores", lambda: outcome.grpo(jnp.zeros(4), g, m)),
        ("scores", lambda: outcome.rloo(jnp.zeros((3, 1)), g, m)),
        ("scores", lambda: outcome.grpo(jnp.zeros(3, jnp.int32), g, m)),
        ("group_ids", lambda: outcome.grpo(s, jnp.zeros(3), m)),
        ("group_ids", lambda: outcome.rloo(s, jnp.zeros(2, jnp.int32), m)),
        ("mask", lambda: outcome.grpo(s, g, jnp.ones(3))),
        ("eps", lambda: outcome.grpo(s, g, m, eps=-1.0)),
        ("rewards", lambda: outcome.reinforce_plus_plus(jnp.zeros(3), jnp.ones(3))),
        ("rewards", lambda: outcome.reinforce_plus_plus(jnp.zeros((3, 2), jnp.int32), m)),
        ("mask", lambda: outcome.reinforce_plus_plus(r, jnp.ones((3, 3)))),
        ("gamma", lambda: outcome.reinforce_plus_plus(r, m, gamma=jnp.ones(2))),
        ("mask", lambda: outcome.reinforce_plus_plus_baseline(r, s, g, jnp.ones((2, 2)))),
        ("scores", lambda: outcome.reinforce_plus_plus_baseline(r, jnp.zeros(2), g, m)),
        ("group_ids", lambda: outcome.reinforce_plus_plus_baseline(r, s, jnp.zeros(4, jnp.int32), m)),
        ("baseline_scores", lambda: outcome.remax(r, jnp.zeros(4), m)),
        ("baseline_scores", lambda: outcome.remax(r, jnp.zeros(3, jnp.int32), m)),
        ("mask", lambda: outcome.remax(r, s, jnp.ones((3, 1)))),
    ]
    for name, call in cases:
        with pytest.raises(ValueError, match=name):
            call()
