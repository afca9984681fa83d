"""Counted matmul FLOPs of jitted JAX functions (ppo_jax.aot.flops on the jaxpr: a scan body times
its length, a cond's costliest branch, while loops once and reported), XLA's cost analysis beside
it (a while body once: it undercounts scanned layers); `SignatureRecorder` counts after timing.
"""

from __future__ import annotations

import jax

from ppo_jax.aot.flops import jaxpr_matmul_flops


def xla_flops(compiled) -> float | None:
    """`cost_analysis()["flops"]` of a `Compiled` (a dict, or one per device); None if unreported."""
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
    return {"flops": flops, "loops": loops,
            "xla_flops": xla_flops(traced.lower().compile()) if with_xla else None}


class SignatureRecorder:
    """Calls `fn`, recording each call's abstract arguments (`calls`: a signature key per call;
    `specs[key]`); `per_call()`: `count_flops` of each call (one trace per signature)."""

    def __init__(self, fn):
        self.fn, self.calls, self.specs = fn, [], {}

    def __call__(self, *args):
        specs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=getattr(x, "sharding", None))
            if hasattr(x, "shape") and hasattr(x, "dtype") else x, args)
        leaves, treedef = jax.tree.flatten(specs)
        key = (treedef, tuple(leaves))
        self.specs.setdefault(key, specs)
        self.calls.append(key)
        return self.fn(*args)

    def per_call(self, with_xla: bool = True) -> list[dict]:
        counts = {key: count_flops(self.fn, *specs, with_xla=with_xla)
                  for key, specs in self.specs.items()}
        return [counts[key] for key in self.calls]
