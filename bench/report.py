"""Collect the benchmarks' JSON (`--json`) into bench/results.md: the header (commits, recorded
CPU, software, load and wall time, commands), each benchmark's own table, the ceiling estimate,
`make bench-train`'s runs and gpu.json. Refuses raw files from commits whose measured code differs.

Usage: python bench/report.py [RAW_DIR (default bench/results_raw)] [--out bench/results.md]
       python bench/report.py --gpu-only GPU_JSON [--out bench/results.md]   (that section only)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
from importlib.metadata import distributions
from pathlib import Path

from gpu import gpu_section, replace_gpu_section
from harness import ROOT, cpu_info, cpu_line, fmt, now, options, table

# the code whose speed the benchmarks measure: commits holding the same of these measured the same.
# Of configs/ only the default run's and the prompts (logprob_memory.py's Llama-8B arithmetic reads
# llama_8b_gpu_tpu.yaml: a change there shows in that estimate, not in a measurement).
MEASURED_CODE = ("ppo_jax", "train.py", "configs/default.yaml", "configs/prompts",
                 "pyproject.toml", "scripts/setup_venv.sh")
BENCH_SCRIPTS = ("bench/*.py", "bench/*.sh")
RENDERING = ("bench/report.py",)  # renders only: measures nothing
# the benchmarks `make bench` runs, in results.md's order, with their headings
SECTIONS = (
    ("ppo_step", "PPO step: ppo_jax vs TRL 0.11 `PPOTrainer` (bench/ppo_step.py)"),
    ("roofline", "Roofline: the PPO update's FLOP rate vs a large matmul (bench/roofline.py)"),
    ("update_profile", "Update profile: where the update's time goes, XLA:CPU flags A/B, PyTorch "
     "beside it (bench/update_profile.py)"),
    ("generate", "Generation: ppo_jax sampler vs transformers `generate` (bench/generate.py)"),
    ("decode_floor", "Decode floor: the sampler's decode step vs its weight matmuls alone "
     "(bench/decode_floor.py)"),
    ("engine", "Rollout engine: the paged engine vs the static sampler at equal KV memory "
     "(bench/engine.py)"),
    ("core", "PPO math: ppo_jax.core vs TRL 0.11-style torch (bench/core.py)"),
    ("logprob_memory", "Log-probs without the `[B, T, V]` logits: memory of the head and of the "
     "whole update (bench/logprob_memory.py)"),
    ("lora_update", "LoRA update: forward + backward against the full fine-tune, two widths "
     "(bench/lora_update.py)"),
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


# --------------------------------------------------------------------------- ceiling
def ceiling_markdown(step: dict, roof: dict, floor: dict | None) -> str:
    """An estimate: ppo_jax's step with every counted scoring + update FLOP at the fastest matmul
    rate measured, generation at the decode floor, host work free; against TRL's measured step."""
    rate = roof["matmul"]["gflops_per_s"]["max"] * 1e9
    gen_scale = floor["floor_step_s"] / floor["decode_step_s"] if floor else 1.0
    rows = []
    for epochs in sorted({r["epochs"] for r in step["results"]}):
        rs = {r["config"]: r for r in step["results"] if r["epochs"] == epochs}
        trl, ours = rs.get("trl"), rs.get("jax-shared")
        if not trl or not ours or not ours.get("model_flops"):
            continue
        t_ours, t_trl = ours["stats"]["time/step"]["median"], trl["stats"]["time/step"]["median"]
        flops = sum(ours["model_flops"][k]["flops"] for k in ("scoring", "update"))
        gen = ours["stats"]["time/generation"]["median"] * gen_scale
        best = gen + flops / rate
        rows.append([epochs, fmt(t_ours), fmt(gen), fmt(flops / rate), fmt(best), fmt(t_trl),
                     f"×{t_trl / t_ours:.2f}", f"**×{t_trl / best:.2f}**"])
    if not rows:
        return "_needs ppo_step.json with TRL and the shared-critic run, and roofline.json_"
    gen_txt = (f"generation at the decode floor (its measured time x {gen_scale:.2f}, the "
               "weight matmuls' share of a decode step in decode_floor.json)" if floor
               else "generation as measured (no decode_floor.json)")
    return "\n".join([
        f"An estimate, not a measurement: ppo_jax's step if scoring and update ran every counted "
        f"model FLOP at the fastest {roof['matmul']['n']}^3 float32 matmul rate measured here "
        f"({fmt(rate / 1e9, 1)} GFLOP/s, roofline.json), {gen_txt}, and host work (decode, reward, "
        "GAE) took no time; against TRL's measured step (seconds, medians):", "",
        table(["epochs", "ppo_jax step", "generation at best", "scoring + update at best",
               "best step", "TRL step", "ratio now", "ratio at best"], rows)])


# --------------------------------------------------------------------------- main
def render(raw: Path, out_path: Path | None = None) -> str:
    """results.md's text from the raw JSON files in `raw` (`out_path`: for the reproduce line)."""
    load = lambda name: json.loads(p.read_text()) if (p := raw / f"{name}.json").is_file() else None  # noqa: E731
    raws = {name: load(name) for name, _ in SECTIONS}
    raws.update({name: d for name in TRAIN_RUNS + LORA_RUNS if (d := load(name))})
    gpu = load("gpu")  # optional: bench/gpu.sh --json <raw>/gpu.json on an accelerator
    rel = raw.relative_to(ROOT) if raw.is_relative_to(ROOT) else raw
    out = ["# Benchmark results", "", f"Generated {now()} by `bench/report.py` from `{rel}`. All "
           "figures are wall-clock times on the machine below; other load on the machine inflates "
           "them (the load average at the end of each benchmark is given).", ""]
    if prov := provenance_lines({**raws, "gpu": gpu}):
        out += ["\n\n".join(prov), ""]
    out += ["## Machine and software", ""] + machine_lines(raws)
    out += ["", "## Reproduce", "", "```bash", "make bench   # sets up .venv and .venv-bench, runs "
            "the nine benchmarks, writes bench/results.md", "# or one at a time:"]
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
    if raws["ppo_step"] and raws["roofline"]:
        out += ["", "## Ceiling: the fastest PPO step the measured CPU allows (bench/report.py)", "",
                ceiling_markdown(raws["ppo_step"], raws["roofline"], raws["decode_floor"])]
    for group, heading in ((LORA_RUNS, "LoRA against the full fine-tune: whole runs (bench/train_run.py, "
                                       "commands in each)"),
                           (TRAIN_RUNS, "Whole training runs (bench/train_run.py, `make bench-train`)")):
        if runs := [raws[name] for name in group if name in raws]:
            out += ["", f"## {heading}"]
            for d in runs:
                out += ["", f"### {d.get('title') or 'train.py runs'}", "", d.get("markdown", "")]
    if gpu:
        out += ["", gpu_section(gpu)]
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("raw", nargs="?", type=Path, default=ROOT / "bench/results_raw")
    args = options(__doc__, parser=parser, out=ROOT / "bench/results.md", gpu_only=None)
    if args.gpu_only is not None:  # only (re)write the GPU section of --out, keep the rest
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
