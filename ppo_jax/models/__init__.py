"""Flax NNX language models (Llama family, Gemma 3, GPT-2), heads, KV cache and HF/GGUF
checkpoint I/O.

See docs/contracts.md and docs/models_ready.md for the API. torch is never imported here
(the GGUF conversion included; only the tests use it).
"""

from ppo_jax.models.config import ModelConfig
from ppo_jax.models.functional import (
    Model, causal_lm_forward, causal_lm_hidden, causal_lm_logits, count_params, flat_params,
    lm_head_logits, param_paths, reward_scores, split_model, values,
)
from ppo_jax.models.heads import (
    CausalLM, CausalLMWithValueHead, RewardModel, ValueModel, init_model, make_backbone,
)
from ppo_jax.models.hf_io import (
    CheckpointError, abstract_model, load_model_config, load_model, load_tokenizer, save_pretrained,
)
from ppo_jax.models.kv_cache import KVCache, init_cache, positions_from_mask

__all__ = [
    "ModelConfig", "CausalLM", "CausalLMWithValueHead", "ValueModel", "RewardModel", "init_model", "make_backbone",
    "KVCache", "init_cache", "positions_from_mask",
    "load_model_config", "load_model", "abstract_model", "load_tokenizer", "save_pretrained",
    "CheckpointError",
    "Model", "split_model", "causal_lm_forward", "causal_lm_logits", "causal_lm_hidden",
    "lm_head_logits", "values", "reward_scores", "param_paths", "flat_params", "count_params",
]
