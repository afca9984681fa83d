#!/usr/bin/env python
"""What fits where: per-chip peak memory and estimated step time of configs compiled for TPU
slices and GPU nodes with `train.py --compile-for` (libtpu / CUDA plugin on this CPU host, shape-only
models; docs/scaling.md). Every figure is an estimate of a program that did not run, labelled so.

Usage: python bench/tpu_compile.py [--only NAME ...] [--table (re-render the JSON in --out)]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from harness import ROOT, table

LLAMA_CFG, LORA_CFG = "configs/llama_8b_gpu_tpu.yaml", "configs/llama_8b_lora.yaml"
LLAMA = ["model.actor=configs/model_shapes/meta-llama-3-8b-instruct"]
OLD = LLAMA + ["mesh.tensor=4", "model.remat=full"]  # the 8B config as it was; now tensor 8, dots
DOTS, GPU8 = "model.remat=dots_with_no_batch_dims_saveable", ["mesh.fsdp=8", "mesh.tensor=1"]
# (name, slice, config, --set overrides): the shipped config; the old one on four slices, then one
# change at a time on v5p-64 and the best together; SmolLM2's default run; one 8-GPU node
VARIANTS = [
    ("shipped-v5p-64", "v5p-64", LLAMA_CFG, LLAMA), ("shipped-h100-8", "h100-8", LLAMA_CFG, LLAMA + GPU8),
    ("base-v5p-64", "v5p-64", LLAMA_CFG, OLD), ("base-v5p-128", "v5p-128", LLAMA_CFG, OLD),
    ("base-v6e-64", "v6e-64", LLAMA_CFG, OLD), ("base-v5e-256", "v5e-256", LLAMA_CFG, OLD),
    ("v5e-256-micro64", "v5e-256", LLAMA_CFG, OLD + ["ppo.micro_batch_size=64"]),
    ("tensor1", "v5p-64", LLAMA_CFG, OLD + ["mesh.tensor=1"]),
    ("tensor8", "v5p-64", LLAMA_CFG, OLD + ["mesh.tensor=8"]),
    ("remat-none", "v5p-64", LLAMA_CFG, OLD + ["model.remat=none"]),
    ("remat-dots", "v5p-64", LLAMA_CFG, OLD + [DOTS]),
    ("micro-32", "v5p-64", LLAMA_CFG, OLD + ["ppo.micro_batch_size=32"]),
    ("frozen-f32", "v5p-64", LLAMA_CFG, OLD + ["model.frozen_param_dtype=float32"]),
    ("params-bf16", "v5p-64", LLAMA_CFG, OLD + ["model.param_dtype=bfloat16"]),
    ("offload-frozen", "v5p-64", LLAMA_CFG, OLD + ["model.offload_frozen=true"]),
    ("full-logits", "v5p-64", LLAMA_CFG, OLD + ["model.logprob_chunk_size=0"]),
    ("tensor8-dots", "v5p-64", LLAMA_CFG, OLD + ["mesh.tensor=8", DOTS]),
    ("tensor8-dots-micro32", "v5p-64", LLAMA_CFG, OLD + ["mesh.tensor=8", DOTS, "ppo.micro_batch_size=32"]),
    ("v5p-128-micro16", "v5p-128", LLAMA_CFG, OLD + ["ppo.micro_batch_size=16"]),
    ("smollm2-v5e-8", "v5e-8", "configs/default.yaml", []),
    ("smollm2-v6e-8", "v6e-8", "configs/default.yaml", []),
    ("h100-8", "h100-8", LLAMA_CFG, OLD + GPU8), ("h200-8", "h200-8", LLAMA_CFG, OLD + GPU8),
    # LoRA (configs/llama_8b_lora.yaml) against the full fine-tune on slices too small for it
    ("full-v5e-8", "v5e-8", LLAMA_CFG, LLAMA), ("lora-v5e-8", "v5e-8", LORA_CFG, LLAMA),
    ("lora-v5e-8-dots", "v5e-8", LORA_CFG, LLAMA + [DOTS]),
    ("lora-v5e-8-tensor8-dots", "v5e-8", LORA_CFG, LLAMA + ["mesh.tensor=8", DOTS]),
]


def run(name: str, slice_name: str, config: str, sets: list[str], out: Path) -> dict | None:
    """One compile; its report with the exit code, wall time and command (None: none written)."""
    path = out / f"{name}.json"
    cmd = [sys.executable, "train.py", "--config", config, "--compile-for", slice_name,
           "--json", str(path), *sum((["--set", s] for s in sets), [])]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if not path.is_file():
        print(f"{name}: train.py exited {proc.returncode}: {proc.stderr[-1500:]}", file=sys.stderr)
        return None
    report = {**json.loads(path.read_text()), "variant": name, "returncode": proc.returncode,
              "wall_seconds": time.perf_counter() - t0, "command": " ".join(cmd[1:])}
    path.write_text(json.dumps(report, indent=2))
    print(f"{name}: exit {proc.returncode} in {report['wall_seconds']:.0f} s", file=sys.stderr, flush=True)
    return report


def row(r: dict) -> list[str]:
    """One markdown row: the largest program's peak, the step and its main programs."""
    programs, step, upd = r["programs"], r["step"], r["programs"].get("update", {})
    worst = max(programs, key=lambda n: programs[n]["peak_bytes"])
    fmt = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
    xmodel = (upd["matmul_flops"] * r["chips"] / upd["model_flops"]
              if upd.get("matmul_flops") and upd.get("model_flops") else None)
    mfu = step.get("mfu_estimate")
    return [r["variant"], r["topology"], "x".join(str(r["mesh"][a]) for a in ("data", "fsdp", "tensor")),
             f"{programs[worst]['peak_bytes'] / 2**30:.1f} ({worst})", "yes" if r["fits"] else "**no**",
             f"{(upd.get('argument_bytes') or 0) / 2**30:.2f}", fmt(xmodel),
             *(fmt(programs[n].get("seconds_estimate")) for n in ("sampler", "experience", "update")),
             fmt(step.get("seconds_estimate")), "-" if mfu is None else f"{100 * mfu:.0f}%"]


def markdown(reports: list[dict]) -> str:
    label = sorted({r["label"].split(" with ")[1].split(", not run")[0] for r in reports})
    return (f"Compiled with {' / '.join(label)}, not run: estimates of programs that did not run.\n\n"
            + table(["variant", "slice", "mesh d x f x t", "peak GiB/chip (program)", "fits",
                     "update args GiB/chip", "update xmodel", "sampler s", "experience s",
                     "update s", "step s", "MFU"], [row(r) for r in reports]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results_raw/tpu")
    parser.add_argument("--only", nargs="*", help="variant names to run")
    parser.add_argument("--table", action="store_true", help="only render the existing JSON")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    names = set(args.only or [v[0] for v in VARIANTS])
    if unknown := names - {v[0] for v in VARIANTS}:
        parser.error(f"unknown variants {sorted(unknown)}")
    reports = []
    for name, slice_name, config, sets in VARIANTS:
        path = args.out / f"{name}.json"
        if name in names and not args.table:
            reports.append(run(name, slice_name, config, sets, args.out))
        elif name in names and path.is_file():
            reports.append(json.loads(path.read_text()))
    print(markdown([r for r in reports if r is not None]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
