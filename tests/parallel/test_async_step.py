"""Issue 57, asynchronous RL on a split mesh (`ppo.max_staleness` > 0): runs on 8 CPU devices
(the trainer's 4 + the rollout group's 4) at staleness 1 and 2 complete, every sample within
its bound; and a run stopped with responses in flight (kill -9, SIGTERM) resumes as
docs/async_rl.md says: the in-flight batches are dropped and drawn again, the same prompts
with the same keys, under the checkpoint's weights.

The runs happen in subprocesses (`sharded_run.py`, `train.py`): the device count is fixed when
jax starts."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ppo_jax.trainer.lifecycle.checkpoint import finished_steps
from tests.parallel.test_sharded_step import (
    PAGED, PROCESS_TOL, assert_same_run, finish, free_port, launch, load,
)
from tests.xla_env import xla_flags

ROOT = Path(__file__).resolve().parents[2]
SPLIT = (1, 2, 2, 4)
# the stream's engine has one prompt width: the synchronous runs compared take it too; 8 slots
# for 16 rows and chunks of 2 of the 8 tokens: batches share the slots over several rounds
COMMON = ("--set", "ppo.rollout_correction=tis", "--set", "generation.max_concurrent=8",
          "--set", "generation.decode_chunk=2", "--set", "data.prompt_buckets=1")
# what only the asynchronous step logs, or logs with another meaning (the stream's figures
# cover its work since the last step, the engine's its own call)
ASYNC_ONLY = ("rollout/", "weights/")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


def staleness_run(tmp_path, cache, s: int, steps: int = 4) -> list[dict]:
    out = tmp_path / f"s{s}"
    extra = (*PAGED, *COMMON, "--set", f"ppo.max_staleness={s}")
    finish(launch(out, [SPLIT], devices=8, steps=steps, cache=cache, extra=extra))
    return load(out, SPLIT)[0]["metrics"]


def common(a: dict, b: dict) -> list[str]:
    return [k for k in a if k in b and not k.startswith(ASYNC_ONLY)]


@pytest.mark.slow  # three 4-step runs on 8 CPU devices
def test_staleness_1_and_2_stay_within_their_bound_and_start_as_the_synchronous_step(
        tmp_path, cache):
    """Staleness s keeps s + 1 batches in flight: step 1 takes a batch of version 0 (the
    synchronous step 1, to float tolerance); every later sample is at most s versions behind,
    none is refused; at s = 1 each batch comes from one version, one behind; at s = 2 the
    weights of an update reach responses already decoding (partial rollouts)."""
    sync = staleness_run(tmp_path, cache, 0)
    runs = {s: staleness_run(tmp_path, cache, s) for s in (1, 2)}
    for s, metrics in runs.items():
        assert len(metrics) == 4
        first = metrics[0]
        for k in common(first, sync[0]):
            assert abs(first[k] - sync[0][k]) <= 1e-5 * max(1.0, abs(sync[0][k])), (s, k)
        assert [m["data_position"] for m in metrics] == [m["data_position"] for m in sync]
        for step, m in enumerate(metrics, 1):
            assert m["rollout/refused"] == 0, (s, step)
            assert m["rollout/staleness_max"] <= min(step - 1, s), (s, step, m)
            assert m["rollout/version_spread"] <= s
            assert m["weights/sync_bytes"] > 0 and m["actor_grad_norm"] > 0
    assert [m["rollout/staleness_max"] for m in runs[1]] == [0, 1, 1, 1]
    assert all(m["rollout/version_spread"] == 0 for m in runs[1])
    two = runs[2]
    assert max(m["rollout/staleness_max"] for m in two) == 2
    # versions 1 and 2 come in during the rounds of steps 2 and 3 (a step logs the stream's
    # work since the previous one); step 4, the last, runs none
    assert [m["rollout/weight_switches"] for m in two] == [0, 0, 1, 1]
    assert any(m["rollout/mixed_version_frac"] > 0 for m in two)
    assert sum(m["rollout/kv_refills"] for m in two) > 0


@pytest.mark.slow  # a 4-step run on two processes and on one
def test_two_processes_take_the_same_decisions_as_one(tmp_path, cache):
    """Staleness 2 on two processes of 4 devices (each 2 trainer + 2 rollout devices) equals
    the same meshes in one process, the stream's figures (weight switches, KV recomputes,
    mixed versions) included: the loop's decisions depend on the stream's state alone, so
    every process submits and switches weights at the same rounds."""
    multi, single = tmp_path / "multi", tmp_path / "single"
    extra = (*PAGED, *COMMON, "--set", "ppo.max_staleness=2")
    coordinator = f"localhost:{free_port()}"
    procs = [launch(multi, [SPLIT], devices=4, steps=4, cache=cache, extra=extra,
                    process=(coordinator, 2, i)) for i in range(2)]
    for p in procs:
        finish(p)
    finish(launch(single, [SPLIT], devices=8, steps=4, cache=cache, extra=extra))
    got, want = load(multi, SPLIT), load(single, SPLIT)
    assert got[0]["processes"] == 2
    assert_same_run(got, want, "two processes, staleness 2", param_atol=PROCESS_TOL)
    assert want[0]["metrics"][3]["rollout/mixed_version_frac"] > 0  # a partial rollout


# --- stop and resume: train.py on 2 CPU devices, the trainer's 1 + the rollout group's 1 ---
STEPS = 5
ASYNC = ["generation.placement=split", "generation.rollout_devices=1", "generation.engine=paged",
         "generation.page_size=8", "ppo.rollout_correction=tis", "data.prompt_buckets=1",
         "train.save_every=1", "train.export_hf=false"]


def train_args(out: Path, s: int, steps: int = STEPS, resume: bool = False) -> list[str]:
    args = ["--config", str(ROOT / "configs/tiny.yaml"), "--set", f"train.output_dir={out}",
            "--set", f"train.steps={steps}", "--set", "train.progress=false",
            "--set", f"data.prompts={ROOT / 'configs/prompts/reviews.jsonl'}",
            "--set", f"ppo.max_staleness={s}"]
    for x in ASYNC:
        args += ["--set", x]
    return args + (["--resume"] if resume else [])


def start(out: Path, cache: Path, s: int = 1, **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PPO_JAX_CACHE": str(cache),
           "XLA_FLAGS": xla_flags(2)}
    return subprocess.Popen([sys.executable, str(ROOT / "train.py"), *train_args(out, s, **kw)],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)


def done(proc: subprocess.Popen, timeout: int = 600) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        pytest.fail(f"train.py timed out:\n{err[-3000:]}")
    return proc.returncode, err


def ok(proc: subprocess.Popen) -> None:
    rc, err = done(proc)
    assert rc == 0, err[-3000:]


def rows(out: Path) -> dict[int, dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(("time/", "tokens_per_s/"))}
            for r in map(json.loads, lines)}


@pytest.fixture(scope="module")
def straight(tmp_path_factory, cache):
    """The uninterrupted staleness-1 run of 5 steps."""
    out = tmp_path_factory.mktemp("straight") / "run"
    ok(start(out, cache))
    return rows(out)


def stop_in_flight(out: Path, cache: Path, sig: int) -> int:
    """Start the staleness-1 run, send `sig` once checkpoint 2 is complete (step 3 under way,
    batch 4 in flight); returns the last checkpoint's step."""
    proc = start(out, cache)
    while 2 not in finished_steps(out / "checkpoints"):
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        time.sleep(0.02)
    proc.send_signal(sig)
    rc, err = done(proc, timeout=120)
    assert rc == (-signal.SIGKILL if sig == signal.SIGKILL else 0), err[-3000:]
    return finished_steps(out / "checkpoints")[-1]


def assert_regenerated(got: dict, want: dict, saved: int) -> None:
    """Up to the checkpoint the runs agree; after it the same prompts are taken; the first
    resumed step takes a batch drawn again under the checkpoint's weights (staleness 0, where
    the uninterrupted run's was 1), and the steps after it are one version behind again."""
    assert sorted(got) == sorted(want) == list(range(STEPS + 1))
    for step in range(saved + 1):
        assert got[step] == want[step], step
    for step in range(saved + 1, STEPS + 1):
        assert got[step]["data_position"] == want[step]["data_position"]
        assert got[step]["rollout/refused"] == 0
    assert want[saved + 1]["rollout/staleness_max"] == 1
    assert got[saved + 1]["rollout/staleness_max"] == 0
    assert all(got[step]["rollout/staleness_max"] == 1 for step in range(saved + 2, STEPS + 1))


@pytest.mark.slow  # four tiny train.py runs on 2 CPU devices
def test_a_run_killed_with_a_batch_in_flight_resumes_drawing_it_again_under_the_checkpoint(
        straight, tmp_path, cache):
    """kill -9 in step 3: the resumed run draws batches 3 and 4 again from checkpoint 2's
    prompt position and key under its weights; its step 3 is then the synchronous step from
    that checkpoint (a copy resumed with ppo.max_staleness=0 for one step), to float
    tolerance."""
    out = tmp_path / "run"
    saved = stop_in_flight(out, cache, signal.SIGKILL)
    sync = tmp_path / "sync"
    shutil.copytree(out, sync)
    ok(start(out, cache, resume=True))
    ok(start(sync, cache, s=0, steps=saved + 1, resume=True))
    got = rows(out)
    assert_regenerated(got, straight, saved)
    want = rows(sync)[saved + 1]
    keys = common(got[saved + 1], want)
    assert "score_mean" in keys and "pg_loss" in keys and "eval/reward_mean" in keys
    for k in keys:
        assert abs(got[saved + 1][k] - want[k]) <= 1e-5 * max(1.0, abs(want[k])), k


@pytest.mark.slow
def test_a_sigterm_with_a_batch_in_flight_saves_the_step_and_resumes_the_same_way(
        straight, tmp_path, cache):
    out = tmp_path / "run"
    saved = stop_in_flight(out, cache, signal.SIGTERM)
    assert saved in (2, 3)  # the step the signal landed in (or, rarely, the one before)
    ok(start(out, cache, resume=True))
    assert_regenerated(rows(out), straight, saved)
