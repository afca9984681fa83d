"""Multi-turn episodes in the paged layout (rollout.engine with turns, rollout.turns): the
episodes of the static layout (`generation.engine: static`, one page per row) under the same
key (tokens, masks, turns, turn ends; log-probs to float tolerance), with fewer slots than rows,
small pages and short chunks; the pool sized so no episode is preempted; bad calls refused by
name."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ppo_jax.models import split_model
from ppo_jax.models.functional import Model
from ppo_jax.models.heads import init_model
from ppo_jax.models.tiny_random import tiny_config
from ppo_jax.rollout.engine import PagedEngine
from ppo_jax.rollout.engine_layout import EngineSettings
from ppo_jax.rollout.sampler import Sampler
from tests.rollout.sampling_settings import sampling_settings

VOCAB, N, WIDTH = 64, 24, 6
STOPS = tuple(range(4, 12))  # one token in eight ends a turn
END = 4  # a turn ending on it ends the episode


@pytest.fixture(scope="module")
def model():
    cfg = tiny_config(VOCAB)
    graphdef, params = split_model(init_model(cfg, seed=3))
    return cfg, Model(graphdef, params)


def prompts(batch=8, n=2, seed=0):
    """`[batch, WIDTH]` left-padded prompts of 2..WIDTH tokens, in groups of n copies."""
    rng = np.random.default_rng(seed)
    ids = np.repeat(rng.integers(12, VOCAB, (batch // n, WIDTH)).astype(np.int32), n, axis=0)
    mask = np.ones_like(ids)
    for g in range(batch // n):
        mask[g * n:(g + 1) * n, :rng.integers(0, WIDTH - 1)] = 0
    ids[mask == 0] = 0
    return ids, mask


def environment(calls):
    """A pure environment of the turn's tokens: a turn ending on END ends the episode, any other
    turn gets (its last token mod 4) observation tokens; `calls` records (row, turn)."""
    def on_turn_end(rows, turns):
        calls.extend((b, tuple(t)) for b, t in zip(rows, turns))
        return [None if t[-1] == END else [20 + (t[-1] + i) % 30 for i in range(t[-1] % 4)]
                for t in turns]
    return on_turn_end


def settings(stop_sequences=((12,), (13, 14)), max_turns=3, **kw):
    return sampling_settings(**{"max_new_tokens": N, "temperature": 1.0, "stop_token_ids": STOPS,
                                "turns": (stop_sequences, max_turns), "samples_per_prompt": 2,
                                **kw})


def engine(**kw):
    return EngineSettings(**{"page_size": 4, "num_pages": 0, "max_concurrent": 0,
                             "decode_chunk": 3, "decode_buckets": 4, "attention": "reference",
                             **kw})


def static_episodes(model, ids, mask, key, s):
    """The static layout (`Sampler` without engine settings: one page per row)."""
    calls = []
    out = Sampler(None, model[0])(model[1], ids, mask, key, s, environment(calls))
    return out, calls


def engine_episodes(model, ids, mask, key, s, engine: EngineSettings):
    cfg, m = model
    calls = []
    eng = PagedEngine(m.graphdef, cfg, s, engine, batch=ids.shape[0], prompt_width=ids.shape[1])
    out = eng.generate(m.params, jnp.asarray(ids), jnp.asarray(mask), key,
                       on_turn_end=environment(calls))
    return out, calls, eng.last_stats


def assert_same_episodes(got, want):
    for name in ("response_ids", "response_mask"):
        np.testing.assert_array_equal(np.asarray(getattr(got, name)),
                                      np.asarray(getattr(want, name)), err_msg=name)
    g, w = got.episodes, want.episodes
    np.testing.assert_array_equal(np.asarray(g.action_mask), np.asarray(w.action_mask))
    np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(want.logprobs), atol=1e-5)
    np.testing.assert_array_equal(g.turns, w.turns)
    np.testing.assert_array_equal(g.ended, w.ended)
    assert g.turn_ends == w.turn_ends


@pytest.mark.parametrize("paged", [
    engine(page_size=4, max_concurrent=4, decode_chunk=3),  # 2 groups at a time
    pytest.param(engine(page_size=6, decode_chunk=5, decode_buckets=2),
                 marks=pytest.mark.slow),  # default-run budget: `make test-slow`
], ids=["4-slots", "all-slots"])
def test_paged_episodes_equal_the_static_layouts(model, paged):
    ids, mask = prompts()
    key = jax.random.PRNGKey(7)
    want, want_calls = static_episodes(model, ids, mask, key, settings())
    got, calls, stats = engine_episodes(model, ids, mask, key, settings(), paged)
    assert_same_episodes(got, want)
    assert sorted(calls) == sorted(want_calls)  # every turn handed over once, with its tokens
    # the batch holds what the test is for: observations between turns, episodes ended by the
    # environment, by max_turns and by the budget
    actions, rmask = np.asarray(got.episodes.action_mask), np.asarray(got.response_mask)
    assert ((rmask == 1) & (actions == 0)).any(axis=1).sum() >= 2
    ep = got.episodes
    assert ep.turns.max() == 3 and ep.ended.any() and not ep.ended.all()
    assert stats.turn_rounds >= 2 and stats.preemptions == 0


@pytest.mark.slow  # default-run budget (17 s; both layouts' cut: tests/rollout/test_multi_turn.py); `make test-slow`
def test_a_long_observation_is_cut_to_the_budget_and_ends_the_row(model):
    """Every turn gets 30 observation tokens: more than the budget leaves; as in the static
    layout, the observation is written up to column N - 1 and the row ends, not ended."""
    ids, mask = prompts(4, 1, seed=1)
    s = settings(samples_per_prompt=1, stop_sequences=())
    key = jax.random.PRNGKey(3)
    long_obs = lambda rows, turns: [[30] * 30 for _ in rows]  # noqa: E731
    want = Sampler(None, model[0])(model[1], ids, mask, key, s, long_obs)
    cfg, m = model
    eng = PagedEngine(m.graphdef, cfg, s, engine(page_size=5, decode_chunk=4), batch=4,
                      prompt_width=WIDTH)
    got = eng.generate(m.params, jnp.asarray(ids), jnp.asarray(mask), key, on_turn_end=long_obs)
    assert_same_episodes(got, want)
    assert (np.asarray(got.response_mask).sum(axis=1) == N).any()


def test_a_multi_turn_pool_holds_every_slots_longest_sequence():
    cfg, (graphdef, _) = tiny_config(VOCAB), split_model(init_model(tiny_config(VOCAB), seed=3))
    # 8 slots x pages_for(6 + 24 - 1, 4) = 8 pages each: 65 with the trash page
    with pytest.raises(ValueError, match=r"generation.num_pages=40 .* a replica needs 65: every "
                                         r"slot of 30 tokens"):
        PagedEngine(graphdef, cfg, settings(), engine(page_size=4, num_pages=40),
                    batch=8, prompt_width=WIDTH)
    # single-turn, the same pool is enough: finished sequences free their pages, or are preempted
    PagedEngine(graphdef, cfg, sampling_settings(N, samples_per_prompt=2),
                engine(page_size=4, num_pages=40), batch=8, prompt_width=WIDTH)


def test_on_turn_end_goes_with_turns_only(model):
    cfg, m = model
    ids, mask = prompts()
    key = jax.random.PRNGKey(0)
    multi = PagedEngine(m.graphdef, cfg, settings(), engine(page_size=6), batch=8,
                        prompt_width=WIDTH)
    with pytest.raises(ValueError, match="needs a callable"):
        multi.generate(m.params, ids, mask, key)
    single = PagedEngine(m.graphdef, cfg, sampling_settings(N, samples_per_prompt=2),
                         engine(page_size=6), batch=8, prompt_width=WIDTH)
    with pytest.raises(ValueError, match="a single-turn one takes none"):
        single.generate(m.params, ids, mask, key, on_turn_end=environment([]))
    with pytest.raises(ValueError, match="max_turns"):
        PagedEngine(m.graphdef, cfg, settings(max_turns=0), engine(page_size=6), batch=8,
                    prompt_width=WIDTH)
