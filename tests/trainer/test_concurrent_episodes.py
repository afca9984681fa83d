"""Issue 57, item 5: environments run concurrently. The `CallPool` runs at most `concurrency`
calls at once, each under its own timeout from its own start, and gives a hung call's place
up at its deadline; in a batch of episodes (`EpisodeRunner` on the paged engine), a step that
hangs past `env.timeout_s` in one row fails that episode only while the other rows finish
every turn long before its deadline, with the same tokens as without the hang; steps that are
slow but within their timeout give the same episodes as instant ones (draws are keyed by row
and position, so the chunk at which an answer is taken in cannot change a token); and
`env.concurrency` bounds the calls in flight. Two processes equal one:
tests/parallel/test_sharded_step.py."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import NamedTuple

import jax
import numpy as np
import pytest

from ppo_jax.core import unregister
from ppo_jax.models import split_model
from ppo_jax.models.functional import Model
from ppo_jax.models.heads import init_model
from ppo_jax.models.tiny_random import tiny_config, tiny_tokenizer
from ppo_jax.parallel import host
from ppo_jax.rollout.sampler import Sampler
from ppo_jax.trainer.config.environment import EnvConfig
from ppo_jax.trainer.environments import (
    CallPool, Environment, EpisodeFailure, StepResult, call_outcome, register_environment,
)
from ppo_jax.trainer.stages.ppo.episodes import EpisodeRunner, episode_scores
from tests.rollout.sampling_settings import engine_settings, sampling_settings

HANG = threading.Event()  # set at the module's end: hanging steps return


# ---------------------------------------------------------------------------- the pool
class InFlight:
    """Counts the calls running at once; `call(seconds)` sleeps inside the count."""

    def __init__(self):
        self.now, self.peak, self.lock = 0, 0, threading.Lock()

    def call(self, seconds: float, value=None):
        with self.lock:
            self.now += 1
            self.peak = max(self.peak, self.now)
        time.sleep(seconds)
        with self.lock:
            self.now -= 1
        return value


def test_the_pool_runs_at_most_concurrency_calls_at_once():
    """8 calls of 0.1 s in 3 places: never more than 3 at once, so three waves (~0.3 s)."""
    count, pool = InFlight(), CallPool(3, timeout_s=5.0)
    t0 = time.monotonic()
    calls = [pool.submit(count.call, 0.1, i) for i in range(8)]
    pool.wait(calls, every=True)
    seconds = time.monotonic() - t0
    assert count.peak == pool.peak == 3
    assert [c.value for c in calls] == list(range(8)) and {c.status for c in calls} == {"done"}
    assert 0.3 <= seconds < 1.5, seconds


def test_a_call_is_timed_from_its_own_start_not_from_its_queueing():
    """One place: the second 0.2 s call waits 0.2 s in the queue, then runs 0.2 s; 0.4 s
    after it was submitted it is done, not expired under a 0.3 s timeout."""
    pool = CallPool(1, timeout_s=0.3)
    first, second = pool.submit(time.sleep, 0.2), pool.submit(time.sleep, 0.2)
    pool.wait([first, second], every=True)
    assert first.status == second.status == "done"
    assert second.started - first.started >= 0.2


def test_a_hung_call_gives_its_place_up_at_its_deadline():
    """One place, a call that hangs, a quick one queued behind it: the quick one starts at the
    hung one's deadline (0.3 s), which is abandoned (counted in `hung` until it returns)."""
    release = threading.Event()
    pool = CallPool(1, timeout_s=0.3)
    hung, quick = pool.submit(release.wait, 30), pool.submit(lambda: "answer")
    t0 = time.monotonic()
    pool.wait([quick])
    assert 0.25 <= time.monotonic() - t0 < 1.5
    assert quick.value == "answer" and hung.status == "expired" and pool.hung == 1
    failure = call_outcome(hung, "tool", "step", 0.3)
    assert failure == EpisodeFailure("tool", "environment 'tool': step took longer than 0.3 s")
    release.set()
    deadline = time.monotonic() + 5
    while pool.hung and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool.hung == 0 and hung.value is None  # its late value is dropped


def test_past_the_cap_of_hung_calls_a_call_is_refused_not_started():
    release = threading.Event()
    pool = CallPool(1, timeout_s=0.1, max_hung=2)
    hanging = [pool.submit(release.wait, 30) for _ in range(2)]
    pool.wait(hanging, every=True)
    refused = pool.submit(lambda: "never")
    assert refused.status == "refused" and pool.hung == 2
    assert call_outcome(refused, "tool", "step", 0.1).error == (
        "environment 'tool': step not started: calls past their timeout are still running (at "
        "the cap of 4 per place of env.concurrency)")
    release.set()
    time.sleep(0.2)
    later = pool.submit(lambda: "runs")
    pool.wait([later])
    assert later.value == "runs" and pool.hung == 0


@pytest.mark.parametrize("kwargs, message", [
    ({"concurrency": 0, "timeout_s": 1.0}, "concurrency=0 must be an int >= 1"),
    ({"concurrency": True, "timeout_s": 1.0}, "concurrency=True must be an int >= 1"),
    ({"concurrency": 2, "timeout_s": 0}, "timeout_s=0 must be a positive number"),
])
def test_a_bad_pool_setting_is_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CallPool(**kwargs)


# ---------------------------------------------------------------------------- row ownership
class FakeDevice(NamedTuple):
    process_index: int
    id: int


def fake_sharding(blocks: dict[int, list[int]], rows: int):
    """A sharding whose devices (process index p for each entry of `blocks[p]`, holding row
    block `blocks[p][i]` of `rows` rows split in 4) answer `devices_indices_map`."""
    per = rows // 4
    index = {FakeDevice(p, 10 * p + i): (slice(b * per, (b + 1) * per),)
             for p, bs in blocks.items() for i, b in enumerate(bs)}
    return SimpleNamespace(
        devices_indices_map=lambda shape: index,
        addressable_devices_indices_map=lambda shape: {
            d: ix for d, ix in index.items() if d.process_index == jax.process_index()})


@pytest.mark.parametrize("blocks, process, want", [
    ({0: [0, 1], 1: [2, 3]}, 0, (0, 8)),  # each process its own blocks
    ({0: [0, 1], 1: [2, 3]}, 1, (8, 16)),
    ({0: [0, 1, 2, 3], 1: [0, 1, 2, 3]}, 0, (0, 16)),  # every row on both: the lower plays
    ({0: [0, 1, 2, 3], 1: [0, 1, 2, 3]}, 1, (0, 0)),
    ({0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3]}, 2, (8, 16)),  # tensor pairs across processes
    ({0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3]}, 3, (8, 8)),
])
def test_each_row_block_is_owned_by_the_lowest_process_holding_it(monkeypatch, blocks,
                                                                  process, want):
    monkeypatch.setattr(jax, "process_count", lambda: len(blocks))
    monkeypatch.setattr(jax, "process_index", lambda: process)
    assert host.owned_rows(fake_sharding(blocks, 16), 16) == want


# ---------------------------------------------------------------------------- episodes
B, N, WIDTH, TURNS = 8, 48, 8, 3


class TimedTool(Environment):
    """Every turn but the last gets "tool says : good"; the third is scored by whether it says
    "good". Each call is timed (`log`: (row, turn, start, end)); row `hang_row`'s first step
    waits for `HANG` (30 s at most); `delay(row, turn)` seconds are slept in each step."""

    name = "timed_tool"

    def __init__(self, hang_row=None, delay=None, count=None):
        self.hang_row, self.delay, self.count, self.log = hang_row, delay, count, []
        self.started = {}  # (row, turn) -> when its step began

    def reset(self, row):
        if self.count is not None:  # long enough for the next reset to start inside it
            self.count.call(0.1)
        return (row["i"], 0), row["prompt"]

    def step(self, state, text):
        (row, turn), t0 = state, time.monotonic()
        self.started[(row, turn)] = t0
        if row == self.hang_row and turn == 0:
            HANG.wait(30)
        if self.delay is not None:
            time.sleep(self.delay(row, turn))
        if self.count is not None:
            self.count.call(0.02)
        self.log.append((row, turn, t0, time.monotonic()))
        if turn + 1 < TURNS:
            return StepResult("tool says : good", False, {"tool_cost": -0.1}, (row, turn + 1),
                              {"tool_call": 1})
        return StepResult(None, True, {"correct": float("good" in text)}, (row, turn + 1), {})


@pytest.fixture(scope="module")
def setup():
    tok = tiny_tokenizer()
    cfg = tiny_config(len(tok))
    graphdef, params = split_model(init_model(cfg, seed=5))
    texts = [f"tell me about {w}" for w in ("music", "rain", "family", "school")]
    ids = np.zeros((B, WIDTH), np.int32)
    mask = np.zeros((B, WIDTH), np.int32)
    for b in range(B):
        enc = tok.encode(texts[b // 2], add_special_tokens=False)
        ids[b, WIDTH - len(enc):], mask[b, WIDTH - len(enc):] = enc, 1
    rows = [{"prompt": texts[b // 2], "i": b} for b in range(B)]
    # a turn ends at any of the first 100 ids but pad (EOS among them): turns of a few tokens
    sampling = sampling_settings(N, stop_token_ids=tuple(range(1, 100)), samples_per_prompt=2)
    sampler = Sampler(engine_settings(page_size=8, decode_chunk=2, max_concurrent=8,
                                             decode_buckets=1), cfg)
    register_environment("timed_tool", override=True)(TimedTool)
    yield SimpleNamespace(tok=tok, model=Model(graphdef, params), ids=ids, mask=mask, rows=rows,
                          sampling=sampling, sampler=sampler)
    HANG.set()
    unregister("environment", "timed_tool")


def play(setup, env: TimedTool, *, timeout_s=30.0, concurrency=32):
    """The batch's episodes with `env` (its factory is replaced by the instance)."""
    cfg = EnvConfig(name="timed_tool", max_turns=TURNS, max_observation_tokens=12,
                    timeout_s=timeout_s, concurrency=concurrency, stop_strings=["good"])
    runner = EpisodeRunner(cfg, setup.sampling, setup.tok)
    runner.env = env
    t0 = time.monotonic()
    out, episodes = runner.play(setup.sampler, setup.model, setup.ids, setup.mask, setup.rows,
                                jax.random.PRNGKey(11))
    return SimpleNamespace(out=out, episodes=episodes, seconds=time.monotonic() - t0, t0=t0,
                           pool=runner.pool)


@pytest.fixture(scope="module")
def instant(setup):
    """The batch with instant steps (its first run also compiles the engine's programs)."""
    play(setup, TimedTool())
    return play(setup, TimedTool())


def rows_of(x, rows):
    return np.asarray(x)[rows]


def assert_same_rows(got, want, rows):
    for name in ("response_ids", "response_mask"):
        np.testing.assert_array_equal(rows_of(getattr(got.out, name), rows),
                                      rows_of(getattr(want.out, name), rows), err_msg=name)
    np.testing.assert_array_equal(rows_of(got.out.episodes.action_mask, rows),
                                  rows_of(want.out.episodes.action_mask, rows))
    np.testing.assert_allclose(rows_of(got.out.logprobs, rows), rows_of(want.out.logprobs, rows),
                               atol=1e-5)
    np.testing.assert_array_equal(got.out.episodes.turns[rows], want.out.episodes.turns[rows])
    np.testing.assert_array_equal(episode_scores(got.episodes)[rows],
                                  episode_scores(want.episodes)[rows])


def test_the_batch_plays_every_turn_with_observations(instant):
    """What the next tests rest on: every row plays its three turns, observations in between."""
    ep = instant.out.episodes
    assert (ep.turns == TURNS).all() and ep.ended.all()
    actions, mask = np.asarray(ep.action_mask), np.asarray(instant.out.response_mask)
    assert ((mask == 1) & (actions == 0)).any(axis=1).all()
    assert [e.failure for e in instant.episodes] == [None] * B


def test_a_step_hanging_past_its_timeout_delays_no_other_row(setup, instant):
    """Row 0's first step hangs past a 2 s timeout: its episode fails (score 0); the other
    seven rows play all their turns, the same tokens as without the hang, and their last step
    ends long before row 0's deadline (with one deadline per chunk boundary their later turns
    could not start before it); the batch ends about one timeout after the hang began, not
    one per turn."""
    timeout = 2.0
    env = TimedTool(hang_row=0)
    got = play(setup, env, timeout_s=timeout)
    hang = env.started[(0, 0)]
    assert all(row != 0 for row, *_ in env.log)  # the hung step never returned
    others = sorted((row, turn) for row, turn, *_ in env.log)
    assert others == [(r, t) for r in range(1, B) for t in range(TURNS)]
    last_other = max(t1 for *_, t1 in env.log)
    print(f"hang began {hang - got.t0:.3f} s into the batch; the other rows' last step "
          f"ended {last_other - hang:.3f} s after it; the batch took {got.seconds:.3f} s")
    assert last_other - hang < timeout / 2
    # the pool's deadline clock starts just before the environment's own `started` stamp
    assert timeout - 0.05 <= got.t0 + got.seconds - hang < timeout + 1.5
    assert got.episodes[0].failure == ("environment 'timed_tool': step took longer than 2 s")
    assert episode_scores(got.episodes)[0] == 0.0 and got.out.episodes.turns[0] == 1
    assert_same_rows(got, instant, list(range(1, B)))


def test_slow_steps_within_their_timeout_give_the_same_episodes(setup, instant):
    """Each step sleeps 0-90 ms, by row and turn: its answer comes in at a later chunk
    boundary than an instant one's, and every token, mask, turn and score is the same."""
    env = TimedTool(delay=lambda row, turn: 0.03 * ((row + turn) % 4))
    got = play(setup, env)
    assert_same_rows(got, instant, list(range(B)))
    assert len(env.log) == B * TURNS


def test_env_concurrency_bounds_the_calls_in_flight(setup, instant):
    """`env.concurrency` 2: the 8 resets (queued at once) and the steps never run more than 2
    at a time, and the episodes are the same."""
    count = InFlight()
    got = play(setup, TimedTool(count=count), concurrency=2)
    assert count.peak == got.pool.peak == 2
    assert_same_rows(got, instant, list(range(B)))
