"""ModelConfig parsing of HF configs (old and new RoPE keys, sliding windows) and param paths."""

from __future__ import annotations

import jax
import pytest

from ppo_jax.models import ModelConfig, flat_params, init_model, param_paths, split_model

BASE = dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
LLAMA3 = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=8192)


def test_rope_read_from_rope_parameters_and_from_legacy_keys():
    new = ModelConfig.from_hf({**BASE, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **LLAMA3}})
    old = ModelConfig.from_hf({**BASE, "rope_theta": 5e5, "rope_scaling": {"type": "llama3", **LLAMA3}})
    assert new == old
    assert (new.rope_type, new.rope_theta, new.rope_factor) == ("llama3", 5e5, 8.0)
    plain = ModelConfig.from_hf({**BASE, "rope_theta": 1e4})
    assert (plain.rope_type, plain.rope_theta, plain.head_dim) == ("default", 1e4, 16)


def test_unsupported_rope_type_and_model_type_are_named():
    with pytest.raises(ValueError, match="rope_type 'yarn'"):
        ModelConfig.from_hf({**BASE, "rope_parameters": {"rope_type": "yarn", "factor": 2.0}})
    with pytest.raises(ValueError, match="model_type 't5'"):
        ModelConfig.from_hf({**BASE, "model_type": "t5"})
    with pytest.raises(ValueError, match="hidden_act 'foo'"):
        ModelConfig.from_hf({**BASE, "hidden_act": "foo"})


def test_every_accepted_activation_is_implemented():
    from ppo_jax.models.config import ACTIVATION_NAMES
    from ppo_jax.models.layers import ACTIVATIONS

    assert set(ACTIVATION_NAMES) == set(ACTIVATIONS)


def test_sliding_windows_per_layer():
    mistral = ModelConfig.from_hf({**BASE, "model_type": "mistral", "sliding_window": 4096})
    assert mistral.sliding_windows == (4096, 4096)
    assert ModelConfig.from_hf({**BASE, "model_type": "mistral", "sliding_window": None}).sliding_windows == ()
    qwen_off = ModelConfig.from_hf({**BASE, "model_type": "qwen2", "sliding_window": 4096})
    assert qwen_off.sliding_windows == () and qwen_off.qkv_bias and not qwen_off.o_bias
    qwen_on = ModelConfig.from_hf({**BASE, "model_type": "qwen2", "use_sliding_window": True,
                                   "sliding_window": 64, "max_window_layers": 1})
    assert qwen_on.sliding_windows == (0, 64)


def test_config_is_hashable_and_validated():
    cfg = ModelConfig.from_hf(BASE, param_dtype="bfloat16", remat="full")
    assert hash(cfg) == hash(cfg.replace())
    with pytest.raises(ValueError, match="param_dtype"):
        cfg.replace(param_dtype="int8")


def test_param_paths_are_readable_slash_strings():
    cfg = ModelConfig.from_hf({**BASE, "tie_word_embeddings": False})
    _, params = split_model(init_model(cfg))
    flat = flat_params(params)
    assert flat["backbone/layers/attn/q_proj/kernel"].shape == (2, 64, 64)
    assert flat["backbone/layers/attn/k_proj/kernel"].shape == (2, 64, 32)
    assert flat["backbone/layers/mlp/down_proj/kernel"].shape == (2, 128, 64)
    assert flat["backbone/embed_tokens/embedding"].shape == (256, 64)
    assert flat["unembed/kernel"].shape == (64, 256)
    paths = param_paths(params)
    assert sorted(jax.tree_util.tree_leaves(paths)) == sorted(flat)
