"""The project's own count of model FLOPs: the matrix multiplies of a traced program (jaxpr).

`jaxpr_matmul_flops(jaxpr)` counts `2 * prod(out.shape) * K` per `dot_general` (K = product of
the contracted dimensions; batch dimensions are in the output) and per `ragged_dot_general`
the rows each group really multiplies (an MoE's chosen experts only: model FLOPs of the
active parameters), each `scan` body `length`
times, a `cond` by its costliest branch, a `while` body `while_trips` times (the sampler's
decode loop: `max_new_tokens - 1`; 1 by default), a `shard_map` body once per device of its
manual axes (its shapes are one device's); of Pallas kernels, megablox's grouped matmuls, the
ragged paged attention and splash attention are counted from their operands, any other
counts 0. Attention's `q k^T` and `p v` are matmuls and
are counted; elementwise work (softmax, norms, Adam) is not. Recomputation under remat is in
the jaxpr and is counted; trace a program built with `model.remat=none` for model FLOPs
without it.

`count_flops(jitted, *args)` applies it to a jitted function's trace, XLA's cost analysis
beside it.
"""

from __future__ import annotations

import math

import jax.numpy as jnp


def dot_general_flops(eqn) -> int:
    """`2 * prod(out.shape) * K` of one `dot_general` equation (multiply + add per term)."""
    (lhs_contract, _), _ = eqn.params["dimension_numbers"]
    lhs_shape = eqn.invars[0].aval.shape
    k = math.prod(lhs_shape[d] for d in lhs_contract)
    return 2 * math.prod(eqn.outvars[0].aval.shape) * k


def ragged_dot_flops(eqn) -> int:
    """`2 x` the multiply-adds of one `ragged_dot_general` (a grouped matmul: MoE experts). Each
    row of a ragged non-contracting dim meets one group's matrix: `2 * prod(out.shape) * K`,
    as a dot. A ragged contracting dim (the experts' weight gradient, out `[G, ...]`) sums each
    group over its own rows only: `2 * prod(out.shape) / G * M`, M the rows of all groups."""
    dims = eqn.params["ragged_dot_dimension_numbers"]
    (lhs_contract, _), _ = dims.dot_dimension_numbers
    lhs_shape = eqn.invars[0].aval.shape
    out = math.prod(eqn.outvars[0].aval.shape)
    ragged = dims.lhs_ragged_dimensions[0]
    if ragged in lhs_contract:
        groups = eqn.invars[2].aval.shape[-1]
        return 2 * out // groups * math.prod(lhs_shape[d] for d in lhs_contract)
    return 2 * out * math.prod(lhs_shape[d] for d in lhs_contract)


# jax's Pallas megablox kernels (`models.grouped_matmul` on TPU): a `jit` named "gmm" (forward,
# input gradient) or "tgmm" (weight gradient) around a pallas_call whose kernel jaxpr holds
# one tile's dot, so they are counted from their operands instead
MEGABLOX_KERNELS = ("gmm", "tgmm")


def megablox_flops(eqn) -> int:
    """`2 x` the multiply-adds of a megablox kernel: `gmm(lhs [M, K], rhs [G, K, N])` -> `[M, N]`
    is `2 * prod(out) * K`; `tgmm(lhs [K, M], rhs [M, N])` -> `[G, K, N]` sums each group over
    its own rows, `2 * prod(out) / G * M`. M counts the zero rows padding it to a row tile."""
    out = eqn.outvars[0].aval.shape
    lhs = next(v.aval.shape for v in eqn.invars if len(getattr(v.aval, "shape", ())) == 2)
    if eqn.params["name"] == "tgmm":
        return 2 * math.prod(out) // out[0] * lhs[1]
    return 2 * math.prod(out) * lhs[1]


# jax's Pallas ragged paged attention (`models.paged_attention_tpu`, the engine's decode on TPU):
# counted as the dense attention over each row's page-table width that the reference path runs
PAGED_ATTENTION_KERNEL = "ragged_paged_attention"


def paged_attention_flops(eqn) -> int:
    """`2 x` the multiply-adds of `ragged_paged_attention(q [T, H, hd], kv_pages, kv_lens,
    page_indices [S, W], ...)` at its upper bound: every query against its row's whole page
    table, `q k^T` and `p v`: `4 * T * H * hd * W * page_size` (the kernel reads only `kv_lens`
    tokens; the sampler is counted at its upper bound likewise)."""
    q, pages, _, table = (v.aval.shape for v in eqn.invars[:4])
    return 4 * math.prod(q) * table[1] * pages[1]


# jax's Pallas splash attention (`models.splash_attention`, no-cache forwards on TPU): its
# pallas_calls are named "splash_mha_{fwd,dq,dkv}..." with q `[B, H, L, hd]` and k `[B, KVH,
# S, hd]` as their first two floating operands (`[H, L, hd]`, `[KVH, S, hd]` when the vmap over
# rows has one row: Pallas' batching rule squeezes it); `[L, S] x hd` matmuls per head as
# `hlo_cost` counts
SPLASH_MATMULS = {"fwd": 2, "dq": 3, "dkv": 4}


def splash_flops(eqn) -> int:
    """`2 x` the multiply-adds of a splash kernel at the dense upper bound, `2 * matmuls * B *
    H * L * S * hd` (`hlo_cost.splash_flops`); 0 for another pallas_call."""
    name = str(eqn.params.get("name", ""))
    kind = next((k for k in SPLASH_MATMULS if name.startswith(("splash_mha_" + k,
                                                               "splash_mqa_" + k))), None)
    blocks = [v.aval.shape for v in eqn.invars if len(getattr(v.aval, "shape", ())) >= 3
              and jnp.issubdtype(v.aval.dtype, jnp.floating)]
    if kind is None or len(blocks) < 2:
        return 0
    return 2 * SPLASH_MATMULS[kind] * math.prod(blocks[0]) * blocks[1][-2]


def shard_map_devices(params: dict) -> int:
    """How many devices run a `shard_map` body: the product of its manual axes' sizes (its
    other axes stay global in the body's shapes). Work the body repeats on every device of a
    manual axis (the MoE router over `tensor`) is counted once per device."""
    return math.prod(params["mesh"].shape[a] for a in params["newly_manual_axes"])


def _repeats(eqn, while_trips: int) -> int:
    """How many times an equation runs its nested jaxprs (a cond is handled by its caller)."""
    name = eqn.primitive.name
    if name == "scan":
        return eqn.params["length"]
    if name == "while":
        return while_trips
    return shard_map_devices(eqn.params) if name == "shard_map" else 1


def _sub_jaxprs(params: dict):
    """Every jaxpr (closed or open) among an equation's params, tuples included."""
    for value in params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            inner = getattr(v, "jaxpr", v)  # ClosedJaxpr -> Jaxpr
            if hasattr(inner, "eqns"):
                yield inner


def jaxpr_matmul_flops(jaxpr, while_trips: int = 1) -> tuple[int, int]:
    """`(flops, loops)`: matmul FLOPs of `jaxpr` (a Jaxpr or ClosedJaxpr) and every jaxpr nested
    in it, and the number of `while` loops met (each body counted `while_trips` times).

    Multipliers: `scan` x `length`; `while` x `while_trips`; `cond`: the largest branch;
    `shard_map` x its devices (`shard_map_devices`); everything else (pjit, custom_vjp /
    custom_jvp calls, checkpoint, ...) x 1.
    """
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    flops, loops = 0, 0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            flops += dot_general_flops(eqn)
            continue
        if name == "ragged_dot_general":
            flops += ragged_dot_flops(eqn)
            continue
        if (name in ("jit", "pjit") and eqn.params.get("name") in MEGABLOX_KERNELS
                and any(len(getattr(v.aval, "shape", ())) == 2 for v in eqn.invars)):
            flops += megablox_flops(eqn)
            continue
        if name in ("jit", "pjit") and eqn.params.get("name") == PAGED_ATTENTION_KERNEL:
            flops += paged_attention_flops(eqn)
            continue
        if name == "pallas_call":  # its kernel jaxpr is one grid step's: counted by its name
            flops += splash_flops(eqn)
            continue
        subs = [jaxpr_matmul_flops(j, while_trips) for j in _sub_jaxprs(eqn.params)]
        if not subs:
            continue
        loops += sum(n for _, n in subs) + (name == "while")
        if name == "cond":
            flops += max(f for f, _ in subs)
        else:
            flops += sum(f for f, _ in subs) * _repeats(eqn, while_trips)
    return flops, loops


def xla_flops(compiled) -> float | None:
    """`cost_analysis()["flops"]` of a `Compiled` (a dict, or one per device); None if unreported.
    XLA counts a while body once, so it undercounts scanned layers: a figure to set beside ours."""
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
    "xla_flops"}` (`jaxpr_matmul_flops` of its trace; `xla_flops` None when `with_xla` is False
    or unreported)."""
    traced = jitted.trace(*args)
    flops, loops = jaxpr_matmul_flops(traced.jaxpr)
    return {"flops": flops, "loops": loops,
            "xla_flops": xla_flops(traced.lower().compile()) if with_xla else None}

