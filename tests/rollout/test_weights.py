"""The rollout copy of the actor's weights (`rollout.weights`): when a copy is made, its dtype,
and the rollout layout (the training rules without `fsdp`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ppo_jax.parallel.rules import ROLLOUT_RULES, RULES, param_spec
from ppo_jax.rollout.weights import (
    cast_floats, needs_rollout_copy, resolve_layout, rollout_copy_fn, rollout_rules,
)


class FakeMesh:
    def __init__(self, **shape):
        self.shape = shape


def test_auto_copies_for_the_paged_engine_only():
    assert resolve_layout("auto", "paged") == "tensor"
    assert resolve_layout("auto", "static") == "train"
    assert resolve_layout("train", "paged") == "train"
    with pytest.raises(ValueError, match="generation.rollout_layout='fsdp'"):
        resolve_layout("fsdp", "paged")
    with pytest.raises(ValueError, match="resolved"):
        rollout_rules("auto")


def test_a_copy_is_made_for_a_dtype_or_to_drop_fsdp():
    fsdp, data = FakeMesh(data=1, fsdp=4, tensor=2), FakeMesh(data=8, fsdp=1, tensor=1)
    assert not needs_rollout_copy(None, "tensor", None)
    assert needs_rollout_copy(None, "tensor", "bfloat16")
    assert needs_rollout_copy(fsdp, "tensor", None)
    assert not needs_rollout_copy(fsdp, "train", None)
    assert not needs_rollout_copy(data, "tensor", None)  # weights already whole on each chip
    assert rollout_copy_fn({"w": jnp.ones(3)}, None, "tensor", None) is None


def test_floats_are_cast_and_integers_kept():
    params = {"w": jnp.ones((2, 2), jnp.float32), "step": jnp.int32(3)}
    out = jax.jit(rollout_copy_fn(params, None, "tensor", "bfloat16"))(params)
    assert out["w"].dtype == jnp.bfloat16 and out["step"].dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(out["w"], np.float32), 1.0)
    assert cast_floats(params, None) is params


def test_the_rollout_rules_are_the_training_rules_without_fsdp():
    fake = FakeMesh(data=1, fsdp=4, tensor=2)
    for path in ("backbone/layers/attn/q_proj/kernel", "backbone/layers/attn/o_proj/kernel",
                 "backbone/embed_tokens/embedding", "backbone/layers/mlp/down_proj/kernel"):
        train = param_spec(path, (2, 64, 64), fake, RULES)
        rollout = param_spec(path, (2, 64, 64), fake, ROLLOUT_RULES)
        assert "fsdp" in tuple(train) and "fsdp" not in tuple(rollout)
        assert [a for a in train if a == "tensor"] == [a for a in rollout if a == "tensor"]
