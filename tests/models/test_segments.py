"""Packed rows: an attention mask of segment ids (1, 1, 2, 2, 2, 0, ...) runs each segment as
if it were its own row. Every family's logits over a packed row equal, per segment, the
logits of that sequence alone, to float32 rounding: attention stays within a segment, RoPE
(or GPT-2's learned) positions restart at each segment, Gemma 3's sliding windows count
within it, and an MoE layer's load-balancing statistics count each real token once."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ppo_jax.models import positions_from_mask, split_model
from ppo_jax.models.config import ModelConfig
from ppo_jax.models.functional import causal_lm_logits
from ppo_jax.models.heads import init_model

from hf_tiny import HF_CONFIGS, transformers

LENGTHS = ((5, 7, 3), (9, 4))  # two packed rows of 16: three segments + 1 pad, two + 3 pads
WIDTH = 16


def gemma3():
    return transformers.Gemma3TextConfig(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24,
        sliding_window=3, layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=128, bos_token_id=2, eos_token_id=1, pad_token_id=0)


def packed(lengths_by_row, seed=0):
    """`(ids [R, W], segment ids [R, W], [(row, start, ids of the sequence)])`."""
    rng = np.random.default_rng(seed)
    ids = np.zeros((len(lengths_by_row), WIDTH), np.int32)
    seg = np.zeros_like(ids)
    seqs = []
    for r, lengths in enumerate(lengths_by_row):
        start = 0
        for k, n in enumerate(lengths):
            tokens = rng.integers(3, 96, n).astype(np.int32)
            ids[r, start:start + n], seg[r, start:start + n] = tokens, k + 1
            seqs.append((r, start, tokens))
            start += n
    return ids, seg, seqs


def test_positions_restart_at_each_segment_and_a_0_1_mask_is_unchanged():
    seg = jnp.array([[1, 1, 1, 2, 2, 3, 0, 0], [0, 0, 1, 1, 1, 1, 0, 0]])
    np.testing.assert_array_equal(positions_from_mask(seg),
                                  [[0, 1, 2, 0, 1, 0, 0, 0], [0, 0, 0, 1, 2, 3, 3, 3]])


@pytest.mark.parametrize("name", [  # Llama and Gemma 3 (windows, local RoPE) in the default run
    "llama_tied", "gemma3", *(pytest.param(n, marks=pytest.mark.slow) for n in
                              ("qwen3_tied", "qwen3_moe", "mistral_window", "gpt2"))])
def test_each_segment_of_a_packed_row_equals_its_sequence_alone(name):
    hf = gemma3() if name == "gemma3" else HF_CONFIGS[name]()
    cfg = ModelConfig.from_hf(hf, dtype="float32")
    graphdef, params = split_model(init_model(cfg, seed=1))
    ids, seg, seqs = packed(LENGTHS)
    logits = np.asarray(jax.jit(causal_lm_logits, static_argnums=0)(graphdef, params, ids, seg))
    for r, start, tokens in seqs:
        alone = causal_lm_logits(graphdef, params, tokens[None], np.ones((1, len(tokens)), np.int32))
        np.testing.assert_allclose(logits[r, start:start + len(tokens)], np.asarray(alone)[0],
                                   rtol=1e-5, atol=1e-5, err_msg=f"{name} segment at {r}:{start}")
