"""One prefill per group (`samples_per_prompt`, `rollout.prefill`): the shared prefill's logits
and KV cache equal the repeated prompts' to 1e-5, and the sampler draws the same tokens and masks
under a fixed key, greedy or sampled; bad group sizes are named before compiling; on a mesh of 8
CPU devices it equals one device."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from ppo_jax.models import split_model
from ppo_jax.models.functional import Model
from ppo_jax.models.heads import init_model
from ppo_jax.models.tiny_random import tiny_config
from ppo_jax.rollout.static_batch import generate, prefill, sample
from tests.rollout.sampling_settings import sampling_settings
from tests.xla_env import xla_flags

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 96
TOL = 1e-5


@pytest.fixture(scope="module")
def split():
    """The tiny Llama with weights scaled x5 (N(0, 0.1)): peaked logits, no greedy near-ties."""
    graphdef, params = split_model(init_model(tiny_config(VOCAB), seed=3))
    params = jax.tree_util.tree_map_with_path(
        lambda p, x: x if "norm" in jax.tree_util.keystr(p) else x * 5, params)
    return graphdef, params


def grouped_prompts(n: int, rows: int = 8):
    """`[rows, 7]` left-padded prompts: the first rows / n of 8 fixed prompts, each repeated n
    times in adjacent rows (as the trainer's np.repeat); the second has 3 padding columns."""
    ids = np.random.default_rng(0).integers(4, VOCAB, (8, 7)).astype(np.int32)[:rows // n]
    mask = np.ones_like(ids)
    mask[1, :3] = 0
    ids[mask == 0] = 0
    return np.repeat(ids, n, axis=0), np.repeat(mask, n, axis=0)


@pytest.mark.parametrize("n", [2, 4])
def test_shared_prefill_logits_and_cache_equal_the_repeated_prompts(split, n):
    ids, mask = grouped_prompts(n)
    logits, cache = prefill(*split, ids, mask, max_new_tokens=5, samples_per_prompt=n)
    want_logits, want_cache = prefill(*split, ids, mask, max_new_tokens=5)
    assert logits.shape == (8, VOCAB) and cache.k.shape == want_cache.k.shape
    assert cache.k.shape[1:3] == (8, 7 + 5 - 1)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(want_logits), atol=TOL, rtol=0)
    for got, want in zip(cache, want_cache):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=TOL, rtol=0)
    assert np.abs(np.asarray(cache.k)[:, :, :7]).max() > 0.1  # the prompt slots are written
    assert not np.asarray(cache.k)[:, :, 7:].any()  # the response slots are not


SAMPLERS = {"greedy": dict(greedy=True),
            "temperature 1, top_k 20, top_p 0.9": dict(temperature=1.0, top_k=20, top_p=0.9)}
_STOPS = {}


def stop_token(split, how: str) -> int:
    """A token the unstopped run meets at step 4 of row 0: with it as the stop token, the
    response masks end at different steps. Row 0 is prompt 0 for every n and draws the same
    noise under one key, so one run (one compile per sampler) serves both n."""
    if how not in _STOPS:
        ids, mask = grouped_prompts(2)
        free, _ = generate(*split, ids, mask, jax.random.PRNGKey(7), max_new_tokens=12,
                           pad_token_id=0, **SAMPLERS[how])
        _STOPS[how] = int(np.asarray(free)[0, 4])
    return _STOPS[how]


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("how", list(SAMPLERS))
def test_shared_prefill_samples_the_tokens_of_the_repeated_path(split, n, how):
    """Through `sample` and its `SamplingSettings` (as the trainer calls it) against
    `generate` on the repeated prompts, one key."""
    ids, mask = grouped_prompts(n)
    kw = dict(max_new_tokens=12, pad_token_id=0, stop_token_ids=(stop_token(split, how),),
              **SAMPLERS[how])
    key = jax.random.PRNGKey(7)
    got, got_mask, _ = sample(Model(*split), ids, mask, key,
                           settings=sampling_settings(samples_per_prompt=n, **kw))
    want, want_mask = generate(*split, ids, mask, key, **kw)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(got_mask), np.asarray(want_mask))
    lengths = np.asarray(got_mask).sum(axis=1)
    assert lengths.min() < 12 and len(set(lengths)) > 1  # stops at different steps
    if how != "greedy":  # the samples of a group are draws of their own, not copies
        assert len({tuple(r) for r in np.asarray(got)[:n]}) > 1


@pytest.mark.parametrize("n,match", [
    (3, "samples_per_prompt=3 does not divide the batch of 8 rows"),
    (0, "samples_per_prompt=0 must be >= 1"),
    (2.0, "samples_per_prompt=2.0 must be an int"),
    (True, "samples_per_prompt=True must be an int"),
    (8, r"samples_per_prompt=8: prompt_ids rows 0..7 \(group 0\) are not one prompt repeated"),
    (16, "samples_per_prompt=16 does not divide the batch of 8 rows"),
])
def test_bad_samples_per_prompt_is_named_before_compiling(split, n, match):
    from ppo_jax.rollout import static_batch

    ids, mask = grouped_prompts(4)
    compiled = static_batch._generate._cache_size(), static_batch._prefill_jit._cache_size()
    with pytest.raises(ValueError, match=match):
        generate(*split, ids, mask, jax.random.PRNGKey(0), max_new_tokens=2, samples_per_prompt=n)
    with pytest.raises(ValueError, match=match):
        prefill(*split, ids, mask, max_new_tokens=2, samples_per_prompt=n)
    assert (static_batch._generate._cache_size(), static_batch._prefill_jit._cache_size()) == compiled


def test_a_group_whose_rows_differ_is_named(split):
    ids, mask = grouped_prompts(2, rows=6)
    ids[5, 6] = (ids[5, 6] + 1) % VOCAB  # group 2's second row: another last token
    with pytest.raises(ValueError, match=r"prompt_ids rows 4..5 \(group 2\) are not one prompt"):
        generate(*split, ids, mask, None, max_new_tokens=2, greedy=True, samples_per_prompt=2)
    ids, mask = grouped_prompts(2, rows=6)
    mask[1, 0] = 0  # group 0's second row: its first token read as padding
    with pytest.raises(ValueError, match=r"prompt_mask rows 0..1 \(group 0\) are not one"):
        generate(*split, ids, mask, None, max_new_tokens=2, greedy=True, samples_per_prompt=2)


@pytest.mark.slow  # default-run budget (16 s); `make test-slow`
def test_shared_prefill_on_a_mesh_of_8_equals_one_device(tmp_path):
    """A 2x2x2 mesh (4 batch shards), n = 2 and 4 on 8 rows: 4 prefill rows split over the
    batch shards, or 2 rows replicated (`shard_rows` constrains only what divides)."""
    env = dict(os.environ, XLA_FLAGS=xla_flags(8),
               JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("shared_prefill_mesh.py"))],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("same") == 2, proc.stdout


@pytest.mark.slow
def test_shared_prefill_on_smollm2_equals_the_repeated_path():
    """SmolLM2-135M-Instruct, float32: 3 chat prompts (left-padded) x 4 samples at temperature
    1, top_p 0.95, EOS as the stop token: prefill logits and cache to 1e-5, the same tokens."""
    from ppo_jax.models import load_model, load_tokenizer
    from ppo_jax.models.packaged import ensure_packaged

    try:
        smol = ensure_packaged("smollm2")
    except (FileNotFoundError, OSError, ImportError) as err:
        pytest.skip(f"SmolLM2 checkpoint cannot be produced ({err})")
    tok = load_tokenizer(smol)
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                     add_generation_prompt=True)
             for p in ("What is the capital of France?", "Write a haiku about the sea.",
                       "Tell me a short story about a brave little robot.")]
    enc = tok(texts, return_tensors="np", padding=True)
    ids, mask = (np.repeat(enc[k].astype(np.int32), 4, axis=0)
                 for k in ("input_ids", "attention_mask"))
    model, _ = load_model(smol, "causal_lm", param_dtype="float32", dtype="float32")
    graphdef, params = split_model(model)
    logits, cache = prefill(graphdef, params, ids, mask, max_new_tokens=24, samples_per_prompt=4)
    want_logits, want_cache = prefill(graphdef, params, ids, mask, max_new_tokens=24)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(want_logits), atol=TOL, rtol=0)
    for got, want in zip(cache, want_cache):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=TOL, rtol=0)
    kw = dict(max_new_tokens=24, temperature=1.0, top_p=0.95, stop_token_ids=(tok.eos_token_id,),
              pad_token_id=int(tok.pad_token_id))
    key = jax.random.PRNGKey(3)
    got = generate(graphdef, params, ids, mask, key, samples_per_prompt=4, **kw)
    want = generate(graphdef, params, ids, mask, key, **kw)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    assert len({tuple(r) for r in np.asarray(got[0])[:4]}) > 1
