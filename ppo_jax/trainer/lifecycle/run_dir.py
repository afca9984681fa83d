"""The run directory (`train.output_dir`): who may write it, and what a resume keeps.

- `check_writable` fails before any model loads when the directory cannot be created or
  written (a file in its place, a read-only filesystem).
- `RunLock` holds an exclusive `fcntl` lock on `<output_dir>/.lock` for the life of a run, so
  a second run into the same directory is refused instead of interleaving its metrics and
  checkpoints with the first (the OS drops the lock when the process dies, so a crashed run
  leaves nothing to clean up).
- `logged_steps` / `supersede_rows`: a run interrupted after its last checkpoint has logged
  steps that a resume will run again; those rows move from `metrics.jsonl` and `samples.jsonl`
  to `metrics.superseded.jsonl` and `samples.superseded.jsonl` (kept, not deleted) so the
  logs hold each step once; `supersede_checkpoints` moves the checkpoints after the step a
  resume continues from (an earlier step asked for, or a damaged newest one) to
  `checkpoints.superseded/`, so they are kept and the run can write those steps again.
- `config.json` is the config a run was started with and is never overwritten; a resume that
  changes settings writes its own `config.resume-<step>.json` beside it (`write_run_config`).
  `config_in_effect` finds the one a checkpoint continues under, `config_of_step` the one a
  step trained under. Config files that no longer apply (a resume's from a later checkpoint
  when the run goes on from an earlier one; any left by a start that wrote no checkpoint,
  when a new run starts there) are moved aside, kept (`supersede_configs`).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
from pathlib import Path

from ppo_jax.trainer.config import ConfigError

METRICS, SUPERSEDED, LOCK = "metrics.jsonl", "metrics.superseded.jsonl", ".lock"
SAMPLES, OLD_SAMPLES = "samples.jsonl", "samples.superseded.jsonl"
CONFIG, OLD_CHECKPOINTS = "config.json", "checkpoints.superseded"
_RESUME_CONFIG = re.compile(r"^config\.resume-(\d+)(?:-(\d+))?\.json$")


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


def supersede_rows(out: Path, step: int, name: str = METRICS, aside: str = SUPERSEDED) -> int:
    """Move the rows of `<out>/<name>` (JSON lines with a "step") of steps after `step` to
    `<out>/<aside>`; returns how many.

    The kept rows are written to a temporary file that replaces `name` atomically, after the
    moved rows are appended to `aside`, so no row is lost on a crash.
    """
    rows = _rows(out / name)
    later = [r for r in rows if int(json.loads(r)["step"]) > step]
    if not later:
        return 0
    with open(out / aside, "a", encoding="utf-8") as f:
        f.write("".join(r + "\n" for r in later))
    tmp = out / (name + ".tmp")
    tmp.write_text("".join(r + "\n" for r in rows if int(json.loads(r)["step"]) <= step),
                   encoding="utf-8")
    tmp.replace(out / name)
    return len(later)


def plural(n: int, noun: str) -> str:
    """"1 row", "2 rows"."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def supersede_checkpoints(out: Path, step: int) -> list[Path]:
    """Move the finished checkpoints of `<out>/checkpoints` after `step` to
    `<out>/checkpoints.superseded/<step>` (`<step>.2`, ... when that name is taken); returns
    where they went. A resume from `step` writes those steps again, and orbax writes no step
    that exists; nothing is deleted."""
    from ppo_jax.trainer.lifecycle.checkpoint import finished_steps

    moved = []
    for later in (s for s in finished_steps(out / "checkpoints") if s > step):
        target = out / OLD_CHECKPOINTS / str(later)
        n = 1
        while target.exists():
            n += 1
            target = out / OLD_CHECKPOINTS / f"{later}.{n}"
        target.parent.mkdir(exist_ok=True)
        (out / "checkpoints" / str(later)).rename(target)
        moved.append(target)
    return moved


def run_configs(out: Path) -> list[tuple[tuple[int, int], Path]]:
    """The config files of the run in `out`, oldest first: `config.json` as (0, 0), then each
    `config.resume-<step>[-<n>].json` as (step, n)."""
    found = [((0, 0), out / CONFIG)] if (out / CONFIG).is_file() else []
    for path in out.glob("config.resume-*.json") if out.is_dir() else ():
        m = _RESUME_CONFIG.match(path.name)
        if m:
            found.append(((int(m.group(1)), int(m.group(2) or 1)), path))
    return sorted(found)


def config_in_effect(out: Path, step: int) -> Path | None:
    """The config a resume from checkpoint `step` continues under: the newest of the run's
    config files written at a step <= `step` (None when the run has none)."""
    files = [path for (at, _), path in run_configs(out) if at <= step]
    return files[-1] if files else None


def config_of_step(out: Path, step: int) -> Path | None:
    """The config step `step` of the run trained under: the newest config file written at a
    checkpoint before `step` (a `config.resume-<k>.json` applies from step k + 1), i.e.
    `config_in_effect(step - 1)`; step 0 (the starting model, evaluated before any update)
    and step 1: the config of the start (None when the run has none)."""
    return config_in_effect(out, max(step - 1, 0))


def _read_json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def supersede_configs(out: Path, step: int, same: dict | None = None) -> list[tuple[Path, Path]]:
    """Move aside, kept, the run's config files written after checkpoint `step`
    (`config.json` counts as written at 0, so `step` -1, a new start, moves every one): a run
    going on from `step` trains those steps again under its own config. `same`: a
    `config.json` that says this stays. Each goes to `<name>.superseded.json` (`-2`, `-3`,
    ... when taken); returns the (old, new) paths."""
    moved = []
    for (at, _), path in run_configs(out):
        if at <= step or (same is not None and path.name == CONFIG and _read_json(path) == same):
            continue
        target, n = path.with_name(f"{path.stem}.superseded.json"), 1
        while target.exists():
            n += 1
            target = path.with_name(f"{path.stem}.superseded-{n}.json")
        path.rename(target)
        moved.append((path, target))
    return moved


def write_run_config(out: Path, config: dict, step: int) -> Path | None:
    """Record the config this start of the run trains with: `config.json` when the run has none,
    else, when it differs from `config_in_effect(step)`, a new `config.resume-<step>.json`
    (`-2`, `-3`, ... when taken). No file is ever overwritten; returns the file written (None
    when the config in effect already says the same)."""
    text = json.dumps(config, indent=2)
    current = config_in_effect(out, step)
    if current is not None and json.loads(current.read_text()) == json.loads(text):
        return None
    path, n = out / CONFIG if current is None else out / f"config.resume-{step}.json", 1
    while path.exists():
        n += 1
        path = out / f"config.resume-{step}-{n}.json"
    path.write_text(text)
    return path
