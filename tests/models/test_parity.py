"""Logits parity with transformers' PyTorch models on tiny random checkpoints, and left-padding
invariance of our logits."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from hf_tiny import HF_CONFIGS, hf_logits, padded_batch


@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_logits_match_transformers_with_left_padding(loaded, name):
    _, params, _, fn, torch_model = loaded[name]
    ids, mask = padded_batch(seed=1)
    ours = np.asarray(fn(params, jnp.asarray(ids), jnp.asarray(mask)))
    ref = hf_logits(torch_model, ids, mask)
    assert ours.dtype == np.float32 and ours.shape == ref.shape
    real = mask.astype(bool)
    assert np.abs(ref[real]).max() > 0.5  # non-trivial logits
    np.testing.assert_allclose(ours[real], ref[real], atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["llama3_untied", "gpt2"])
def test_prompt_alone_and_left_padded_by_two_give_same_logits(loaded, name):
    _, params, _, fn, _ = loaded[name]
    ids, mask = padded_batch(seed=2, pads=(0, 2, 5, 1))
    # row 1 is row 0's first 10 tokens shifted right by 2 behind 2 pad slots
    ids[1, 2:] = ids[0, :-2]
    full = np.asarray(fn(params, jnp.asarray(ids), jnp.asarray(mask)))
    alone_ids, alone_mask = ids[:1, :-2], mask[:1, :-2]
    alone = np.asarray(fn(params, jnp.asarray(alone_ids), jnp.asarray(alone_mask)))
    np.testing.assert_allclose(full[1, 2:], alone[0], atol=1e-5, rtol=0)
    assert np.isfinite(full).all()  # fully masked (pad) query rows stay finite
