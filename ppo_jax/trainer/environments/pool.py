"""A bounded pool of environment calls: at most `concurrency` run at once, each under its own
`timeout_s`, measured from the moment it starts (not from when it was queued).

    pool = CallPool(concurrency=32, timeout_s=10.0)
    call = pool.submit(env.step, state, text)   # runs now, or once a place is free
    pool.wait([call], timeout_s=0.5)            # until it finishes or expires, at most 0.5 s
    call.status                                 # "done" (value / error), "expired", "refused"

Each call runs in a daemon thread of its own: Python cannot stop a thread, and a call that never
returns must neither keep the process alive at exit nor hold a place of the pool. At its
deadline a running call is **expired**: its place goes to the next queued call, its thread is
abandoned (counted in `hung` until it returns; its late value is dropped). Expiry is noticed
when the pool is used (`submit`, `poll`, `wait`), which the episode driver does at every chunk
boundary of the engine, so a hung call gives its place up within one chunk of its deadline.

Abandoned threads are capped: while `hung` >= `max_hung` (default 4 x `concurrency`) a queued
call is **refused** at once instead of started, so an environment whose every call hangs cannot
grow the process's threads without bound; its episodes fail, and `env.max_failed_steps` stops
a run whose every episode fails. A hung call that returns frees its count.

The shape is that of `concurrent.futures.ThreadPoolExecutor` with a per-call deadline; verl's
agent loop and OpenRLHF's multi-turn executor bound their tool calls with an asyncio semaphore
the same way. The code is this project's own.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any, Callable, Optional, Sequence

QUEUED, RUNNING, DONE, EXPIRED, REFUSED = "queued", "running", "done", "expired", "refused"
HUNG_PER_PLACE = 4  # abandoned threads allowed per place of the pool (`max_hung`)


class Call:
    """One call of the pool: `fn(*args)`, its `status` (module doc) and, when done, its
    `value` or the `error` it raised; `started`: `time.monotonic()` when it began."""

    def __init__(self, fn: Callable, args: tuple):
        self.fn, self.args = fn, args
        self.status, self.started = QUEUED, None
        self.value: Any = None
        self.error: Optional[BaseException] = None

    @property
    def finished(self) -> bool:
        """Done, expired or refused: its outcome will not change."""
        return self.status in (DONE, EXPIRED, REFUSED)


class CallPool:
    """At most `concurrency` calls at once, each expired `timeout_s` after it starts (None: no
    limit); at most `max_hung` abandoned threads (module doc).

    Raises:
      ValueError: `concurrency` not an int >= 1, `timeout_s` not positive or None, `max_hung`
        not an int >= 1.
    """

    def __init__(self, concurrency: int, timeout_s: Optional[float],
                 max_hung: Optional[int] = None):
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
            raise ValueError(f"concurrency={concurrency!r} must be an int >= 1")
        if timeout_s is not None and not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
            raise ValueError(f"timeout_s={timeout_s!r} must be a positive number of seconds "
                             "or None")
        max_hung = HUNG_PER_PLACE * concurrency if max_hung is None else max_hung
        if isinstance(max_hung, bool) or not isinstance(max_hung, int) or max_hung < 1:
            raise ValueError(f"max_hung={max_hung!r} must be an int >= 1")
        self.concurrency, self.timeout_s, self.max_hung = concurrency, timeout_s, max_hung
        self.hung = 0  # threads of expired calls still running
        self.peak = 0  # the most calls running at once so far
        self._queue: deque[Call] = deque()
        self._running: set[Call] = set()
        self._cond = threading.Condition()

    def submit(self, fn: Callable, *args) -> Call:
        """Queue `fn(*args)`; it starts at once when the pool has a free place."""
        call = Call(fn, args)
        with self._cond:
            self._queue.append(call)
            self._advance()
        return call

    def poll(self) -> None:
        """Expire the running calls past their deadline and start queued ones in their
        places (`wait` does the same)."""
        with self._cond:
            self._advance()

    def wait(self, calls: Sequence[Call], timeout_s: Optional[float] = None, *,
             every: bool = False) -> None:
        """Block until one of `calls` (with `every`, all of them) is finished, or `timeout_s`
        seconds pass (None: no limit). Wakes at each deadline of a running call to expire it.
        Returns at once for no calls."""
        end = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while True:
                self._advance()
                finished = [c.finished for c in calls]
                if not calls or (all(finished) if every else any(finished)):
                    return
                now = time.monotonic()
                wake = [d - now for d in (end, self._next_deadline()) if d is not None]
                if end is not None and end <= now:
                    return
                self._cond.wait(max(min(wake), 0.0) if wake else None)

    # ------------------------------------------------------------------ under the lock
    def _advance(self) -> None:
        """Expire overdue calls, then fill the free places from the queue."""
        now = time.monotonic()
        if self.timeout_s is not None:
            for call in [c for c in self._running if now - c.started >= self.timeout_s]:
                call.status = EXPIRED
                self._running.discard(call)
                self.hung += 1
        while self._queue and len(self._running) < self.concurrency:
            call = self._queue.popleft()
            if self.hung >= self.max_hung:
                call.status = REFUSED
                continue
            call.status, call.started = RUNNING, time.monotonic()
            self._running.add(call)
            threading.Thread(target=self._work, args=(call,), name="environment-call",
                             daemon=True).start()
        self.peak = max(self.peak, len(self._running))
        self._cond.notify_all()

    def _next_deadline(self) -> Optional[float]:
        if self.timeout_s is None or not self._running:
            return None
        return min(c.started for c in self._running) + self.timeout_s

    def _work(self, call: Call) -> None:
        try:
            value, error = call.fn(*call.args), None
        except BaseException as e:  # noqa: BLE001 - reported through the call, never raised
            value, error = None, e
        with self._cond:
            if call.status == EXPIRED:  # abandoned at its deadline: the late value is dropped
                self.hung -= 1
            else:
                call.value, call.error, call.status = value, error, DONE
                self._running.discard(call)
            self._advance()
