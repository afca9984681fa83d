"""The run directory (`train.output_dir`): who may write it, and what a resume keeps.

- `check_writable` fails before any model loads when the directory cannot be created or
  written (a file in its place, a read-only filesystem).
- `RunLock` holds an exclusive `fcntl` lock on `<output_dir>/.lock` for the life of a run, so
  a second run into the same directory is refused instead of interleaving its metrics and
  checkpoints with the first (the OS drops the lock when the process dies, so a crashed run
  leaves nothing to clean up).
- `logged_steps` / `supersede_metrics`: a run interrupted after its last checkpoint has logged
  steps that a resume will run again; those rows move from `metrics.jsonl` to
  `metrics.superseded.jsonl` (kept, not deleted) so the metrics hold each step once.
"""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

from ppo_jax.trainer.config import ConfigError

METRICS, SUPERSEDED, LOCK = "metrics.jsonl", "metrics.superseded.jsonl", ".lock"


def check_writable(out: Path) -> None:
    """Create `out` if needed and check a file can be written there. Raises ConfigError."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"train.output_dir={str(out)!r} cannot be written: "
                          f"{e.strerror or e}") from None


class RunLock:
    """Exclusive lock on `<out>/.lock`; `release()` (or process exit) frees it."""

    def __init__(self, out: Path):
        self.path = out / LOCK
        self._fd = None
        self._made = not self.path.exists()  # this run made the lock file: abandon() removes it
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            self._fd = None
            raise ConfigError(f"train.output_dir={str(out)!r} is in use by another running "
                              "train.py (it holds .lock); wait for it or choose another "
                              "train.output_dir") from None
        os.ftruncate(self._fd, 0)
        os.write(self._fd, str(os.getpid()).encode())

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def abandon(self, remove_dir: bool) -> None:
        """Release the lock after a start-up error and remove the lock file if this run made
        it, and the directory too when `remove_dir` (this run created it) and it is empty, so a
        run refused at start-up leaves nothing behind."""
        if self._fd is not None and self._made:
            self.path.unlink(missing_ok=True)  # still held: no other run can have taken it
        self.release()
        if remove_dir:
            try:
                self.path.parent.rmdir()
            except OSError:  # not empty: keep what is in it
                pass

    def __del__(self):  # a trainer dropped without train() (e.g. an error while loading)
        self.release()


def _rows(path: Path) -> list[str]:
    return [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()] \
        if path.is_file() else []


def logged_steps(out: Path) -> list[int]:
    """Steps recorded in `<out>/metrics.jsonl` (empty when there is none)."""
    return [int(json.loads(line)["step"]) for line in _rows(out / METRICS)]


def supersede_metrics(out: Path, step: int) -> int:
    """Move the rows of steps after `step` to `metrics.superseded.jsonl`; returns how many.

    The kept rows are written to a temporary file that replaces `metrics.jsonl` atomically,
    after the moved rows are appended to the superseded file, so no row is lost on a crash.
    """
    rows = _rows(out / METRICS)
    later = [r for r in rows if int(json.loads(r)["step"]) > step]
    if not later:
        return 0
    with open(out / SUPERSEDED, "a", encoding="utf-8") as f:
        f.write("".join(r + "\n" for r in later))
    tmp = out / (METRICS + ".tmp")
    tmp.write_text("".join(r + "\n" for r in rows if int(json.loads(r)["step"]) <= step),
                   encoding="utf-8")
    tmp.replace(out / METRICS)
    return len(later)
