"""orbax checkpoints of a run: train states, KL controller, RNG, and the data position.

Layout under `<output_dir>/checkpoints/<step>/`: `state` (a pytree of arrays, written
collectively by every process with orbax's StandardSave) and `meta` (JSON: step, data
position). Saving is synchronous and atomic (orbax writes `<step>.orbax-checkpoint-tmp` and renames
it when complete), so an error mid-run never leaves a half checkpoint that `--resume` would pick
up. A write that fails (disk full, a permission error) raises `CheckpointWriteError` naming the
step and the cause; orbax deletes checkpoints beyond `max_to_keep` only after a new one is
complete, so the previous one stays, and the next save of that step replaces the temporary
folder (measured with orbax 0.12.8, tests/trainer/test_preemption.py).

A finished checkpoint that cannot be read back (a truncated or damaged file: disk errors, a copy
cut short) raises `CheckpointReadError` naming the step, the file and the cause in one line,
instead of orbax's and tensorstore's tracebacks (`damage_of`; tests/trainer/test_resume_trust.py).
"""

from __future__ import annotations

import json
import logging
import re
import sys
import threading
import traceback
import warnings
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp


def finished_steps(directory: str | Path) -> list[int]:
    """Sorted steps of the finished checkpoints under `directory` (none if it does not exist),
    read without creating anything."""
    directory = Path(directory)
    return sorted(ocp.utils.checkpoint_steps(directory)) if directory.is_dir() else []


class CheckpointWriteError(RuntimeError):
    """A checkpoint was not written; the message names its step, the cause and the step kept."""


class CheckpointReadError(ValueError):
    """A finished checkpoint cannot be read back: `step`, `file` (the damaged file, or the
    folder holding it when the reader does not say which) and `cause`, all in the message."""

    def __init__(self, step: int, file: Path, cause: str):
        self.step, self.file, self.cause = step, Path(file), cause
        super().__init__(f"checkpoint of step {step} cannot be read: {file}: {cause}")


JSON_FILES = ("state/_METADATA", "meta/metadata")  # orbax's tree metadata, our meta dict
_STATUS = re.compile(r"\b([A-Z_]{4,}): ")  # a tensorstore status code: DATA_LOSS, OUT_OF_RANGE, ...
_LOCAL_FILE = re.compile(r'local file "([^"]+)"')
_ARRAY = re.compile(r'Error reading "([^"/]+)/[^"]*" in OCDBT')
_SIZE = re.compile(r"value of size (\d+)")


def check_files(step: int, step_dir: Path) -> None:
    """The JSON files a restore reads first are there and parse (a missing or cut `_METADATA`
    otherwise reads as a checkpoint of another tree).

    Raises:
      CheckpointReadError: naming the file and what is wrong with it.
    """
    for name in JSON_FILES:
        path = step_dir / name
        if not path.is_file():
            raise CheckpointReadError(step, path, "missing")
        try:
            json.loads(path.read_bytes())
        except OSError as e:
            raise CheckpointReadError(step, path, f"{type(e).__name__}: {e.strerror or e}") from None
        except ValueError as e:  # UnicodeDecodeError and JSONDecodeError among them
            raise CheckpointReadError(step, path, f"not valid JSON, damaged or truncated "
                                      f"({size_of(path)}; {e})") from None


def size_of(path: Path) -> str:
    n = path.stat().st_size
    return "empty" if n == 0 else f"{n:,} bytes"


def _chain(e: BaseException):
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


class _Orphans:
    """While a restore runs and after one failed, orbax's other reads of that checkpoint can fail
    too, late and on tensorstore's threads: their callbacks find orbax's event loop closed
    ("RuntimeError: Event loop is closed" from `call_soon_threadsafe`), and their coroutines and
    futures, once collected, print tracebacks with whole tensorstore specs or log "Future
    exception was never retrieved". `quiet(step_dir)` drops those (the ones naming `step_dir`,
    and closed-loop callbacks off the main thread) from `sys.unraisablehook` and the asyncio
    log (and orbax's never-awaited read coroutines from warnings), for as long as a mark is
    set; anything else is passed on."""

    marks: set[str] = set()  # "<step_dir>/" of the restores in flight or failed
    installed = False

    @classmethod
    def quiet(cls, step_dir: Path) -> None:
        if not cls.installed:
            previous = sys.unraisablehook

            def hook(unraisable):
                if not cls.drops(unraisable.exc_value, unraisable.exc_traceback):
                    previous(unraisable)

            sys.unraisablehook = hook
            logging.getLogger("asyncio").addFilter(
                lambda record: not cls.names_one(record.getMessage()))
            warnings.filterwarnings("ignore", "coroutine '_read_array_index_and_device_put' was "
                                    "never awaited", RuntimeWarning)  # orbax's, cancelled
            cls.installed = True
        cls.marks.add(f"{step_dir}/")

    @classmethod
    def names_one(cls, text: str) -> bool:
        return any(mark in text for mark in cls.marks)

    @classmethod
    def drops(cls, value: BaseException, tb) -> bool:
        if not cls.marks:
            return False
        closed_loop = (isinstance(value, RuntimeError) and str(value) == "Event loop is closed"
                       and threading.current_thread() is not threading.main_thread()
                       and "call_soon_threadsafe" in [f.name for f in traceback.extract_tb(tb)])
        return closed_loop or cls.names_one(str(value))


def damage_of(step_dir: Path, error: BaseException) -> tuple[Path, str] | None:
    """(file, cause) when `error` (orbax's, from restoring the checkpoint in `step_dir`) is a
    file that cannot be read: a tensorstore status (DATA_LOSS, OUT_OF_RANGE, ...) or an OS
    error; None for anything else (a tree that does not fit, a bug). An array's data file is
    found by the size tensorstore reports for it; else the folder and the array are named."""
    for e in _chain(error):
        if isinstance(e, OSError) and getattr(e, "filename", None):
            return Path(e.filename), f"{type(e).__name__}: {e.strerror or e}"
        text = str(e).split(" [tensorstore_spec", 1)[0]
        status = _STATUS.search(text)
        files = _LOCAL_FILE.findall(text)
        if not (status and files):
            continue
        detail = text.rsplit(f'"{files[-1]}": ', 1)[-1]
        cause, path = f"{status.group(1)}: {detail}", Path(files[-1])
        array = _ARRAY.search(text)
        if array and path.is_dir():
            cause += f" (reading array {array.group(1)})"
        size = _SIZE.search(detail)
        if path.is_dir() and size:
            same = [p for p in sorted(path.rglob("*")) if p.is_file()
                    and p.stat().st_size == int(size.group(1))]
            if len(same) == 1:
                path, cause = same[0], cause + "; the file is shorter than its index says: truncated"
        return path, cause[:600]
    return None


def misfit(step_dir: Path, error: BaseException, state: str) -> str:
    """The line for a checkpoint in `step_dir` that reads but whose tree does not fit `state`
    (the train state it was restored into, in words), with orbax's `error` cut short."""
    return (f"checkpoint {step_dir} does not fit {state}: was it written with other stage or "
            "model.* settings (shared_critic, actor, critic, param_dtype, lora.*)? "
            f"({type(error).__name__}: {' '.join(str(error)[:300].split())})")


class Checkpointer:
    """Thin wrapper over `orbax.checkpoint.CheckpointManager`."""

    def __init__(self, directory: str | Path, *, max_to_keep: int = 2):
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                               enable_async_checkpointing=False)
        self.manager = ocp.CheckpointManager(self.directory, options=options,
                                             item_names=("state", "meta"))

    def save(self, step: int, state: Any, meta: dict) -> None:
        """Write checkpoint `step` (a pytree of arrays + a JSON-able dict) and wait for it.

        Raises:
          CheckpointWriteError: the write failed (from the orbax / OS error, chained); earlier
            checkpoints are kept.
        """
        try:
            self.manager.save(int(step), args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True)
            self.manager.wait_until_finished()
        except Exception as e:  # any failure means step `step` is not on disk
            kept = finished_steps(self.directory)
            last = (f"the last checkpoint kept is step {kept[-1]} ({self.directory / str(kept[-1])}), "
                    "which --resume continues from" if kept else
                    "no earlier checkpoint is kept, so --resume starts over")
            raise CheckpointWriteError(
                f"checkpoint of step {step} was not written to {self.directory} "
                f"({type(e).__name__}: {str(e)[:300]}); {last}") from e

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def restore(self, step: int, like: Any) -> tuple[Any, dict]:
        """Read checkpoint `step` into the structure, dtypes and shardings of `like`.

        Raises:
          FileNotFoundError: no checkpoint `step` under the directory.
          CheckpointReadError: a file of it is missing, truncated or damaged (step, file, cause).
          ValueError / KeyError / TypeError: from orbax, a tree that does not fit `like`
            (`misfit` words it).
        """
        if step not in self.manager.all_steps():
            raise FileNotFoundError(f"no checkpoint for step {step} in {self.directory}")
        step_dir = self.directory / str(step)
        check_files(step, step_dir)
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        damage = None
        _Orphans.quiet(step_dir)  # until the restore succeeds (a failed one reports late)
        try:
            out = self.manager.restore(int(step), args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
        except Exception as e:
            damage = damage_of(step_dir, e)
            if damage is None:
                raise
        if damage is not None:  # raised here, the error holds none of orbax's frames
            raise CheckpointReadError(step, *damage)
        _Orphans.marks.discard(f"{step_dir}/")
        return out["state"], dict(out["meta"])

    def reload(self) -> None:
        """Read the list of checkpoints again (after folders were moved by hand or by
        `run_dir.supersede_checkpoints`)."""
        self.manager.reload()

    def close(self) -> None:
        self.manager.close()
