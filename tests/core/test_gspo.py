"""GSPO (ppo_jax.core.sequence_losses): sequence ratio, sequence clip, per-token broadcast.

A hand-checked batch with both clip sides active runs with and without ``jax.jit`` (chex
variants); a float64 plain-numpy loop is the reference for loss, gradient and stats on a random
ragged batch (an empty row, a full row, NaN in masked slots); GSPO-token (sg[s_i] pi / sg[pi])
gives the same gradient under every loss aggregation.
"""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ppo_jax import core

LOW, HIGH = 3e-4, 4e-4  # the GSPO paper's clip ranges
TOL = dict(rtol=1e-6, atol=1e-6)


def prefix_mask(lengths, t):
    return (np.arange(t)[None, :] < np.asarray(lengths)[:, None]).astype(np.int32)


# Row log-ratios (old = 0) and advantages; NaN in masked slots. Row means:
# r0 +1e-3, A +1: s = 1.0010 > 1 + 4e-4, clipped high -> loss -1.0004
# r1 -1e-3, A -0.5: s = 0.9990 < 1 - 3e-4, clipped low -> loss 0.5 * 0.9997
# r2 +1e-4, A mean(1, 3, 2) = 2: inside the range -> loss -2 e^1e-4
# r3 empty -> loss 0
# r4 +2e-3, A -1: the unclipped term is the larger (pessimistic side) -> loss e^2e-3
NAN = float("nan")
LENGTHS = [4, 2, 3, 0, 1]
MASK = prefix_mask(LENGTHS, 4)
LOG_RATIO = np.array([[0.01, -0.02, 0.005, 0.009], [-0.003, 0.001, NAN, NAN],
                      [0.0002, -0.0001, 0.0002, NAN], [NAN] * 4, [0.002, NAN, NAN, NAN]])
ADV = np.array([[1.0] * 4, [-0.5, -0.5, NAN, NAN], [1.0, 3.0, 2.0, NAN], [NAN] * 4,
                [-1.0, NAN, NAN, NAN]])
WANT_ROW_LOSS = [-(1 + HIGH), 0.5 * (1 - LOW), -2 * math.exp(1e-4), 0.0, math.exp(2e-3)]


def batch_of(lp, old, adv, mask):
    return core.LossInputs(mask=mask, logprobs=lp, old_logprobs=old, advantages=adv)


def gspo_objective(lp, old, adv, mask, mode="seq-mean-token-mean", **kw):
    per_token, stats = core.gspo_loss(batch_of(lp, old, adv, mask), **kw)
    return core.reduce_loss({"pg_loss": per_token}, stats, mask, mode)


class GSPOWorkedCaseTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_sequence_ratio_is_clipped_on_both_sides_and_broadcast_to_valid_tokens(self):
        fn = self.variant(lambda lp: core.gspo_loss(batch_of(lp, jnp.zeros((5, 4)), jnp.asarray(ADV),
                                                             jnp.asarray(MASK)),
                                                    cliprange=LOW, cliprange_high=HIGH))
        per_token, stats = fn(jnp.asarray(LOG_RATIO, jnp.float32))
        want = np.where(MASK > 0, np.array(WANT_ROW_LOSS)[:, None], 0.0)
        np.testing.assert_allclose(per_token, want, rtol=1e-6, atol=1e-7)
        assert np.all(np.isfinite(per_token)) and all(np.all(np.isfinite(v)) for v in stats.values())
        ratio = np.exp([1e-3, -1e-3, 1e-4, 0.0, 2e-3])
        np.testing.assert_allclose(stats["ratio"], np.where(MASK > 0, ratio[:, None], 0.0), rtol=1e-6)
        np.testing.assert_array_equal(stats["clipfrac"], np.where(MASK > 0, [[1], [1], [0], [0], [0]], 0))
        np.testing.assert_array_equal(stats["clipfrac_low"], np.where(MASK > 0, [[0], [1], [0], [0], [0]], 0))
        np.testing.assert_array_equal(stats["clipfrac_high"], np.where(MASK > 0, [[1], [0], [0], [0], [0]], 0))

    @chex.variants(with_jit=True, without_jit=True)
    def test_seq_mean_token_mean_is_the_mean_of_sequence_losses_and_its_gradient(self):
        lp = jnp.asarray(LOG_RATIO, jnp.float32)
        fn = self.variant(jax.value_and_grad(
            lambda lp: gspo_objective(lp, jnp.zeros((5, 4)), jnp.asarray(ADV), jnp.asarray(MASK),
                                      cliprange=LOW, cliprange_high=HIGH), has_aux=True))
        (loss, stats), grad = fn(lp)
        np.testing.assert_allclose(loss, np.mean(WANT_ROW_LOSS), rtol=1e-6)
        # clipped tokens: rows 0 (4 tokens) and 1 (2 tokens) of 10 valid tokens
        np.testing.assert_allclose([stats["clipfrac"], stats["clipfrac_low"], stats["clipfrac_high"]],
                                   [0.6, 0.2, 0.4], rtol=1e-6)
        # d/d lp_{i,t} = -(1/G) A_i s_i / |y_i| on unclipped rows, 0 on clipped rows and padding
        want = np.zeros((5, 4))
        want[2, :3] = -2 * math.exp(1e-4) / 3 / 5
        want[4, 0] = math.exp(2e-3) / 5
        np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-9)

    @chex.variants(with_jit=True, without_jit=True)
    def test_first_minibatch_has_ratio_one_zero_approxkl_and_no_clip(self):
        lp = jnp.asarray(np.where(MASK > 0, -1.5, NAN), jnp.float32)
        fn = self.variant(lambda lp: gspo_objective(lp, lp, jnp.asarray(ADV), jnp.asarray(MASK),
                                                    cliprange=LOW, cliprange_high=HIGH))
        loss, stats = fn(lp)
        assert float(stats["ratio"]) == 1.0 and float(stats["token_ratio"]) == 1.0
        assert float(stats["approxkl"]) == 0.0 and float(stats["clipfrac"]) == 0.0
        np.testing.assert_allclose(loss, -(1.0 - 0.5 + 2.0 + 0.0 - 1.0) / 5, rtol=1e-6)

    @chex.variants(with_jit=True, without_jit=True)
    def test_empty_rows_and_an_all_padding_batch_give_zero_not_nan(self):
        nan = jnp.full((2, 3), jnp.nan)
        mask = jnp.zeros((2, 3), jnp.int32)
        fn = self.variant(jax.value_and_grad(
            lambda lp: gspo_objective(lp, nan, nan, mask, cliprange=LOW), has_aux=True))
        (loss, stats), grad = fn(nan)
        assert float(loss) == 0.0 and all(float(v) == 0.0 for v in stats.values())
        np.testing.assert_array_equal(grad, np.zeros((2, 3)))


# ----------------------------------------------------------------- float64 numpy reference
def ref_gspo(lp, old, adv, mask, lo, hi):
    """Row losses, d mean(row losses) / d lp, and token-mean stats, by loops."""
    b, t = mask.shape
    hi = lo if hi is None else hi
    losses, grad = np.zeros(b), np.zeros((b, t))
    sums = dict(clipfrac=0.0, clipfrac_low=0.0, clipfrac_high=0.0, ratio=0.0, token_ratio=0.0,
                approxkl=0.0, policykl=0.0)
    for i in range(b):
        idx = [j for j in range(t) if mask[i, j]]
        if not idx:
            continue
        n = len(idx)
        s = math.exp(sum(lp[i, j] - old[i, j] for j in idx) / n)
        a = sum(adv[i, j] for j in idx) / n
        l1, l2 = -a * s, -a * min(max(s, 1 - lo), 1 + hi)
        losses[i] = max(l1, l2)
        for j in idx:
            grad[i, j] = (-a * s / n if l1 >= l2 else 0.0) / b
            d = lp[i, j] - old[i, j]
            sums["clipfrac"] += float(l2 > l1)
            sums["clipfrac_low"] += float(l2 > l1 and s < 1 - lo)
            sums["clipfrac_high"] += float(l2 > l1 and s > 1 + hi)
            sums["ratio"] += s
            sums["token_ratio"] += math.exp(d)
            sums["approxkl"] += 0.5 * d * d
            sums["policykl"] -= d
    n_tokens = int(mask.sum())
    return losses, grad, {k: v / n_tokens for k, v in sums.items()}


def ragged_gspo_batch(seed, b=12, t=16):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, t + 1, size=b)
    lengths[0], lengths[1] = 0, t  # an empty row, a full row
    mask = prefix_mask(lengths, t)
    old = -np.abs(rng.normal(1.0, 1.0, (b, t)))
    offset = rng.uniform(-1.5e-3, 1.5e-3, (b, 1))  # around GSPO's clip ranges
    adv = np.repeat(rng.normal(0.0, 1.0, (b, 1)), t, axis=1)
    offset[3], adv[3] = -1.2e-3, -0.7  # below 1 - 5e-4 with A < 0: clipped low
    offset[4], adv[4] = 1.2e-3, 0.9  # above 1 + 5e-4 with A > 0: clipped high
    lp = old + offset + rng.normal(0.0, 2e-4, (b, t))
    adv[2] += rng.normal(0.0, 1.0, t)  # a row whose advantage varies over tokens (its mean is used)
    pad = mask == 0
    lp[pad], old[pad], adv[pad] = np.nan, np.inf, np.nan
    return lp, old, adv, mask


@pytest.mark.usefixtures("x64")
@pytest.mark.parametrize("lo,hi", [(LOW, HIGH), (5e-4, None)])
def test_gspo_loss_gradient_and_stats_match_a_float64_numpy_loop(lo, hi):
    lp, old, adv, mask = ragged_gspo_batch(3)
    want_rows, want_grad, want_stats = ref_gspo(lp, old, adv, mask, lo, hi)
    assert 0 < want_stats["clipfrac_low"] and 0 < want_stats["clipfrac_high"]  # both sides clip
    assert want_stats["clipfrac"] < 1
    args = [jnp.asarray(x) for x in (lp, old, adv, mask)]

    def objective(lp):
        return gspo_objective(lp, *args[1:], cliprange=lo, cliprange_high=hi)

    for fn in (objective, jax.jit(objective)):
        (loss, stats), grad = jax.value_and_grad(fn, has_aux=True)(args[0])
        assert loss.dtype == jnp.float64
        np.testing.assert_allclose(loss, np.mean(want_rows), **TOL)
        np.testing.assert_allclose(grad, want_grad, rtol=1e-9, atol=1e-12)
        for k, v in want_stats.items():
            np.testing.assert_allclose(stats[k], v, **TOL, err_msg=k)
    per_token, _ = core.gspo_loss(batch_of(*args), cliprange=lo, cliprange_high=hi)
    np.testing.assert_allclose(per_token, np.where(mask > 0, want_rows[:, None], 0.0), **TOL)
    # token-mean weighs row i by its length: sum_i |y_i| loss_i / N
    np.testing.assert_allclose(core.aggregate(per_token, args[3], "token-mean"),
                               np.sum(mask.sum(1) * want_rows) / mask.sum(), **TOL)


@pytest.mark.usefixtures("x64")
@pytest.mark.parametrize("mode", core.LOSS_AGGREGATIONS)
def test_gspo_token_form_gives_the_same_loss_and_gradient_under_every_aggregation(mode):
    lp, old, adv, mask = (jnp.asarray(x) for x in ragged_gspo_batch(4))
    adv = jnp.where(mask > 0, jnp.nan_to_num(adv)[:, :1], jnp.nan)  # A_{i,t} = A_i

    def gspo_token(lp):  # s_{i,t} = sg[s_i] pi / sg[pi] (paper sec. 4.3), the clip per token
        valid = mask > 0
        lp0 = jnp.where(valid, lp, 0.0)
        seq = jax.lax.stop_gradient(core.sequence_log_ratio(lp, old, mask))
        s = jnp.exp(seq[:, None] + lp0 - jax.lax.stop_gradient(lp0))
        a = jnp.where(valid, adv, 0.0)
        per_token = jnp.maximum(-a * s, -a * jnp.clip(s, 1 - LOW, 1 + HIGH))
        return core.aggregate(per_token, mask, mode)

    def gspo(lp):
        return gspo_objective(lp, old, adv, mask, mode, cliprange=LOW, cliprange_high=HIGH)[0]

    want_loss, want_grad = jax.value_and_grad(gspo_token)(lp)
    loss, grad = jax.jit(jax.value_and_grad(gspo))(lp)
    np.testing.assert_allclose(loss, want_loss, **TOL)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-9, atol=1e-12)


def test_micro_batches_of_rows_add_up_to_the_minibatch_loss():
    lp, old, adv, mask = (jnp.asarray(x, jnp.float32) for x in ragged_gspo_batch(5))
    mask = mask.astype(jnp.int32)
    norms = core.loss_normalizers(mask)

    @jax.jit
    def loss(lp, old, adv, mask):
        per_token, stats = core.gspo_loss(batch_of(lp, old, adv, mask), cliprange=LOW, cliprange_high=HIGH)
        return core.reduce_loss({"pg_loss": per_token}, stats, mask, "seq-mean-token-mean", norms)

    arrays = (lp, old, adv, mask)
    whole = loss(*arrays)
    halves = jax.tree.map(jnp.add, loss(*(x[:6] for x in arrays)), loss(*(x[6:] for x in arrays)))
    chex.assert_trees_all_close(halves, whole, rtol=1e-6, atol=1e-7)


def test_gspo_is_registered_and_rejects_bad_clip_settings():
    assert core.get_policy_loss("gspo") is core.gspo_loss
    batch = batch_of(*(jnp.zeros((1, 2)) for _ in range(3)), jnp.ones((1, 2)))
    with pytest.raises(ValueError, match="cliprange must be >= 0"):
        core.gspo_loss(batch, cliprange=-1e-4)
    with pytest.raises(ValueError, match="cliprange_high must be >= 0"):
        core.gspo_loss(batch, cliprange=3e-4, cliprange_high=-4e-4)
    with pytest.raises(ValueError, match="cliprange must be a numeric scalar"):
        core.gspo_loss(batch, cliprange="3e-4")
    with pytest.raises(ValueError, match="cliprange must be a scalar"):
        core.gspo_loss(batch, cliprange=jnp.array([3e-4, 4e-4]))
    with pytest.raises(ValueError, match="gspo has no dual clip"):
        core.gspo_loss(batch, cliprange=3e-4, dual_clip=3.0)
    with pytest.raises(ValueError, match="advantages is missing"):
        core.gspo_loss(batch._replace(advantages=None), cliprange=3e-4)
