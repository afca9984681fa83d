"""Per-chip costs of a compiled program, read from its optimized HLO text with loop trip counts.

XLA's `compiled.cost_analysis()` counts the body of every `while` loop once, whatever its trip
count, and `lax.scan` compiles to a `while`: the PPO update (epochs x minibatches x micro-batches
x layers) would be undercounted by the product of its trip counts. This module walks the
program the compiler produced, the text of `compiled.as_text()`; that text is after SPMD
partitioning, so its shapes are one chip's. It counts every instruction as many times as it runs:

- `flops`: `2 * prod(out) * K` per `dot` / `convolution` (`matmul_flops`; K the contracted size),
  plus one per output element of elementwise arithmetic and one per input element of a
  `reduce` (what XLA's `HloCostAnalysis` counts; transcendentals are left out, as it does).
- `bytes`: HBM traffic of each top-level instruction (a fusion, a copy, a collective): its
  operands read plus its output written, where a fusion that only slices an operand reads the
  slice and one that updates a buffer in place writes the update (a scan's per-layer read of
  stacked params is one layer, not all of them).
- `collectives`: count and bytes (the larger of operand and result, per chip) of all-gather,
  reduce-scatter, all-reduce, all-to-all and collective-permute.

Trip counts come from the loop itself: `known_trip_count` when the compiler wrote one, else the
condition `counter < N` (directly or inside an `and`, as in the sampler's early-stopping loop,
which gives its upper bound) with the counter's start value and step read from the loop's init
and body tuples. A loop whose count cannot be read is counted once and reported in
`unknown_loops`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Optional

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
               "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
               "s4": 0.5, "u4": 0.5, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3b11fnuz": 1, "token": 0}
COLLECTIVES = {"all-gather": "all-gather", "all-gather-start": "all-gather",
               "all-reduce": "all-reduce", "all-reduce-start": "all-reduce",
               "reduce-scatter": "reduce-scatter", "all-to-all": "all-to-all",
               "collective-permute": "collective-permute",
               "collective-permute-start": "collective-permute"}
COLLECTIVE_KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all",
                    "collective-permute")
ELEMENTWISE = {"add", "subtract", "multiply", "divide", "maximum", "minimum", "negate", "abs",
               "compare", "select", "and", "or", "xor", "not", "clamp", "remainder", "power",
               "sign", "floor", "ceil", "round-nearest-even", "round-nearest-afz"}
FREE = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "while", "conditional",
        "call", "after-all", "opt-barrier", "partition-id", "replica-id", "iota",
        "all-gather-done", "all-reduce-done", "collective-permute-done", "async-done",
        "copy-done", "send-done", "recv-done"}
SLICES = {"dynamic-slice", "slice", "gather"}
_SHAPE = re.compile(r"([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\](\{[^}]*\})?")
_CALLED = re.compile(r"\b(calls|to_apply|body|condition|branch_computations|true_computation|"
                     r"false_computation|called_computations)=(\{[^}]*\}|%[\w.\-]+)")


@dataclass
class Instr:
    name: str
    type: str  # the result type text, e.g. "bf16[8,128]{1,0}" or a tuple "(s32[], ...)"
    opcode: str
    operands: list[str]
    attrs: str
    root: bool = False
    args: str = ""  # the text inside the opcode's parentheses (a constant's value)

    def called(self) -> dict[str, list[str]]:
        """{attribute: [computation names]} of the computations this instruction calls."""
        out: dict[str, list[str]] = {}
        for key, value in _CALLED.findall(self.attrs):
            out.setdefault(key, []).extend(re.findall(r"%([\w.\-]+)", value))
        return out


@dataclass
class Computation:
    name: str
    instrs: dict[str, Instr] = field(default_factory=dict)
    root: Optional[Instr] = None


def _split_type(rest: str) -> tuple[str, str]:
    """`"(a, b) op(...)"` or `"f32[2]{0} op(...)"` -> (type text, the rest after it)."""
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                return rest[:i + 1], rest[i + 1:].lstrip()
    head, _, tail = rest.partition(" ")
    return head, tail


def _parse_instr(line: str) -> Optional[Instr]:
    m = re.match(r"\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$", line)
    if not m:
        return None
    type_text, rest = _split_type(m.group(3))
    op = re.match(r"([\w\-]+)\(", rest)
    if not op:
        return None
    depth, start = 0, op.end() - 1
    for i in range(start, len(rest)):
        depth += rest[i] == "("
        depth -= rest[i] == ")"
        if depth == 0:
            break
    args = rest[start + 1:i]
    operands = re.findall(r"%([\w.\-]+)", args)
    return Instr(m.group(2), type_text, op.group(1), operands, rest[i + 1:], bool(m.group(1)),
                 args)


def parse_module(text: str) -> tuple[dict[str, Computation], str]:
    """`({name: Computation}, entry name)` of an HLO module's text."""
    comps: dict[str, Computation] = {}
    entry, current = None, None
    for line in text.splitlines():
        head = re.match(r"(ENTRY\s+)?%([\w.\-]+)\s.*\{\s*$", line)
        if head and not line.startswith(" "):
            current = comps.setdefault(head.group(2), Computation(head.group(2)))
            entry = head.group(2) if head.group(1) else entry
            continue
        if current is None or line.strip() in ("", "}"):
            continue
        instr = _parse_instr(line)
        if instr is not None:
            current.instrs[instr.name] = instr
            if instr.root:
                current.root = instr
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return comps, entry


def shapes(type_text: str, hbm_only: bool = False) -> list[tuple[str, tuple[int, ...]]]:
    """A `(dtype, dims)` pair for every array in a type text, tuples included.

    With `hbm_only`, only those in the default memory space: a TPU layout's `S(n)` with n > 0 is
    on-chip memory or host."""
    return [(dt, tuple(int(d) for d in dims.split(",") if d))
            for dt, dims, layout in _SHAPE.findall(type_text)
            if dt in DTYPE_BYTES and not (hbm_only and re.search(r"S\([1-9]", layout))]


def type_bytes(type_text: str, hbm_only: bool = False) -> float:
    """Bytes of every array in a type text (see `shapes` for `hbm_only`)."""
    return sum(DTYPE_BYTES[dt] * math.prod(dims) for dt, dims in shapes(type_text, hbm_only))


def type_elements(type_text: str) -> int:
    return sum(math.prod(dims) for _, dims in shapes(type_text))
