"""The jitted programs of a trainer's step, with abstract arguments, for ahead-of-time compiles.

A trainer built with `StageTrainer.abstract(cfg, devices)` holds `jax.ShapeDtypeStruct`s in
place of arrays. Its `programs()` lists the very jitted functions `step()` calls, each with
the arguments of its widest call, so `Program.lower()` lowers what a run
would run: same shardings, dtypes, remat, donation. `ppo_jax.aot` compiles them for a TPU
topology and reads their memory and costs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import jax

from ppo_jax.trainer.placement import Placement, shapes_of


@dataclass
class Program:
    """One jitted function of a step.

    Attributes:
      name: its row in the report ("sampler", "experience", "update", ...).
      fn: the `jax.jit`-wrapped function the trainer calls.
      args: its positional arguments, `ShapeDtypeStruct` pytrees with shardings.
      per_step: calls per steady-state step (1 / eval.every for the evaluation; 0 for a
        program that runs only in some steps, e.g. the critic warm-up's update).
      note: when it runs, if not every step.
      while_trips: iterations of its `while` loops, for the jaxpr FLOP count
        (`aot.flops`): the sampler's decode loop runs at most `max_new_tokens - 1`.
    """

    name: str
    fn: Any
    args: tuple
    per_step: float = 1.0
    note: str = ""
    while_trips: int = 1

    def lower(self):
        """`fn.lower(*args)`: the `jax.stages.Lowered` of this program."""
        return self.fn.lower(*self.args)


def batch_shape(place: Placement, shape: Sequence[int], dtype) -> jax.ShapeDtypeStruct:
    """An abstract batch array: dim 0 split over ("data", "fsdp") as every batch of a run."""
    return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=place.by_row)


def out_shapes(fn, args: tuple, shardings) -> Any:
    """The outputs of `fn(*args)` as `ShapeDtypeStruct`s (traced, not compiled), each with
    `shardings` (a sharding for every leaf, or a same-structure tree)."""
    out = jax.eval_shape(fn, *args)
    if isinstance(shardings, jax.sharding.Sharding):
        return shapes_of(out, lambda _: shardings)
    return shapes_of(out, shardings)
