"""orbax checkpoints of a run: train states, KL controller, RNG, and the data position.

Layout under `<output_dir>/checkpoints/<step>/`: `state` (a pytree of arrays, written
collectively by every process with orbax's StandardSave) and `meta` (JSON: step, data position,
config). Saving is synchronous and atomic (orbax writes a temporary folder and renames it), so an
error mid-run never leaves a half checkpoint that `--resume` would pick up.
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


class Checkpointer:
    """Thin wrapper over `orbax.checkpoint.CheckpointManager`."""

    def __init__(self, directory: str | Path, *, max_to_keep: int = 2):
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                               enable_async_checkpointing=False)
        self.manager = ocp.CheckpointManager(self.directory, options=options,
                                             item_names=("state", "meta"))

    def save(self, step: int, state: Any, meta: dict) -> None:
        """Write checkpoint `step` (a pytree of arrays + a JSON-able dict) and wait for it."""
        self.manager.save(int(step), args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True)
        self.manager.wait_until_finished()

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
