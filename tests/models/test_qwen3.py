"""Qwen3 dense (`model_type: qwen3`): its config read from and written back to HF, the q/k norm
params (names, partition), and greedy tokens of the paged engine equal to the static sampler.
Logits parity with transformers and the save round trip run in test_parity.py / test_hf_io.py
on the `qwen3_tied` / `qwen3_untied` checkpoints of hf_tiny.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ppo_jax.models import split_model
from ppo_jax.models.config import ModelConfig, to_hf_dict
from ppo_jax.models.heads import init_model
from ppo_jax.models.hf_names import architecture, hf_tensor
from ppo_jax.models.tiny_random import tiny_config
from ppo_jax.parallel.rules import param_spec

from greedy_parity import assert_paged_equals_static
from hf_tiny import HF_CONFIGS, padded_batch

VOCAB = 96


def test_qwen3_config_reads_qk_norm_head_dim_and_no_bias_and_writes_them_back():
    cfg = ModelConfig.from_hf(HF_CONFIGS["qwen3_tied"]())
    assert cfg.model_type == "qwen3" and cfg.qk_norm and cfg.head_dim == 24
    assert not (cfg.qkv_bias or cfg.o_bias or cfg.mlp_bias) and cfg.tie_word_embeddings
    assert not ModelConfig.from_hf(HF_CONFIGS["qwen3_untied"]()).tie_word_embeddings
    # Qwen3Config's head_dim default is 128, not hidden // heads
    d = {k: v for k, v in HF_CONFIGS["qwen3_tied"]().to_dict().items() if k != "head_dim"}
    assert ModelConfig.from_hf(d).head_dim == 128
    assert ModelConfig.from_hf({**d, "attention_bias": True}).qkv_bias
    out = to_hf_dict(cfg, architecture(cfg, "causal_lm"), "float32")
    assert out["architectures"] == ["Qwen3ForCausalLM"] and out["head_dim"] == 24
    assert out["attention_bias"] is False
    assert ModelConfig.from_hf(out) == cfg
    assert not ModelConfig.from_hf({**d, "model_type": "qwen2"}).qk_norm


def test_qk_norm_params_are_named_as_hf_and_replicated():
    cfg = tiny_config(VOCAB, model_type="qwen3", qk_norm=True, head_dim=24)
    _, params = split_model(init_model(cfg, seed=0))
    attn = nnx.to_pure_dict(params)["backbone"]["layers"]["attn"]
    assert attn["q_norm"]["scale"].shape == attn["k_norm"]["scale"].shape == (2, 24)
    t = hf_tensor(cfg, "backbone/layers/attn/k_norm/scale")
    assert t.names(2) == ["model.layers.0.self_attn.k_norm.weight",
                          "model.layers.1.self_attn.k_norm.weight"] and not t.transpose
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1),
                             ("data", "fsdp", "tensor"))
    assert param_spec("backbone/layers/attn/q_norm/scale", (2, 24), mesh) == jax.sharding.PartitionSpec()


def test_paged_engine_greedy_tokens_equal_the_static_sampler_on_qwen3():
    cfg = tiny_config(VOCAB, model_type="qwen3", qk_norm=True, head_dim=24)
    graphdef, params = split_model(init_model(cfg, seed=3))
    # norms away from 1, so a missed q/k norm in either path shows up in the tokens
    rng = np.random.default_rng(0)
    pure = nnx.to_pure_dict(params)
    for name in ("q_norm", "k_norm"):
        s = pure["backbone"]["layers"]["attn"][name]["scale"]
        pure["backbone"]["layers"]["attn"][name]["scale"] = jnp.asarray(
            1.0 + 0.5 * rng.standard_normal(s.shape), s.dtype)
    nnx.replace_by_pure_dict(params, pure)
    ids, mask = padded_batch(seed=0, length=8, pads=(0, 3, 1, 5, 0, 2), vocab=VOCAB)
    tokens = assert_paged_equals_static(graphdef, params, cfg, ids, mask, max_new_tokens=16,
                                        page_size=8)
    assert len(set(map(tuple, tokens))) > 1  # not a degenerate constant output
