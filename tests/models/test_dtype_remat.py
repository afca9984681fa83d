"""dtype policy (bf16 params / compute, float32 outputs) and per-layer remat equivalence."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ppo_jax.models import causal_lm_logits, load_model, split_model
from hf_tiny import padded_batch


def test_bfloat16_params_load_and_run_with_float32_logits(hf_checkpoints, loaded):
    d = hf_checkpoints["llama3_untied"][0]
    model, cfg = load_model(d, param_dtype="bfloat16", dtype="bfloat16")
    graphdef, params = split_model(model)
    assert {x.dtype for x in jax.tree_util.tree_leaves(params)} == {jnp.dtype(jnp.bfloat16)}
    ids, mask = padded_batch(seed=6)
    logits = jax.jit(lambda p, i, m: causal_lm_logits(graphdef, p, i, m))(params, ids, mask)
    assert logits.dtype == jnp.float32 and bool(jnp.isfinite(logits).all())
    _, p32, _, fn32, _ = loaded["llama3_untied"]
    ref = np.asarray(fn32(p32, ids, mask))
    real = mask.astype(bool)
    err = np.abs(np.asarray(logits) - ref)[real]
    assert err.max() < 0.05 * np.abs(ref[real]).max()  # bf16 rounding, not a wiring error


def test_bfloat16_params_with_float32_compute(hf_checkpoints):
    model, _ = load_model(hf_checkpoints["gpt2"][0], param_dtype="bfloat16", dtype="float32")
    ids, mask = padded_batch(seed=6)
    graphdef, params = split_model(model)
    hidden = jax.jit(lambda p: nnx.merge(graphdef, p).backbone(ids, mask)[0])(params)
    assert model.backbone.wte.embedding[...].dtype == jnp.bfloat16 and hidden.dtype == jnp.float32


def _loss_and_grads(d, remat):
    model, cfg = load_model(d, remat=remat)
    graphdef, params = split_model(model)
    ids, mask = padded_batch(seed=8)

    def loss(p):
        logp = jax.nn.log_softmax(causal_lm_logits(graphdef, p, ids, mask)[:, :-1])
        tok = jnp.take_along_axis(logp, jnp.asarray(ids)[:, 1:, None], -1)[..., 0]
        m = jnp.asarray(mask[:, 1:], jnp.float32)
        return -(tok * m).sum() / m.sum()

    return jax.jit(jax.value_and_grad(loss))(params)


@pytest.fixture(scope="module")
def no_remat(hf_checkpoints):
    return _loss_and_grads(hf_checkpoints["llama_tied"][0], "none")


@pytest.mark.parametrize("remat", ["full", "dots_saveable"])
def test_remat_gives_identical_loss_and_grads(hf_checkpoints, no_remat, remat):
    loss0, g0 = no_remat
    loss1, g1 = _loss_and_grads(hf_checkpoints["llama_tied"][0], remat)
    np.testing.assert_allclose(float(loss1), float(loss0), rtol=0, atol=1e-6)
    for a, b in zip(jax.tree_util.tree_leaves(g0), jax.tree_util.tree_leaves(g1)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=0, atol=1e-6)
    assert max(float(jnp.abs(x).max()) for x in jax.tree_util.tree_leaves(g0)) > 1e-3


def test_unknown_remat_policy_is_rejected(hf_checkpoints):
    with pytest.raises(ValueError, match="remat='sometimes'"):
        load_model(hf_checkpoints["llama_tied"][0], remat="sometimes")
