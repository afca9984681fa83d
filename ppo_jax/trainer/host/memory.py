"""Give freed host memory back to the operating system between the phases of a step.

On the CPU backend XLA's buffers, orbax's write buffers and the HF export's copies are allocated
with the C library's malloc from several threads. glibc keeps what those threads free in
per-thread arenas, where allocations of the next phase (made on other threads) cannot reuse it:
the resident size then grows by the size of a whole train state after each checkpoint (measured
with the default config: 5.0 -> 7.4 GB resident between steps, 8.2 -> 10.7 GB at peak).
`malloc_trim(0)` returns the free pages of every arena: 10-50 ms per call here. There is no
`gc.collect()`: reference counting already frees the buffers, and a collection of the
interpreter's heap costs 0.2-0.3 s.

Handing pages back has a price: XLA:CPU allocates the temporaries of every call afresh, glibc
serves the large ones with `mmap` and unmaps them on free, so each call of a jitted update
faults its whole working set in again (SmolLM2-135M, one minibatch's forward + backward: ~490k
page faults and ~1 s of system time per ~4.5 s call). With `MALLOC_SETTINGS` in the environment
when the process starts (one arena, no `mmap`'d chunks, no trimming, a 1 GiB top pad) freed
buffers stay mapped and every thread reuses them: the faults drop to ~0 (docs/benchmarks.md).
One arena also removes the per-thread arenas `malloc_trim` was for, so `release_host_memory`
leaves the memory mapped when the settings are on. glibc reads them only at start-up:
`train.py` re-executes itself with them (`malloc_env`; `PPO_JAX_MALLOC_TUNING=0` turns it off).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import platform
import sys
from typing import Mapping

# glibc malloc tunables, read from the environment at process start (mallopt(3)): one arena for
# every thread, no mmap'd chunks (free never unmaps), never trim the heap, grow it 1 GiB at a
# time. The trim threshold is beyond what mallopt's int argument can express at run time.
MALLOC_SETTINGS = {
    "MALLOC_ARENA_MAX": "1",
    "MALLOC_MMAP_MAX_": "0",
    "MALLOC_TRIM_THRESHOLD_": str(2 ** 46),
    "MALLOC_TOP_PAD_": str(2 ** 30),
}
OPT_OUT = "PPO_JAX_MALLOC_TUNING"  # "0" / "false" / "off" / "no": leave malloc as it is


def malloc_settings_active(environ: Mapping[str, str] | None = None) -> bool:
    """True when every `MALLOC_SETTINGS` variable is set (to any value) in `environ` (default:
    this process's environment, which glibc read at start-up)."""
    environ = os.environ if environ is None else environ
    return all(k in environ for k in MALLOC_SETTINGS)


def malloc_env(environ: Mapping[str, str] | None = None, system: str | None = None,
               libc: str | None = None) -> dict[str, str] | None:
    """The environment to re-execute this process with so that glibc starts with
    `MALLOC_SETTINGS` (a variable already set keeps its value), or None when there is nothing
    to do: not Linux with glibc, the settings already set, or `PPO_JAX_MALLOC_TUNING` off."""
    environ = dict(os.environ if environ is None else environ)
    if environ.get(OPT_OUT, "").strip().lower() in ("0", "false", "off", "no"):
        return None
    system = platform.system() if system is None else system
    libc = platform.libc_ver()[0] if libc is None else libc
    if system != "Linux" or libc != "glibc" or malloc_settings_active(environ):
        return None
    return {**MALLOC_SETTINGS, **environ}


def reexec_with_malloc_settings() -> None:
    """Replace this process with itself under `MALLOC_SETTINGS` (same pid, same interpreter and
    arguments: `sys.orig_argv`) when `malloc_env` asks for it; return without doing anything
    otherwise. Call it first thing in a `__main__` block (train.py, the CPU benchmarks), before
    anything worth keeping is done: glibc reads the settings only at start-up."""
    env = malloc_env()
    if env is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, sys.orig_argv, env)


@functools.cache
def _malloc_trim():
    """libc's `malloc_trim`, or None where there is none (macOS, musl)."""
    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), "malloc_trim") if name else None
    except (OSError, AttributeError):
        return None


def release_host_memory() -> None:
    """Hand the free pages of every malloc arena back to the OS with glibc's `malloc_trim(0)`.

    A no-op without glibc, and with `MALLOC_SETTINGS` on: there one arena reuses its free
    memory for every thread, and trimming would make the next phase fault its pages in again."""
    trim = _malloc_trim()
    if trim is not None and not malloc_settings_active():
        trim(0)
