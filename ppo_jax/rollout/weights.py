"""The rollout copy of the actor's weights: cast and laid out for decoding, once per step.

Training keeps the actor sharded FSDP-style (`parallel.rules.RULES`): every weight matrix split
over `fsdp` too, gathered layer by layer inside each forward pass. A decode step is a forward
pass of one token per row, so the sampler would gather every weight once per decoded token
(docs/scaling.md measures it). Before sampling, the trainer makes one copy in an inference
layout instead (`generation.rollout_layout: tensor`, `parallel.rules.ROLLOUT_RULES`): the same
tensor splits, replicated over `data` and `fsdp`, so decoding gathers nothing; and in
`generation.param_dtype` when set (e.g. bfloat16: half the bytes read per decoded token, and the
rollout/trainer log-prob mismatch that `core.rollout_correction` measures and corrects). This is
verl's resharding of the actor into its inference engine, inside one mesh.
"""

from __future__ import annotations

from typing import Any, Literal, Optional

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from ppo_jax.parallel.rules import ROLLOUT_RULES, RULES, tree_shardings

ROLLOUT_LAYOUTS = ("auto", "tensor", "train")
RolloutLayout = Literal[ROLLOUT_LAYOUTS]  # generation.rollout_layout
PLACEMENTS = ("colocated", "split")  # where the rollout copy lives: docs/async_rl.md
RolloutPlacement = Literal[PLACEMENTS]  # generation.placement


def resolve_layout(layout: str, engine: str) -> str:
    """"auto": "tensor" for the paged engine, "train" for the static batch (compiled for
    v5e-256, the static sampler with a fsdp-replicated copy was partitioned into 1.1 million
    GiB of all-gathers a step: docs/rollout_engine.md); else `layout`. Raises ValueError."""
    if layout not in ROLLOUT_LAYOUTS:
        raise ValueError(f"generation.rollout_layout={layout!r}; one of {ROLLOUT_LAYOUTS}")
    if layout == "auto":
        return "tensor" if engine == "paged" else "train"
    return layout


def rollout_rules(layout: str):
    """The partition rules of the rollout copy: "tensor" (replicated over data / fsdp) or
    "train" (the training layout: no copy for the layout's sake). Raises ValueError."""
    if layout not in ROLLOUT_LAYOUTS[1:]:
        raise ValueError(f"rollout layout {layout!r}; one of {ROLLOUT_LAYOUTS[1:]} (resolved)")
    return ROLLOUT_RULES if layout == "tensor" else RULES


def needs_rollout_copy(mesh: Optional[Mesh], layout: str, param_dtype: Optional[str]) -> bool:
    """Whether sampling needs its own copy: a dtype to cast to, or an fsdp axis to drop."""
    rollout_rules(layout)
    fsdp = mesh is not None and mesh.shape["fsdp"] > 1
    return param_dtype is not None or (layout == "tensor" and fsdp)


def cast_floats(params: Any, dtype: Optional[str]) -> Any:
    """Every floating-point leaf of `params` in `dtype` (None: unchanged)."""
    if dtype is None:
        return params
    dt = jnp.dtype(dtype)
    return jax.tree.map(lambda x: x.astype(dt) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                        params)


def rollout_copy_fn(params: Any, mesh: Optional[Mesh], layout: str, param_dtype: Optional[str]):
    """A jitted `params -> rollout params` that casts and lays them out by
    `rollout_rules(layout)`, or None when `needs_rollout_copy` says sampling can use the
    training params as they are.

    `params` may be arrays or `jax.ShapeDtypeStruct`s (only their tree and shapes are read)."""
    if not needs_rollout_copy(mesh, layout, param_dtype):
        return None
    if mesh is None:
        return jax.jit(lambda p: cast_floats(p, param_dtype))
    out = tree_shardings(params, mesh, rollout_rules(layout))
    return jax.jit(lambda p: cast_floats(p, param_dtype), out_shardings=out)
