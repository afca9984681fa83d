"""Assemble `bench/results.md` from the JSON files the benchmark scripts write with `--json`.

Reads `core.json` (bench/core.py), `generate.json` (bench/generate.py), `ppo_step.json`
(bench/ppo_step.py), `roofline.json` (bench/roofline.py), `update_profile.json`
(bench/update_profile.py), `decode_floor.json` (bench/decode_floor.py) and `logprob_memory.json`
(bench/logprob_memory.py) from a directory (any of them may be missing; its section then says so),
plus `gpu.json` (bench/gpu.sh --json) and the whole-run files of `make bench-train`
(bench/train_run.py: `train_run.json`, `train_ab_malloc.json`, `train_ab_columns.json`) when
present,
and writes one markdown file: the date, the git commit(s) the figures came from (with a warning
when the raw files come from commits with different measured code, a dirty tree, or record
none: bench/provenance.py), the machine (CPU
model, cores, memory, load average and wall time of each benchmark), the software versions,
the commands to reproduce, and one section of tables per benchmark with the figures as measured
(median, with min-max over the runs).

Usage: python bench/report.py [RAW_DIR (default bench/results_raw)] [--out bench/results.md]
       python bench/report.py --gpu-only GPU_JSON [--out bench/results.md]   (that section only)
The sections are written by bench/sections.py (and bench/gpu_figures.py for the GPU run).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from gpu_figures import gpu_section, replace_gpu_section  # noqa: E402
from common import cpu_info  # noqa: E402
from provenance import cpu_lines, provenance_lines  # noqa: E402
from train_figures import train_run_markdown  # noqa: E402
from sections import (ceiling_markdown, core_markdown, decode_floor_markdown, generate_markdown,  # noqa: E402
                      logprob_memory_markdown, ppo_step_markdown, roofline_markdown,
                      update_profile_markdown)


# --------------------------------------------------------------------------- machine
def machine_info() -> dict:
    """CPU model, logical cores, memory and OS of this machine (read at report time)."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gib = int(line.split()[1]) / 2**20
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": mem_gib,
            "os": platform.platform(), "python": platform.python_version()}


def package_versions(names=("jax", "jaxlib", "flax", "optax", "numpy", "torch", "transformers")) -> dict:
    out = {}
    for name in names:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


# --------------------------------------------------------------------------- main
def load(raw: Path, name: str) -> dict | None:
    path = raw / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


# the benchmarks `make bench` runs, in its order, with their results.md sections
BENCHES = ("core", "generate", "ppo_step", "roofline", "update_profile", "decode_floor",
           "logprob_memory")
# `make bench-train`'s bench/train_run.py files (optional: about 65 minutes), in its order
TRAIN_RUNS = ("train_run", "train_ab_malloc", "train_ab_columns")
SECTIONS = (
    ("ppo_step", "PPO step: ppo_jax vs TRL 0.11 `PPOTrainer` (bench/ppo_step.py)",
     ppo_step_markdown),
    ("roofline", "Roofline: the PPO update's FLOP rate vs a large matmul (bench/roofline.py)",
     roofline_markdown),
    ("update_profile", "Update profile: where the update's time goes, XLA:CPU flags A/B, PyTorch "
     "beside it (bench/update_profile.py)", update_profile_markdown),
    ("generate", "Generation: ppo_jax sampler vs transformers `generate` (bench/generate.py)",
     generate_markdown),
    ("decode_floor", "Decode floor: the sampler's decode step vs its weight matmuls alone "
     "(bench/decode_floor.py)", decode_floor_markdown),
    ("core", "PPO math: ppo_jax.core vs TRL 0.11-style torch (bench/core.py)", core_markdown),
    ("logprob_memory", "Log-probs without the `[B, T, V]` logits: memory of the head and of the "
     "whole update (bench/logprob_memory.py)", logprob_memory_markdown),
)


def malloc_line(raws: dict[str, dict | None]) -> str:
    """Which benchmarks ran under train.py's glibc malloc settings (their `malloc_settings`; for
    ppo_step, its workers', where every result records it: both sides run under the same
    environment). A file from before the field existed says "not recorded"."""
    groups: dict[str, list[str]] = {"on": [], "off": [], "on and off (an A/B)": [],
                                    "not recorded": []}
    for name, d in raws.items():
        if not d:
            continue
        if "variants" in d:  # bench/train_run.py: per train.py command line
            flags = [v.get("malloc_settings") for v in d["variants"]]
        else:
            flags = [r.get("malloc_settings") for r in d.get("results", [])
                     if isinstance(r, dict)]
            if not flags or None in flags:  # only ppo_step records it per worker
                flags = [d.get("malloc_settings")]
        key = ("not recorded" if None in flags else "on" if all(flags)
               else "off" if not any(flags) else "on and off (an A/B)")
        groups[key].append(name)
    return ("- train.py's malloc settings (one arena, no unmapping; ppo_jax/trainer/host_memory.py) "
            "in each benchmark's processes: "
            + "; ".join(f"{k}: {', '.join(v)}" for k, v in groups.items() if v))


def machine_lines(raws: dict[str, dict | None]) -> list[str]:
    """The machine / software bullet list: the CPU the raw files record (provenance.cpu_lines), the
    machine and packages at report time, and each benchmark's load and wall time."""
    m, step = machine_info(), raws.get("ppo_step")
    results = (step or {}).get("results", [])
    trl = next((r for r in results if r["config"] == "trl"), None)
    ours = next((r for r in results if r["config"] != "trl"), None)
    out = cpu_lines(raws, cpu_info())
    out += [f"- report rendered on: {m['cpu']}, {m['cores']} logical cores"
            + (f", {m['memory_gib']:.0f} GiB memory" if m["memory_gib"] else "")
            + f"; OS {m['os']}; Python {m['python']}"]
    v = package_versions()
    out.append("- main environment (.venv): " + ", ".join(f"{k} {x}" for k, x in v.items() if x))
    if ours is not None:
        kind = ours.get("device_kind")
        out.append(f"- ppo_jax backend: {ours.get('device')}"
                   + (f" ({kind})" if kind and kind != ours.get("device") else "")
                   + ("; XLA:CPU uses every core" if ours.get("device") == "cpu" else ""))
    if trl is not None:
        tv = trl["versions"]
        out.append(f"- TRL environment (.venv-bench): trl {tv['trl']}, transformers "
                   f"{tv['transformers']}, torch {tv['torch']} ({tv['torch_threads']} threads)")
    loads = [(n, d.get("load_average")) for n, d in raws.items() if d]
    if any(la is not None for _, la in loads):
        out.append("- load average (1 min) at the end of each benchmark: "
                   + ", ".join(f"{n} {la:.2f}" for n, la in loads if la is not None))
    out.append(malloc_line(raws))
    walls = [(n, d["wall_s"]) for n, d in raws.items() if d and d.get("wall_s") is not None]
    if walls:
        out.append("- wall time of each benchmark (its whole process): "
                   + ", ".join(f"{n} {w / 60:.1f} min" for n, w in walls)
                   + f"; {sum(w for _, w in walls) / 60:.1f} min in all")
    return out


def render(raw: Path, out_path: Path | None = None) -> str:
    """results.md's text from the raw JSON files in `raw`; `out_path` (where it goes) only
    changes the reproduce line."""
    raws = {name: load(raw, name) for name in BENCHES}
    raws.update({name: d for name in TRAIN_RUNS if (d := load(raw, name))})
    gpu = load(raw, "gpu")  # optional: bench/gpu.sh --json <raw>/gpu.json on an accelerator
    rel = raw.relative_to(ROOT) if raw.is_relative_to(ROOT) else raw
    now = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    out = ["# Benchmark results", "",
           f"Generated {now} by `bench/report.py` from `{rel}`. "
           "All figures are wall-clock times on the machine below; other load on the machine "
           "inflates them (the load average at the end of each benchmark is given).", ""]
    prov = provenance_lines({**raws, "gpu": gpu})
    if prov:
        out += ["\n\n".join(prov), ""]
    out += ["## Machine and software", ""] + machine_lines(raws)
    out += ["", "## Reproduce", "", "```bash",
            "make bench   # sets up .venv and .venv-bench, runs the seven benchmarks, writes "
            "bench/results.md", "# or one at a time:"]
    for name, d in raws.items():
        if d and d.get("command"):
            out.append(d["command"])
        elif name in BENCHES and name not in ("ppo_step", "roofline"):
            out.append(f".venv/bin/python bench/{name}.py --json {rel}/{name}.json")
    dest = ""
    if out_path is not None and out_path.resolve() != (ROOT / "bench/results.md").resolve():
        o = out_path.resolve()
        dest = f" --out {o.relative_to(ROOT) if o.is_relative_to(ROOT) else o}"
    out += [f".venv/bin/python bench/report.py {rel}{dest}", "```"]
    if any(name in raws for name in TRAIN_RUNS):
        out += ["", "`make bench-train` ran the whole-run measurements (bench/train_run.py, "
                "commands above)."]
    for name, heading, markdown in SECTIONS:
        d = raws[name]
        out += ["", f"## {heading}", "", markdown(d) if d else f"_not run (no {name}.json)_"]
    if raws["ppo_step"] and raws["roofline"]:
        out += ["", "## Ceiling: the fastest PPO step this machine allows (bench/report.py)", "",
                ceiling_markdown(raws["ppo_step"], raws["roofline"], raws["decode_floor"])]
    runs = [raws[name] for name in TRAIN_RUNS if name in raws]
    if runs:
        out += ["", "## Whole training runs (bench/train_run.py, `make bench-train`)"]
        for d in runs:
            out += ["", f"### {d.get('title') or 'train.py runs'}", "", train_run_markdown(d)]
    if gpu:
        out += ["", gpu_section(gpu)]
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("raw", nargs="?", type=Path, default=ROOT / "bench/results_raw")
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results.md")
    parser.add_argument("--gpu-only", type=Path, default=None, metavar="GPU_JSON",
                        help="only (re)write the GPU section of --out from this gpu.json, "
                             "keeping the rest of the file")
    args = parser.parse_args()
    if args.gpu_only is not None:
        section = gpu_section(json.loads(args.gpu_only.read_text()))
        old = args.out.read_text() if args.out.is_file() else "# Benchmark results\n"
        args.out.write_text(replace_gpu_section(old, section))
        print(f"wrote the GPU section of {args.out}")
        return
    text = render(args.raw.resolve(), args.out)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
