"""glibc malloc settings for XLA:CPU (ppo_jax.trainer.host.memory) and train.py's re-exec under
them: which environment is asked for, when nothing is done, and that trimming stops with them."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ppo_jax.trainer.host import memory as host_memory
from ppo_jax.trainer.host.memory import MALLOC_SETTINGS, malloc_env, malloc_settings_active

ROOT = Path(__file__).resolve().parents[2]


def test_settings_are_asked_for_on_linux_glibc_and_user_values_kept():
    env = malloc_env({"PATH": "/bin", "MALLOC_ARENA_MAX": "2"}, system="Linux", libc="glibc")
    assert env == {"PATH": "/bin", "MALLOC_ARENA_MAX": "2", "MALLOC_MMAP_MAX_": "0",
                   "MALLOC_TRIM_THRESHOLD_": str(2 ** 46), "MALLOC_TOP_PAD_": str(2 ** 30)}
    assert malloc_settings_active(env) and not malloc_settings_active({"MALLOC_ARENA_MAX": "1"})


@pytest.mark.parametrize("environ,system,libc", [
    ({"PPO_JAX_MALLOC_TUNING": "0"}, "Linux", "glibc"),
    ({"PPO_JAX_MALLOC_TUNING": "Off"}, "Linux", "glibc"),
    ({"PPO_JAX_MALLOC_TUNING": "false"}, "Linux", "glibc"),
    (dict(MALLOC_SETTINGS), "Linux", "glibc"),  # already on: no second exec
    ({}, "Darwin", ""),
    ({}, "Linux", ""),  # musl and other C libraries
])
def test_nothing_to_do(environ, system, libc):
    assert malloc_env(environ, system=system, libc=libc) is None


def test_trimming_stops_under_the_settings(monkeypatch):
    calls = []
    monkeypatch.setattr(host_memory, "_malloc_trim", lambda: calls.append)
    for k in MALLOC_SETTINGS:
        monkeypatch.delenv(k, raising=False)
    host_memory.release_host_memory()
    assert calls == [0]
    for k, v in MALLOC_SETTINGS.items():
        monkeypatch.setenv(k, v)
    host_memory.release_host_memory()
    assert calls == [0]


def test_reexec_runs_the_script_again_once_with_the_settings(tmp_path):
    """The real execve: a script that calls the re-exec runs twice, the second time with the
    settings in its environment (and does not exec a third time)."""
    script = tmp_path / "probe.py"
    script.write_text(textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(ROOT)!r})
        print("start", os.environ.get("MALLOC_ARENA_MAX"), flush=True)
        from ppo_jax.trainer.host.memory import reexec_with_malloc_settings
        reexec_with_malloc_settings()
        print("after", os.environ.get("MALLOC_ARENA_MAX"), os.environ.get("MALLOC_MMAP_MAX_"))
    """))
    env = {k: v for k, v in os.environ.items() if k not in MALLOC_SETTINGS and k != "PPO_JAX_MALLOC_TUNING"}
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                         check=True).stdout.split("\n")
    if malloc_env(env) is None:  # not Linux with glibc: nothing happens
        assert out[:2] == ["start None", "after None None"]
    else:
        assert out[:3] == ["start None", "start 1", "after 1 0"]
    off = subprocess.run([sys.executable, str(script)], env={**env, "PPO_JAX_MALLOC_TUNING": "0"},
                         capture_output=True, text=True, check=True).stdout.split("\n")
    assert off[:2] == ["start None", "after None None"]


@pytest.mark.parametrize("script", ["train.py", "bench/core.py", "bench/generate.py", "bench/ppo_step.py"])
def test_entry_points_reexec_first_in_main(script):
    """train.py and the CPU benchmarks re-execute under the settings before anything else runs in
    their `__main__` block (the benchmarks then measure XLA:CPU as train.py runs it)."""
    tree = ast.parse((ROOT / script).read_text())
    main = [n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)]
    assert len(main) == 1, script
    calls = [ast.unparse(n.value.func) for n in main[0].body
             if isinstance(n, ast.Expr) and isinstance(n.value, ast.Call)]
    assert calls[0] in ("reexec_with_malloc_settings", "under_malloc_settings"), (script, calls)
    assert calls[-1] in ("main", "sys.exit"), (script, calls)
