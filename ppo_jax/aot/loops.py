"""Trip counts of the `while` loops of an optimized HLO module (`aot.hlo`).

XLA leaves a loop's counter in its state tuple: the condition compares it with a constant
(`counter < N`, possibly inside an `and` with an early-stop test, as in the sampler, or inside a
fusion), the init tuple holds its start and the body adds a constant step. `trip_count` reads
the three, or the `known_trip_count` the compiler wrote in the loop's backend config.
"""

from __future__ import annotations

import re
from typing import Callable, Optional

from ppo_jax.aot.hlo import Computation, Instr

Value = Optional[tuple]  # ("const", v) | ("counter", tuple index, offset) | None
_MIRROR = {"LT": "GT", "GT": "LT", "LE": "GE", "GE": "LE", "NE": "NE"}


def _int_constant(ins: Instr) -> Optional[int]:
    if ins.opcode != "constant":
        return None
    try:
        return int(ins.args.strip())
    except ValueError:
        return None


def scalar_value(comp: Computation, name: str, outer: Callable[[int], Value] = None,
                 depth: int = 0) -> Value:
    """The symbolic value of scalar `name` of `comp`: a constant, or the loop counter (element
    k of the computation's tuple parameter) plus a constant, through converts, copies, bitcasts
    and +/- constants. In a fused computation, `outer(i)` gives the value of its parameter i.
    None for anything else."""
    ins = comp.instrs.get(name)
    if ins is None or depth > 12:
        return None
    c = _int_constant(ins)
    if c is not None:
        return ("const", c)
    if ins.opcode == "parameter" and outer is not None:
        return outer(int(ins.args))
    if ins.opcode == "get-tuple-element":
        src, index = comp.instrs.get(ins.operands[0]), re.search(r"index=(\d+)", ins.attrs)
        if src is not None and src.opcode == "parameter" and index and outer is None:
            return ("counter", int(index.group(1)), 0)
        return None
    if ins.opcode in ("convert", "copy", "bitcast") and ins.operands:
        return scalar_value(comp, ins.operands[0], outer, depth + 1)
    if ins.opcode in ("add", "subtract") and len(ins.operands) == 2:
        a, b = (scalar_value(comp, o, outer, depth + 1) for o in ins.operands)
        sign = 1 if ins.opcode == "add" else -1
        if a and b and a[0] == "counter" and b[0] == "const":
            return ("counter", a[1], a[2] + sign * b[1])
        if a and b and a[0] == "const" and b[0] == "counter" and sign == 1:
            return ("counter", b[1], b[2] + a[1])
    return None


def _bound_from(a: Value, b: Value, direction: str):
    if a and b and a[0] == "const" and b[0] == "counter":
        a, b, direction = b, a, _MIRROR.get(direction, "")
    if a and b and a[0] == "counter" and b[0] == "const" and direction in ("LT", "LE", "NE"):
        return a[1], a[2], direction, b[1]
    return None


def compare_bound(comps, comp: Computation, ins: Optional[Instr], outer=None, depth: int = 0):
    """`(tuple index, offset, direction, limit)` of `counter + offset <direction> limit`, found
    at `ins` or inside an `and` or a fusion of it; None otherwise."""
    if ins is None or depth > 8:
        return None
    if ins.opcode == "and":
        for o in ins.operands:
            found = compare_bound(comps, comp, comp.instrs.get(o), outer, depth + 1)
            if found:
                return found
        return None
    if ins.opcode == "fusion":
        fused = comps.get(ins.called().get("calls", [None])[0])
        if fused is None or fused.root is None:
            return None

        def param(i, fusion=ins):
            return scalar_value(comp, fusion.operands[i], outer)

        return compare_bound(comps, fused, fused.root, param, depth + 1)
    if ins.opcode != "compare" or len(ins.operands) != 2:
        return None
    direction = re.search(r"direction=(\w+)", ins.attrs)
    a, b = (scalar_value(comp, o, outer) for o in ins.operands)
    return _bound_from(a, b, direction.group(1) if direction else "")


def trip_count(comps, parent: Computation, loop: Instr) -> Optional[int]:
    """Iterations of a `while` (an upper bound for a loop that may stop early), or None when
    its condition is not `counter <op> constant`."""
    known = re.search(r'"known_trip_count":\{"n":"(\d+)"', loop.attrs)
    if known:
        return int(known.group(1))
    called = loop.called()
    cond, body = comps.get(called["condition"][0]), comps.get(called["body"][0])
    if cond is None or body is None or cond.root is None:
        return None
    bound = compare_bound(comps, cond, cond.root)
    if bound is None:
        return None
    index, offset, direction, limit = bound
    init = parent.instrs.get(loop.operands[0]) if loop.operands else None
    start = 0
    if init is not None and init.opcode == "tuple" and index < len(init.operands):
        v = scalar_value(parent, init.operands[index])
        start = v[1] if v and v[0] == "const" else 0
    step = 1
    if body.root is not None and body.root.opcode == "tuple" and index < len(body.root.operands):
        v = scalar_value(body, body.root.operands[index])
        if v and v[0] == "counter" and v[1] == index and v[2] != 0:
            step = v[2]
    span = limit - offset - start
    if direction == "LE":
        span += 1
    return max(0, -(-span // step)) if step > 0 else None
