"""Shared fixtures: a tiny random Llama checkpoint (built locally, no download).

Every test process (this one and the train.py / worker subprocesses it starts, which inherit the
environment) shares one XLA persistent compilation cache for the session: many tests compile the
same tiny programs, and a cached executable is the executable XLA would build again (measured on
tests/trainer/test_update.py + test_critic_free.py, 2-core AMD EPYC: 206 s -> 149 s with a cold
cache). Set JAX_COMPILATION_CACHE_DIR to keep your own.

The tests compile hundreds of tiny programs, where XLA:CPU's LLVM optimisation takes longer
than the programs run: the default run (`-m 'not slow'`) adds `--xla_backend_optimization_level=0`
to XLA_FLAGS unless XLA_FLAGS names a level (`pytest_configure`; tests/trainer/test_update.py +
test_critic_free.py, 2 workers
on the 2-core Intel Xeon: 115 s -> 83 s). Subprocesses that need several CPU devices take
these flags too (`tests/xla_env.xla_flags`). Training, benchmarks and `train.py` keep XLA's
default.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest

if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # before any test module imports jax
    _cache = tempfile.mkdtemp(prefix="ppo_jax_test_xla_cache_")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ.update(JAX_COMPILATION_CACHE_DIR=_cache,
                      JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                      JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """Path of a tiny random Llama HF directory with a word-level tokenizer."""
    from ppo_jax.models.tiny_random import ensure_tiny_random

    return ensure_tiny_random(tmp_path_factory.mktemp("ckpt") / "tiny-random-llama")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """PPO_JAX_CACHE (where the tiny model is written) in a fresh folder for one test module's
    runs; modules that need the path itself define their own."""
    mp = pytest.MonkeyPatch()
    mp.setenv("PPO_JAX_CACHE", str(tmp_path_factory.mktemp("cache")))
    yield
    mp.undo()


def pytest_configure(config):
    """The default run (`-m 'not slow'`, before any test module is imported and any backend
    starts) compiles at XLA backend optimisation level 0 (module doc); a run that selects the
    slow tests keeps XLA's default: some of them pin multi-device steps to 1e-5, which level 0
    moves by about that much (the multi-turn 2x2x2 mesh step)."""
    if config.option.markexpr.strip() != "not slow":
        return
    if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + " --xla_backend_optimization_level=0").strip()
