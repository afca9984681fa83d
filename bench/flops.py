"""Counted FLOPs of jitted JAX functions, for the benchmarks (ppo_step.py, roofline.py).

Two counts of one compiled function:

- `jaxpr_matmul_flops`: the matrix-multiply FLOPs of its jaxpr, `2 * prod(out.shape) * K` per
  `dot_general` (K = product of the contracted dimensions; batch dimensions are in the output),
  each `scan` body counted `length` times, a `cond` by its costliest branch. Attention's
  `q k^T` and `p v` are matmuls and are counted; elementwise work (softmax, norms, Adam) is
  not. This is the figure the benchmarks quote as "model FLOPs": it is what the program
  executes, LM head on response positions only, recomputation under remat included.
- `xla_flops`: XLA's `compiled.cost_analysis()["flops"]`, beside it for reference. XLA's
  `HloCostAnalysis` counts a `while` body ONCE whatever its trip count, and `lax.scan` compiles
  to a `while`: with the layers in a scan (ppo_jax.models.layers.scan_layers) it undercounts a
  model by about its depth. The tests pin both behaviours on a scanned matmul.

`while_loop`s (trip count unknown from the jaxpr) are counted once and reported in `loops`.
The jaxpr count lives in `ppo_jax.aot.flops` (`train.py --compile-for` uses it too).

`SignatureRecorder` wraps a jitted function without changing what it runs and remembers each
call's abstract arguments, so the counts are taken after the timed steps (no extra work inside
them); tracing again with `ShapeDtypeStruct`s hits JAX's compilation cache.
"""

from __future__ import annotations

import jax

from ppo_jax.aot.flops import dot_general_flops, jaxpr_matmul_flops  # noqa: F401 - re-exported


def xla_flops(compiled) -> float | None:
    """`cost_analysis()["flops"]` of a `Compiled` (a dict, or a list of one per device in older
    JAX); None where the backend does not report it."""
    try:
        ca = compiled.cost_analysis()
    except Exception:  # noqa: BLE001 - not every backend implements cost analysis
        return None
    if isinstance(ca, (list, tuple)):
        ca = ca[0] if ca else None
    flops = (ca or {}).get("flops")
    return None if flops is None or flops < 0 else float(flops)


def count_flops(jitted, *args, with_xla: bool = True) -> dict:
    """Counts of `jitted(*args)` (arrays or `ShapeDtypeStruct`s): `{"flops", "loops",
    "xla_flops"}`; `xla_flops` is None when `with_xla` is False or unreported."""
    traced = jitted.trace(*args)
    flops, loops = jaxpr_matmul_flops(traced.jaxpr)
    xla = xla_flops(traced.lower().compile()) if with_xla else None
    return {"flops": flops, "loops": loops, "xla_flops": xla}


def abstract(tree):
    """`tree` with every array replaced by a `ShapeDtypeStruct` (shape, dtype, sharding)."""
    def spec(x):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            return x
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))
    return jax.tree.map(spec, tree)


class SignatureRecorder:
    """Calls `fn` unchanged; records each call's abstract arguments.

    `calls`: one signature key per call, in order; `specs[key]`: the `ShapeDtypeStruct` args.
    `per_call(with_xla)`: the `count_flops` of each recorded call (one trace per signature).
    """

    def __init__(self, fn):
        self.fn, self.calls, self.specs = fn, [], {}

    def __call__(self, *args):
        specs = abstract(args)
        leaves, treedef = jax.tree.flatten(specs)
        key = (treedef, tuple(leaves))
        self.specs.setdefault(key, specs)
        self.calls.append(key)
        return self.fn(*args)

    def per_call(self, with_xla: bool = True) -> list[dict]:
        counts = {key: count_flops(self.fn, *specs, with_xla=with_xla)
                  for key, specs in self.specs.items()}
        return [counts[key] for key in self.calls]
