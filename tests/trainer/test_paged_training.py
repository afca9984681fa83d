"""PPO runs with the paged engine (`generation.engine: paged`): its settings refused by name
before anything loads, the engine's figures logged, and a run killed with SIGKILL resumed from
its last checkpoint equal to the uninterrupted run, bit for bit."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import train
from ppo_jax.trainer.lifecycle.checkpoint import finished_steps

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs/tiny.yaml"
PAGED = ["generation.engine=paged", "generation.page_size=8", "generation.max_concurrent=2",
         "generation.decode_chunk=3"]
VOLATILE = ("time/", "tokens_per_s/")


def args(out: Path, *sets: str, steps: int = 4) -> list[str]:
    out_args = ["--config", str(TINY), "--set", f"train.output_dir={out}",
                "--set", f"train.steps={steps}", "--set", "train.progress=false",
                "--set", "train.save_every=1", "--set", "eval.every=2"]
    for s in (*PAGED, *sets):
        out_args += ["--set", s]
    return out_args


def rows(out: Path) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(x).items() if not k.startswith(VOLATILE)} for x in lines]


@pytest.mark.parametrize("sets, message", [
    (["generation.page_size=7"], r"generation.page_size=7 does not divide the cache length 40"),
    (["generation.num_pages=3"], r"generation.num_pages=3 gives 3 pages per replica"),
    (["generation.max_concurrent=3", "generation.samples_per_prompt=4", "ppo.batch_size=8",
      "ppo.mini_batch_size=4", "ppo.micro_batch_size=4"],
     r"generation.max_concurrent=3 .* at least samples_per_prompt=4"),
    (["generation.attention=flash"], r"generation.attention"),
    (["generation.attention=pallas"], r"generation.attention=pallas: head_dim=16: the kernel "
                                      r"needs head_dim == 128"),
])
def test_bad_engine_settings_exit_before_loading(sets, message, tmp_path, capsys):
    out = tmp_path / "run"
    assert train.main(args(out, *sets)) != 0
    assert re.search(message, capsys.readouterr().err)
    assert not (out / "metrics.jsonl").exists()


@pytest.mark.slow  # three tiny train.py runs, about a minute and a half on 2 cores
def test_a_killed_paged_run_resumes_equal_to_the_uninterrupted_run(tmp_path, monkeypatch):
    monkeypatch.setenv("PPO_JAX_CACHE", str(tmp_path / "cache"))
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    assert train.main(args(straight)) == 0
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PPO_JAX_CACHE": str(tmp_path / "cache")}
    proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *args(killed)], cwd=ROOT,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    while 2 not in finished_steps(killed / "checkpoints"):
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        time.sleep(0.05)
    time.sleep(0.5)  # into step 3
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert train.main(args(killed) + ["--resume"]) == 0
    got, want = rows(killed), rows(straight)
    assert [r["step"] for r in got] == [0, 1, 2, 3, 4] and got == want
    assert want[1]["rollout/prefills"] >= 2  # 4 rows through 2 slots
    from safetensors.numpy import load_file

    a, b = (load_file(d / "actor_hf" / "model.safetensors") for d in (killed, straight))
    for key in b:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)
