"""Collect the benchmarks' JSON (`--json`) into bench/results.md: the header (commits, recorded
CPU, software, load and wall time, commands), each benchmark's own table and `make bench-train`'s
runs. Refuses raw files from commits whose measured code differs.

Usage: python bench/report.py [RAW_DIR (default bench/results_raw)] [--out bench/results.md]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
from importlib.metadata import distributions
from pathlib import Path

from harness import ROOT, cpu_info, cpu_line, now, options

# the code whose speed the benchmarks measure: commits holding the same of these measured the same
# (of configs/ only the default run's and the prompts)
MEASURED_CODE = ("ppo_jax", "train.py", "configs/default.yaml", "configs/prompts",
                 "pyproject.toml", "scripts/setup_venv.sh")
BENCH_SCRIPTS = ("bench/*.py", "bench/*.sh")
RENDERING = ("bench/report.py",)  # renders only: measures nothing
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
def code_changes(a: str, b: str, root: Path = ROOT) -> tuple[list[str], list[str]] | None:
    """(MEASURED_CODE files, benchmark scripts but RENDERING) that differ between commits `a`
    and `b`, or None where git cannot tell."""
    def names(*paths: str) -> list[str]:
        return subprocess.run(["git", "diff", "--name-only", a, b, "--", *paths], cwd=root,
                              capture_output=True, text=True, check=True).stdout.split()

    try:
        return names(*MEASURED_CODE), names(*BENCH_SCRIPTS, *(f":(exclude){p}" for p in RENDERING))
    except (OSError, subprocess.CalledProcessError):
        return None


def provenance_lines(raws: dict[str, dict | None], root: Path = ROOT) -> list[str]:
    """The commit(s) of the raw files, a note when several hold the same measured code, warnings
    for a dirty tree or no commit; SystemExit when the measured code differs (or is unknown)."""
    recs = {name: (d.get("commit"), d.get("dirty")) for name, d in raws.items() if d}
    distinct: list[str] = []
    for commit, _ in recs.values():  # a short hash is the same commit as a full one it starts
        if commit and not any(commit.startswith(c) or c.startswith(commit) for c in distinct):
            distinct.append(commit)
    missing = [n for n, (c, _) in recs.items() if c is None]
    dirty = [n for n, (_, d) in recs.items() if d]
    if not recs:
        return []
    if len(distinct) == 1 and not missing:
        lines = [f"Code: commit `{distinct[0]}` (every raw file)."]
    else:
        lines = ["Code: " + ", ".join(f"{n} `{c}`" if c else f"{n} not recorded"
                                      for n, (c, _) in recs.items()) + "."]
    if len(distinct) > 1:
        changes = {c: code_changes(distinct[0], c, root) for c in distinct[1:]}
        differ = {c: "git cannot tell" if ch is None else ", ".join(ch[0])
                  for c, ch in changes.items() if ch is None or ch[0]}
        if differ:
            raise SystemExit(
                "refusing to mix raw files from commits with different measured code ("
                + "; ".join(f"`{distinct[0]}` vs `{c}`: {why}" for c, why in differ.items())
                + f"): {lines[0]} Run the benchmarks again on one commit.")
        scripts = sorted({f for ch in changes.values() for f in ch[1]})
        lines.append(f"> **Note:** the raw files come from {len(distinct)} commits ("
                     + ", ".join(f"`{c}`" for c in distinct) + ") that hold the same measured "
                     f"code: `git diff` between them is empty for {', '.join(MEASURED_CODE)}"
                     + (f"; the benchmark scripts that differ: {', '.join(scripts)}." if scripts
                        else "; the benchmark scripts are the same too."))
    if dirty:
        lines.append("> **Warning:** measured on a dirty tree (uncommitted changes to tracked "
                     f"files): {', '.join(dirty)}; the commit does not hold the code measured.")
    if missing:
        lines.append(f"> **Warning:** no commit recorded for {', '.join(missing)} (a tree outside "
                     "git without $PPO_BENCH_COMMIT): which code these figures came from is unknown.")
    return lines


def cpu_lines(raws: dict[str, dict | None], here: dict) -> list[str]:
    """The CPU the raw files record; a warning when they record several, or none (then the report
    machine's is named as that)."""
    recs = {name: d.get("cpu") for name, d in raws.items() if d}
    distinct = list(dict.fromkeys(cpu_line(c) for c in recs.values() if c))
    missing = [n for n, c in recs.items() if not c]
    if not distinct:
        return [f"- CPU: not recorded by the raw files; this report was rendered on {cpu_line(here)}"]
    lines = ["- CPU (recorded by the benchmarks): " + (distinct[0] if len(distinct) == 1 else "; ".join(
        f"{n}: {cpu_line(c)}" for n, c in recs.items() if c))]
    if len(distinct) > 1:
        lines.append(f"> **Warning:** the raw files come from {len(distinct)} different CPUs: "
                     "their figures are not from one machine and must not be compared as one run.")
    if missing:
        lines.append(f"> **Warning:** no CPU recorded for {', '.join(missing)}: which machine "
                     "measured those is unknown.")
    return lines


# --------------------------------------------------------------------------- machine
def malloc_line(raws: dict[str, dict | None]) -> str:
    """Which benchmarks ran under train.py's malloc settings (per variant or worker where they have)."""
    groups: dict[str, list[str]] = {k: [] for k in ("on", "off", "on and off (an A/B)", "not recorded")}
    for name, d in raws.items():
        if not d:
            continue
        flags = ([v.get("malloc_settings") for v in d["variants"]] if "variants" in d
                 else [r.get("malloc_settings") for r in d.get("results", []) if isinstance(r, dict)])
        if not flags or None in flags and "variants" not in d:
            flags = [d.get("malloc_settings")]
        groups["not recorded" if None in flags else "on" if all(flags) else "off"
               if not any(flags) else "on and off (an A/B)"].append(name)
    return ("- train.py's malloc settings (one arena, no unmapping; ppo_jax/trainer/host/memory.py) "
            "in each benchmark's processes: "
            + "; ".join(f"{k}: {', '.join(v)}" for k, v in groups.items() if v))


def machine_lines(raws: dict[str, dict | None]) -> list[str]:
    """The recorded CPU, the report machine and packages, ppo_step's backend and TRL environment,
    each benchmark's load and wall time."""
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    installed = {d.metadata["Name"].lower(): d.version for d in distributions()}
    out = cpu_lines(raws, cpu_info()) + [
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
    loads, walls = ({n: d[k] for n, d in raws.items() if d and d.get(k) is not None}
                    for k in ("load_average", "wall_s"))
    if loads:
        out.append("- load average (1 min) at the end of each benchmark: "
                   + ", ".join(f"{n} {la:.2f}" for n, la in loads.items()))
    out.append(malloc_line(raws))
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
           "them (the load average at the end of each benchmark is given).", ""]
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
        out += ["", f"## {heading}", "", (d.get("markdown") or f"_{name}.json carries no section "
                                          "(written before the benchmarks rendered their own)_")
                if d else f"_not run (no {name}.json)_"]
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
