"""The rollout / trainer log-prob mismatch (ppo_jax.core.rollout_correction): measured and
corrected.

A hand-checked 2x3 batch for each mode runs with and without ``jax.jit`` (chex variants); a
float64 plain-numpy loop is the reference for the weights and stats on a random ragged batch
(an empty row, a full row, NaN / inf in masked slots); micro-batch stats with the minibatch's
normalisers add up to the whole batch's; a huge sequence log-ratio gives weight 0, never NaN.
"""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ppo_jax import core

NAN = float("nan")
MASK = np.array([[1, 1, 0], [1, 1, 1]], np.int32)
# d = old - rollout: row 0 (ln 3, -ln 2, masked), row 1 (0.4, 0.4, 0.0); rollout = 0
D = np.array([[math.log(3.0), -math.log(2.0), NAN], [0.4, 0.4, 0.0]])
ROLLOUT = np.where(MASK > 0, 0.0, np.inf)  # inf in the masked slot too


def weights_of(mode, old=D, rollout=ROLLOUT, mask=MASK, cap=2.0, normalizers=None,
               band=core.ICEPOP_BAND):
    return core.rollout_correction_weights(jnp.asarray(old, jnp.float32),
                                           jnp.asarray(rollout, jnp.float32), jnp.asarray(mask),
                                           mode=mode, cap=cap, band=band, normalizers=normalizers)


class HandCheckedTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_tis_truncates_each_token_ratio_at_the_cap(self):
        w, stats = self.variant(lambda o: weights_of("tis", o))(jnp.asarray(D, jnp.float32))
        want = [[2.0, 0.5, 0.0], [math.exp(0.4), math.exp(0.4), 1.0]]
        np.testing.assert_allclose(w, want, rtol=1e-6)
        assert w.dtype == jnp.float32
        np.testing.assert_allclose(stats["rollout_correction/weight_mean"],
                                   (2.5 + 2 * math.exp(0.4) + 1.0) / 5, rtol=1e-6)
        np.testing.assert_allclose(stats["rollout_correction/truncated_fraction"], 1 / 5)

    @chex.variants(with_jit=True, without_jit=True)
    def test_mis_keeps_a_sequence_ratio_up_to_the_cap_and_zeroes_one_above(self):
        # row 0: rho = 3 / 2 = 1.5 <= 2, kept on both real tokens; row 1: e^0.8 = 2.23 > 2
        w, stats = self.variant(lambda o: weights_of("mis", o))(jnp.asarray(D, jnp.float32))
        np.testing.assert_allclose(w, [[1.5, 1.5, 0.0], [0.0, 0.0, 0.0]], rtol=1e-6)
        np.testing.assert_allclose(stats["rollout_correction/weight_mean"], 3.0 / 5, rtol=1e-6)
        np.testing.assert_allclose(stats["rollout_correction/truncated_fraction"], 1 / 2)

    @chex.variants(with_jit=True, without_jit=True)
    def test_icepop_keeps_a_token_ratio_inside_the_band_and_zeroes_one_outside(self):
        # IcePop's band [0.5, 5]: 3 and 0.5 (the low end, inclusive) kept; [0.6, 2.5]: both out
        w, stats = self.variant(lambda o: weights_of("icepop", o))(jnp.asarray(D, jnp.float32))
        e = math.exp(0.4)
        np.testing.assert_allclose(w, [[3.0, 0.5, 0.0], [e, e, 1.0]], rtol=1e-6)
        assert float(stats["rollout_correction/truncated_fraction"]) == 0.0
        w, stats = self.variant(lambda o: weights_of("icepop", o, band=(0.6, 2.5)))(
            jnp.asarray(D, jnp.float32))
        np.testing.assert_allclose(w, [[0.0, 0.0, 0.0], [e, e, 1.0]], rtol=1e-6)
        np.testing.assert_allclose(stats["rollout_correction/weight_mean"], (2 * e + 1) / 5,
                                   rtol=1e-6)
        np.testing.assert_allclose(stats["rollout_correction/truncated_fraction"], 2 / 5)

    @chex.variants(with_jit=True, without_jit=True)
    def test_none_weighs_every_real_token_one(self):
        w, stats = self.variant(lambda o: weights_of("none", o))(jnp.asarray(D, jnp.float32))
        np.testing.assert_array_equal(w, MASK.astype(np.float32))
        assert float(stats["rollout_correction/weight_mean"]) == 1.0
        assert float(stats["rollout_correction/truncated_fraction"]) == 0.0

    @chex.variants(with_jit=True, without_jit=True)
    def test_mismatch_stats_of_the_hand_batch(self):
        # logprobs - rollout_logprobs = D on the real tokens
        fn = self.variant(lambda lp: core.rollout_mismatch(lp, jnp.asarray(ROLLOUT, jnp.float32),
                                                           jnp.asarray(MASK)))
        stats = fn(jnp.asarray(D, jnp.float32))
        d = np.array([math.log(3.0), -math.log(2.0), 0.4, 0.4, 0.0])
        np.testing.assert_allclose(stats["mismatch/abs_logprob_diff"], np.abs(d).mean(), rtol=1e-6)
        np.testing.assert_allclose(stats["mismatch/k3_kl"], (np.exp(d) - d - 1).mean(), rtol=1e-5)
        np.testing.assert_allclose(stats["mismatch/max_ratio"], 3.0, rtol=1e-6)
        np.testing.assert_allclose(stats["mismatch/min_ratio"], 0.5, rtol=1e-6)

    @chex.variants(with_jit=True, without_jit=True)
    def test_equal_log_probs_give_weight_exactly_one_in_every_mode(self):
        lp = jnp.asarray(np.random.default_rng(0).normal(-2, 1, (2, 3)), jnp.float32)
        for mode in core.ROLLOUT_CORRECTIONS:
            w, stats = self.variant(lambda x: weights_of(mode, x, x))(lp)
            np.testing.assert_array_equal(w, MASK.astype(np.float32))
            assert float(stats["rollout_correction/truncated_fraction"]) == 0.0
        stats = self.variant(lambda x: core.rollout_mismatch(x, x, MASK))(lp)
        assert float(stats["mismatch/abs_logprob_diff"]) == 0.0 == float(stats["mismatch/k3_kl"])
        assert float(stats["mismatch/max_ratio"]) == 1.0 == float(stats["mismatch/min_ratio"])


# --- float64 numpy reference -------------------------------------------------------------

def reference(old, rollout, mask, mode, cap, band=(0.8, 1.3)):
    """Plain loops: weights [B, T], weight_mean, truncated_fraction (rows over all B). icepop:
    the IcePop paper's M(k) = k inside [low, high], else 0; OpenRLHF openrlhf/models/loss.py
    lines 200-205 (commit 3c3be623) agrees."""
    b, t = mask.shape
    w = np.zeros((b, t))
    tokens, at_cap, rejected, dropped = 0, 0, 0, 0
    for i in range(b):
        log_rho = 0.0
        for j in range(t):
            if mask[i, j]:
                tokens += 1
                log_rho += old[i, j] - rollout[i, j]
        for j in range(t):
            if not mask[i, j]:
                continue
            ratio = math.exp(old[i, j] - rollout[i, j])
            if mode == "none":
                w[i, j] = 1.0
            elif mode == "tis":
                w[i, j] = min(ratio, cap)
                at_cap += ratio >= cap
            elif mode == "icepop":
                inside = band[0] <= ratio <= band[1]
                w[i, j] = ratio if inside else 0.0
                dropped += not inside
            else:
                w[i, j] = math.exp(log_rho) if log_rho <= math.log(cap) else 0.0
        rejected += mode == "mis" and mask[i].any() and log_rho > math.log(cap)
    frac = {"tis": at_cap / tokens, "mis": rejected / b, "icepop": dropped / tokens}.get(mode, 0.0)
    return w, w.sum() / tokens, frac


def mismatch_reference(lp, rollout, mask):
    d = [lp[i, j] - rollout[i, j] for i, j in zip(*np.nonzero(mask))]
    return {"mismatch/abs_logprob_diff": sum(abs(x) for x in d) / len(d),
            "mismatch/k3_kl": sum(math.exp(x) - x - 1 for x in d) / len(d),
            "mismatch/max_ratio": max(math.exp(x) for x in d),
            "mismatch/min_ratio": min(math.exp(x) for x in d)}


def random_batch(seed=0):
    """Rows of 5, 2, 0 (empty) and 4 real tokens of 5; NaN / inf in masked slots."""
    rng = np.random.default_rng(seed)
    mask = (np.arange(5)[None] < np.array([5, 2, 0, 4])[:, None]).astype(np.int32)
    rollout = rng.normal(-2.0, 1.0, mask.shape)
    old = rollout + rng.normal(0.0, 0.4, mask.shape)
    return np.where(mask > 0, old, NAN), np.where(mask > 0, rollout, -np.inf), mask


@pytest.mark.parametrize("mode", ["none", "tis", "mis", "icepop"])
@pytest.mark.parametrize("jit", [False, True])
def test_weights_and_stats_match_the_float64_reference(x64, mode, jit):
    old, rollout, mask = random_batch()
    cap = 1.3
    fn = lambda o, r: core.rollout_correction_weights(o, r, mask, mode=mode, cap=cap,  # noqa: E731
                                                      band=(0.8, 1.3))
    w, stats = (jax.jit(fn) if jit else fn)(jnp.asarray(old), jnp.asarray(rollout))
    want_w, want_mean, want_frac = reference(old, rollout, mask, mode, cap)
    assert w.dtype == jnp.float64
    np.testing.assert_allclose(w, want_w, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(stats["rollout_correction/weight_mean"], want_mean, rtol=1e-12)
    np.testing.assert_allclose(stats["rollout_correction/truncated_fraction"], want_frac)
    if mode != "none":  # the batch exercises both branches
        assert 0.0 < want_frac < 1.0


@pytest.mark.parametrize("jit", [False, True])
def test_mismatch_stats_match_the_float64_reference(x64, jit):
    old, rollout, mask = random_batch(1)
    fn = lambda a, b: core.rollout_mismatch(a, b, mask)  # noqa: E731
    stats = (jax.jit(fn) if jit else fn)(jnp.asarray(old), jnp.asarray(rollout))
    for key, want in mismatch_reference(old, rollout, mask).items():
        np.testing.assert_allclose(stats[key], want, rtol=1e-12, err_msg=key)


def test_an_empty_mask_gives_ratio_one_and_zero_means():
    stats = core.rollout_mismatch(jnp.full((2, 3), jnp.nan), jnp.zeros((2, 3)), jnp.zeros((2, 3)))
    assert {k: float(v) for k, v in stats.items()} == {
        "mismatch/abs_logprob_diff": 0.0, "mismatch/k3_kl": 0.0,
        "mismatch/max_ratio": 1.0, "mismatch/min_ratio": 1.0}
    w, wst = core.rollout_correction_weights(jnp.zeros((2, 3)), jnp.zeros((2, 3)),
                                             jnp.zeros((2, 3)), mode="mis", cap=2.0)
    assert float(jnp.abs(w).sum()) == 0.0
    assert all(float(v) == 0.0 for v in wst.values())


@pytest.mark.parametrize("mode", ["none", "tis", "mis", "icepop"])
def test_micro_batch_stats_with_minibatch_normalizers_add_up_to_the_whole(mode):
    old, rollout, mask = random_batch(2)
    norms = core.loss_normalizers(mask)
    _, whole = core.rollout_correction_weights(old, rollout, mask, mode=mode, cap=1.3)
    parts = [core.rollout_correction_weights(old[s], rollout[s], mask[s], mode=mode, cap=1.3,
                                             normalizers=norms)[1]
             for s in (slice(0, 1), slice(1, 3), slice(3, 4))]
    for key, value in whole.items():
        np.testing.assert_allclose(sum(p[key] for p in parts), value, rtol=1e-6, err_msg=key)


# --- NaN / inf safety -----------------------------------------------------------------

@pytest.mark.parametrize("mode", ["none", "tis", "mis", "icepop"])
def test_nan_and_inf_in_masked_slots_reach_no_weight_stat_or_gradient(mode):
    old, rollout, mask = random_batch(3)
    old = np.where(mask > 0, old, np.inf).astype(np.float32)
    rollout = rollout.astype(np.float32)  # NaN / -inf in masked slots
    lp = jnp.where(mask > 0, jnp.asarray(old), jnp.nan)

    @jax.jit
    def surrogate(lp, old, rollout):
        w, stats = core.rollout_correction_weights(old, rollout, mask, mode=mode, cap=1.5)
        return jnp.sum(jnp.where(mask > 0, w * lp, 0)), (w, stats)

    (value, (w, stats)), grads = jax.value_and_grad(surrogate, argnums=(0, 1, 2), has_aux=True)(
        lp, jnp.asarray(old), jnp.asarray(rollout))
    for leaf in jax.tree.leaves((value, w, stats, grads)):
        assert bool(jnp.all(jnp.isfinite(leaf)))
    assert float(jnp.abs(jnp.where(mask > 0, 0, w)).sum()) == 0.0
    np.testing.assert_array_equal(grads[0], w)  # d/dlp of sum(w lp) is the (constant) weight
    assert float(jnp.abs(grads[1]).sum()) == 0.0 == float(jnp.abs(grads[2]).sum())  # stopped
    stats = core.rollout_mismatch(lp, jnp.asarray(rollout), mask)
    assert all(bool(jnp.isfinite(v)) for v in stats.values())


@pytest.mark.parametrize("jit", [False, True])
def test_a_huge_sequence_log_ratio_gives_weight_zero_and_no_nan(jit):
    # row 0: each token's log-ratio 3e38 (the float32 sum overflows to inf); row 1: -3e38 (rho
    # underflows to 0, kept with weight 0); row 2: +inf on a real token; row 3: on-policy
    old = jnp.asarray([[3e38, 3e38], [-3e38, -3e38], [jnp.inf, 0.0], [-1.0, -2.0]], jnp.float32)
    rollout = jnp.asarray([[0.0, 0.0], [0.0, 0.0], [0.0, 0.0], [-1.0, -2.0]], jnp.float32)
    fn = lambda o: core.rollout_correction_weights(o, rollout, jnp.ones((4, 2)), mode="mis",  # noqa: E731
                                                   cap=2.0)
    w, stats = (jax.jit(fn) if jit else fn)(old)
    np.testing.assert_array_equal(w, [[0, 0], [0, 0], [0, 0], [1, 1]])
    np.testing.assert_allclose(stats["rollout_correction/truncated_fraction"], 2 / 4)
    np.testing.assert_allclose(stats["rollout_correction/weight_mean"], 2 / 8)
    w_tis, _ = core.rollout_correction_weights(old, rollout, jnp.ones((4, 2)), mode="tis", cap=2.0)
    np.testing.assert_array_equal(w_tis, [[2, 2], [0, 0], [2, 1], [1, 1]])


def test_masked_inputs_zero_rollout_logprobs_like_every_per_token_field():
    assert "rollout_logprobs" in core.loss_inputs.PER_TOKEN_FIELDS
    mask = jnp.asarray([[1, 0]])
    batch = core.masked_inputs(core.LossInputs(mask=mask, rollout_logprobs=jnp.asarray([[-1.0, jnp.nan]])))
    np.testing.assert_array_equal(batch.rollout_logprobs, [[-1.0, 0.0]])


# --- validation -------------------------------------------------------------------------

@pytest.mark.parametrize("mode, cap, match", [
    ("is", 2.0, "unknown rollout correction 'is'; known: none, tis, mis, icepop"),
    ("tis", 0.5, "cap must be a finite number >= 1 for 'tis', got 0.5"),
    ("mis", float("inf"), "cap must be a finite number >= 1 for 'mis', got inf"),
    ("mis", float("nan"), "got nan"),
    ("tis", True, "cap must be a numeric scalar"),
    ("tis", None, "cap must be a numeric scalar"),
    ("tis", jnp.ones(2), "cap must be a scalar"),
])
def test_bad_modes_and_caps_are_refused_naming_the_value(mode, cap, match):
    with pytest.raises(ValueError, match=match):
        core.check_rollout_correction(mode, cap)
    with pytest.raises(ValueError, match=match):
        core.rollout_correction_weights(jnp.zeros((1, 2)), jnp.zeros((1, 2)), jnp.ones((1, 2)),
                                        mode=mode, cap=cap)


@pytest.mark.parametrize("band, match", [
    ((2.0, 0.5), r"low must be >= 0 and <= high"), ((-0.1, 5.0), r"low must be >= 0"),
    ((1.2, 5.0), r"must hold 1"), ((0.5, 0.9), r"must hold 1"),
    ((0.5, float("inf")), "must be finite"), ((0.5, "x"), "band high must be a numeric scalar"),
])
def test_bad_icepop_bands_are_refused_naming_the_band(band, match):
    with pytest.raises(ValueError, match=match):
        core.check_rollout_correction("icepop", 2.0, band)
    with pytest.raises(ValueError, match=match):
        core.rollout_correction_weights(jnp.zeros((1, 2)), jnp.zeros((1, 2)), jnp.ones((1, 2)),
                                        mode="icepop", band=band)


def test_a_band_of_zero_to_infinity_like_bounds_is_accepted_and_drops_nan():
    core.check_rollout_correction("icepop", 2.0, (0.0, 1.0))
    core.check_rollout_correction("tis", 2.0, (3.0, 1.0))  # a band tis never reads
    w, _ = core.rollout_correction_weights(jnp.asarray([[0.0, jnp.nan, 50.0]]), jnp.zeros((1, 3)),
                                           jnp.ones((1, 3)), mode="icepop", band=(0.0, 1.0))
    np.testing.assert_array_equal(w, [[1.0, 0.0, 0.0]])  # NaN and e^50 dropped, no NaN weight


def test_cap_one_and_an_unused_cap_of_none_are_accepted():
    core.check_rollout_correction("tis", 1)
    core.check_rollout_correction("none", 0.0)  # the cap of "none" is never read
    core.check_rollout_correction("mis", jnp.float32(3.0))


@pytest.mark.parametrize("args, match", [
    ((jnp.zeros((1, 2)), jnp.zeros((1, 3)), jnp.ones((1, 2))), "rollout_logprobs has shape"),
    ((jnp.zeros((1, 2), jnp.int32), jnp.zeros((1, 2)), jnp.ones((1, 2))), "old_logprobs must be a floating"),
    ((jnp.zeros((2,)), jnp.zeros((2,)), jnp.ones((2,))), "old_logprobs must have rank 2"),
    ((jnp.zeros((1, 2)), jnp.zeros((1, 2)), jnp.ones((2, 1))), "mask must have shape"),
    ((jnp.zeros((1, 2)), None, jnp.ones((1, 2))), "rollout_logprobs is missing"),
])
def test_bad_arrays_are_refused_naming_the_argument(args, match):
    with pytest.raises(ValueError, match=match):
        core.rollout_correction_weights(*args, mode="tis", cap=2.0)
