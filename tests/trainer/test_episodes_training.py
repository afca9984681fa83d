"""Multi-turn episodes through train.py (`env.*`): a single-turn environment gives exactly
today's rollouts and losses; a scripted tool environment trains with observations inside the
responses (action mask) and logs its `env/*` figures; a raising environment fails its episodes,
not the run; an unknown environment is refused at load time."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from ppo_jax.core import unregister
from ppo_jax.trainer.environments import Environment, StepResult, register_environment
from ppo_jax.trainer.rewards.functions import get_reward_function

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import train  # noqa: E402
from tests.trainer.scripted_environment import ScriptedTool as Scripted  # noqa: E402

IGNORED = ("time/", "tokens_per_s", "env/", "memory", "rss")


class RewardOnce(Environment):
    """One turn, scored by the run's reward function (vader): today's single-turn PPO."""

    name = "reward_once"

    def __init__(self):
        self.fn = get_reward_function("vader")

    def reset(self, row):
        return row["prompt"], row["prompt"]

    def step(self, state, text):
        return StepResult(None, True, {"score": float(self.fn([state], [text])[0])}, state, {})


class Raising(Environment):
    name = "raising"

    def reset(self, row):
        return 0, row["prompt"]

    def step(self, state, text):
        raise RuntimeError("the sandbox is down")


@pytest.fixture(scope="module", autouse=True)
def environments():
    for name, cls in (("reward_once", RewardOnce), ("scripted", Scripted), ("raising", Raising)):
        register_environment(name)(cls)
    yield
    for name in ("reward_once", "scripted", "raising"):
        unregister("environment", name)


def run(tmp_path, name, *sets, steps=2):
    out = tmp_path / name
    args = ["--config", str(ROOT / "configs/tiny.yaml"), "--set", f"train.output_dir={out}",
            "--set", f"data.prompts={ROOT / 'configs/prompts/reviews.jsonl'}",
            "--set", f"train.steps={steps}", "--set", "train.progress=false",
            "--set", "train.export_hf=false", "--set", "eval.every=0",
            "--set", "eval.at_start=false", "--set", "generation.max_new_tokens=12", *sets]
    code = train.main(args)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return code, rows


@pytest.mark.slow  # default-run budget (48 s on 2 cores); `make test-slow`
def test_a_single_turn_environment_is_todays_ppo_to_the_bit(tmp_path, monkeypatch):
    """An environment of one turn plays on the engine's turn loop (one page per row): the
    static batch's tokens, so every figure of the step is single-turn PPO's to the bit, but
    the sampler's own log-probs, which round apart with the attention's program (`mismatch/*`,
    their distance to the trainer's recomputation, ~1e-7 either way)."""
    monkeypatch.setenv("PPO_JAX_CACHE", str(tmp_path / "cache"))
    code, plain = run(tmp_path, "plain")
    code2, env = run(tmp_path, "env", "--set", "env.name=reward_once", "--set",
                     "env.stop_strings=[]")
    assert code == code2 == 0
    compared = 0
    for a, b in zip(plain, env, strict=True):
        for k, v in a.items():
            if k.startswith("mismatch/"):
                assert b[k] == pytest.approx(v, abs=1e-6), (a["step"], k, v, b[k])
            elif not k.startswith(IGNORED) and k not in ("action_length",):
                assert b[k] == v, (a["step"], k, v, b[k])
                compared += 1
    assert compared > 60 and env[-1]["env/turns"] == 1.0


def test_a_tool_environment_trains_over_observations(tmp_path, monkeypatch):
    monkeypatch.setenv("PPO_JAX_CACHE", str(tmp_path / "cache"))
    # the word-level tiny tokenizer: a turn ends at one of a few common words
    code, rows = run(tmp_path, "scripted", "--set", "env.name=scripted", "--set",
                     "generation.max_new_tokens=32", "--set",
                     "env.stop_strings=[good,great,what,very,not,do]")
    assert code == 0
    assert any(r["env/tool_call"] > 0 and r["action_length"] < r["response_length"]
               for r in rows)
    for r in rows:
        assert r["env/failures"] == 0.0
        assert r["env/turns"] >= 1.0 and r["action_length"] <= r["response_length"]
        assert r["score_mean"] == pytest.approx(
            r.get("env/reward/correct", 0.0) + r.get("env/reward/tool_cost", 0.0), abs=1e-6)


TOOL = ("--set", "env.name=scripted", "--set", "generation.max_new_tokens=32", "--set",
        "env.stop_strings=[good,great,what,very,not,do]")


@pytest.mark.slow  # 40 s; the paged engine with an environment runs by default in
# tests/parallel/test_sharded_step.py (through the trainer) and tests/rollout/test_paged_multi_turn.py
def test_the_paged_engine_plays_the_same_episodes(tmp_path, monkeypatch):
    """`generation.engine: paged` with an environment: turns wait at chunk boundaries (2 slots
    for 4 rows, chunks of 3), observations are prefilled into pages of 8; the run's episodes,
    rewards, losses and evaluation are those of `generation.engine: static` (the same turn loop
    with one page per row), to the bit. Only the sampler's own log-probs round apart with the
    attention's width (`mismatch/*`: the trainer's recomputation against them, ~1e-7)."""
    monkeypatch.setenv("PPO_JAX_CACHE", str(tmp_path / "cache"))
    code, static = run(tmp_path, "static", *TOOL)
    code2, paged = run(tmp_path, "paged", *TOOL, "--set", "generation.engine=paged", "--set",
                       "generation.page_size=8", "--set", "generation.max_concurrent=2",
                       "--set", "generation.decode_chunk=3")
    assert code == code2 == 0
    compared = 0
    for a, b in zip(static, paged, strict=True):
        for k, v in a.items():
            if k.startswith("mismatch/"):
                assert b[k] == pytest.approx(v, rel=1e-4, abs=1e-6), (a["step"], k, v, b[k])
            elif not k.startswith(("time/", "tokens_per_s", "memory", "rss")):
                assert b[k] == v, (a["step"], k, v, b[k])
                compared += 1
        assert b["rollout/prefills"] >= 2 and b["rollout/preemptions"] == 0
    assert compared > 60 and any(r["action_length"] < r["response_length"] for r in paged)
    assert any(r.get("rollout/turn_rounds", 0) >= 1 for r in paged)


def test_a_resumed_multi_turn_run_equals_the_uninterrupted_run(tmp_path, monkeypatch):
    """Episodes end inside their step: the checkpoint at a step boundary holds no episode, and
    the environment's state is the explicit value `reset` rebuilds; so a run stopped after
    step 1 and resumed logs the uninterrupted run's figures to the bit."""
    monkeypatch.setenv("PPO_JAX_CACHE", str(tmp_path / "cache"))
    code, straight = run(tmp_path, "straight", *TOOL, "--set", "train.save_every=1", steps=3)
    code2, _ = run(tmp_path, "stopped", *TOOL, "--set", "train.save_every=1", steps=1)
    code3, resumed = run(tmp_path, "stopped", *TOOL, "--set", "train.save_every=1", "--resume",
                         steps=3)
    assert code == code2 == code3 == 0
    volatile = ("time/", "tokens_per_s", "memory", "rss")
    strip = lambda r: {k: v for k, v in r.items() if not k.startswith(volatile)}  # noqa: E731
    assert [r["step"] for r in resumed] == [1, 2, 3]
    assert [strip(r) for r in resumed] == [strip(r) for r in straight]
    assert any(r["action_length"] < r["response_length"] for r in straight)


def test_the_held_out_evaluation_plays_episodes(tmp_path, monkeypatch):
    monkeypatch.setenv("PPO_JAX_CACHE", str(tmp_path / "cache"))
    code, rows = run(tmp_path, "eval", "--set", "env.name=scripted", "--set",
                     "generation.max_new_tokens=32", "--set",
                     "env.stop_strings=[good,great,what,very,not,do]", "--set", "eval.every=1",
                     "--set", "eval.at_start=true", "--set", "eval.num_samples=4", steps=1)
    assert code == 0 and [r["step"] for r in rows] == [0, 1]
    for r in rows:  # two turns at most: a call (observation), then the scripted `correct` 1
        assert 1.0 <= r["eval/turns"] <= 2.0 and 0.0 <= r.get("eval/reward/correct", 0) <= 1.0
        assert r["eval/episodes"] == 4.0 and "eval/reward_mean" in r
    samples = [json.loads(x) for x in (tmp_path / "eval" / "samples.jsonl").read_text()
               .splitlines()]
    talks = [x["response"] for x in samples if x.get("eval")]
    # the observation "tool says: good" in the user's frame (the tiny word-level vocabulary
    # has neither "tool" nor "says")
    assert talks and any("user : <unk> <unk> : good" in t for t in talks)


def test_a_raising_environment_fails_its_episodes_not_the_run(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("PPO_JAX_CACHE", str(tmp_path / "cache"))
    code, rows = run(tmp_path, "raising", "--set", "env.name=raising", steps=1)
    assert code == 0
    assert rows[-1]["env/failures"] == rows[-1]["env/episodes"] and rows[-1]["score_mean"] == 0.0
    err = capfd.readouterr().err
    assert "env raising: episode failed (reward 0)" in err and "the sandbox is down" in err


def test_every_episode_failing_for_max_failed_steps_steps_stops_the_run(tmp_path, monkeypatch,
                                                                         capfd):
    """Issue 54: `env.max_failed_steps` steps in a row whose every episode failed stop the run
    before that step's update: exit 1, one `error:` line, the earlier steps' metrics and
    checkpoints kept, the lock released."""
    from ppo_jax.trainer.lifecycle.run_dir import RunLock

    monkeypatch.setenv("PPO_JAX_CACHE", str(tmp_path / "cache"))
    code, rows = run(tmp_path, "streak", "--set", "env.name=raising", "--set",
                     "env.max_failed_steps=2", "--set", "train.save_every=1", steps=4)
    assert code == 1 and [r["step"] for r in rows] == [1] and rows[0]["env/failures"] == 4.0
    errors = [x for x in capfd.readouterr().err.splitlines() if x.startswith("error:")]
    assert errors == [
        "error: step 2: every episode of environment 'raising' failed for 2 steps in a row "
        "(env.max_failed_steps=2); stopped before its update (the last checkpoint, step 1, is "
        "kept). The first failure: environment 'raising': step raised RuntimeError: the sandbox "
        "is down"]
    out = tmp_path / "streak"
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.isdigit()) == ["1"]
    RunLock(out).release()  # free: the failed run let go of it


def test_an_unknown_environment_is_refused_at_load_time(tmp_path, capsys):
    out = tmp_path / "nothing"
    code = train.main(["--config", str(ROOT / "configs/tiny.yaml"), "--set",
                       f"train.output_dir={out}", "--set", "env.name=no_such_env"])
    assert code == 2 and not out.exists()
    err = capsys.readouterr().err
    assert "env.name" in err and "no_such_env" in err and "calculator" in err


@pytest.mark.parametrize("sets, message", [
    (["env.max_turns=0"], "env.max_turns"),
    (["env.timeout_s=0"], "env.timeout_s"),
    (["env.max_observation_tokens=-1"], "env.max_observation_tokens"),
    (["ppo.dynamic_sampling=true", "generation.samples_per_prompt=2"], "dynamic_sampling"),
    (["ppo.advantage_estimator=remax"], "greedy baseline"),
    (["env.kwargs.format=json"], "format='json'"),
    (["env.max_failed_steps=0"], "env.max_failed_steps=0 must be an int >= 1"),
    (["env.kwargs.tool_call_cost=-0.05"], "env.name: environment 'calculator': "
     "env.kwargs.tool_call_cost=-0.05 must be >= 0: it is a cost, added to the score as "
     "-tool_call_cost (a negative one pays a bonus; for a cost of 0.05 give tool_call_cost: "
     "0.05)"),
])
def test_env_settings_that_cannot_run_are_refused_at_load_time(tmp_path, capsys, sets, message):
    out = tmp_path / "nothing"
    args = ["--config", str(ROOT / "configs/tiny.yaml"), "--set", f"train.output_dir={out}",
            "--set", "env.name=calculator"]
    for s in sets:
        args += ["--set", s]
    assert train.main(args) == 2 and not out.exists()
    assert message in capsys.readouterr().err


def test_an_observation_limit_that_leaves_no_room_inside_the_template_frame_is_refused(
        tmp_path, capsys):
    """The chat template's frame around an observation counts against
    env.max_observation_tokens: a limit at or below its length would cut every observation to
    nothing, so it is refused once the tokenizer is loaded, before any compile."""
    out = tmp_path / "run"
    code = train.main(["--config", str(ROOT / "configs/tiny.yaml"), "--set",
                       f"train.output_dir={out}", "--import", "tests.trainer.scripted_environment",
                       "--set", "env.name=scripted_tool", "--set", "env.max_observation_tokens=1"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert ("env.max_observation_tokens=1 leaves no room for an observation's text: the chat "
            "template's frame around a 'user' observation takes") in err


def test_a_paged_pool_that_cannot_hold_every_slots_episode_is_refused(tmp_path, capsys):
    """9 pages hold one sequence of 40 tokens (5 pages of 8) and the trash page: enough for
    single-turn PPO (finished sequences free pages, the youngest is preempted), not for two
    slots of episodes, which are never preempted."""
    out = tmp_path / "nothing"
    paged = ["generation.engine=paged", "generation.page_size=8", "generation.num_pages=9",
             "generation.max_concurrent=2"]
    args = ["--config", str(ROOT / "configs/tiny.yaml"), "--set", f"train.output_dir={out}",
            "--set", "env.name=scripted"]
    for s in paged:
        args += ["--set", s]
    assert train.main(args) == 2 and not out.exists()
    err = capsys.readouterr().err
    assert "generation.num_pages=9 gives 9 pages per replica" in err
    assert "a replica needs 11: every slot of 40 tokens" in err
