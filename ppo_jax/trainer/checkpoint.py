"""orbax checkpoints of a run: train states, KL controller, RNG, and the data position.

Layout under `<output_dir>/checkpoints/<step>/`: `state` (a pytree of arrays, written
collectively by every process with orbax's StandardSave) and `meta` (JSON: step, data position,
config). Saving is synchronous and atomic (orbax writes `<step>.orbax-checkpoint-tmp` and renames
it when complete), so an error mid-run never leaves a half checkpoint that `--resume` would pick
up. A write that fails (disk full, a permission error) raises `CheckpointWriteError` naming the
step and the cause; orbax deletes checkpoints beyond `max_to_keep` only after a new one is
complete, so the previous one stays, and the next save of that step replaces the temporary
folder (measured with orbax 0.12.8, tests/trainer/test_preemption.py).
"""

from __future__ import annotations

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
        """
        if step not in self.manager.all_steps():
            raise FileNotFoundError(f"no checkpoint for step {step} in {self.directory}")
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        out = self.manager.restore(int(step), args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
        return out["state"], dict(out["meta"])

    def close(self) -> None:
        self.manager.close()
