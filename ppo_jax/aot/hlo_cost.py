"""Walk a parsed HLO module (`aot.hlo`) with loop trip counts: FLOPs, HBM bytes, collectives
and a roofline time per chip. See `aot.hlo` for what is counted and how trip counts are read.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from ppo_jax.aot.hlo import (
    COLLECTIVE_KINDS, COLLECTIVES, ELEMENTWISE, FREE, SLICES, Computation, Instr, parse_module,
    shapes, type_bytes, type_elements,
)
from ppo_jax.aot.loops import trip_count


@dataclass
class Costs:
    """Per-chip totals of one run of a program, every loop body counted by its trip count."""

    flops: float = 0.0
    matmul_flops: float = 0.0
    bytes: float = 0.0
    compute_seconds: float = 0.0  # sum over top-level ops of max(flops / peak, bytes / bandwidth)
    collectives: dict = field(default_factory=lambda: {k: {"count": 0.0, "bytes": 0.0}
                                                       for k in COLLECTIVE_KINDS})
    loops: list = field(default_factory=list)  # (trip count or None, body name)
    unknown_loops: int = 0
    ops: list = field(default_factory=list)  # (seconds, calls, flops, bytes, opcode, op_name)

    def top_ops(self, n: int = 8) -> list[dict]:
        """The `n` top-level ops with the most roofline time over the run (what to look at)."""
        rows = sorted(self.ops, key=lambda r: -r[0])[:n]
        return [{"seconds": t, "calls": c, "flops": f, "bytes": b, "opcode": o, "op_name": name}
                for t, c, f, b, o, name in rows]


def _hbm(type_text: str) -> float:
    """HBM bytes of a type: arrays in the default memory space only."""
    return type_bytes(type_text, hbm_only=True)


def shapes_text(type_text: str, index: int) -> str:
    """The text of element `index` of a tuple type (the type itself when it is no tuple)."""
    if not type_text.startswith("("):
        return type_text
    depth, start, parts = 0, 1, []
    for i, ch in enumerate(type_text):
        depth += ch in "({["
        depth -= ch in ")}]"
        if (ch == "," and depth == 1) or (ch == ")" and depth == 0):
            parts.append(type_text[start:i].strip())
            start = i + 1
    parts = [re.sub(r"/\*index=\d+\*/", "", p).strip() for p in parts]
    return parts[index] if index < len(parts) else ""


def _operand_type(comp: Computation, name: str) -> str:
    ins = comp.instrs.get(name)
    return ins.type if ins is not None else ""


def _window(attrs: str, rank: int) -> dict:
    """A convolution's window: size, stride, pad (lo, hi), lhs_dilate, rhs_dilate per dim."""
    text = re.search(r"window=\{([^}]*)\}", attrs)
    fields = dict(re.findall(r"(\w+)=([0-9_x]+)", text.group(1))) if text else {}

    def ints(key, default):
        return [int(v) for v in fields[key].split("x")] if key in fields else [default] * rank

    pads = [tuple(int(v) for v in p.split("_")) for p in fields["pad"].split("x")] \
        if "pad" in fields else [(0, 0)] * rank
    return {"size": ints("size", 1), "stride": ints("stride", 1), "pad": pads,
            "lhs_dilate": ints("lhs_dilate", 1), "rhs_dilate": ints("rhs_dilate", 1)}


def _valid_pairs(out: int, lhs: int, size: int, stride: int, pad_lo: int, ld: int, rd: int) -> int:
    """(output position, kernel position) pairs of one spatial dim that meet a real input
    element (not padding, not a hole of the input dilation): what a convolution multiplies."""
    o = np.arange(out)[:, None]
    k = np.arange(size)[None, :]
    pos = o * stride - pad_lo + k * rd
    return int(np.count_nonzero((pos >= 0) & (pos <= (lhs - 1) * ld) & (pos % ld == 0)))


def conv_flops(comp: Computation, ins: Instr) -> float:
    """`2 x` the multiply-adds of a convolution, counting only kernel positions that meet real
    input elements (XLA:TPU writes batched matmuls as convolutions whose batch dims are
    spatial dims with input dilation; XLA's HloCostAnalysis counts them the same way)."""
    lhs = shapes(_operand_type(comp, ins.operands[0]))
    rhs = shapes(_operand_type(comp, ins.operands[1]))
    out = shapes(ins.type)
    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", ins.attrs)
    if not (lhs and rhs and out and labels):
        return 0.0
    (lhs_dims, rhs_dims, out_dims) = (lhs[0][1], rhs[0][1], out[0][1])
    lhs_l, rhs_l, out_l = labels.groups()
    spatial = sorted(c for c in lhs_l if c.isdigit())
    w = _window(ins.attrs, len(spatial))
    pairs = 1
    for i, d in enumerate(spatial):
        pairs *= _valid_pairs(out_dims[out_l.index(d)], lhs_dims[lhs_l.index(d)], w["size"][i],
                              w["stride"][i], w["pad"][i][0], w["lhs_dilate"][i],
                              w["rhs_dilate"][i])
    batch, features = out_dims[out_l.index("b")], out_dims[out_l.index("f")]
    return 2.0 * batch * features * rhs_dims[rhs_l.index("i")] * pairs


# Grouped-matmul kernels (MoE experts), Mosaic custom calls known by their op_name:
# XLA:TPU's for `jax.lax.ragged_dot`, "ragged-dot-<mode>" ("ragged-dot-metadata" only lays out
# the group offsets), and jax's Pallas megablox kernels (`models.grouped_matmul`), a
# "tpu_custom_call" whose op_name ends in "jit(gmm)/pallas_call" (forward, input gradient) or
# "jit(tgmm)/pallas_call" (weight gradient), or "transpose(jvp(jit(tgmm)))/pallas_call" where
# no scope (a shard_map) is between the gradient and the kernel
_RAGGED_DOT = re.compile(
    r'op_name="[^"]*(?:ragged-dot-(?!metadata)|jit\(t?gmm\)\)*/pallas_call")')


def ragged_dot_flops(comp: Computation, ins: Instr) -> float:
    """`2 x` the multiply-adds of a grouped-matmul kernel, from its last two operands (the
    rows `[M, K]` and the groups' matrices, or for megablox's `tgmm` the rows' cotangents
    `[M, N]`) and its result: each row meets its own group's matrix, `2 * prod(out) * K`;
    with the result `[G, K, N]` (the weight gradient), each group sums over its own rows,
    `2 * prod(out) / G * M`. M counts megablox's zero padding rows (up to a row tile)."""
    lhs = shapes(_operand_type(comp, ins.operands[-2]))
    out = shapes(ins.type)
    if not lhs or not out:
        return 0.0
    (_, lhs_dims), (_, out_dims) = lhs[0], out[0]
    if len(out_dims) == 3:
        return 2.0 * math.prod(out_dims) / out_dims[0] * lhs_dims[0]
    return 2.0 * math.prod(out_dims) * lhs_dims[-1]


# jax's Pallas splash attention (`models.splash_attention`): "tpu_custom_call"s named after the
# kernel, "splash_mha_{fwd,dq,dkv}[_segmented]...", with q `[B, H, L, hd]` and k `[B, KVH, S,
# hd]` (`[H, L, hd]`, `[KVH, S, hd]` for one row) as operands 2 and 3, and this many `[L, S] x hd` matmuls per head: forward q k^T and
# p v; dq recomputes q k^T, then do v^T and ds k; dkv recomputes q k^T, then do v^T, p^T do
# and ds^T q
_SPLASH = re.compile(r"splash_mq?h?a_(fwd|dq|dkv)")
SPLASH_MATMULS = {"fwd": 2, "dq": 3, "dkv": 4}


def splash_flops(comp: Computation, ins: Instr, kind: str) -> float:
    """`2 x` the multiply-adds of a splash kernel over every (query, key) pair, `2 * matmuls *
    B * H * L * S * hd`: the dense upper bound (the kernel skips the blocks its mask empties,
    about half of them for a causal mask), as `dot_attention`'s einsums are counted."""
    q = shapes(_operand_type(comp, ins.operands[2])) if len(ins.operands) > 3 else []
    k = shapes(_operand_type(comp, ins.operands[3])) if len(ins.operands) > 3 else []
    if not q or not k or len(q[0][1]) < 3:
        return 0.0
    return 2.0 * SPLASH_MATMULS[kind] * math.prod(q[0][1]) * k[0][1][-2]


def instr_flops(comp: Computation, ins: Instr) -> tuple[float, float]:
    """`(matmul flops, other flops)` of one instruction (not of what it calls)."""
    if ins.opcode == "custom-call" and _RAGGED_DOT.search(ins.attrs):
        return ragged_dot_flops(comp, ins), 0.0
    splash = _SPLASH.match(ins.name) if ins.opcode == "custom-call" else None
    if splash is not None:
        return splash_flops(comp, ins, splash.group(1)), 0.0
    if ins.opcode == "dot":
        lhs = shapes(_operand_type(comp, ins.operands[0]))
        dims = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", ins.attrs)
        if not lhs or dims is None:
            return 0.0, 0.0
        k = math.prod(lhs[0][1][int(d)] for d in dims.group(1).split(",") if d)
        return 2.0 * type_elements(ins.type) * k, 0.0
    if ins.opcode == "convolution":
        return conv_flops(comp, ins), 0.0
    if ins.opcode in ELEMENTWISE:
        return 0.0, float(type_elements(ins.type))
    if ins.opcode == "reduce" and ins.operands:
        return 0.0, float(type_elements(_operand_type(comp, ins.operands[0])))
    return 0.0, 0.0


def _in_place_root(fused: Computation) -> tuple[set, float]:
    """Parameters updated in place by the fused root's dynamic-update-slices and scatters (XLA
    writes both into their operand's buffer), and the bytes the root writes (the updates for
    those, the whole value for other outputs)."""
    root = fused.root
    outs = [fused.instrs.get(o) for o in root.operands] if root.opcode == "tuple" else [root]
    in_place, written = set(), 0.0
    for out in outs:
        while out is not None and out.opcode == "bitcast" and out.operands:
            out = fused.instrs.get(out.operands[0])
        if out is not None and out.opcode == "dynamic-update-slice" and len(out.operands) > 1:
            in_place.add(out.operands[0])
            written += _hbm(_operand_type(fused, out.operands[1]))
        elif out is not None and out.opcode == "scatter" and len(out.operands) == 3:
            in_place.add(out.operands[0])  # (operand, indices, updates)
            written += _hbm(_operand_type(fused, out.operands[2]))
        elif out is not None:
            written += _hbm(out.type)
    return in_place, written


def _users(comp: Computation) -> dict[str, list[Instr]]:
    users: dict[str, list[Instr]] = {}
    for inner in comp.instrs.values():
        for o in inner.operands:
            users.setdefault(o, []).append(inner)
    return users


def _param_read(comps, fused: Computation, param: Instr, depth: int = 0) -> float:
    """Bytes a fused computation reads of its parameter `param`: the slices taken when every
    use slices it (through nested fusions), else the whole operand."""
    full = _hbm(param.type)
    used = _users(fused).get(param.name, [])
    if not used or depth > 6:
        return full
    read = 0.0
    for u in used:
        if u.opcode in SLICES and u.operands[0] == param.name:
            read += _hbm(u.type) if full else 0.0
        elif u.opcode == "fusion" and u.called().get("calls"):
            inner = comps.get(u.called()["calls"][0])
            if inner is None:
                return full
            params = {int(i.args): i for i in inner.instrs.values() if i.opcode == "parameter"}
            for j, o in enumerate(u.operands):
                if o == param.name and j in params:
                    read += _param_read(comps, inner, params[j], depth + 1)
        else:
            return full
    return min(read, full)


def fusion_bytes(comps, comp: Computation, ins: Instr) -> float:
    """HBM bytes of a fusion: each operand read once (only the slices of an operand that is only
    sliced; nothing for a buffer updated in place) plus what the root writes."""
    fused = comps.get(ins.called().get("calls", [None])[0])
    if fused is None or fused.root is None:
        return sum(_hbm(_operand_type(comp, o)) for o in ins.operands) + _hbm(ins.type)
    in_place, written = _in_place_root(fused)
    read = sum(_param_read(comps, fused, p) for p in fused.instrs.values()
               if p.opcode == "parameter" and p.name not in in_place)
    return read + written


def instr_bytes(comps, comp: Computation, ins: Instr) -> float:
    """HBM bytes of a top-level (unfused) instruction."""
    if ins.opcode in FREE or (ins.opcode == "custom-call" and "AllocateBuffer" in ins.attrs):
        return 0.0
    if ins.opcode == "fusion":
        return fusion_bytes(comps, comp, ins)
    if ins.opcode in ("dynamic-slice", "slice"):
        return 2.0 * _hbm(ins.type)
    if ins.opcode == "dynamic-update-slice" and len(ins.operands) > 1:
        return 2.0 * _hbm(_operand_type(comp, ins.operands[1]))
    if ins.opcode == "copy-start":  # (destination, source, context): one read, one write
        return _hbm(_operand_type(comp, ins.operands[0])) + _hbm(shapes_text(ins.type, 0))
    return sum(_hbm(_operand_type(comp, o)) for o in ins.operands) + _hbm(ins.type)


def _collective(costs: Costs, comp: Computation, ins: Instr, mult: float) -> None:
    kind = COLLECTIVES.get(ins.opcode)
    if kind is None:
        return
    done = comp.root is not None and "AsyncCollectiveDone" in comp.root.attrs
    if done:  # the same collective appears in its start and its done computation
        return
    if kind == "all-reduce" and "reduce-scatter" in comp.name:
        kind = "reduce-scatter"  # an all-reduce fused with the slice of its shard
    size = max(type_bytes(ins.type), sum(type_bytes(_operand_type(comp, o)) for o in ins.operands))
    costs.collectives[kind]["count"] += mult
    costs.collectives[kind]["bytes"] += mult * size


class _Walker:
    def __init__(self, comps, peak_flops: Optional[float], hbm_bandwidth: Optional[float]):
        self.comps, self.peak, self.bandwidth = comps, peak_flops, hbm_bandwidth
        self.costs = Costs()

    def inner_flops(self, name: str, mult: float) -> float:
        """Flops of a fused (or called) computation, counted into the totals; returns them."""
        comp, total = self.comps.get(name), 0.0
        if comp is None:
            return 0.0
        for ins in comp.instrs.values():
            mm, other = instr_flops(comp, ins)
            self.costs.matmul_flops += mult * mm
            self.costs.flops += mult * (mm + other)
            total += mm + other
            _collective(self.costs, comp, ins, mult)
            for callee in ins.called().get("calls", []):
                total += self.inner_flops(callee, mult)
        return total

    def visit(self, name: str, mult: float) -> None:
        comp = self.comps[name]
        for ins in comp.instrs.values():
            called = ins.called()
            if ins.opcode == "while":
                trips = trip_count(self.comps, comp, ins)
                self.costs.loops.append((trips, called["body"][0]))
                self.costs.unknown_loops += trips is None
                self.visit(called["body"][0], mult * (1 if trips is None else trips))
                continue
            if ins.opcode == "conditional":
                for branch in called.get("branch_computations", []) + called.get(
                        "true_computation", []) + called.get("false_computation", []):
                    self.visit(branch, mult)  # every branch: an upper bound
                continue
            if ins.opcode == "call":
                for callee in called.get("to_apply", []) + called.get("calls", []):
                    self.visit(callee, mult)
                continue
            mm, other = instr_flops(comp, ins)
            flops = mm + other
            self.costs.matmul_flops += mult * mm
            self.costs.flops += mult * flops
            _collective(self.costs, comp, ins, mult)
            for callee in called.get("calls", []):
                flops += self.inner_flops(callee, mult)
            nbytes = instr_bytes(self.comps, comp, ins)
            self.costs.bytes += mult * nbytes
            if self.peak and self.bandwidth and (flops or nbytes):
                seconds = mult * max(flops / self.peak, nbytes / self.bandwidth)
                self.costs.compute_seconds += seconds
                where = re.search(r'op_name="([^"]*)"', ins.attrs)
                self.costs.ops.append((seconds, mult, mult * flops, mult * nbytes, ins.opcode,
                                       where.group(1) if where else ins.name))


def program_costs(hlo_text: str, *, peak_flops: Optional[float] = None,
                  hbm_bandwidth: Optional[float] = None) -> Costs:
    """`Costs` of one run of the program whose optimized HLO text is `hlo_text` (per chip).

    Args:
      hlo_text: `compiled.as_text()` of a `jax.stages.Compiled`.
      peak_flops: the chip's peak FLOP/s (bf16), for `compute_seconds`; None: not computed.
      hbm_bandwidth: the chip's HBM bytes/s, for `compute_seconds`.

    Raises:
      ValueError: the text holds no ENTRY computation.
    """
    comps, entry = parse_module(hlo_text)
    walker = _Walker(comps, peak_flops, hbm_bandwidth)
    walker.visit(entry, 1.0)
    return walker.costs
