#!/usr/bin/env python
"""What fits where: compile configs for TPU slices and GPU nodes with `train.py --compile-for`
and tabulate per-chip peak memory and estimated speed (docs/scaling.md).

    python bench/tpu_compile.py                       # every variant below (~1 hour on 2 cores)
    python bench/tpu_compile.py --only base-v5p-64    # some of them
    python bench/tpu_compile.py --table               # re-render from the JSON already written

Each variant is one `train.py --compile-for SLICE --json` process (libtpu on this CPU host; no
TPU, no weights: the models are the shape-only directories of configs/model_shapes/). Its
report goes to `--out/<variant>.json`; the table goes to stdout as markdown. Every figure is
labelled "compiled for <slice> with libtpu <version>, not run": an estimate of a program that
did not run (ppo_jax.aot.compile_for says how each is made).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LLAMA = ["model.actor=configs/model_shapes/meta-llama-3-8b-instruct"]
LLAMA_CFG = "configs/llama_8b_gpu_tpu.yaml"
GIB = 2 ** 30

# (name, slice, config, --set overrides): the 8B config as it was (tensor 4, full remat) on
# four slices, then one choice changed at a time on v5p-64, then the SmolLM2 default run; the
# shipped config now has tensor 8 and dots remat (the "shipped" rows)
OLD = ["mesh.tensor=4", "model.remat=full"]
VARIANTS = [
    ("shipped-v5p-64", "v5p-64", LLAMA_CFG, LLAMA),
    ("shipped-h100-8", "h100-8", LLAMA_CFG, LLAMA + ["mesh.fsdp=8", "mesh.tensor=1"]),
    ("base-v5p-64", "v5p-64", LLAMA_CFG, LLAMA + OLD),
    ("base-v5p-128", "v5p-128", LLAMA_CFG, LLAMA + OLD),
    ("base-v6e-64", "v6e-64", LLAMA_CFG, LLAMA + OLD),
    ("base-v5e-256", "v5e-256", LLAMA_CFG, LLAMA + OLD),
    ("v5e-256-micro64", "v5e-256", LLAMA_CFG, LLAMA + OLD + ["ppo.micro_batch_size=64"]),
    ("tensor1", "v5p-64", LLAMA_CFG, LLAMA + OLD + ["mesh.tensor=1"]),
    ("tensor8", "v5p-64", LLAMA_CFG, LLAMA + OLD + ["mesh.tensor=8"]),
    ("remat-none", "v5p-64", LLAMA_CFG, LLAMA + OLD + ["model.remat=none"]),
    ("remat-dots", "v5p-64", LLAMA_CFG,
     LLAMA + OLD + ["model.remat=dots_with_no_batch_dims_saveable"]),
    ("micro-32", "v5p-64", LLAMA_CFG, LLAMA + OLD + ["ppo.micro_batch_size=32"]),
    ("frozen-f32", "v5p-64", LLAMA_CFG, LLAMA + OLD + ["model.frozen_param_dtype=float32"]),
    ("params-bf16", "v5p-64", LLAMA_CFG, LLAMA + OLD + ["model.param_dtype=bfloat16"]),
    ("offload-frozen", "v5p-64", LLAMA_CFG, LLAMA + OLD + ["model.offload_frozen=true"]),
    ("full-logits", "v5p-64", LLAMA_CFG, LLAMA + OLD + ["model.logprob_chunk_size=0"]),
    # the best of the single changes together, and v5p-128 with a micro-batch per batch shard
    ("tensor8-dots", "v5p-64", LLAMA_CFG,
     LLAMA + OLD + ["mesh.tensor=8", "model.remat=dots_with_no_batch_dims_saveable"]),
    ("tensor8-dots-micro32", "v5p-64", LLAMA_CFG,
     LLAMA + OLD + ["mesh.tensor=8", "model.remat=dots_with_no_batch_dims_saveable",
                    "ppo.micro_batch_size=32"]),
    ("v5p-128-micro16", "v5p-128", LLAMA_CFG, LLAMA + OLD + ["ppo.micro_batch_size=16"]),
    ("smollm2-v5e-8", "v5e-8", "configs/default.yaml", []),
    ("smollm2-v6e-8", "v6e-8", "configs/default.yaml", []),
    # one 8-GPU node (the CUDA PJRT plugin: pip install -e .[gpu-aot]), FSDP over the 8 GPUs
    ("h100-8", "h100-8", LLAMA_CFG, LLAMA + OLD + ["mesh.fsdp=8", "mesh.tensor=1"]),
    ("h200-8", "h200-8", LLAMA_CFG, LLAMA + OLD + ["mesh.fsdp=8", "mesh.tensor=1"]),
]


def run(name: str, slice_name: str, config: str, sets: list[str], out: Path) -> dict | None:
    """One compile; its report with the exit code, wall time and command added (None when
    train.py wrote none: the error is printed)."""
    path = out / f"{name}.json"
    cmd = [sys.executable, "train.py", "--config", config, "--compile-for", slice_name,
           "--json", str(path), *sum((["--set", s] for s in sets), [])]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if not path.is_file():
        print(f"{name}: train.py exited {proc.returncode}: {proc.stderr[-1500:]}", file=sys.stderr)
        return None
    report = json.loads(path.read_text())
    report.update(variant=name, returncode=proc.returncode, wall_seconds=wall,
                  command=" ".join(cmd[1:]))
    path.write_text(json.dumps(report, indent=2))
    print(f"{name}: exit {proc.returncode} in {wall:.0f} s", file=sys.stderr, flush=True)
    return report


def row(r: dict) -> str:
    """One markdown row: the largest program's peak, the step and its main programs."""
    programs = r["programs"]
    worst = max(programs, key=lambda n: programs[n]["peak_bytes"])
    step = r["step"]
    sec = {n: programs[n].get("seconds_estimate") for n in ("sampler", "experience", "update")}
    fmt = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
    mesh = "x".join(str(r["mesh"][a]) for a in ("data", "fsdp", "tensor"))
    mfu = step.get("mfu_estimate")
    upd = programs.get("update", {})
    xmodel = (upd["matmul_flops"] * r["chips"] / upd["model_flops"]
              if upd.get("matmul_flops") and upd.get("model_flops") else None)
    peak = programs[worst]["peak_bytes"] / GIB
    return (f"| {r['variant']} | {r['topology']} | {mesh} | {peak:.1f} "
            f"({worst}) | {'yes' if r['fits'] else '**no**'} | "
            f"{upd.get('argument_bytes', 0) / GIB:.2f} | {fmt(xmodel)} | "
            f"{fmt(sec['sampler'])} | {fmt(sec['experience'])} | {fmt(sec['update'])} | "
            f"{fmt(step.get('seconds_estimate'))} | "
            f"{'-' if mfu is None else f'{100 * mfu:.0f}%'} |")


def table(reports: list[dict]) -> str:
    label = sorted({r["label"].split(" with ")[1].split(", not run")[0] for r in reports})
    head = ("| variant | slice | mesh d x f x t | peak GiB/chip (program) | fits | update args "
            "GiB/chip | update xmodel | sampler s | experience s | update s | step s | MFU |\n"
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    return (f"Compiled with {' / '.join(label)}, not run: estimates of programs that did not "
            "run.\n\n"
            + head + "\n" + "\n".join(row(r) for r in reports))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results_raw/tpu")
    parser.add_argument("--only", nargs="*", help="variant names to run")
    parser.add_argument("--table", action="store_true", help="only render the existing JSON")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    names = set(args.only or [v[0] for v in VARIANTS])
    unknown = names - {v[0] for v in VARIANTS}
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}")
    reports = []
    for name, slice_name, config, sets in VARIANTS:
        path = args.out / f"{name}.json"
        if name not in names:
            continue
        if args.table:
            if path.is_file():
                reports.append(json.loads(path.read_text()))
            continue
        reports.append(run(name, slice_name, config, sets, args.out))
    print(table([r for r in reports if r is not None]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
