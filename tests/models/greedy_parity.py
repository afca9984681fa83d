"""`assert_paged_equals_static`: a model family's greedy tokens, masks and log-probs from the
paged engine (small pages, two slots, chunks of 5) equal the static sampler's, for the family
tests (Qwen3, Qwen3-MoE, Gemma 3)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ppo_jax.rollout.engine import PagedEngine
from ppo_jax.rollout.static_batch import generate
from tests.rollout.sampling_settings import engine_settings, sampling_settings


def assert_paged_equals_static(graphdef, params, cfg, ids: np.ndarray, mask: np.ndarray, *,
                               max_new_tokens: int, page_size: int) -> np.ndarray:
    """Runs both samplers greedily on `ids` / `mask` `[B, P]`; returns the `[B, N]` tokens."""
    kw = dict(max_new_tokens=max_new_tokens, greedy=True, pad_token_id=0)
    eng = PagedEngine(graphdef, cfg, sampling_settings(**kw),
                      engine_settings(page_size=page_size, max_concurrent=2, decode_chunk=5),
                      batch=ids.shape[0], prompt_width=ids.shape[1])
    got = [np.asarray(x) for x in eng.generate(params, jnp.asarray(ids), jnp.asarray(mask),
                                               jax.random.PRNGKey(0))]
    want = generate(graphdef, params, ids, mask, None, return_logprobs=True, **kw)
    np.testing.assert_array_equal(got[0], np.asarray(want[0]))
    np.testing.assert_array_equal(got[1], np.asarray(want[1]))
    np.testing.assert_allclose(got[2], np.asarray(want[2]), atol=1e-5)
    return got[0]
