"""Preemption: SIGTERM (and SIGINT) stop a run at the next step boundary, saved, on every process.

Spot TPU slices and SLURM time limits end a job with SIGTERM and a short grace period.
`StopSignals`, installed by `StageTrainer.train`, replaces the SIGTERM and SIGINT handlers with
ones that only record the signal. Python runs a handler on the main thread between bytecodes,
so an XLA call, a compilation or an orbax write in progress is never cut short: the loop reads
the record at the next step boundary, saves that step and returns. The first SIGINT gives
SIGINT its default action back, so a second Ctrl-C kills the process at once, without saving:
on Linux the kernel does that when it delivers the first one (`SA_RESETHAND`, set through
`sigaction`), since a Python handler would only run, and could only reset it, once the XLA call
in progress (tens of seconds for a large model) returns.
Off the main thread `signal.signal` refuses (ValueError): then nothing is installed and the
signals keep their handlers.

Agreement across processes: `stop_agreed()` takes the maximum of every process's record at each
step boundary (`multihost_utils.process_allgather` of one int32), so every process stops after
the same step, the one the signalled process was in. JAX's own
`multihost_utils.reached_preemption_sync_point(step)` was measured too (jax 0.10.2, two CPU
processes joined over localhost, a loop with one collective a step): it works, but its C++
SIGTERM notifier polls once a second and the step it agrees on is one past the largest step
any process had reached when the notice got round, so with 50 ms steps a SIGTERM after step 20
stopped both processes at step 34, 0.78 s later, where the all-gather stopped both at step 21,
0.06 s later. It sees SIGTERM only (not SIGINT), and a Python handler for SIGTERM replaces its
C++ one, so the single-process path would be a second mechanism. The all-gather costs 3-8 ms a
step on that setup (a tiny step takes about 1 s, a SmolLM2 step on CPU about 50 s); one process
needs no collective. While `train()` runs, JAX's notifier is replaced, and on exit SIGTERM gets
back the handler Python knew of (SIG_DFL when JAX's C++ one was installed).
"""

from __future__ import annotations

import platform
import signal
import sys

SA_RESETHAND = 0x80000000  # Linux, <asm-generic/signal-defs.h>

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def any_process(flag: bool) -> bool:
    """True when `flag` is set on any process of the run: an all-gather across processes (a
    collective: every process must call it at the same point), the flag itself with one."""
    import jax

    if jax.process_count() == 1:
        return bool(flag)
    import numpy as np
    from jax.experimental import multihost_utils

    flags = multihost_utils.process_allgather(np.array([int(flag)], np.int32))
    return bool(np.max(flags))


def reset_on_first_delivery(sig: int) -> bool:
    """Add `SA_RESETHAND` to the handler installed for `sig`, so the kernel restores the default
    action as it delivers the first `sig`. Linux on x86_64 / aarch64 (glibc and musl share this
    `struct sigaction` layout); elsewhere nothing changes. Returns whether it was set."""
    if not sys.platform.startswith("linux") or platform.machine() not in ("x86_64", "aarch64"):
        return False
    import ctypes

    class Sigaction(ctypes.Structure):
        _fields_ = [("handler", ctypes.c_void_p), ("mask", ctypes.c_ulong * (128 // 8)),
                    ("flags", ctypes.c_uint), ("restorer", ctypes.c_void_p)]

    libc, action = ctypes.CDLL(None, use_errno=True), Sigaction()
    if libc.sigaction(sig, None, ctypes.byref(action)) != 0:
        return False
    action.flags |= SA_RESETHAND
    return libc.sigaction(sig, ctypes.byref(action), None) == 0


class StopSignals:
    """Context manager: inside it, SIGTERM and SIGINT only record that a stop was asked for
    (`received`: the first signal's name, e.g. "SIGTERM"); leaving it restores the handlers.

    Raises nothing: off the main thread it installs nothing (`installed` is False)."""

    def __init__(self):
        self.received: str | None = None
        self._previous: dict = {}

    @property
    def installed(self) -> bool:
        return bool(self._previous)

    def __enter__(self) -> "StopSignals":
        try:
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._record)
            reset_on_first_delivery(signal.SIGINT)
        except ValueError:  # not the main thread of the main interpreter
            self._restore()
        return self

    def __exit__(self, *exc) -> bool:
        self._restore()
        return False

    def _restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        self._previous = {}

    def _record(self, signum, frame) -> None:
        # no print here: the main thread may be inside a write to the same stream (re-entrant)
        if self.received is None:
            self.received = signal.Signals(signum).name
        if signum == signal.SIGINT:  # a second Ctrl-C: the default action, at once
            signal.signal(signal.SIGINT, signal.SIG_DFL)

    def stop_agreed(self) -> bool:
        """Whether any process of the run received a stop signal (collective with several
        processes: call it at the same step boundary on every one)."""
        return any_process(self.received is not None)


class WallClockBudget:
    """`train.max_minutes`: a wall-clock budget that ends a run at a step boundary, for
    comparisons at equal wall time (docs/training.md "Held-out evaluation").

    `WallClockBudget(minutes)` starts the clock (`time.monotonic`); `minutes=None` is no budget.
    `spent()` is whether it has run out on any process (collective with several processes, as
    `StopSignals.stop_agreed`: call it at the same step boundary on every one)."""

    def __init__(self, minutes: float | None):
        import time

        self._now = time.monotonic
        self.minutes = minutes
        self.deadline = None if minutes is None else self._now() + 60.0 * minutes

    def spent(self) -> bool:
        return self.deadline is not None and any_process(self._now() >= self.deadline)
