"""`trainer.state`: the trainable filter, the one join of trained and frozen params, gradients of
the trained leaves only, and the SFT / reward-model update step importable as a module-level
function (a LoRA model's step equal to the same step written out by hand)."""

import ast
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from ppo_jax.trainer.loading.lora import is_trained
from ppo_jax.trainer.stages.supervised import supervised_update
from ppo_jax.trainer.state import TrainState, full_params, loss_of_trained, split_trainable

PACKAGE = Path(__file__).resolve().parents[2] / "ppo_jax"


def _params():
    return {"backbone": {"layer": {"kernel": jnp.arange(6.0).reshape(2, 3),
                                   "lora_a": jnp.ones((2, 1)), "lora_b": jnp.zeros((1, 3))}},
            "value_head": {"kernel": jnp.full((3, 1), 0.5)}}


def test_the_filter_splits_adapters_and_heads_from_the_base_and_the_join_undoes_it():
    trained, frozen = split_trainable(_params(), is_trained)
    assert sorted(trained["backbone"]["layer"]) == ["lora_a", "lora_b"]
    assert "value_head" in trained and "value_head" not in frozen
    assert list(frozen["backbone"]["layer"]) == ["kernel"]
    whole = full_params(frozen, trained)
    assert jax.tree.structure(whole) == jax.tree.structure(_params())
    assert all(a is b for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(
        full_params(frozen, trained))))
    assert full_params(None, trained) == trained
    with pytest.raises(ValueError, match="'lora_a' is in two"):
        full_params(trained, trained)


def test_loss_of_trained_differentiates_the_trained_leaves_only():
    trained, frozen = split_trainable(_params(), is_trained)

    def loss(params, x):  # y = x @ (W + A B) @ v
        layer = params["backbone"]["layer"]
        w = layer["kernel"] + layer["lora_a"] @ layer["lora_b"]
        return jnp.sum(x @ w @ params["value_head"]["kernel"])

    x = jnp.array([[1.0, 2.0]])
    grads = jax.grad(loss_of_trained(loss, frozen))(trained, x)
    assert jax.tree.structure(grads) == jax.tree.structure(trained)
    # by hand: d/dB = A^T x^T v^T; d/dA = x^T v^T B^T = 0 (B = 0); d/dv = (x W)^T
    w = np.arange(6.0).reshape(2, 3)
    np.testing.assert_allclose(grads["backbone"]["layer"]["lora_b"],
                               np.ones((1, 2)) @ np.array([[1.0], [2.0]]) @ np.full((1, 3), 0.5))
    np.testing.assert_allclose(grads["backbone"]["layer"]["lora_a"], np.zeros((2, 1)))
    np.testing.assert_allclose(grads["value_head"]["kernel"], (np.array([[1.0, 2.0]]) @ w).T)


def test_the_supervised_step_is_a_module_level_function_of_explicit_values():
    trained, frozen = split_trainable(_params(), is_trained)
    tx = optax.sgd(0.1)
    state = TrainState.create(trained, tx)
    batch = {"x": jnp.array([[1.0, 2.0], [0.0, 1.0]]), "weight": jnp.ones(2)}

    def loss(graphdef, params, micro, n):
        layer = params["backbone"]["layer"]
        w = layer["kernel"] + layer["lora_a"] @ layer["lora_b"]
        value = jnp.sum(micro["x"] @ w @ params["value_head"]["kernel"])
        return value / n, {"loss": value / n}

    step = jax.jit(partial(supervised_update, graphdef=None, tx=tx, loss=loss,
                           denominator=lambda b: jnp.sum(b["weight"]), micro_batch_size=1,
                           mesh=None, backbone_frozen=False))
    new, stats = step(state, frozen, batch)
    g = jax.grad(lambda t: loss(None, full_params(frozen, t), batch, 2.0)[0])(trained)
    want = jax.tree.map(lambda p, d: p - 0.1 * d, trained, g)
    for a, b in zip(jax.tree.leaves(new.params), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    assert int(new.step) == 1
    np.testing.assert_allclose(stats["grad_norm"], optax.global_norm(g), rtol=1e-6)


def test_only_the_train_state_module_joins_or_splits_params():
    """Trained and frozen params are split and joined in one place (`trainer.state`): no other
    module of the package imports `join` or `split_params` from `models.lora`."""
    users = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "ppo_jax.models.lora":
                names = {a.name for a in node.names} & {"join", "split_params"}
                if names:
                    users.append(str(path.relative_to(PACKAGE.parent)))
    assert users == ["ppo_jax/trainer/state.py"]
