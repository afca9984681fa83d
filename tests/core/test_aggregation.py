"""Loss aggregation: hand-computed values of every mode, exactness under micro-batching, NaN
safety, and the per-token loss interface of the built-in losses."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ppo_jax import core

# 2 x 3 case: row 0 has two valid tokens (1, 2), row 1 one (4); 3, 5, 6 are padding.
L = jnp.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
M = jnp.array([[1, 1, 0], [1, 0, 0]])
HAND = {
    "token-mean": (1 + 2 + 4) / 3,  # 7/3
    "seq-mean-token-mean": ((1 + 2) / 2 + 4 / 1) / 2,  # 2.75
    "seq-mean-token-sum": ((1 + 2) + 4) / (2 * 3),  # 7/6: S rows x T = 3 padded length
}


class AggregateTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_every_mode_matches_the_hand_computed_2x3_case(self):
        for mode, want in HAND.items():
            got = self.variant(lambda x, m: core.aggregate(x, m, mode))(L, M)
            np.testing.assert_allclose(got, want, rtol=1e-7, err_msg=mode)

    @chex.variants(with_jit=True, without_jit=True)
    def test_padding_nan_reaches_no_value_or_gradient_in_any_mode(self):
        poisoned = jnp.where(M > 0, L, jnp.nan)
        for mode, want in HAND.items():
            value, grad = self.variant(jax.value_and_grad(lambda x: core.aggregate(x, M, mode)))(poisoned)
            np.testing.assert_allclose(value, want, rtol=1e-7, err_msg=mode)
            assert bool(jnp.all(jnp.isfinite(grad))) and not bool(jnp.any(jnp.where(M > 0, 0, grad)))

    def test_gradients_weigh_tokens_by_mode(self):
        # token-mean: 1/3 per token; seq-mean-token-mean: 1/(2*2) on row 0, 1/2 on row 1;
        # seq-mean-token-sum: 1/6 on every valid token.
        want = {"token-mean": [[1 / 3, 1 / 3, 0], [1 / 3, 0, 0]],
                "seq-mean-token-mean": [[0.25, 0.25, 0], [0.5, 0, 0]],
                "seq-mean-token-sum": [[1 / 6, 1 / 6, 0], [1 / 6, 0, 0]]}
        for mode, g in want.items():
            np.testing.assert_allclose(jax.grad(lambda x: core.aggregate(x, M, mode))(L), g, rtol=1e-6)

    def test_empty_mask_gives_zero_and_empty_row_still_counts_as_a_sequence(self):
        for mode in core.LOSS_AGGREGATIONS:
            assert float(core.aggregate(L, jnp.zeros((2, 3)), mode)) == 0.0
        one_row = jnp.array([[1, 1, 0], [0, 0, 0]])
        assert float(core.aggregate(L, one_row, "seq-mean-token-mean")) == pytest.approx(1.5 / 2)

    def test_unknown_mode_and_bad_shapes_are_named(self):
        with pytest.raises(ValueError, match="unknown loss aggregation 'seq-mean'; known: token-mean, "
                                             "seq-mean-token-mean, seq-mean-token-sum"):
            core.aggregate(L, M, "seq-mean")
        with pytest.raises(ValueError, match=r"per_token must have rank 2"):
            core.aggregate(L[0], M[0])
        with pytest.raises(ValueError, match=r"mask must have shape \(2, 3\)"):
            core.aggregate(L, M[:, :2])
        with pytest.raises(ValueError, match=r"stat 'x'.*per-token"):
            core.token_mean_stats({"x": jnp.ones(2)}, M)


@pytest.mark.parametrize("mode", core.LOSS_AGGREGATIONS)
@pytest.mark.parametrize("micro", [1, 2])
def test_micro_batches_sum_to_the_whole_minibatch_loss_stats_and_gradients(mode, micro):
    rng = np.random.default_rng(0)
    b, t = 4, 6
    mask = jnp.asarray(np.arange(t)[None] < np.array([[6], [1], [0], [4]]))  # ragged, one empty row
    lp, old, adv = (jnp.asarray(rng.normal(0, 0.3, (b, t)), jnp.float32) for _ in range(3))
    ent = jnp.asarray(rng.uniform(0, 2, (b, t)), jnp.float32)

    def objective(lp, old, adv, ent, mask, norms):
        batch = core.masked_inputs(core.LossInputs(mask=mask, logprobs=lp, old_logprobs=old, advantages=adv,
                                                   ref_logprobs=old, entropy=ent))
        per_token, stats = core.ppo_clip_loss(batch, cliprange=0.1)
        terms = {"pg_loss": per_token, **core.policy_regularizers(batch, entropy_coef=0.1, kl_loss_coef=0.2)}
        return core.reduce_loss(terms, stats, mask, mode, norms)

    whole = jax.value_and_grad(lambda lp: objective(lp, old, adv, ent, mask, None), has_aux=True)
    (want_loss, want_stats), want_grad = whole(lp)

    @jax.jit
    def accumulated(lp):
        norms = core.loss_normalizers(mask)

        def body(carry, mb):
            fn = lambda lp_mb: objective(lp_mb, *mb[1:], norms)
            out, grad = jax.value_and_grad(fn, has_aux=True)(mb[0])
            return jax.tree.map(jnp.add, carry, out), grad

        split = [x.reshape(b // micro, micro, t) for x in (lp, old, adv, ent, mask)]
        init = jax.tree.map(jnp.zeros_like, (want_loss, want_stats))
        out, grads = jax.lax.scan(body, init, split)
        return out, grads.reshape(b, t)

    (loss, stats), grad = accumulated(lp)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    chex.assert_trees_all_close(stats, want_stats, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-6, atol=1e-8)
    parts = want_stats["pg_loss"] + want_stats["entropy_loss"] + want_stats["kl_loss"]
    np.testing.assert_allclose(parts, want_loss, rtol=1e-6)  # the terms add up to the loss


def test_stats_are_token_means_whatever_the_loss_mode():
    # clipfrac stays a fraction of tokens under seq-mean-token-sum: 2 of 3 valid tokens clipped.
    batch = core.LossInputs(mask=M, logprobs=jnp.array([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]),
                            old_logprobs=jnp.zeros((2, 3)), advantages=jnp.ones((2, 3)))
    per_token, stats = core.ppo_clip_loss(batch, cliprange=0.2)
    for mode in core.LOSS_AGGREGATIONS:
        _, out = core.reduce_loss({"pg_loss": per_token}, stats, M, mode)
        np.testing.assert_allclose(out["clipfrac"], 2 / 3, rtol=1e-6)
    np.testing.assert_allclose(per_token, [[-1.2, -1.2, 0.0], [-1.0, 0.0, 0.0]], rtol=1e-6)


def test_scalar_forms_equal_the_token_mean_of_the_per_token_forms():
    rng = np.random.default_rng(3)
    x = [jnp.asarray(rng.normal(0, 0.5, (3, 4)), jnp.float32) for _ in range(3)]
    mask = jnp.array([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]])
    loss, stats = core.policy_loss(*x, mask, cliprange=0.2)
    per_token, pt_stats = core.ppo_clip_loss(
        core.LossInputs(mask=mask, logprobs=x[0], old_logprobs=x[1], advantages=x[2]), cliprange=0.2)
    assert float(loss) == float(core.aggregate(per_token, mask))
    assert float(stats["ratio"]) == float(core.aggregate(pt_stats["ratio"], mask))
    vloss, _ = core.value_loss(*x, mask, cliprange_value=0.2)
    v_pt, _ = core.clipped_value_loss(
        core.LossInputs(mask=mask, values=x[0], old_values=x[1], returns=x[2]), cliprange_value=0.2)
    assert float(vloss) == float(core.aggregate(v_pt, mask))
    with pytest.raises(ValueError, match="advantages is missing from the loss batch"):
        core.ppo_clip_loss(core.LossInputs(mask=mask, logprobs=x[0], old_logprobs=x[1]), cliprange=0.2)


def test_a_pinned_horizon_makes_seq_mean_token_sum_independent_of_all_pad_columns():
    """``loss_normalizers(mask, max_response_length=T)``: the loss of a mask cut to its used columns equals
    the full-width loss (Dr. GRPO's constant is the maximum length, not the array's width)."""
    rng = np.random.default_rng(1)
    full = jnp.asarray(np.arange(8)[None] < np.array([[3], [1], [0], [2]]))  # used columns: 3
    x = jnp.asarray(rng.normal(0, 1, (4, 8)), jnp.float32)
    want = core.aggregate(x, full, "seq-mean-token-sum")
    for width in (3, 5):
        norms = core.loss_normalizers(full[:, :width], max_response_length=8)
        assert float(norms.max_response_length) == 8.0 and float(norms.tokens) == 6.0
        got = core.aggregate(x[:, :width], full[:, :width], "seq-mean-token-sum", norms)
        np.testing.assert_allclose(got, want, rtol=1e-6)
    unpinned = core.aggregate(x[:, :3], full[:, :3], "seq-mean-token-sum")
    np.testing.assert_allclose(unpinned, want * 8 / 3, rtol=1e-6)  # the width-dependent form
    with pytest.raises(ValueError, match="max_response_length=0"):
        core.loss_normalizers(full, max_response_length=0)
