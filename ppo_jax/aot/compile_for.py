"""`train.py --compile-for TOPOLOGY`: compile every program of a run for a TPU slice on this
host and report per-chip memory, FLOPs, collectives and estimated time.

`StageTrainer.abstract` builds the config's trainer on the slice's devices from config.json
shapes, without weights. Each program its `programs()` lists is lowered and compiled by libtpu
exactly as a run would call it. Per program:

- memory: the argument, output and temporary bytes of `compiled.memory_analysis()`.
  `peak_bytes` = arguments + outputs - donated aliases + temporaries + the run's other resident
  arrays, since train states and frozen params a program does not take still occupy HBM while
  it runs. It fits when `peak_bytes` <= `topology.Chip.usable_hbm_bytes`, the HBM the compiler
  allows. A program the compiler refuses for lack of HBM is reported with the bytes it asked for.
- costs, from `aot.hlo_cost`: FLOPs, HBM bytes and collectives per chip, with loop trip counts
  applied. `seconds_estimate` adds, with no overlap, each op's roofline time, max(FLOPs / peak
  bf16 rate, HBM bytes / bandwidth), and the collective bytes over the chip's ICI bandwidth,
  an all-reduce counted twice. The compiler's own `optimal_seconds` counts each loop body once
  and is negative for some sharded programs, so it is reported as `compiler_optimal_seconds`
  but not used.
- the step: programs weighted by their calls per step; its model FLOPs are the matmul FLOPs of
  the same programs traced with `model.remat=none` (`aot.flops`), and the implied MFU is
  model FLOPs / (chips x peak x estimated seconds).
- transfers between device groups (`generation.placement: split`: the weights sent to the
  rollout group after each update) are not XLA programs: each is estimated as the bytes the
  most loaded receiving chip takes over the chip's ICI bandwidth, added to the step's seconds
  with no overlap (staleness 0), and labelled an estimate. With a split, each program's memory
  and FLOPs are those of the chips of its own group (the sampler's on the rollout group).

Every figure is an estimate of a program that did not run: "compiled for <slice> with libtpu
<version>, not run" (or with the CUDA PJRT plugin, for a GPU node; its compiler gives no
`cost_analysis`, so `compiler_optimal_seconds` is None there).
"""

from __future__ import annotations

import dataclasses
import math
import re
import time

import jax
import numpy as np

from ppo_jax.aot.flops import jaxpr_matmul_flops
from ppo_jax.aot.hlo_cost import program_costs
from ppo_jax.aot.topology import GIB, Slice, compiler_version, slice_devices

_SHARED = ("mesh.fsdp / mesh.tensor (shard over more chips)",)
_LAST = ("model.remat (full: recompute layers instead of keeping them)",
         "model.logprob_chunk_size (no [B, N, V] logits)")
LOWER_IT = {  # per stage: the config keys that lower a program's per-chip memory
    "ppo": _SHARED + ("ppo.micro_batch_size (activations of the forward / backward)",) + _LAST
    + ("model.frozen_param_dtype (bfloat16 reference and reward model)",
       "model.offload_frozen (frozen params in host memory between phases)"),
    "sft": _SHARED + ("sft.micro_batch_size (activations of the forward / backward)",
                      "sft.max_length (shorter sequences)") + _LAST,
    "reward_model": _SHARED + ("reward_model.micro_batch_size (activations of the forward / "
                               "backward)", "reward_model.max_length (shorter pairs)") + _LAST,
}
_UNITS = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}


def per_chip_bytes(tree, devices=None) -> float:
    """Bytes one chip holds of every array (or `ShapeDtypeStruct`) of `tree` in device memory
    (leaves placed in host memory are not counted); with `devices` (a set), only the arrays
    placed on them (a split placement's group)."""
    total = 0.0
    for x in jax.tree.leaves(tree):
        sharding = getattr(x, "sharding", None)
        if sharding is None or getattr(sharding, "memory_kind", None) not in (None, "device"):
            continue
        if devices is not None and not sharding.device_set & devices:
            continue
        total += math.prod(sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
    return total


def devices_of(tree) -> frozenset:
    """The devices the arrays of `tree` are placed on (a program's group)."""
    out = set()
    for x in jax.tree.leaves(tree):
        sharding = getattr(x, "sharding", None)
        if sharding is not None:
            out |= sharding.device_set
    return frozenset(out)


def device_groups(resident: dict) -> set[frozenset]:
    """The device sets the resident arrays live on (one, or a split's two groups)."""
    return {frozenset(x.sharding.device_set) for x in jax.tree.leaves(resident)
            if getattr(x, "sharding", None) is not None}


def other_resident_bytes(resident: dict, args: tuple) -> float:
    """Per-chip bytes of the resident arrays that are not among `args` (by identity), on the
    chips of the program's arguments."""
    taken = {id(x) for x in jax.tree.leaves(args)}
    rest = [x for x in jax.tree.leaves(resident) if id(x) not in taken]
    return per_chip_bytes(rest, devices_of(args) or None)


def _oom_bytes(message: str) -> float | None:
    """The bytes an out-of-memory compile error says the program needs."""
    m = re.search(r"required[^(]*\(([\d.]+)([KMGT])", message) or re.search(
        r"Used ([\d.]+)([KMGT])", message)
    return float(m.group(1)) * _UNITS[m.group(2)] if m else None


def _collective_seconds(collectives: dict, ici: float | None) -> float:
    if not ici:
        return 0.0
    traffic = sum(v["bytes"] * (2 if kind == "all-reduce" else 1)
                  for kind, v in collectives.items())
    return traffic / ici


def compile_program(program, s: Slice, resident: dict) -> dict:
    """Compile one `trainer.programs.Program` for slice `s`; its row of the report."""
    chip, t0 = s.chip, time.perf_counter()
    other = other_resident_bytes(resident, program.args)
    row = {"calls_per_step": program.per_step, "note": program.note, "resident_bytes": other,
           "chips": len(devices_of(program.args)) or s.chips}
    try:
        compiled = program.lower().compile()
    except Exception as e:  # noqa: BLE001 - libtpu reports out-of-memory as a runtime error
        needed = _oom_bytes(str(e))
        if "RESOURCE_EXHAUSTED" not in str(e) or needed is None:
            raise
        # the compiler stops at its own memory check: only the total it needed is known
        row.update(dict.fromkeys(("argument_bytes", "output_bytes", "temp_bytes", "flops",
                                  "seconds_estimate")), collectives={},
                   peak_bytes=needed + other, fits=False,
                   compile_seconds=time.perf_counter() - t0, error=str(e).splitlines()[0][:300])
        return row
    ma = compiled.memory_analysis()
    costs = program_costs(compiled.as_text(), peak_flops=chip.peak_bf16_flops,
                          hbm_bandwidth=chip.hbm_bandwidth)
    peak = (ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes
            + ma.temp_size_in_bytes + other)
    collective_s = _collective_seconds(costs.collectives, chip.ici_bandwidth)
    ca = compiled.cost_analysis()
    ca = ca[0] if isinstance(ca, (list, tuple)) else ca
    row.update(
        argument_bytes=ma.argument_size_in_bytes, output_bytes=ma.output_size_in_bytes,
        alias_bytes=ma.alias_size_in_bytes, temp_bytes=ma.temp_size_in_bytes, peak_bytes=peak,
        fits=peak <= s.usable_hbm_bytes, flops=costs.flops, matmul_flops=costs.matmul_flops,
        hbm_bytes_accessed=costs.bytes, collectives=costs.collectives,
        compute_seconds=costs.compute_seconds, collective_seconds=collective_s,
        seconds_estimate=costs.compute_seconds + collective_s,
        compiler_optimal_seconds=(ca or {}).get("optimal_seconds"),
        loops=[n for n, _ in costs.loops], unknown_loops=costs.unknown_loops,
        top_ops=costs.top_ops(),
        compile_seconds=time.perf_counter() - t0)
    return row


def model_flops(trainer_cls, cfg, devices) -> dict[str, float]:
    """`{program: matmul FLOPs}` (global, one call) of the programs of `cfg` with
    `model.remat=none` (no recomputation credited), from their jaxprs (`aot.flops`)."""
    plain = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, remat="none"))
    trainer = trainer_cls.abstract(plain, devices)
    return {p.name: float(jaxpr_matmul_flops(p.fn.trace(*p.args).jaxpr, p.while_trips)[0])
            for p in trainer.programs()}


def transfer_rows(transfers: list[dict], s: Slice) -> dict:
    """`{name: row}` of the transfers between device groups (`PPOTrainer.transfers`): bytes
    (one copy), the most a receiving chip takes, calls per step, and `seconds_estimate` =
    receiving chip's bytes / the chip's ICI bandwidth (None where it is not known)."""
    ici = s.chip.ici_bandwidth
    return {t["name"]: {"bytes": t["bytes"], "receiver_bytes": t["receiver_bytes"],
                        "calls_per_step": t["per_step"], "note": t["note"],
                        "seconds_estimate": t["receiver_bytes"] / ici if ici else None,
                        "label": "estimate: bytes a receiving chip takes / ICI bandwidth, "
                                 "not compiled"}
            for t in transfers}


def step_figures(programs: dict, flops: dict, s: Slice, transfers: dict | None = None) -> dict:
    """The steady-state step: programs and transfers weighted by calls per step, one after
    the other (no time, MFU or per-chip FLOPs when a program did not compile or a transfer
    has no estimate)."""
    total = sum(r["calls_per_step"] * flops.get(name, 0.0) for name, r in programs.items())
    rows = [*programs.values(), *(transfers or {}).values()]
    if any(r.get("seconds_estimate") is None for r in rows):
        return {"seconds_estimate": None, "model_flops": total, "mfu_estimate": None}
    seconds = sum(r["calls_per_step"] * r["seconds_estimate"] for r in rows)
    mfu = total / (s.chips * s.chip.peak_bf16_flops * seconds) if seconds > 0 else None
    return {"seconds_estimate": seconds, "model_flops": total, "mfu_estimate": mfu,
            "flops_per_chip": sum(r["calls_per_step"] * r["flops"] for r in programs.values())}


def compile_for(trainer_cls, cfg, s: Slice, *, log=print) -> dict:
    """Build the trainer of `cfg` abstractly on slice `s` and compile its programs.

    Returns the report (the `--json` document, see `docs/scaling.md`).

    Raises:
      TopologyError: see `slice_devices`; ConfigError / ValueError: a config that cannot run on
        this slice (e.g. a mesh that does not fit its chips), as a run would.
    """
    devices = slice_devices(s)
    trainer = trainer_cls.abstract(cfg, devices)
    resident = trainer.resident()
    compiler, version = compiler_version(s)
    programs = {}
    for program in trainer.programs():
        log(f"compiling {program.name} for {s.name} ...")
        programs[program.name] = compile_program(program, s, resident)
    flops = model_flops(trainer_cls, cfg, devices)
    for name, row in programs.items():
        row["model_flops"] = flops.get(name)
        if row.get("matmul_flops") and row["model_flops"]:  # > 1: recomputed or repeated work
            row["flops_vs_model"] = row["matmul_flops"] * row["chips"] / row["model_flops"]
    transfers = transfer_rows(getattr(trainer, "transfers", list)(), s)
    mesh = dict(trainer.place.mesh.shape)
    rollout = getattr(trainer, "rollout_place", trainer.place)
    return {
        "topology": s.name, "topology_desc": s.topology, "chips": s.chips,
        "hosts": len({d.process_index for d in devices}), "chip_kind": s.chip.kind,
        "hbm_bytes_per_chip": s.usable_hbm_bytes, "hbm_bytes_published": s.chip.hbm_bytes,
        "chip_source": s.chip.source, "peak_bf16_flops": s.chip.peak_bf16_flops,
        "fits": all(r["fits"] for r in programs.values()),
        "libtpu_version": version if compiler == "libtpu" else None,
        "compiler": f"{compiler} {version}",
        "jax_version": jax.__version__, "stage": cfg.stage, "mesh": mesh,
        "rollout_mesh": None if rollout is trainer.place else dict(rollout.mesh.shape),
        "resident_bytes": max((per_chip_bytes(resident, g) for g in device_groups(resident)),
                              default=0.0),
        "programs": programs, "transfers": transfers,
        "step": step_figures(programs, flops, s, transfers),
        "label": f"compiled for {s.name} ({s.topology}) with {compiler} {version}, not run",
    }


def _gib(x) -> str:
    return "-" if x is None else f"{x / GIB:.2f}"


def _size(x) -> str:
    """Bytes in three significant digits: 512, 1.5K, 38.2M, 5.83G (powers of 1024)."""
    if x is None:
        return "-"
    for unit, scale in (("G", 2 ** 30), ("M", 2 ** 20), ("K", 2 ** 10)):
        if x >= scale:  # 1000-1023 units: no exponent (".3g" would print 1.01e+03)
            v = x / scale
            return f"{v:.0f}{unit}" if v >= 999.5 else f"{v:.3g}{unit}"
    return f"{x:.0f}"


def _num(x) -> float:
    return float("nan") if x is None else x


SHORT = {"all-gather": "ag", "reduce-scatter": "rs", "all-reduce": "ar", "all-to-all": "a2a",
         "collective-permute": "cp"}


def _collectives_text(row: dict) -> str:
    parts = [f"{SHORT[k]} {int(v['count'])}x {_size(v['bytes'])}"
             for k, v in row.get("collectives", {}).items() if v["count"]]
    return ", ".join(parts) or "-"


def format_report(report: dict) -> str:
    """The table `train.py --compile-for` prints: per chip, per call (bytes), per step
    (FLOPs and seconds are one call's; `calls` says how many a step makes)."""
    rollout = (f", rollout mesh {report['rollout_mesh']}" if report.get("rollout_mesh")
               else "")
    lines = [f"{report['label']}: {report['chips']} chips on {report['hosts']} host(s), mesh "
             f"{report['mesh']}{rollout}, {_gib(report['hbm_bytes_per_chip'])} GiB HBM usable "
             "per chip",
             f"{'program':<19}{'calls':>6}{'args':>8}{'out':>8}{'temp':>8}{'other':>8}"
             f"{'peak':>8}  fits{'FLOP/chip':>11}{'xmodel':>7}{'est. s':>10}  collectives "
             "(count x bytes)"]
    for name, r in report["programs"].items():
        lines.append(
            f"{name:<19}{r['calls_per_step']:>6.2f}{_size(r.get('argument_bytes')):>8}"
            f"{_size(r.get('output_bytes')):>8}{_size(r.get('temp_bytes')):>8}"
            f"{_size(r['resident_bytes']):>8}{_size(r['peak_bytes']):>8}  "
            f"{'yes' if r['fits'] else 'NO':<4}{_num(r.get('flops')):>11.3g}"
            f"{_num(r.get('flops_vs_model')):>7.2f}"
            f"{_num(r.get('seconds_estimate')):>10.4g}  {_collectives_text(r)}")
    for name, t in report.get("transfers", {}).items():
        seconds = "-" if t["seconds_estimate"] is None else f"{t['seconds_estimate']:.4g}"
        lines.append(f"{name:<19}{t['calls_per_step']:>6.2f}  {_size(t['bytes'])} to the rollout "
                     f"group ({_size(t['receiver_bytes'])} per receiving chip), {seconds} s "
                     f"({t['label']})")
    st = report["step"]
    if st["seconds_estimate"] is not None:
        lines.append(f"step (calls-weighted): {st['seconds_estimate']:.4g} s; model FLOPs "
                     f"{st['model_flops']:.3g}; MFU {100 * (st['mfu_estimate'] or 0):.1f}% "
                     "(estimates; remat recomputation not credited)")
    lines.append("other = the run's resident arrays a program does not take (train states, "
                 "frozen params); peak = args + out - donated + temp + other; xmodel = matmul "
                 "FLOPs x chips / model FLOPs (> 1: remat recomputation, or work repeated on "
                 "chips when a micro-batch has fewer rows than data x fsdp)")
    return "\n".join(lines)


def over_message(report: dict) -> str:
    """Why the run does not fit: each program over the HBM, by how much, and what lowers it."""
    hbm = report["hbm_bytes_per_chip"]
    over = [f"{name} needs {_gib(r['peak_bytes'])} GiB per chip, {_gib(r['peak_bytes'] - hbm)} "
            f"GiB over the {_gib(hbm)} GiB of a {report['chip_kind']} chip ("
            + (f"arguments {_gib(r['argument_bytes'])}, temporaries {_gib(r['temp_bytes'])}, "
               if r.get("argument_bytes") is not None else "the compiler's own total, ")
            + f"other resident {_gib(r['resident_bytes'])})"
            for name, r in report["programs"].items() if not r["fits"]]
    return ("does not fit " + report["topology"] + ": " + "; ".join(over)
            + ". Settings that lower it: " + "; ".join(LOWER_IT[report["stage"]])
            + f". ({report['label']})")
