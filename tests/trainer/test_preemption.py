"""Issue 26: SIGTERM / SIGINT stop a run after the step in progress, saved on every process at the
same step, exit 0; `--resume` then gives every metric and the exported weights of the
uninterrupted run, bit for bit. A second Ctrl-C kills at once, unsaved. A checkpoint write that
fails keeps the previous checkpoint and names the step and the cause.

The one-process runs are real `train.py` subprocesses of configs/tiny.yaml (5 steps); the signal
goes out once checkpoint 2 is complete, so it lands in step 3 (or, rarely, in the few
milliseconds before step 3 starts: then the run stops at step 2, already saved)."""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import train  # noqa: E402
from ppo_jax.trainer.lifecycle.checkpoint import finished_steps  # noqa: E402
from ppo_jax.trainer.lifecycle.preemption import StopSignals  # noqa: E402
from tests.xla_env import xla_flags  # noqa: E402

TINY = ROOT / "configs/tiny.yaml"
STEPS = 5
VOLATILE = ("time/", "tokens_per_s/")  # wall-clock figures
PREEMPTED = re.compile(r"^preempted at step (\d+); resume with --resume(?: auto \(no step was "
                       r"saved\))?$", re.MULTILINE)
TWO = ["ppo.batch_size=16", "ppo.mini_batch_size=8", "ppo.micro_batch_size=4", "mesh.data=1",
       "mesh.fsdp=2", "mesh.tensor=2",  # responses stop early, as in tests/parallel
       "generation.stop_token_ids=[" + ",".join(map(str, range(2, 106))) + "]"]


def tiny_args(out: Path, *sets: str, resume: bool = False, steps: int = STEPS) -> list[str]:
    args = ["--config", str(TINY), "--set", f"train.output_dir={out}", "--set", f"train.steps={steps}",
            "--set", "train.progress=false",
            "--set", f"data.prompts={ROOT / 'configs/prompts/reviews.jsonl'}"]
    for s in sets:
        args += ["--set", s]
    return args + (["--resume"] if resume else [])


class Run:
    """A `train.py` subprocess with its stdout / stderr in files next to its output directory."""

    def __init__(self, out: Path, *sets: str, resume: bool = False, env: dict | None = None,
                 name: str = ""):
        self.out = out
        log = out.parent / f"{out.name}{name}{'.resume' if resume else ''}"
        self.stdout, self.stderr = Path(f"{log}.out"), Path(f"{log}.err")
        with open(self.stdout, "w") as so, open(self.stderr, "w") as se:
            self.proc = subprocess.Popen(
                [sys.executable, str(ROOT / "train.py"), *tiny_args(out, *sets, resume=resume)],
                cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
                stdout=so, stderr=se)

    def wait(self, timeout: float = 600) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            pytest.fail(f"train.py timed out:\n{self.stderr.read_text()[-3000:]}")

    def finish(self) -> "Run":
        assert self.wait() == 0, self.stderr.read_text()[-3000:]
        return self

    def when_saved(self, step: int) -> None:
        """Wait until checkpoint `step` is complete (and the run still going)."""
        while step not in finished_steps(self.out / "checkpoints"):
            assert self.proc.poll() is None, self.stderr.read_text()[-3000:]
            time.sleep(0.02)

    def preempted_at(self) -> int:
        found = PREEMPTED.findall(self.stderr.read_text())
        assert len(found) == 1, self.stderr.read_text()[-3000:]
        return int(found[0])


def comparable_rows(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]


def assert_same_run(got: Path, want: Path) -> None:
    """Every non-timing metric of every step, and the exported actor, equal bit for bit."""
    from safetensors.numpy import load_file

    assert comparable_rows(got) == comparable_rows(want)
    assert [r["step"] for r in comparable_rows(got)] == list(range(STEPS + 1))
    a, b = (load_file(d / "actor_hf" / "model.safetensors") for d in (got, want))
    assert a.keys() == b.keys()
    for key in b:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def assert_stopped_saved(run: Run, rc: int) -> int:
    """Exit 0 after a stop signal: the step it names is the last checkpoint, nothing exported,
    no "done:" summary. Returns that step."""
    assert rc == 0, run.stderr.read_text()[-3000:]
    step = run.preempted_at()
    assert step in (2, 3)  # the signal went out after checkpoint 2 (module docstring)
    assert finished_steps(run.out / "checkpoints")[-1] == step
    assert comparable_rows(run.out)[-1]["step"] == step
    assert not (run.out / "actor_hf").exists()
    assert "done:" not in run.stdout.read_text()
    return step


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """PPO_JAX_CACHE (the tiny model) of the subprocesses and in-process runs of this module."""
    path = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PPO_JAX_CACHE", str(path))
        yield path


@pytest.fixture(scope="module")
def straight(tmp_path_factory, cache):
    """The uninterrupted 5-step tiny run (in this process: no second start-up)."""
    out = tmp_path_factory.mktemp("straight") / "run"
    assert train.main(tiny_args(out)) == 0
    return out


def test_stop_signals_only_record_and_give_the_handlers_back():
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    for sig, name in ((signal.SIGTERM, "SIGTERM"), (signal.SIGINT, "SIGINT")):
        with StopSignals() as stop:
            assert stop.installed and not stop.stop_agreed()
            os.kill(os.getpid(), sig)
            for _ in range(200):  # the handler runs on the main thread between bytecodes
                if stop.received:
                    break
                time.sleep(0.005)
            assert stop.received == name and stop.stop_agreed()
            if sig == signal.SIGINT:  # a second Ctrl-C would kill at once
                assert signal.getsignal(signal.SIGINT) == signal.SIG_DFL
        assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before
    seen = []
    worker = threading.Thread(target=lambda: seen.append(StopSignals().__enter__().installed))
    worker.start()
    worker.join()
    assert seen == [False]  # off the main thread: nothing installed, no error


@pytest.mark.parametrize("sig", [pytest.param(signal.SIGTERM, id="SIGTERM"),
                                 pytest.param(signal.SIGINT, id="SIGINT", marks=pytest.mark.slow)])
def test_a_stop_signal_mid_run_saves_that_step_exits_0_and_resume_equals_the_uninterrupted_run(
        sig, straight, tmp_path):
    run = Run(tmp_path / "run")
    run.when_saved(2)
    sent = time.perf_counter()
    run.proc.send_signal(sig)
    rc = run.wait(timeout=60)
    print(f"{signal.Signals(sig).name} -> exit: {time.perf_counter() - sent:.2f} s")
    assert_stopped_saved(run, rc)
    resumed = Run(run.out, resume=True).finish()
    assert "done: step 5" in resumed.stdout.read_text()
    assert_same_run(run.out, straight)


def catches_sigint(pid: int) -> bool:
    """Whether process `pid` has a handler for SIGINT (bit 1 of SigCgt in /proc/PID/status)."""
    status = Path(f"/proc/{pid}/status").read_text()
    (mask,) = re.findall(r"^SigCgt:\s*([0-9a-f]+)$", status, re.MULTILINE)
    return bool(int(mask, 16) >> (signal.SIGINT - 1) & 1)


@pytest.mark.slow
def test_a_second_sigint_kills_at_once_without_a_new_checkpoint(cache, tmp_path):
    # 40 PPO epochs: a step of seconds, so the second Ctrl-C comes while step 3 still runs (a
    # warm tiny step can end, save and exit in 0.2 s)
    run = Run(tmp_path / "run", "ppo.ppo_epochs=40")
    run.when_saved(2)
    run.proc.send_signal(signal.SIGINT)
    deadline = time.perf_counter() + 10
    while catches_sigint(run.proc.pid):  # delivered: the kernel gave SIGINT its default back
        assert time.perf_counter() < deadline, "the first SIGINT was not delivered in 10 s"
        time.sleep(0.001)
    sent = time.perf_counter()
    run.proc.send_signal(signal.SIGINT)
    assert run.wait(timeout=30) == -signal.SIGINT  # the default action: killed by the signal
    assert time.perf_counter() - sent < 5
    assert finished_steps(run.out / "checkpoints") == [1, 2]
    assert not PREEMPTED.findall(run.stderr.read_text())


def test_a_failed_checkpoint_write_keeps_the_previous_one_and_names_the_step(
        cache, tmp_path, monkeypatch, capsys):
    """The second write (step 2) writes the state and half of its meta file, then the disk is
    full: exit 1 naming step 2, the cause and step 1; with max_to_keep=1 step 1 is still there,
    and `--resume` continues from it (the half-written folder ignored, then replaced)."""
    from orbax.checkpoint._src.handlers import json_checkpoint_handler as handler

    writes, write = [], handler.JsonCheckpointHandler._save_fn

    async def disk_full_at_the_second(self, item, directory):
        writes.append(directory)
        if len(writes) != 2:
            return await write(self, item, directory)
        (directory / self._filename).write_text('{"step": ')
        raise OSError(errno.ENOSPC, "No space left on device", str(directory / self._filename))

    monkeypatch.setattr(handler.JsonCheckpointHandler, "_save_fn", disk_full_at_the_second)
    out = tmp_path / "run"
    args = tiny_args(out, "train.max_to_keep=1", steps=3)
    assert train.main(args) == 1
    err = capsys.readouterr().err
    assert re.search(r"error: checkpoint of step 2 was not written .*OSError: \[Errno 28\] No space "
                     r"left on device.*the last checkpoint kept is step 1", err), err[-2000:]
    assert finished_steps(out / "checkpoints") == [1]
    assert [p.name for p in (out / "checkpoints").iterdir() if not p.name.isdigit()] == \
        ["2.orbax-checkpoint-tmp"]  # the half write, never taken for a checkpoint
    assert [r["step"] for r in comparable_rows(out)] == [0, 1, 2]  # the metrics written stay
    monkeypatch.setattr(handler.JsonCheckpointHandler, "_save_fn", write)
    assert train.main(args + ["--resume"]) == 0
    assert "resumed from step 1" in capsys.readouterr().out
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["3"]
    assert [r["step"] for r in comparable_rows(out)] == [0, 1, 2, 3]  # step 2 once, run again


def supervised_cfg(stage: str, tiny_checkpoint, data: Path, out: Path, steps: int):
    from ppo_jax.trainer.config import load_config

    source = "model.actor" if stage == "sft" else "model.reward_model"
    return load_config(TINY, [f"stage={stage}", f"{source}={tiny_checkpoint}", f"{stage}.data={data}",
                              f"{stage}.batch_size=4", f"{stage}.micro_batch_size=2",
                              f"{stage}.max_length=40", f"{stage}.eval_every=2", f"train.steps={steps}",
                              "train.save_every=2", f"train.output_dir={out}", "train.progress=false"])


def supervised_data(tmp_path: Path, stage: str) -> Path:
    topics = ["the bus", "a train", "the coffee", "my week", "the party", "the garden", "a film",
              "the market", "the weather", "dinner", "the music", "the school"]
    rows = ([{"prompt": f"tell me about {t}", "response": f"{t} was good and fun"} for t in topics]
            if stage == "sft" else
            [{"prompt": f"what about {t} ?", "chosen": "it was great", "rejected": f"{t} was awful"}
             for t in topics * 2])
    path = tmp_path / f"{stage}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("stage", ["sft", pytest.param("reward_model", marks=pytest.mark.slow)])
def test_supervised_stages_stop_saved_at_the_step_a_sigterm_lands_in(stage, tiny_checkpoint, tmp_path,
                                                                      capsys):
    """SIGTERM sent from inside step 3 (save_every=2): the run saves step 3, does not export and
    returns; resumed to step 4 its params and losses equal a straight 4-step run's."""
    import jax

    from ppo_jax.trainer.stages import trainer_class

    cls, data = trainer_class(stage), supervised_data(tmp_path, stage)
    straight = cls(supervised_cfg(stage, tiny_checkpoint, data, tmp_path / "a", 4))
    straight.train(progress=False)
    run = cls(supervised_cfg(stage, tiny_checkpoint, data, tmp_path / "b", 4))
    step = run.step

    def step_signalled_at_3():
        if run.step_count == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return step()

    run.step = step_signalled_at_3
    assert len(run.train(progress=False)) == 3 and run.preempted_at == 3
    assert "preempted at step 3; resume with --resume" in capsys.readouterr().err
    assert finished_steps(tmp_path / "b" / "checkpoints") == [2, 3]
    assert not list((tmp_path / "b").glob("*_hf"))
    resumed = cls(supervised_cfg(stage, tiny_checkpoint, data, tmp_path / "b", 4), resume=True)
    assert resumed.step_count == 3
    resumed.train(progress=False)
    params = [jax.tree.map(np.asarray, t.state["model"].params) for t in (straight, resumed)]
    jax.tree.map(np.testing.assert_array_equal, *params)
    rows = [[json.loads(x) for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
            for d in "ab"]
    assert [r["step"] for r in rows[1]] == [1, 2, 3, 4]
    assert [(r["loss"], r.get("eval/loss")) for r in rows[0]] == \
        [(r["loss"], r.get("eval/loss")) for r in rows[1]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def two_processes(out: Path, *, resume: bool = False) -> list[Run]:
    """Two train.py processes (2 CPU devices each) joined over localhost, mesh (1, 2, 2)."""
    sets = [*TWO, "distributed.enabled=true", f"distributed.coordinator_address=localhost:{free_port()}",
            "distributed.num_processes=2"]
    env = {"XLA_FLAGS": xla_flags(2)}
    return [Run(out, *sets, f"distributed.process_id={i}", resume=resume, env=env, name=f".p{i}")
            for i in range(2)]


@pytest.mark.slow  # three pairs of train.py processes: about 7 minutes on 2 cores (cold cache)
def test_sigterm_to_one_of_two_processes_saves_both_at_the_same_step_and_resume_is_exact(
        cache, tmp_path):
    straight = [r.finish() for r in two_processes(tmp_path / "straight")][0].out
    runs = two_processes(tmp_path / "run")
    runs[0].when_saved(2)
    sent = time.perf_counter()
    runs[1].proc.send_signal(signal.SIGTERM)
    codes = [r.wait(timeout=60) for r in runs]
    print(f"SIGTERM to process 1 -> both exited: {time.perf_counter() - sent:.2f} s")
    steps = [assert_stopped_saved(r, rc) for r, rc in zip(runs, codes)]
    assert steps[0] == steps[1]
    for r in two_processes(tmp_path / "run", resume=True):
        r.finish()
    assert_same_run(tmp_path / "run", straight)
