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
GRPO_4K = LLAMA + ["ppo.advantage_estimator=grpo", "generation.samples_per_prompt=8",
                   "ppo.batch_size=512", "ppo.mini_batch_size=128", "ppo.micro_batch_size=16",
                   "generation.max_new_tokens=4096", "ppo.kl_coef=0.0"]
ENGINES = {  # the static batch as it was (weights gathered per token), with the bf16 rollout
    # copy, and the paged engine (Pallas decode attention) with it
    "static": [],
    "static-copy": ["generation.param_dtype=bfloat16", "generation.rollout_layout=tensor"],
    "paged": ["generation.engine=paged", "generation.attention=pallas",
              "generation.param_dtype=bfloat16"],
}
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
    # the rollout engine (docs/rollout_engine.md): GRPO with 4,096-token responses, both engines
    *[(f"grpo4k-{name}-{slice_name}", slice_name, LLAMA_CFG, GRPO_4K + sets)
      for slice_name in ("v5p-64", "v5e-256") for name, sets in ENGINES.items()],
    ("shipped-paged-v5p-64", "v5p-64", LLAMA_CFG, LLAMA + ENGINES["paged"]),
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


SAMPLER = ("sampler", "rollout_copy", "engine_prefill", "engine_decode")


def sampler_seconds(programs: dict) -> float:
    """The sampling programs' estimated seconds per step (each x its calls per step)."""
    return sum(p["seconds_estimate"] * p["calls_per_step"] for n, p in programs.items()
               if n in SAMPLER and p.get("seconds_estimate") is not None)


def sampler_collectives(programs: dict) -> dict:
    """`{kind: (count, GiB)}` per chip per step of the sampling programs (x calls)."""
    out = {}
    for n, p in programs.items():
        for kind, c in (p.get("collectives") or {}).items() if n in SAMPLER else ():
            count, gib = out.get(kind, (0.0, 0.0))
            out[kind] = (count + c["count"] * p["calls_per_step"],
                         gib + c["bytes"] * p["calls_per_step"] / 2 ** 30)
    return out


def kv_gib_per_chip(r: dict) -> float:
    """The sampler's KV memory per chip, from the run's config (not the compile): the static
    batch's `[B, P + N - 1]` cache, or the paged engine's pools; rows or replicas over data x
    fsdp, KV heads over tensor where it divides them."""
    from ppo_jax.models.hf_io import load_config as model_config
    from ppo_jax.rollout.engine import EngineSettings, engine_layout
    from ppo_jax.trainer.config import load_config

    cfg = load_config(r["config"], r["overrides"])
    g, m = cfg.generation, model_config(ROOT / cfg.model.actor, dtype=cfg.model.dtype)
    shards, tensor = r["mesh"]["data"] * r["mesh"]["fsdp"], r["mesh"]["tensor"]
    heads = m.num_kv_heads // tensor if m.num_kv_heads % tensor == 0 else m.num_kv_heads
    token = 2 * heads * m.head_dim * m.num_layers * m.jnp_dtype.itemsize
    width, batch = cfg.data.max_prompt_length, cfg.ppo.batch_size
    if g.engine == "static":
        return batch / shards * (width + g.max_new_tokens - 1) * token / 2 ** 30
    lay = engine_layout(EngineSettings(g.page_size, g.num_pages, g.max_concurrent),
                        batch=batch, prompt_width=width, max_new_tokens=g.max_new_tokens,
                        group_size=g.samples_per_prompt, replicas=shards)
    return lay.pages * g.page_size * token / 2 ** 30


def fmt2(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def sampler_table(reports: list[dict]) -> str:
    """The sampling programs of each variant: KV memory, fit, collectives and seconds."""
    rows = []
    for r in reports:
        coll = sampler_collectives(r["programs"])
        ag, other = coll.get("all-gather", (0, 0)), sum(v[1] for k, v in coll.items() if k != "all-gather")
        worst = max((n for n in r["programs"] if n in SAMPLER),
                    key=lambda n: r["programs"][n]["peak_bytes"])
        rows.append([r["variant"], r["topology"], f"{kv_gib_per_chip(r):.1f}",
                     f"{r['programs'][worst]['peak_bytes'] / 2 ** 30:.1f} ({worst})",
                     "yes" if all(r["programs"][n]["fits"] for n in r["programs"] if n in SAMPLER)
                     else "**no**", f"{ag[0]:,.0f} x, {ag[1]:,.1f} GiB", f"{other:,.1f} GiB",
                     f"{sampler_seconds(r['programs']):.2f}", fmt2(r["step"].get("seconds_estimate")),
                     "-" if r["step"].get("mfu_estimate") is None
                     else f"{100 * r['step']['mfu_estimate']:.1f}%"])
    return table(["variant", "slice", "KV GiB/chip", "sampler peak GiB/chip (program)", "fits",
                  "sampler all-gathers / step / chip", "other collectives", "sampler s",
                  "step s", "MFU"], rows)


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
             fmt(sampler_seconds(programs)),
             *(fmt(programs[n].get("seconds_estimate")) for n in ("experience", "update")),
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
    reports = [r for r in reports if r is not None]
    print(markdown(reports))
    engine = [r for r in reports if r["variant"].startswith(("grpo4k", "shipped"))]
    if engine:
        print("\nThe sampling programs (rollout copy, sampler or engine prefill + decode):\n")
        print(sampler_table(engine))
    return 0


if __name__ == "__main__":
    sys.exit(main())
