"""Collect the benchmarks' JSON (`--json`) into bench/results.md: the header (commits, recorded
CPU, software, wall time, commands), each benchmark's own table and `make bench-train`'s
runs; warns when the raw files come from several commits or CPUs.

Usage: python bench/report.py [RAW_DIR (default bench/results_raw)] [--out bench/results.md]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from importlib.metadata import distributions
from pathlib import Path

from harness import ROOT, cpu_info, cpu_line, now, options

# the benchmarks `make bench` runs, in results.md's order, with their headings
SECTIONS = (
    ("ppo_step", "PPO step: ppo_jax vs TRL 0.11 `PPOTrainer` (bench/ppo_step.py)"),
    ("generate", "Generation: ppo_jax sampler vs transformers `generate` (bench/generate.py)"),
    ("engine", "Rollout engine: the paged engine vs the static sampler at equal KV memory "
     "(bench/engine.py)"),
    ("core", "PPO math: ppo_jax.core vs TRL 0.11-style torch (bench/core.py)"),
)
TRAIN_RUNS = ("train_run", "train_ab_malloc", "train_ab_columns")  # `make bench-train`, optional
# bench/train_run.py runs of LoRA against the full fine-tune (docs/lora.md), optional
LORA_RUNS = ("lora_train_run", "lora_timing")


# --------------------------------------------------------------------------- provenance
def provenance_lines(raws: dict[str, dict | None]) -> list[str]:
    """The commit(s) of the raw files; warnings for several commits or CPUs, a dirty tree or no
    commit (each benchmark's section names its own commit, CPU and load in its first line)."""
    recs = {name: d for name, d in raws.items() if d}
    if not recs:
        return []
    commits: list[str] = []
    for c in (d.get("commit") for d in recs.values()):  # a short hash is the same commit as a full one
        if c and not any(c.startswith(x) or x.startswith(c) for x in commits):
            commits.append(c)
    missing = [n for n, d in recs.items() if not d.get("commit")]
    dirty = [n for n, d in recs.items() if d.get("dirty")]
    lines = [f"Code: commit `{commits[0]}` (every raw file)." if len(commits) == 1 and not missing else
             "Code: " + ", ".join(f"{n} `{d['commit']}`" if d.get("commit") else f"{n} not recorded"
                                  for n, d in recs.items()) + "."]
    for what, values, why in (("commits", commits, "the code measured may differ"),
                              ("CPUs", recorded_cpus(raws), "not one machine")):
        if len(values) > 1:
            lines.append(f"> **Warning:** the raw files come from {len(values)} {what} ({why}): "
                         "do not compare their figures as one run.")
    if dirty:
        lines.append("> **Warning:** measured on a dirty tree (uncommitted changes to tracked "
                     f"files): {', '.join(dirty)}; the commit does not hold the code measured.")
    if missing:
        lines.append(f"> **Warning:** no commit recorded for {', '.join(missing)} (a tree outside "
                     "git without $PPO_BENCH_COMMIT): which code these figures came from is unknown.")
    return lines


def recorded_cpus(raws: dict[str, dict | None]) -> list[str]:
    """The distinct CPUs the raw files record (`cpu_line`)."""
    return list(dict.fromkeys(cpu_line(d["cpu"]) for d in raws.values() if d and d.get("cpu")))


# --------------------------------------------------------------------------- machine
def malloc_line(raws: dict[str, dict | None]) -> str:
    """Which benchmarks ran under train.py's malloc settings (per variant or worker where they have)."""
    groups: dict[str, list[str]] = {k: [] for k in ("on", "off", "on and off (an A/B)", "not recorded")}
    for name, d in raws.items():
        if not d:
            continue
        flags = [r.get("malloc_settings") for r in d.get("variants") or d.get("results") or [d]]
        groups["not recorded" if None in flags else "on" if all(flags) else "off"
               if not any(flags) else "on and off (an A/B)"].append(name)
    return ("- train.py's malloc settings (one arena, no unmapping; ppo_jax/trainer/host/memory.py) "
            "in each benchmark's processes: "
            + "; ".join(f"{k}: {', '.join(v)}" for k, v in groups.items() if v))


def machine_lines(raws: dict[str, dict | None]) -> list[str]:
    """The recorded CPU, the report machine and packages, ppo_step's backend and TRL environment,
    the malloc settings, each benchmark's wall time."""
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    installed = {d.metadata["Name"].lower(): d.version for d in distributions()}
    out = ["- CPU (recorded by the benchmarks): " + "; ".join(recorded_cpus(raws)),
           f"- report rendered on: {cpu_info()['model']}, {os.cpu_count()} logical cores, {mem:.0f} GiB "
           f"memory; OS {platform.platform()}; Python {platform.python_version()}",
           "- main environment (.venv): " + ", ".join(f"{n} {installed[n]}" for n in (
               "jax", "jaxlib", "flax", "optax", "numpy", "torch", "transformers") if n in installed)]
    results = (raws.get("ppo_step") or {}).get("results", [])
    if ours := next((r for r in results if r["config"] != "trl"), None):
        dev, kind = ours.get("device"), ours.get("device_kind")
        out.append(f"- ppo_jax backend: {dev}" + (f" ({kind})" if kind and kind != dev else "")
                   + ("; XLA:CPU uses every core" if dev == "cpu" else ""))
    if trl := next((r for r in results if r["config"] == "trl"), None):
        v = trl["versions"]
        out.append(f"- TRL environment (.venv-bench): trl {v['trl']}, transformers "
                   f"{v['transformers']}, torch {v['torch']} ({v['torch_threads']} threads)")
    out.append(malloc_line(raws))
    walls = {n: d["wall_s"] for n, d in raws.items() if d and d.get("wall_s") is not None}
    if walls:
        out.append("- wall time of each benchmark (its whole process): "
                   + ", ".join(f"{n} {w / 60:.1f} min" for n, w in walls.items())
                   + f"; {sum(walls.values()) / 60:.1f} min in all")
    return out


# --------------------------------------------------------------------------- main
def render(raw: Path, out_path: Path | None = None) -> str:
    """results.md's text from the raw JSON files in `raw` (`out_path`: for the reproduce line)."""
    load = lambda name: json.loads(p.read_text()) if (p := raw / f"{name}.json").is_file() else None  # noqa: E731
    raws = {name: load(name) for name, _ in SECTIONS}
    raws.update({name: d for name in TRAIN_RUNS + LORA_RUNS if (d := load(name))})
    rel = raw.relative_to(ROOT) if raw.is_relative_to(ROOT) else raw
    out = ["# Benchmark results", "", f"Generated {now()} by `bench/report.py` from `{rel}`. All "
           "figures are wall-clock times on the machine below; other load on the machine inflates "
           "them (each section gives the load average at its end).", ""]
    if prov := provenance_lines(raws):
        out += ["\n\n".join(prov), ""]
    out += ["## Machine and software", ""] + machine_lines(raws)
    out += ["", "## Reproduce", "", "```bash", "make bench   # sets up .venv and .venv-bench, runs "
            "the benchmarks, writes bench/results.md", "# or one at a time:"]
    out += [d["command"] for d in raws.values() if d and d.get("command")]
    o = (out_path or ROOT / "bench/results.md").resolve()
    dest = "" if o == (ROOT / "bench/results.md").resolve() else \
        f" --out {o.relative_to(ROOT) if o.is_relative_to(ROOT) else o}"
    out += [f".venv/bin/python bench/report.py {rel}{dest}", "```"]
    for name, heading in SECTIONS:
        d = raws[name]
        out += ["", f"## {heading}", "", d.get("markdown", "") if d else f"_not run (no {name}.json)_"]
    for group, heading in ((LORA_RUNS, "LoRA against the full fine-tune: whole runs (bench/train_run.py, "
                                       "commands in each)"),
                           (TRAIN_RUNS, "Whole training runs (bench/train_run.py, `make bench-train`)")):
        if runs := [raws[name] for name in group if name in raws]:
            out += ["", f"## {heading}"]
            for d in runs:
                out += ["", f"### {d.get('title') or 'train.py runs'}", "", d.get("markdown", "")]
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("raw", nargs="?", type=Path, default=ROOT / "bench/results_raw")
    args = options(__doc__, parser=parser, out=ROOT / "bench/results.md")
    text = render(args.raw.resolve(), args.out)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
