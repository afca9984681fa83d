"""Learning-rate schedules: the first update of every schedule moves the params."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from ppo_jax.trainer.config import load_config
from ppo_jax.trainer.optim import (actor_optimizer, head_labels, make_optimizer, make_schedule,
                                   stop_backbone_gradient)


@pytest.mark.parametrize("schedule", ["constant", "cosine"])
def test_warmup_starts_at_peak_over_w_and_reaches_the_peak_at_update_w(schedule):
    # optim.warmup_steps=4, peak 0.4: updates 1..4 (counts 0..3) use 0.1, 0.2, 0.3, 0.4.
    lr = make_schedule(0.4, schedule=schedule, warmup_steps=4, total_steps=10)
    np.testing.assert_allclose([float(lr(c)) for c in range(4)], [0.1, 0.2, 0.3, 0.4], rtol=1e-6)
    if schedule == "constant":
        np.testing.assert_allclose([float(lr(c)) for c in (4, 9, 100)], 0.4, rtol=1e-6)
    else:  # decays after the peak, still positive at the last update (count 9), 0 after
        tail = [float(lr(c)) for c in range(3, 11)]
        assert all(a > b for a, b in zip(tail, tail[1:])) and tail[-2] > 0.0 and tail[-1] == 0.0
        want = 0.5 * 0.4 * (1 + np.cos(np.pi * (6 - 4) / (10 + 1 - 4)))  # update 6 = count 5
        np.testing.assert_allclose(float(lr(5)), want, rtol=1e-6)


def test_schedules_without_warmup_are_unchanged():
    const = make_schedule(0.4, schedule="constant", warmup_steps=0, total_steps=10)
    cosine = make_schedule(0.4, schedule="cosine", warmup_steps=0, total_steps=10)
    ref = optax.cosine_decay_schedule(0.4, 10)
    for c in range(12):
        assert float(const(c)) == pytest.approx(0.4)
        assert float(cosine(c)) == pytest.approx(float(ref(c)), abs=1e-7)
    with pytest.raises(ValueError, match="optim.schedule='linear'"):
        make_schedule(0.4, schedule="linear", warmup_steps=0, total_steps=10)


@pytest.mark.parametrize("schedule", ["constant", "cosine"])
@pytest.mark.parametrize("warmup", [0, 4])
def test_the_first_optimiser_update_moves_the_params(schedule, warmup):
    # Adam's first step is lr * g / (|g| + eps) = lr: w = 1 - lr (lr = 0.1 with warmup 4).
    tx = make_optimizer(0.4, schedule=schedule, warmup_steps=warmup, total_steps=10)
    params = {"w": jnp.ones(())}
    state = tx.init(params)
    updates, state = jax.jit(tx.update)({"w": jnp.ones(())}, state, params)
    new = optax.apply_updates(params, updates)
    np.testing.assert_allclose(new["w"], 1.0 - (0.1 if warmup else 0.4), rtol=1e-5)


def _two_part_params():
    return {"backbone": {"w": jnp.array([1.0, -2.0]), "b": jnp.array(0.5)},
            "score": {"kernel": jnp.array([[3.0], [-1.0]])}}


def test_head_labels_split_the_score_head_from_the_backbone():
    labels = head_labels(_two_part_params(), ("score",))
    assert labels == {"backbone": {"w": "backbone", "b": "backbone"}, "score": {"kernel": "head"}}


@pytest.mark.parametrize("scale", [0.0, 0.25])
def test_backbone_lr_scale_scales_only_the_backbone_updates(scale):
    # Adam's updates are linear in the learning rate: the backbone's are `scale` times those of
    # the one-rate optimiser at every step, the head's equal them (0: the backbone never moves).
    params = _two_part_params()
    one, split = (make_optimizer(0.1, schedule="cosine", warmup_steps=2, total_steps=5,
                                 max_grad_norm=1.0, backbone_lr_scale=s) for s in (1.0, scale))
    s1, s2 = one.init(params), split.init(params)
    for k in range(4):
        grads = jax.tree.map(lambda x: jnp.sin(x * (k + 1.0)) + 0.3, params)
        u1, s1 = one.update(grads, s1, params)
        u2, s2 = split.update(grads, s2, params)
        np.testing.assert_allclose(u2["score"]["kernel"], u1["score"]["kernel"], rtol=1e-6)
        for name in ("w", "b"):
            np.testing.assert_allclose(u2["backbone"][name], scale * u1["backbone"][name],
                                       rtol=1e-6, atol=1e-9)
    with pytest.raises(ValueError, match="backbone_lr_scale=-1"):
        make_optimizer(0.1, backbone_lr_scale=-1.0)


def test_stop_backbone_gradient_leaves_only_the_head_gradient():
    def loss(p):
        return jnp.sum(p["backbone"]["w"] ** 2) * p["backbone"]["b"] + jnp.sum(p["score"]["kernel"] ** 3)

    full = jax.grad(loss)(_two_part_params())
    frozen = jax.grad(lambda p: loss(stop_backbone_gradient(p)))(_two_part_params())
    np.testing.assert_allclose(frozen["score"]["kernel"], full["score"]["kernel"])
    np.testing.assert_array_equal(frozen["backbone"]["w"], 0.0)
    np.testing.assert_array_equal(frozen["backbone"]["b"], 0.0)


@pytest.mark.parametrize("head_lr", [None, 1e-3])
def test_a_shared_value_head_trains_at_its_own_rate_and_the_backbone_at_actor_lr(head_lr):
    # Adam's updates are linear in the learning rate and the clip sees every gradient: with
    # optim.value_head_lr the value head's updates are those of one AdamW at value_head_lr, the
    # backbone's those of one AdamW at actor_lr, at every step; null: one AdamW at actor_lr.
    sets = ["model.shared_critic=true", "optim.actor_lr=2e-5"]
    optim = load_config(None, sets + ([f"optim.value_head_lr={head_lr}"] if head_lr else [])).optim
    params = {"backbone": {"w": jnp.array([1.0, -2.0]), "b": jnp.array(0.5)},
              "value_head": {"kernel": jnp.array([[3.0], [-1.0]]), "bias": jnp.zeros((1,))}}
    tx = actor_optimizer(optim, 5, shared_critic=True)
    at_actor, at_head = (make_optimizer(lr, total_steps=5) for lr in (2e-5, head_lr or 2e-5))
    states = [t.init(params) for t in (tx, at_actor, at_head)]
    for k in range(3):
        grads = jax.tree.map(lambda x: jnp.cos(x * (k + 1.0)) + 0.2, params)
        (u, sa), (ua, sb), (uh, sc) = (t.update(grads, st, params) for t, st in
                                       zip((tx, at_actor, at_head), states))
        states = [sa, sb, sc]
        np.testing.assert_allclose(u["value_head"]["kernel"], uh["value_head"]["kernel"], rtol=1e-6)
        np.testing.assert_allclose(u["backbone"]["w"], ua["backbone"]["w"], rtol=1e-6)
    # the bias's gradient is 1.2 at every step (cos 0 + 0.2; the clip rescales it a little):
    # Adam moves it by the head's rate
    assert abs(float(u["value_head"]["bias"][0])) == pytest.approx(head_lr or 2e-5, rel=1e-2)
    # without a shared critic value_head_lr does not apply: one AdamW at actor_lr
    separate = actor_optimizer(optim, 5, shared_critic=False)
    u, _ = separate.update(grads, separate.init(params), params)
    ua, _ = at_actor.update(grads, at_actor.init(params), params)
    np.testing.assert_allclose(u["value_head"]["kernel"], ua["value_head"]["kernel"], rtol=1e-6)
