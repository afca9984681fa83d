"""Continuous generation across batches (rollout.stream): batches streamed under fixed weights
equal `generate` under their keys while sharing the slots; a weight switch mid-batch with
partial rollouts (recomputed KV: the new policy's forward-pass log-probs; kept KV: not),
and without (a drain, then one version per sequence); bad arguments refused by name.

One engine (4 rows of 8-token prompts, 4 slots, chunks of 3 tokens, up to 10 tokens, stop
tokens 5, 7, 9) serves every test, so its programs compile once for the module."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ppo_jax.models import split_model
from ppo_jax.models.functional import path_str
from ppo_jax.models.heads import init_model
from ppo_jax.models.tiny_random import tiny_config
from ppo_jax.rollout.engine import PagedEngine
from ppo_jax.rollout.forward import policy_logprobs
from tests.rollout.sampling_settings import engine_settings, sampling_settings
from tests.rollout.test_paged_engine import mixed_prompts
from tests.xla_env import xla_flags

HERE = Path(__file__).resolve().parent

VOCAB, BATCH, WIDTH, N = 96, 4, 8, 10
SAMPLING = dict(temperature=1.0, stop_token_ids=(5, 7, 9), pad_token_id=0)


@pytest.fixture(scope="module")
def setup():
    cfg = tiny_config(VOCAB)
    graphdef, params = split_model(init_model(cfg, seed=3))
    _, other = split_model(init_model(cfg, seed=4))  # another policy: every weight differs
    engine = PagedEngine(graphdef, cfg, sampling_settings(N, **SAMPLING),
                         engine_settings(page_size=4, max_concurrent=4, decode_chunk=3,
                                         decode_buckets=1),
                         batch=BATCH, prompt_width=WIDTH)
    batches = [tuple(jnp.asarray(x) for x in mixed_prompts(BATCH, WIDTH, seed=i)) + (
        jax.random.PRNGKey(10 + i),) for i in range(3)]
    return engine, graphdef, params, other, batches


def host(generation):
    return [np.asarray(x) for x in generation[:3]]


def submit_all(stream, batches):
    for i, (ids, mask, key) in enumerate(batches):
        stream.submit(ids, mask, key, tag=i)


def switch_midway(engine, params, new, batches, rounds=2, **options):
    """Stream `batches` under `params`, switch to `new` (version 1) after `rounds` rounds;
    returns the finished batches by tag and the stream."""
    stream = engine.stream(params, version=0, **options)
    submit_all(stream, batches)
    done = [b for _ in range(rounds) for b in stream.step()]
    stream.set_params(new, 1)
    done += stream.flush()
    return {b.tag: b for b in done}, stream


@pytest.mark.slow  # ~30 s of compiles; the one-block and partial-rollout tests stay
def test_streamed_batches_equal_generate_and_share_the_slots(setup):
    engine, _, params, _, batches = setup
    want = [host(engine.generate(params, ids, mask, key)) for ids, mask, key in batches]
    stream = engine.stream(params, version=0, max_batches_in_flight=2)
    submit_all(stream, batches)
    done = stream.flush()
    assert sorted(b.tag for b in done) == [0, 1, 2] and stream.in_flight == 0
    for b in done:
        got = host(b.generation)
        np.testing.assert_array_equal(got[0], want[b.tag][0], err_msg=f"batch {b.tag} tokens")
        np.testing.assert_array_equal(got[1], want[b.tag][1], err_msg=f"batch {b.tag} mask")
        # equal here; a matmul of another row count may round otherwise on other CPUs
        np.testing.assert_allclose(got[2], want[b.tag][2], atol=2e-6, rtol=0,
                                   err_msg=f"batch {b.tag} logprobs")
        np.testing.assert_array_equal(b.versions, np.where(got[1] > 0, 0, -1))
    assert 0 < want[0][1].sum() < want[0][1].size  # stop tokens: ragged rows
    # the next batch's rows entered slots the previous one's finished rows freed
    assert stream.stats.mixed_chunks > 0 and stream.stats.batches == 3
    # ... so the three batches took fewer decode chunks than three generate calls in a row
    assert stream.stats.engine.chunks < sum(int(np.ceil((w[1].sum(1).max() - 1) / 3))
                                            for w in want)


def test_a_partial_rollout_switches_weights_at_a_chunk_boundary(setup):
    """Rounds 1-2 draw columns 0-6 of the first batch under version 0; the switch recomputes
    the live rows' keys and values under version 1, whose tokens then have its forward-pass
    log-probs given the whole prefix."""
    engine, graphdef, params, new, batches = setup
    done, stream = switch_midway(engine, params, new, batches[:2])
    assert stream.stats.switches == 1 and stream.stats.refills == 1
    mixed = 0
    for tag, b in done.items():
        ids, mask, key = batches[tag]
        tokens, resp_mask, logp = host(b.generation)
        old = host(engine.generate(params, ids, mask, key))
        v = b.versions
        real = resp_mask > 0
        assert ((v >= 0) == real).all()
        assert (np.diff(np.where(real, v, 1), axis=1) >= 0).all()  # 0s, then 1s, per row
        mixed += int(((v == 0).any(1) & (v == 1).any(1)).sum())
        before = v == 0  # drawn under the old weights: exactly generate's draws
        np.testing.assert_array_equal(tokens[before], old[0][before])
        np.testing.assert_allclose(logp[before], old[2][before], atol=2e-6, rtol=0)
        after = v == 1
        ref_new = np.asarray(policy_logprobs(graphdef, new, ids, mask, tokens, resp_mask))
        ref_old = np.asarray(policy_logprobs(graphdef, params, ids, mask, tokens, resp_mask))
        np.testing.assert_allclose(logp[after], ref_new[after], atol=2e-5)
        np.testing.assert_allclose(logp[before], ref_old[before], atol=2e-5)
        if after.any():
            assert np.abs(ref_old[after] - ref_new[after]).max() > 1e-2  # the switch mattered
    assert mixed > 0  # some rows span both versions
    first = done[0].versions[:, :7]  # columns 0-6 of the first batch: drawn before the switch
    assert (first[first >= 0] == 0).all() and (first == 0).sum() >= 3 * 7


def test_kept_kv_decodes_on_the_old_keys_and_values(setup):
    """With `kv_on_switch="keep"` the new weights read the keys and values the old ones
    wrote: equal to a recompute when only the final norm changed (the keys and values are
    the same), off the new policy's forward pass when every weight changed."""
    engine, graphdef, params, new, batches = setup
    head_only = jax.tree_util.tree_map_with_path(  # the final norm feeds the head, no KV
        lambda path, x: x * 1.7 if path_str(path) == "backbone/norm/scale" else x, params)
    for weights, same in ((head_only, True), (new, False)):
        kept, _ = switch_midway(engine, params, weights, batches[:1], kv_on_switch="keep")
        b = kept[0]
        ids, mask, _ = batches[0]
        tokens, resp_mask, logp = host(b.generation)
        ref = np.asarray(policy_logprobs(graphdef, weights, ids, mask, tokens, resp_mask))
        after = b.versions == 1
        assert after.sum() >= 4
        gap = np.abs(logp[after] - ref[after]).max()
        assert (gap < 2e-5) if same else (gap > 1e-2), gap


def test_without_partial_rollouts_sequences_drain_before_the_switch(setup):
    """The switch waits until the sequences live at `set_params` have finished under the old
    weights; every sequence then has one version, and its tokens are `generate`'s under that
    version's weights."""
    engine, _, params, new, batches = setup
    stream = engine.stream(params, version=0, partial_rollouts=False)
    submit_all(stream, batches[:2])
    done = stream.step()
    live = [s.row for s in stream.scheds[0].slots if s is not None]  # batch 0's unfinished rows
    stream.set_params(new, 1)
    done += stream.flush()
    assert stream.stats.drain_chunks > 0 and stream.stats.switches == 1
    versions = {}
    for b in done:
        ids, mask, key = batches[b.tag]
        got = host(b.generation)
        real = got[1] > 0
        for row in range(BATCH):
            vs = set(b.versions[row][real[row]].tolist())
            assert len(vs) == 1, (b.tag, row, vs)
            versions[(b.tag, row)] = vs.pop()
        for version, weights in ((0, params), (1, new)):
            rows = [r for r in range(BATCH) if versions[(b.tag, r)] == version]
            want = host(engine.generate(weights, ids, mask, key))
            for g, w in zip(got, want):
                np.testing.assert_array_equal(g[rows], w[rows])
    # batch 0 filled the 4 slots in round 1; batch 1 waited in the queue. Its rows were
    # admitted only after the drain, under the new weights, though slots freed during it
    assert live and all(versions[(0, row)] == 0 for row in range(BATCH))
    assert all(versions[(1, row)] == 1 for row in range(BATCH))


@pytest.mark.parametrize("options, message", [
    (dict(max_batches_in_flight=0), r"max_batches_in_flight=0 must be an int >= 1"),
    (dict(kv_on_switch="drop"), r"kv_on_switch='drop'; one of \('recompute', 'keep'\)"),
    (dict(version=1.5), r"version=1.5 must be an int"),
])
def test_bad_stream_arguments_are_refused_by_name(setup, options, message):
    engine, _, params, _, _ = setup
    with pytest.raises(ValueError, match=message):
        engine.stream(params, **options)


def test_bad_submissions_and_versions_are_refused(setup):
    engine, _, params, _, batches = setup
    stream = engine.stream(params, version=3)
    ids, mask, key = batches[0]
    with pytest.raises(ValueError, match=r"prompts \(4, 7\); this engine was built for \(4, 8\)"):
        stream.submit(ids[:, :7], mask[:, :7], key)
    stream.submit(ids, mask, key)
    with pytest.raises(ValueError, match="use one kind of key"):
        stream.submit(ids, mask, jax.random.key(0))
    with pytest.raises(ValueError, match="version=3 must be an int above the newest given, 3"):
        stream.set_params(params, 3)
    stream.set_params(params, 5)
    with pytest.raises(ValueError, match="above the newest given, 5"):
        stream.set_params(params, 4)


def test_a_multi_turn_engine_does_not_stream():
    cfg = tiny_config(VOCAB)
    graphdef, params = split_model(init_model(cfg, seed=3))
    engine = PagedEngine(graphdef, cfg, sampling_settings(8, turns=(((5,),), 2)),
                         engine_settings(page_size=4), batch=2, prompt_width=8)
    with pytest.raises(ValueError, match="multi-turn engine .* cannot stream"):
        engine.stream(params)


@pytest.mark.slow  # a subprocess with 8 CPU devices; `make test-slow`
def test_a_2x2x2_mesh_streams_as_one_engine():
    env = dict(os.environ, XLA_FLAGS=xla_flags(8), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, str(HERE / "stream_mesh.py")], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("same: mesh 2x2x2") == 2, proc.stdout


@pytest.mark.slow  # its own engine compiles (~10 s); `make test-slow`
def test_a_pool_that_preempts_streams_the_same_tokens(setup):
    """A pool of 7 pages of 4 (the trash page, one full-length row of 17 tokens, one more) for
    4 slots: growth preempts the youngest rows, which restart from their prompts; the streamed
    batches still equal `generate`, and after a mid-stream switch (recomputed KV) every
    version-1 token has the new policy's forward-pass log-prob, restarted rows included."""
    _, graphdef, params, new, batches = setup
    cfg = tiny_config(VOCAB)
    engine = PagedEngine(graphdef, cfg, sampling_settings(N, **SAMPLING),
                         engine_settings(page_size=4, num_pages=7, max_concurrent=4,
                                         decode_chunk=2, decode_buckets=1),
                         batch=BATCH, prompt_width=WIDTH)
    stream = engine.stream(params, version=0, max_batches_in_flight=2)
    submit_all(stream, batches)
    for b in stream.flush():
        want = host(engine.generate(params, *batches[b.tag]))
        got = host(b.generation)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])
        np.testing.assert_allclose(got[2], want[2], atol=2e-6, rtol=0)
    assert stream.stats.engine.preemptions > 0 and stream.stats.mixed_chunks > 0
    done, stream = switch_midway(engine, params, new, batches, rounds=3)
    assert stream.stats.engine.preemptions > 0
    for tag, b in done.items():
        ids, mask, _ = batches[tag]
        tokens, resp_mask, logp = host(b.generation)
        for version, weights in ((0, params), (1, new)):
            ref = np.asarray(policy_logprobs(graphdef, weights, ids, mask, tokens, resp_mask))
            at = b.versions == version
            np.testing.assert_allclose(logp[at], ref[at], atol=2e-5, err_msg=f"{tag} v{version}")


def test_one_batch_in_flight_without_partial_rollouts_is_the_synchronous_loop(setup):
    """`max_batches_in_flight=1, partial_rollouts=False` with new weights after each batch:
    the synchronous PPO loop (max_staleness 0), batch for batch `generate` under that step's
    weights, through generate's own compiled programs."""
    engine, _, params, new, batches = setup
    stream = engine.stream(params, version=0, max_batches_in_flight=1, partial_rollouts=False)
    weights = [params, new, params]
    for i, (ids, mask, key) in enumerate(batches):
        stream.submit(ids, mask, key, tag=i)
        (b,) = stream.flush()
        want = host(engine.generate(weights[i], ids, mask, key))
        for g, w in zip(host(b.generation), want):
            np.testing.assert_array_equal(g, w)
        np.testing.assert_array_equal(b.versions, np.where(want[1] > 0, i, -1))
        stream.set_params(weights[(i + 1) % 3], i + 1)
    assert stream.stats.mixed_chunks == 0 and stream.stats.drain_chunks == 0
