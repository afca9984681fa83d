"""Bad shapes, ranks, dtypes and names raise ValueError naming the argument, at trace time.

``jax.eval_shape`` only traces (no compile, no run), so an error raised under it is raised
before any compile work.
"""

import jax
import jax.numpy as jnp
import pytest

from ppo_jax import core

F = jnp.zeros((2, 4), jnp.float32)
M = jnp.ones((2, 4), jnp.int32)


def raises_at_trace(fn, *args, match):
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(fn, *args)
    with pytest.raises(ValueError, match=match):
        jax.jit(fn)(*args)


def test_mismatched_gae_shapes_name_the_argument_and_shapes():
    raises_at_trace(lambda v, r: core.compute_gae(v, r, M, gamma=1.0, lam=0.95),
                    F, jnp.zeros((2, 5)), match=r"rewards has shape \(2, 5\) but values has shape \(2, 4\)")


def test_integer_logprobs_are_rejected_with_their_dtype():
    raises_at_trace(lambda lp: core.compute_rewards(jnp.zeros(2), lp, F, M, kl_coef=0.1),
                    jnp.zeros((2, 4), jnp.int32), match=r"logprobs must be a floating-point array.*int32")


def test_wrong_rank_names_the_argument():
    raises_at_trace(lambda lg: core.logprobs_from_logits(lg, M), F,
                    match=r"logits must have rank 3.*\(2, 4\)")
    raises_at_trace(lambda s: core.compute_rewards(s, F, F, M, kl_coef=0.1), jnp.zeros((2, 1)),
                    match=r"scores must have rank 1")
    raises_at_trace(lambda v: core.value_loss(v, v, v, jnp.ones(4), cliprange_value=0.2), jnp.zeros(4),
                    match=r"values must have rank 2")


def test_bad_tokens_and_masks_name_the_argument():
    logits = jnp.zeros((2, 4, 3))
    raises_at_trace(lambda t: core.logprobs_from_logits(logits, t), F,
                    match=r"tokens must be an integer array")
    raises_at_trace(lambda t: core.logprobs_from_logits(logits, t), jnp.zeros((2, 3), jnp.int32),
                    match=r"tokens has shape \(2, 3\) but logits has shape \(2, 4, 3\)")
    raises_at_trace(lambda m: core.policy_loss(F, F, F, m, cliprange=0.2), jnp.ones((2, 3)),
                    match=r"mask must have shape \(2, 4\), got shape \(2, 3\)")
    raises_at_trace(lambda m: core.masked_mean(F, m), jnp.ones((2, 4), jnp.complex64),
                    match=r"mask must be a bool, integer or float 0/1 array.*complex64")
    raises_at_trace(lambda s: core.compute_rewards(s, F, F, M, kl_coef=0.1), jnp.zeros(3),
                    match=r"scores has shape \(3,\)")


def test_unknown_kl_estimator_names_the_value_and_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown KL estimator 'k4'; known: kl, abs, mse, low_var_kl"):
        core.kl_penalty(F, F, "k4")
    with pytest.raises(ValueError, match=r"unknown KL estimator 'k4'"):
        core.compute_rewards(jnp.zeros(2), F, F, M, kl_coef=0.1, estimator="k4")
    with pytest.raises(ValueError, match=r"'full' needs full logits.*full_kl"):
        core.compute_rewards(jnp.zeros(2), F, F, M, kl_coef=0.1, estimator="full")


def test_bad_hyper_parameters_are_rejected():
    with pytest.raises(ValueError, match=r"dual_clip must be > 1.0, got 1.0"):
        core.policy_loss(F, F, F, M, cliprange=0.2, dual_clip=1.0)
    with pytest.raises(ValueError, match=r"cliprange must be >= 0"):
        core.policy_loss(F, F, F, M, cliprange=-0.1)
    with pytest.raises(ValueError, match=r"temperature must be > 0"):
        core.entropy_from_logits(jnp.zeros((1, 1, 3)), 0.0)
    with pytest.raises(ValueError, match=r"kl_coef must be a scalar, got shape \(2,\)"):
        core.compute_rewards(jnp.zeros(2), F, F, M, kl_coef=jnp.ones(2))
    with pytest.raises(ValueError, match=r"unknown GAE method 'fast'; known: chunked, scan, associative"):
        core.compute_gae(F, F, M, gamma=1.0, lam=1.0, method="fast")
    with pytest.raises(ValueError, match=r"unroll must be an int >= 1, got 0"):
        core.compute_gae(F, F, M, gamma=1.0, lam=1.0, method="scan", unroll=0)
    with pytest.raises(ValueError, match=r"unknown KL controller kind 'pid'; known: fixed, adaptive"):
        core.init_kl_controller("pid", 0.1)
    with pytest.raises(ValueError, match=r"adaptive KL controller needs horizon"):
        core.init_kl_controller("adaptive", 0.1, target=6.0)
    with pytest.raises(ValueError, match=r"target must be > 0"):
        core.init_kl_controller("adaptive", 0.1, target=0.0, horizon=10.0)
