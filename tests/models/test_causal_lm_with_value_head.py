"""`CausalLMWithValueHead`: the shared actor-critic is a CausalLM with a value head on the same
backbone: its logits are the CausalLM's, its head starts at zero, and it exports as the LM."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import load_file

from ppo_jax.models import CausalLMWithValueHead, load_model, save_pretrained, split_model
from ppo_jax.rollout.forward import critic_values, policy_logprobs_and_values


def test_it_loads_as_the_causal_lm_with_a_zero_value_head(tiny_checkpoint):
    lm, cfg = load_model(tiny_checkpoint, "causal_lm")
    shared, _ = load_model(tiny_checkpoint, "causal_lm_value")
    assert isinstance(shared, CausalLMWithValueHead)
    ids = jnp.asarray([[3, 4, 5, 6], [0, 7, 8, 9]], jnp.int32)
    mask = jnp.asarray([[1, 1, 1, 1], [0, 1, 1, 1]], jnp.int32)
    np.testing.assert_array_equal(shared(ids, mask)[0], lm(ids, mask)[0])
    head = nnx.to_pure_dict(nnx.state(shared, nnx.Param))["value_head"]
    assert head["kernel"].shape == (cfg.hidden_size, 1) and head["kernel"].dtype == jnp.float32
    assert not np.any(head["kernel"]) and not np.any(head["bias"])


def test_its_values_are_the_value_model_head_on_the_same_hidden_states(tiny_checkpoint):
    """One backbone pass (`policy_logprobs_and_values`) gives the values a ValueModel with the
    same backbone and head gives (`critic_values`)."""
    shared, _ = load_model(tiny_checkpoint, "causal_lm_value", head_init_std=0.05)
    critic, _ = load_model(tiny_checkpoint, "value")
    sg, sp = split_model(shared)
    cg, cp = split_model(critic)
    cp = nnx.to_pure_dict(cp)
    cp["value_head"] = nnx.to_pure_dict(sp)["value_head"]
    q = jnp.asarray([[0, 3, 4], [5, 6, 7]], jnp.int32)
    qm = jnp.asarray([[0, 1, 1], [1, 1, 1]], jnp.int32)
    r = jnp.asarray([[8, 9], [10, 1]], jnp.int32)
    rm = jnp.asarray([[1, 1], [1, 0]], jnp.int32)
    _, _, values = policy_logprobs_and_values(sg, sp, q, qm, r, rm)
    np.testing.assert_allclose(values, critic_values(cg, cp, q, qm, r, rm), atol=1e-6)
    assert float(jnp.abs(values).max()) > 0


def test_it_exports_as_the_causal_lm_alone(tiny_checkpoint, tmp_path):
    lm, cfg = load_model(tiny_checkpoint, "causal_lm")
    shared, _ = load_model(tiny_checkpoint, "causal_lm_value", head_init_std=0.05)
    a = load_file(str(save_pretrained(lm, cfg, tmp_path / "lm") / "model.safetensors"))
    b = load_file(str(save_pretrained(shared, cfg, tmp_path / "shared") / "model.safetensors"))
    assert sorted(a) == sorted(b) and not [k for k in b if k.startswith("score")]
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
