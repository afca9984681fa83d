"""LoRA on the decoders (`ppo_jax.models.lora`): a fresh adapter is the base model exactly, the
layer and its gradients equal a float64 numpy reference, the merged weights equal the adapter
model, the params split / join without copies, and the adapters take their kernel's sharding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from ppo_jax.models import causal_lm_logits, load_model, split_model
from ppo_jax.models.lora import (
    LoraLinear, LoraSettings, adapter_params, base_params, fresh_adapter, is_adapter, join,
    merge_adapters, split_params,
)
from hf_tiny import padded_batch

LLAMA_ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TARGETS = {"llama_tied": LLAMA_ALL, "llama3_untied": ("q_proj", "v_proj", "down_proj"),
           "qwen2": LLAMA_ALL, "qwen3_untied": LLAMA_ALL, "gpt2": ("c_attn", "c_proj", "c_fc")}


def lora_model(d, targets, rank=4, alpha=8.0, seed=0):
    model, cfg = load_model(d, "causal_lm", seed=seed,
                            lora=LoraSettings(rank, alpha, tuple(targets)))
    graphdef, params = split_model(model)
    return graphdef, nnx.to_pure_dict(params), cfg


def random_b(params, seed=1, scale=0.05):
    """The params with every lora_b drawn at random (a trained adapter)."""
    rng = np.random.default_rng(seed)

    def walk(tree, prefix=""):
        return {k: walk(v, f"{prefix}{k}/") if isinstance(v, dict) else
                (jnp.asarray(rng.normal(0, scale, v.shape), v.dtype) if k == "lora_b" else v)
                for k, v in tree.items()}
    return walk(params)


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_a_fresh_adapter_gives_the_base_models_logits_exactly(name, hf_checkpoints, loaded):
    d, _ = hf_checkpoints[name]
    base_graphdef, base, _, _, _ = loaded[name]
    graphdef, params, cfg = lora_model(d, TARGETS[name])
    ids, mask = padded_batch(vocab=cfg.vocab_size)
    want = np.asarray(causal_lm_logits(base_graphdef, base, ids, mask))
    got = np.asarray(causal_lm_logits(graphdef, params, ids, mask))
    np.testing.assert_array_equal(got, want)
    # the adapters are there, with the layer axis first, B zero and A not
    q = params["backbone"]["layers"]["attn"]["c_attn" if name == "gpt2" else "q_proj"]
    assert q["lora_a"].shape == (2, 64, 4) and q["lora_b"].shape[:2] == (2, 4)
    assert not np.any(np.asarray(q["lora_b"])) and np.all(np.abs(np.asarray(q["lora_a"])) > 0)
    # and with B trained they change the logits
    moved = np.asarray(causal_lm_logits(graphdef, random_b(params), ids, mask))
    assert np.abs(moved - want).max() > 1e-2


def test_the_layer_and_its_gradients_equal_a_float64_numpy_reference():
    rng = np.random.default_rng(0)
    din, dout, rank, scale = 6, 5, 3, 2.5
    layer = LoraLinear(din, dout, rank=rank, scale=scale, use_bias=True, rngs=nnx.Rngs(0))
    w, b = rng.normal(size=(din, dout)), rng.normal(size=dout)
    a, bb = rng.normal(size=(din, rank)), rng.normal(size=(rank, dout))
    x, g = rng.normal(size=(4, din)), rng.normal(size=(4, dout))
    layer.kernel[...], layer.bias[...] = jnp.asarray(w, jnp.float32), jnp.asarray(b, jnp.float32)
    graphdef, state = nnx.split(layer)

    def loss(adapters):
        st = nnx.to_pure_dict(state)
        st.update(adapters)
        return jnp.sum(nnx.merge(graphdef, st)(jnp.asarray(x, jnp.float32)) * jnp.asarray(g, jnp.float32))

    f32 = {"lora_a": jnp.asarray(a, jnp.float32), "lora_b": jnp.asarray(bb, jnp.float32)}
    value, grads = jax.value_and_grad(loss)(f32)
    y = x @ w + b + scale * (x @ a) @ bb  # float64 reference
    np.testing.assert_allclose(float(value), np.sum(y * g), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grads["lora_a"]), scale * x.T @ (g @ bb.T), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(grads["lora_b"]), scale * (x @ a).T @ g, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["llama3_untied", "gpt2"])
def test_merged_weights_give_the_adapter_models_logits(name, hf_checkpoints, loaded):
    d, _ = hf_checkpoints[name]
    base_graphdef = loaded[name][0]
    graphdef, params, cfg = lora_model(d, TARGETS[name])
    params = random_b(params)
    ids, mask = padded_batch(vocab=cfg.vocab_size)
    want = np.asarray(causal_lm_logits(graphdef, params, ids, mask))
    merged = merge_adapters(params, cfg.lora_scale)
    assert not adapter_params(merged)
    got = np.asarray(causal_lm_logits(base_graphdef, merged, ids, mask))
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)


def test_split_and_join_are_inverse_and_copy_nothing(hf_checkpoints):
    graphdef, params, cfg = lora_model(hf_checkpoints["llama_tied"][0], LLAMA_ALL)
    trained, frozen = split_params(params, is_adapter)
    assert all(k.split("/")[-1] in ("lora_a", "lora_b") for k in _paths(trained))
    assert not any(is_adapter(k) for k in _paths(frozen))
    back = join(frozen, trained)
    assert jax.tree.structure(back) == jax.tree.structure(params)
    assert all(x is y for x, y in zip(jax.tree.leaves(back), jax.tree.leaves(params)))
    assert _paths(base_params(params)) == _paths(frozen)
    assert join({}, params) == params
    with pytest.raises(ValueError, match="two of the trees"):
        join(params, trained)


def _paths(tree, prefix=""):
    out = []
    for k, v in tree.items():
        out += _paths(v, f"{prefix}{k}/") if isinstance(v, dict) else [prefix + k]
    return out


def test_fresh_adapters_follow_peft_init_and_the_seed():
    a = fresh_adapter("backbone/layers/attn/q_proj/lora_a", (2, 64, 8), np.float32, seed=3)
    assert a.shape == (2, 64, 8) and np.abs(a).max() <= 1 / 8 and np.abs(a).max() > 0.1
    assert np.array_equal(a, fresh_adapter("backbone/layers/attn/q_proj/lora_a", (2, 64, 8),
                                           np.float32, seed=3))
    other = fresh_adapter("backbone/layers/attn/k_proj/lora_a", (2, 64, 8), np.float32, seed=3)
    assert not np.array_equal(a, other)
    assert not np.any(fresh_adapter("x/lora_b", (2, 8, 64), np.float32, seed=3))
    g = fresh_adapter("x/lora_a", (4, 512, 8), np.float32, seed=0, init="gaussian")
    assert abs(g.std() - 1 / 8) < 0.01
    with pytest.raises(ValueError, match="model.lora.init"):
        fresh_adapter("x/lora_a", (2, 4, 4), np.float32, seed=0, init="pissa")


def test_bad_targets_and_ranks_are_named(hf_checkpoints):
    d = hf_checkpoints["llama_tied"][0]
    with pytest.raises(ValueError, match=r"target_modules=\['q_proj', 'c_attn'\].*c_attn"):
        load_model(d, lora=LoraSettings(4, 8.0, ("q_proj", "c_attn")))
    with pytest.raises(ValueError, match="lora_rank=-1"):
        load_model(d, lora=LoraSettings(-1, 8.0, ("q_proj",)))
    with pytest.raises(ValueError, match="lora_alpha"):
        load_model(d, lora=LoraSettings(4, 0.0, ("q_proj",)))


def test_adapters_take_the_sharding_of_their_kernel():
    from jax.sharding import AbstractMesh

    from ppo_jax.parallel.rules import param_spec

    mesh = AbstractMesh((1, 2, 4), ("data", "fsdp", "tensor"))
    spec = lambda p, s: param_spec(p, s, mesh)  # noqa: E731
    assert spec("backbone/layers/attn/q_proj/kernel", (2, 64, 64)) == P(None, "fsdp", "tensor")
    assert spec("backbone/layers/attn/q_proj/lora_a", (2, 64, 8)) == P(None, "fsdp")
    assert spec("backbone/layers/attn/q_proj/lora_b", (2, 8, 64)) == P(None, None, "tensor")
    assert spec("backbone/layers/mlp/down_proj/lora_a", (2, 128, 8)) == P(None, "tensor")
    assert spec("backbone/layers/mlp/down_proj/lora_b", (2, 8, 64)) == P(None, None, "fsdp")
    assert spec("opt_state/1/0/mu/backbone/layers/attn/o_proj/lora_a", (2, 64, 8)) == P(None, "tensor")
