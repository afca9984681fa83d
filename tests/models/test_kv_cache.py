"""KV cache: prefill + token-by-token decoding reproduces the full forward's logits."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ppo_jax.models import KVCache, causal_lm_forward, init_cache, positions_from_mask
from ppo_jax.models.heads import last_real_index
from hf_tiny import padded_batch

SLOTS = 16  # cache longer than the sequence: unused trailing slots have mask 0


@pytest.mark.parametrize("name", ["llama3_untied", "mistral_window", "qwen3_tied", "gpt2"])
def test_prefill_then_decode_matches_full_forward(loaded, name):
    graphdef, params, cfg, fn, _ = loaded[name]
    ids, mask = padded_batch(seed=3, length=12, pads=(0, 2, 5))
    full = np.asarray(fn(params, jnp.asarray(ids), jnp.asarray(mask)))
    slot_mask = jnp.asarray(np.pad(mask, ((0, 0), (0, SLOTS - mask.shape[1]))))

    step = jax.jit(lambda p, i, m, c, ci: causal_lm_forward(graphdef, p, i, m, cache=c, cache_index=ci))
    cache = init_cache(cfg, batch=3, max_len=SLOTS)
    assert isinstance(cache, KVCache)
    assert cache.k.shape == (cfg.num_layers, 3, SLOTS, cfg.num_kv_heads, cfg.head_dim)

    prompt = 7
    logits, cache = step(params, jnp.asarray(ids[:, :prompt]), slot_mask, cache, jnp.int32(0))
    real = mask[:, :prompt].astype(bool)
    np.testing.assert_allclose(np.asarray(logits)[real], full[:, :prompt][real], atol=1e-5, rtol=0)
    for t in range(prompt, ids.shape[1]):
        logits, cache = step(params, jnp.asarray(ids[:, t:t + 1]), slot_mask, cache, jnp.int32(t))
        np.testing.assert_allclose(np.asarray(logits)[:, 0], full[:, t], atol=1e-5, rtol=0)


def test_cache_rejects_mask_not_covering_all_slots(loaded):
    graphdef, params, cfg, _, _ = loaded["llama_tied"]
    cache = init_cache(cfg, batch=1, max_len=8)
    with pytest.raises(ValueError, match="cover all 8 cache slots"):
        causal_lm_forward(graphdef, params, jnp.ones((1, 2), jnp.int32), jnp.ones((1, 4), jnp.int32),
                          cache=cache, cache_index=0)


class TestMaskArithmetic(chex.TestCase):
    """Positions and the reward read index come from the mask alone (hand-checked numbers)."""

    @chex.variants(with_jit=True, without_jit=True)
    def test_positions_count_real_tokens_only(self):
        mask = jnp.array([[0, 0, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]], jnp.int32)
        pos = self.variant(positions_from_mask)(mask)
        np.testing.assert_array_equal(pos, [[0, 0, 0, 1, 2, 2], [0, 1, 2, 3, 4, 5]])

    @chex.variants(with_jit=True, without_jit=True)
    def test_reward_is_read_at_last_real_new_token(self):
        mask = jnp.array([[0, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0]], jnp.int32)
        idx = self.variant(lambda m: last_real_index(m, 6))(mask)
        np.testing.assert_array_equal(idx, [2, 5, 5])  # empty row reads the last slot
        # with a cache: 3 new tokens at slots [2, 5)
        idx = self.variant(lambda m: last_real_index(m, 3, jnp.int32(2)))(mask)
        np.testing.assert_array_equal(idx, [0, 2, 2])
