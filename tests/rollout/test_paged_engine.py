"""The paged engine (rollout.engine): the tokens of transformers' greedy generate and of the static
sampler under the same keys, groups sharing a prefill, a pool that only continuous batching (and
preemption) can fit, bad settings refused by name, an 8-device mesh equal to one device."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ppo_jax.models import load_model, split_model
from ppo_jax.models.heads import init_model
from ppo_jax.models.tiny_random import tiny_config
from ppo_jax.rollout.engine import PagedEngine
from ppo_jax.rollout.engine_layout import EngineSettings, check_page_size, engine_layout
from ppo_jax.rollout.static_batch import generate
from tests.rollout.sampling_settings import engine_settings, sampling_settings
from tests.xla_env import xla_flags

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

HERE = Path(__file__).resolve().parent
VOCAB = 96


@pytest.fixture(scope="module")
def tiny():
    cfg = tiny_config(VOCAB)
    graphdef, params = split_model(init_model(cfg, seed=3))
    return cfg, graphdef, params


def mixed_prompts(batch=8, width=8, n=1, seed=0):
    """`[batch, width]` left-padded prompts of 1..width tokens in groups of n copies."""
    rng = np.random.default_rng(seed)
    ids = np.repeat(rng.integers(4, VOCAB, (batch // n, width)).astype(np.int32), n, axis=0)
    mask = np.ones_like(ids)
    for g in range(batch // n):
        mask[g * n:(g + 1) * n, :rng.integers(0, width)] = 0
    ids[mask == 0] = 0
    return ids, mask


def run_engine(cfg, graphdef, params, ids, mask, key, engine: EngineSettings, **sampling):
    settings = sampling_settings(**sampling)
    eng = PagedEngine(graphdef, cfg, settings, engine, batch=ids.shape[0], prompt_width=ids.shape[1])
    out = eng.generate(params, jnp.asarray(ids), jnp.asarray(mask), key)
    return [np.asarray(x) for x in out], eng.last_stats


def assert_same(got, want, tag=""):
    for g, w, name in zip(got, want, ("tokens", "mask", "logprobs")):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5, err_msg=f"{tag}{name}")


def test_greedy_tokens_equal_transformers_generate_and_the_static_sampler(tmp_path):
    hf_cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=128,
                                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if not name.endswith("norm.weight"):
                p.normal_(0.0, 0.1)
    hf.save_pretrained(tmp_path)
    model, _ = load_model(tmp_path, "causal_lm")
    graphdef, params = split_model(model)
    ids, mask = mixed_prompts(6, 8)
    kw = dict(max_new_tokens=24, greedy=True, pad_token_id=0)
    got, stats = run_engine(model.cfg, graphdef, params, ids, mask, jax.random.PRNGKey(0),
                            engine_settings(page_size=8, max_concurrent=2, decode_chunk=5), **kw)
    with torch.no_grad():
        want = hf.generate(torch.tensor(ids, dtype=torch.long),
                           attention_mask=torch.tensor(mask, dtype=torch.long), max_new_tokens=24,
                           do_sample=False, eos_token_id=None, pad_token_id=0)
    np.testing.assert_array_equal(got[0], want[:, ids.shape[1]:].numpy())
    static = generate(graphdef, params, ids, mask, None, return_logprobs=True, **kw)
    assert_same(got, static)
    assert stats.prefills >= 3  # 6 rows through 2 slots: refilled as rows finished


@pytest.mark.parametrize("n", [1, pytest.param(2, marks=pytest.mark.slow),
                               pytest.param(4, marks=pytest.mark.slow)])  # default-run budget
def test_sampled_tokens_equal_the_static_sampler_under_the_same_keys(tiny, n):
    cfg, graphdef, params = tiny
    ids, mask = mixed_prompts(8, 8, n, seed=n)
    kw = dict(max_new_tokens=12, temperature=0.9, top_k=30, top_p=0.95, pad_token_id=0,
              stop_token_ids=(5, 7), samples_per_prompt=n)
    key = jax.random.PRNGKey(7)
    want = generate(graphdef, params, ids, mask, key, return_logprobs=True, **kw)
    got, stats = run_engine(cfg, graphdef, params, ids, mask, key,
                            engine_settings(page_size=4, max_concurrent=4, decode_chunk=3), **kw)
    assert_same(got, want, f"n={n} ")
    assert 0 < got[1].sum() < got[1].size  # some rows stopped early, none is empty


def test_finished_sequences_free_the_pages_a_pool_too_small_for_the_batch_needs(tiny):
    """A pool of 12 pages of 4 for 8 rows of up to 20 tokens (5 pages each, 40 at once): only
    retiring finished rows (and preempting, recomputing the youngest) lets the batch finish,
    and no row's pages are ever written by another (its tokens equal the static sampler's)."""
    cfg, graphdef, params = tiny
    ids, mask = mixed_prompts(8, 8, seed=3)
    kw = dict(max_new_tokens=12, temperature=1.0, pad_token_id=0, stop_token_ids=(5, 7, 9, 11))
    key = jax.random.PRNGKey(3)
    want = generate(graphdef, params, ids, mask, key, return_logprobs=True, **kw)
    engine = engine_settings(page_size=4, num_pages=6, max_concurrent=4, decode_chunk=2)
    got, stats = run_engine(cfg, graphdef, params, ids, mask, key, engine, **kw)
    assert_same(got, want)
    assert stats.peak_pages <= 5 and stats.prefills >= 4
    assert stats.preemptions > 0  # the pool holds one full-length row: growth preempts


def test_the_smallest_pool_equals_the_roomiest(tiny):
    cfg, graphdef, params = tiny
    ids, mask = mixed_prompts(8, 8, n=2, seed=5)
    kw = dict(max_new_tokens=16, temperature=1.0, pad_token_id=0, stop_token_ids=(5,),
              samples_per_prompt=2)
    key = jax.random.PRNGKey(5)
    small = engine_layout(engine_settings(page_size=4), batch=8, prompt_width=8,
                          max_new_tokens=16, group_size=2, replicas=1)
    tight, _ = run_engine(cfg, graphdef, params, ids, mask, key,
                          engine_settings(page_size=4, num_pages=1 + small.max_pages + 1,
                                         max_concurrent=2, decode_chunk=4), **kw)
    roomy, _ = run_engine(cfg, graphdef, params, ids, mask, key,
                          engine_settings(page_size=4, decode_chunk=4), **kw)
    assert_same(tight, roomy)


@pytest.mark.parametrize("engine, kwargs, message", [
    (engine_settings(page_size=4, num_pages=4), {},
     r"generation.num_pages=4 gives 4 pages per replica .* needs 5"),
    (engine_settings(page_size=4, max_concurrent=1), {"group_size": 2},
     r"generation.max_concurrent=1 .* at least samples_per_prompt=2"),
    (engine_settings(page_size=4, max_concurrent=6), {"replicas": 4},
     r"generation.max_concurrent=6 must be a multiple of the 4 replicas"),
    (engine_settings(page_size=4, decode_chunk=0), {}, r"generation.decode_chunk=0"),
    (engine_settings(page_size=4, attention="flash"), {}, r"generation.attention='flash'"),
    (engine_settings(page_size=4), {"group_size": 3}, r"not whole groups of samples_per_prompt=3"),
])
def test_bad_engine_settings_are_refused_by_name(engine, kwargs, message):
    args = dict(batch=8, prompt_width=8, max_new_tokens=8, group_size=1, replicas=1)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        engine_layout(engine, **args)


def test_a_page_size_that_does_not_divide_the_cache_length_is_refused():
    with pytest.raises(ValueError, match=r"generation.page_size=5 does not divide the cache "
                                         r"length 104 \(max.*\); page sizes that do: .*8"):
        check_page_size(5, 104, "max")
    check_page_size(8, 104, "max")


@pytest.mark.slow  # default-run budget (25 s; the mesh stays in the default run through tests/parallel/test_sharded_step.py's paged-engine step); `make test-slow`
def test_a_2x2x2_mesh_equals_one_device():
    env = dict(os.environ, XLA_FLAGS=xla_flags(8),
               JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, str(HERE / "paged_engine_mesh.py")], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("same: mesh 2x2x2") == 2, proc.stdout
