"""Gemma 3 text (`model_type: gemma3_text`) against transformers 5's Gemma3ForCausalLM: the
config in both HF forms and back, float32 logits to 1e-5, greedy tokens of `generate`, the
save / load round trips, the paged engine, LoRA, remat, bfloat16 and a 32k-vocabulary head.

The tiny model has local and global layers (window 4 < the 12-token batch), two RoPE bases
(linear scaling on the global one), `query_pre_attn_scalar` != head_dim != hidden / heads, and
norm weights around 0 (Gemma's `(1 + w)`: around 1 in effect)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P

from ppo_jax.models import (
    causal_lm_logits, load_model, load_model_config, save_pretrained, split_model,
)
from ppo_jax.models.config import ModelConfig, to_hf_dict
from ppo_jax.models.heads import init_model
from ppo_jax.models.hf_names import architecture, hf_tensor
from ppo_jax.models.lora import LoraSettings
from ppo_jax.parallel.rules import param_spec
from ppo_jax.rollout.forward import policy_logprobs
from ppo_jax.rollout.static_batch import generate

from greedy_parity import assert_paged_equals_static
from hf_tiny import hf_logits, padded_batch, torch, transformers

LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
ROPE = {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 50.0}}
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def hf_config(**overrides):
    kw = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=32,
              query_pre_attn_scalar=24, sliding_window=4, layer_types=LAYER_TYPES,
              rope_parameters=ROPE, max_position_embeddings=128, bos_token_id=2,
              eos_token_id=1, pad_token_id=0)
    return transformers.Gemma3TextConfig(**{**kw, **overrides})


def build(hf_cfg, seed=0):
    """A Gemma3ForCausalLM, weights ~ N(0, 0.08), norm weights w ~ N(0, 0.1)."""
    torch.manual_seed(seed)
    model = transformers.Gemma3ForCausalLM(hf_cfg).to(torch.float32)
    model.config._attn_implementation = "eager"
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((0.1 if "norm" in name else 0.08) * torch.randn(p.shape, generator=g))
    return model.eval()


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """(dir, torch model, graphdef, params, cfg) of the tiny checkpoint."""
    torch_model = build(hf_config())
    d = tmp_path_factory.mktemp("gemma3")
    torch_model.save_pretrained(d)
    model, cfg = load_model(d)
    return (d, torch_model, *split_model(model), cfg)


def logits(graphdef, params, ids, mask):
    return np.asarray(jax.jit(causal_lm_logits, static_argnums=0)(graphdef, params, ids, mask))


def test_config_reads_both_hf_forms_and_writes_back_what_transformers_reads():
    new = ModelConfig.from_hf(hf_config().to_dict())
    assert (new.model_type, new.head_dim, new.query_pre_attn_scalar) == ("gemma3_text", 32, 24.0)
    assert new.sliding_windows == (4, 0, 4, 4) and new.qk_norm and new.tie_word_embeddings
    assert (new.rope_type, new.rope_factor, new.rope_theta, new.rope_local_theta) == (
        "linear", 4.0, 1000.0, 50.0)
    assert new.hidden_act == "gelu_pytorch_tanh" and new.attn_scale == 24.0 ** -0.5
    # a transformers-4 config.json (Gemma-3-4B's keys): legacy RoPE keys, a layer pattern
    legacy = {**hf_config().to_dict(), "rope_theta": 1000.0, "rope_local_base_freq": 50.0,
              "rope_scaling": {"rope_type": "linear", "factor": 4.0}, "sliding_window_pattern": 2}
    for key in ("rope_parameters", "layer_types", "_sliding_window_pattern"):
        legacy.pop(key)
    old = ModelConfig.from_hf(legacy)
    assert old == new.replace(sliding_windows=(4, 0, 4, 0))
    # transformers reads the legacy keys the same way
    hf = transformers.Gemma3TextConfig(**{k: v for k, v in legacy.items() if k != "model_type"})
    assert ModelConfig.from_hf(hf.to_dict()) == old
    out = to_hf_dict(new, architecture(new, "causal_lm"), "float32")
    assert out["architectures"] == ["Gemma3ForCausalLM"]
    assert ModelConfig.from_hf(out) == new
    assert ModelConfig.from_hf(transformers.Gemma3TextConfig(
        **{k: v for k, v in out.items() if k != "model_type"}).to_dict()) == new
    assert architecture(new, "reward") == "Gemma3TextForSequenceClassification"


@pytest.mark.parametrize("edit, match", [
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0: Gemma 3 has no"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"sliding_window": None}, "sliding_window=None"),
    ({"layer_types": ["full_attention"] * 3}, "layer_types="),
    ({"rope_parameters": {**ROPE, "full_attention": {"rope_type": "yarn", "factor": 2.0}}},
     "rope_type='yarn'"),
])
def test_what_gemma3_lacks_or_gemma2_has_is_refused_by_name(edit, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf({**hf_config().to_dict(), **edit})


def test_logits_match_transformers_in_float32_with_left_padding(gemma):
    _, torch_model, graphdef, params, _ = gemma
    ids, mask = padded_batch(seed=1, length=12, pads=(0, 2, 5, 7))
    ours, ref = logits(graphdef, params, ids, mask), hf_logits(torch_model, ids, mask)
    real = mask.astype(bool)
    assert np.abs(ref[real]).max() > 1.0  # non-trivial logits
    np.testing.assert_allclose(ours[real], ref[real], atol=1e-5, rtol=0)


def test_greedy_tokens_equal_transformers_generate(gemma):
    _, torch_model, graphdef, params, _ = gemma
    ids, mask = padded_batch(seed=2, length=7, pads=(0, 2, 4))
    ours, _ = generate(graphdef, params, ids, mask, jax.random.PRNGKey(0), max_new_tokens=16,
                       greedy=True, pad_token_id=0)
    with torch.no_grad():
        want = torch_model.generate(torch.tensor(ids).long(), attention_mask=torch.tensor(mask),
                                    max_new_tokens=16, do_sample=False, eos_token_id=None,
                                    pad_token_id=0)
    np.testing.assert_array_equal(np.asarray(ours), want[:, ids.shape[1]:].numpy())
    assert len(set(np.asarray(ours).ravel())) > 3  # not a constant output


def test_checkpoints_round_trip_between_ppo_jax_and_transformers(gemma, tmp_path):
    d, _, graphdef, params, cfg = gemma
    save_pretrained(nnx.merge(graphdef, params), cfg, tmp_path / "lm")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "lm",
                                                           attn_implementation="eager").eval()
    assert type(hf).__name__ == "Gemma3ForCausalLM"
    ids, mask = padded_batch(seed=4, length=12)
    real = mask.astype(bool)
    np.testing.assert_allclose(hf_logits(hf, ids, mask)[real],
                               logits(graphdef, params, ids, mask)[real], atol=1e-5, rtol=0)
    assert load_model_config(tmp_path / "lm") == cfg
    # a reward model: transformers' sequence-classification class reads the same score
    reward, _ = load_model(d, "reward", fresh_score_head=True, head_init_std=0.5)
    save_pretrained(reward, cfg, tmp_path / "rm")
    hf_rm = transformers.AutoModelForSequenceClassification.from_pretrained(
        tmp_path / "rm", attn_implementation="eager").eval()
    assert type(hf_rm).__name__ == "Gemma3TextForSequenceClassification"
    with torch.no_grad():
        want = hf_rm(input_ids=torch.tensor(ids).long(), attention_mask=torch.tensor(mask)).logits
    np.testing.assert_allclose(np.asarray(reward(jnp.asarray(ids), jnp.asarray(mask))[0]),
                               want[:, 0].numpy(), atol=1e-5)


def test_paged_engine_greedy_tokens_equal_the_static_sampler(gemma):
    _, _, graphdef, params, cfg = gemma
    ids, mask = padded_batch(seed=3, length=8, pads=(0, 3, 1, 5, 0, 2))
    assert_paged_equals_static(graphdef, params, cfg, ids, mask, max_new_tokens=16, page_size=4)


def test_a_fresh_lora_adapter_gives_the_base_logits_exactly(gemma):
    d, _, graphdef, params, _ = gemma
    ids, mask = padded_batch(seed=5, length=12)
    lora, lora_cfg = load_model(d, lora=LoraSettings(4, 8.0, ALL))
    lora_params = nnx.to_pure_dict(split_model(lora)[1])
    assert lora_params["backbone"]["layers"]["attn"]["q_proj"]["lora_a"].shape == (4, 64, 4)
    np.testing.assert_array_equal(logits(*split_model(lora), ids, mask),
                                  logits(graphdef, params, ids, mask))


@pytest.mark.slow  # two gradient compiles (~10 s on 2 cores)
def test_remat_leaves_the_gradients_unchanged(gemma):
    d, _, graphdef, params, _ = gemma
    ids, mask = padded_batch(seed=5, length=12)

    def grads(g, p):
        def nll(p):
            logp = jax.nn.log_softmax(causal_lm_logits(g, p, ids, mask)[:, :-1])
            tok = jnp.take_along_axis(logp, jnp.asarray(ids)[:, 1:, None], -1)[..., 0]
            return -(tok * mask[:, 1:]).sum() / mask[:, 1:].sum()
        return jax.jit(jax.grad(nll))(p)

    remat_graphdef, remat_params = split_model(load_model(d, remat="full")[0])
    g0 = jax.tree.leaves(grads(graphdef, params))
    assert max(float(jnp.abs(x).max()) for x in g0) > 1e-2
    for a, b in zip(g0, jax.tree.leaves(grads(remat_graphdef, remat_params))):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-6, rtol=0)


def test_bfloat16_forward_is_finite_and_as_close_as_transformers_own(gemma):
    d, torch_model, graphdef, params, _ = gemma
    ids, mask = padded_batch(seed=6, length=12)
    real = mask.astype(bool)
    ref = logits(graphdef, params, ids, mask)[real]
    model, _ = load_model(d, param_dtype="bfloat16", dtype="bfloat16")
    ours = logits(*split_model(model), ids, mask)[real]
    hf16 = build(hf_config()).to(torch.bfloat16)
    hf16.load_state_dict(torch_model.state_dict())
    theirs = hf_logits(hf16, ids, mask)[real]
    assert np.isfinite(ours).all()
    # bfloat16 rounding of both models against the float32 logits
    assert np.abs(ours - ref).max() <= 2 * np.abs(theirs - ref).max() + 1e-2


def test_norms_are_named_as_hf_and_replicated():
    cfg = ModelConfig.from_hf(hf_config().to_dict())
    _, params = split_model(init_model(cfg, seed=0))
    layers = nnx.to_pure_dict(params)["backbone"]["layers"]
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), ("data", "fsdp", "tensor"))
    for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm"):
        assert layers[name]["scale"].shape == (4, 64) and not layers[name]["scale"].any()
        path = f"backbone/layers/{name}/scale"
        assert hf_tensor(cfg, path).names(4)[3] == f"model.layers.3.{name}.weight"
        assert param_spec(path, (4, 64), mesh) == P()
    assert hf_tensor(cfg, "backbone/layers/attn/q_norm/scale").names(4)[0] == (
        "model.layers.0.self_attn.q_norm.weight")
    assert param_spec("backbone/layers/attn/k_norm/scale", (4, 32), mesh) == P()


def test_a_32k_vocabulary_gives_the_same_logprobs_chunked_as_whole():
    cfg = ModelConfig.from_hf(hf_config(vocab_size=32_768).to_dict())
    graphdef, params = split_model(init_model(cfg, seed=1))
    ids, mask = padded_batch(seed=7, length=6, vocab=32_768)
    resp = np.random.default_rng(8).integers(3, 32_768, (3, 5)).astype(np.int32)
    args = (graphdef, params, ids, mask, resp, np.ones_like(resp))
    run = jax.jit(policy_logprobs, static_argnums=0,
                  static_argnames=("with_entropy", "logprob_chunk_size"))
    whole = run(*args, with_entropy=True, logprob_chunk_size=0)
    for chunk in (4096, 32_768):  # blocks of the vocabulary, or all of it in one
        got = run(*args, with_entropy=True, logprob_chunk_size=chunk)
        for a, b in zip(got, whole):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=1e-6)
    assert np.all(np.asarray(whole[0]) < -5)  # ~ log(1 / 32768) under a near-uniform head
