"""A wall-clock limit on a call of user code (`reward.timeout_s`), kept in the calling thread.

The call stays in the thread that makes it because math-verify (`verifiers.math_correct`)
times its own parses with `signal.alarm`, which only works in the main thread: moved to a
worker thread, every `parse` would raise. So in the main thread a watchdog timer sends
`WATCHDOG_SIGNAL` to it when the time is up, and the handler installed for the call raises
`Expired` there: a loop, a `time.sleep`, a lock or a socket wait all stop. (math-verify's
SIGALRM is another signal and timer, so neither limit disturbs the other.) Called from any
other thread, where no handler can be installed, the call runs in a daemon worker thread
and is abandoned when the time is up.

Not stoppable: a single C call that holds the GIL and never returns to Python (a catastrophic
regular expression, say), and, in the main thread, code that replaces or ignores
`WATCHDOG_SIGNAL`'s handler while it runs; the run then waits as it would without a limit.
"""

from __future__ import annotations

import signal
import threading
from typing import Any, Callable, Optional

WATCHDOG_SIGNAL = getattr(signal, "SIGUSR2", None)  # one no library in the run uses


class Expired(BaseException):
    """The call ran past its limit. A BaseException (as KeyboardInterrupt), so that the user
    code's own `except Exception` cannot swallow it."""


def call_with_deadline(fn: Callable[[], Any], timeout_s: Optional[float]) -> Any:
    """`fn()`, stopped after `timeout_s` seconds (None: no limit).

    Raises:
      Expired: `fn` had not returned after `timeout_s` seconds.
      whatever `fn` raises.
    """
    if timeout_s is None:
        return fn()
    if (threading.current_thread() is not threading.main_thread() or WATCHDOG_SIGNAL is None
            or not hasattr(signal, "pthread_kill")):
        return _in_worker(fn, timeout_s)
    armed = [True]

    def expire(signum, frame):
        if armed[0]:  # a signal that lands after the call returned is ignored
            raise Expired()

    previous = signal.signal(WATCHDOG_SIGNAL, expire)
    timer = threading.Timer(timeout_s, signal.pthread_kill,
                            (threading.main_thread().ident, WATCHDOG_SIGNAL))
    timer.daemon = True
    timer.start()
    try:
        return fn()
    finally:
        armed[0] = False
        timer.cancel()
        timer.join()  # a signal already sent is delivered before the handler is put back
        signal.signal(WATCHDOG_SIGNAL, previous)


def _in_worker(fn: Callable[[], Any], timeout_s: float) -> Any:
    """`fn()` in a daemon thread, waited for `timeout_s` seconds (left running after that)."""
    out: dict = {}

    def run():
        try:
            out["result"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            out["error"] = e

    worker = threading.Thread(target=run, daemon=True, name="user-code-call")
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise Expired()
    if "error" in out:
        raise out["error"]
    return out["result"]
