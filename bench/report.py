"""Assemble `bench/results.md` from the JSON files the benchmark scripts write with `--json`.

Reads `core.json` (bench/core.py), `generate.json` (bench/generate.py), `ppo_step.json`
(bench/ppo_step.py) and `roofline.json` (bench/roofline.py) from a directory (any of them may be missing; its section then says so),
plus `gpu.json` (bench/gpu.sh --json) when present,
and writes one markdown file: the date, the machine (CPU model, cores, memory, load average
when each benchmark ran), the software versions, the commands to reproduce, and one section of
tables per benchmark with the figures as measured (median, with min-max over the runs).

Usage: python bench/report.py [RAW_DIR (default bench/results_raw)] [--out bench/results.md]
       python bench/report.py --gpu-only GPU_JSON [--out bench/results.md]   (that section only)
The table helpers are also used by the scripts to print their own results.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHASES = (("generation", "generation"), ("scoring", "scoring"), ("update", "update"),
          ("step", "whole step"))


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


# --------------------------------------------------------------------------- formatting
def _f(x, digits: int = 2) -> str:
    if x is None:
        return "n/a"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    if abs(x) >= 100:
        return f"{x:.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    return f"{x:.{digits}f}"


def _spread(st: dict | None, digits: int = 2) -> str:
    """`median (min-max)` of a stats dict."""
    if not st:
        return "n/a"
    if st.get("n", 2) == 1 or st["min"] == st["max"]:
        return _f(st["median"], digits)
    return f"{_f(st['median'], digits)} ({_f(st['min'], digits)}–{_f(st['max'], digits)})"


def _gflop(flops) -> str:
    """FLOPs as GFLOP to 3 significant figures ("n/a" for None)."""
    return "n/a" if flops is None else f"{flops / 1e9:.3g}"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


# --------------------------------------------------------------------------- ppo_step
def ppo_step_markdown(data: dict) -> str:
    """Per `ppo_epochs` value: phase times, tokens/s, compile / memory, and ratios vs TRL."""
    s = data["settings"]
    out = [f"Model `{s['model']}`, {s['dtype']}, batch {s['batch']} (one minibatch, no gradient "
           f"accumulation), {s['new_tokens']} new tokens per response (no early stop), KL coef "
           f"{s['kl_coef']} fixed, grad clip {s['max_grad_norm']}; {s['warmup']} warm-up + "
           f"{s['steps']} measured steps per configuration; median (min–max)."]
    by_epochs: dict[int, list[dict]] = {}
    for r in data["results"]:
        by_epochs.setdefault(r["epochs"], []).append(r)
    order = {"trl": 0, "jax-shared": 1, "jax-separate": 2}
    for epochs in sorted(by_epochs):
        rs = sorted(by_epochs[epochs], key=lambda r: order.get(r["config"], 9))
        out.append(f"\n#### ppo_epochs = {epochs}\n")
        rows = []
        for r in rs:
            st = r["stats"]
            comp = r.get("compile_s")
            comp_txt = "none (eager)" if comp is None else _f(comp["time/step"])
            rows.append([r["label"]] + [_spread(st.get(f"time/{k}")) for k, _ in PHASES]
                        + [comp_txt, _f(r["peak_rss_mib"], 0)])
        out.append("Wall time per step, seconds:\n")
        out.append(table(["configuration"] + [f"{n} s" for _, n in PHASES]
                         + ["compile s", "peak RSS MiB"], rows))
        rows = [[r["label"]] + [_spread(r["stats"].get(f"tokens_per_s/{k}"), 1) for k, _ in PHASES]
                for r in rs]
        out.append("\nTokens/s (generation: new tokens; scoring, step: real prompt + response "
                   "tokens; update: epochs x those):\n")
        out.append(table(["configuration"] + [f"{n} tok/s" for _, n in PHASES], rows))
        trl = next((r for r in rs if r["config"] == "trl"), None)
        ours = [r for r in rs if r["config"] != "trl"]
        if trl is not None and ours:
            rows = []
            for r in ours:
                tok = [r["stats"][f"tokens_per_s/{k}"]["median"] / trl["stats"][f"tokens_per_s/{k}"]["median"]
                       for k, _ in PHASES]
                tim = [trl["stats"][f"time/{k}"]["median"] / r["stats"][f"time/{k}"]["median"]
                       for k, _ in PHASES]
                rows.append([f"{r['label']}: ours/TRL tokens/s"] + [f"×{x:.2f}" for x in tok])
                rows.append([f"{r['label']}: TRL time / ours time"] + [f"×{x:.2f}" for x in tim])
            out.append("\nRatios against TRL (medians; above 1: ppo_jax is faster):\n")
            out.append(table(["comparison"] + [n for _, n in PHASES], rows))
        flops = flops_table(rs)
        if flops:
            out.append("\nModel FLOPs per step, counted (matmuls executed: ppo_jax from the compiled "
                       "functions' jaxprs, TRL from torch's FlopCounterMode on one extra untimed "
                       "step; ppo_jax applies the LM head to response positions only, TRL to "
                       "every position; GFLOP/s = those FLOPs / the phase's median time):\n")
            out.append(flops)
        comp_rows = [[r["label"], _f(r.get("load_s")), _f(r.get("first_step_s"))]
                     + [_f((r.get("compile_s") or {}).get(f"time/{k}")) for k, _ in PHASES]
                     for r in rs]
        out.append("\nLoad and first step (compile = first step minus the steady-state median):\n")
        out.append(table(["configuration", "load s", "first step s"]
                         + [f"compile {n} s" for _, n in PHASES], comp_rows))
    return "\n".join(out)


def flops_table(rs: list[dict]) -> str | None:
    """Scoring / update GFLOP per step and GFLOP/s of each result with `model_flops`."""
    rows = []
    for r in rs:
        mf = r.get("model_flops")
        if not mf:
            continue
        cells = [r["label"]]
        cells += [_gflop(mf[k]["flops"]) for k in ("scoring", "update")]
        cells += [_f(r["stats"].get(f"gflops_per_s/{k}", {}).get("median"), 1)
                  for k in ("scoring", "update")]
        rows.append(cells + [mf["source"].split(",")[0]])
    if not rows:
        return None
    return table(["configuration", "scoring GFLOP / step", "update GFLOP / step",
                  "scoring GFLOP/s", "update GFLOP/s", "counted by"], rows)


# --------------------------------------------------------------------------- roofline
def roofline_markdown(data: dict) -> str:
    """The update's model-FLOP rate against a large matmul's (bench/roofline.py's JSON)."""
    cpu, mm, u = data["cpu"], data["matmul"], data["update"]
    dry = " DRY RUN on the tiny random model: not a figure to quote." if data.get("tiny") else ""
    out = [f"CPU {cpu['model']}, {cpu['cores']} logical cores, instruction sets "
           f"{' '.join(cpu['isa']) or 'n/a'}; jax {data['jax']}, float32, one process, measured "
           f"{data['date']}.{dry} GFLOP/s: median (min–max); the update's FLOPs are the "
           f"matmuls of its compiled program ({u['flops_source']}), attention included.", ""]
    n = mm["n"]
    rows = [[f"matmul {n}x{n}x{n} (jitted `x @ y`)", _spread(mm["gflops_per_s"], 1),
             f"{_gflop(mm['flops'])} (2 N^3)", _spread(mm["seconds"], 3)],
            [f"PPO update: `{u['model']}`, {u['mode']} critic, {u['epochs']} epoch(s), batch "
             f"{u['batch']}, {u['new_tokens']} new tokens", _spread(u["gflops_per_s"], 1),
             f"{_gflop(u['flops'])} per step (XLA cost analysis {_gflop(u['xla_flops'])}, "
             f"6N model {_gflop(u['flops_6n'])})", _spread(u["seconds"], 3)]]
    out.append(table(["work", "GFLOP/s", "GFLOP", "seconds"], rows))
    out.append(f"\nUpdate / matmul rate: **{data['ratio']:.2f}** (target ≥ {data['target']:.2f}); "
               f"scoring ran at {_f(u['scoring_gflops_per_s']['median'], 1)} GFLOP/s. XLA's "
               "cost analysis counts each loop body once (the layers are a `lax.scan`), hence "
               "its lower figure.")
    return "\n".join(out)


# --------------------------------------------------------------------------- core / generate
def core_markdown(data: dict) -> str:
    out = [f"B={data['batch']}, T={data['length']}, float32. One pass of reward shaping + GAE + "
           "advantage whitening + clipped policy/value loss forward and gradient; torch: TRL 0.11 "
           f"semantics written for the bench (Python loops as TRL has them). Median (min) per call; "
           f"torch {data['runs']} runs, JAX {data['jax_runs']} runs each."]
    rows = [["torch, TRL 0.11 style", f"{data['torch']['median_ms']:.3f} ({data['torch']['min_ms']:.3f})",
             "×1.0", "—"]]
    for label, r in data["jax"].items():
        default = " (default)" if label == data.get("default_gae") else ""
        rows.append([f"jax jit, GAE {label}{default}", f"{r['median_ms']:.3f} ({r['min_ms']:.3f})",
                     f"×{data['torch']['median_ms'] / r['median_ms']:.1f}", f"{r['compile_s']:.2f}"])
    out.append("\n" + table(["implementation", "ms per call", "speed-up vs torch", "compile s"], rows))
    if data.get("gae_alone"):
        out.append("\nGAE alone (jitted, [B, T]):\n")
        out.append(table(["method", "ms per call (min)"],
                         [[k, f"{v['median_ms']:.3f} ({v['min_ms']:.3f})"]
                          for k, v in data["gae_alone"].items()]))
    return "\n".join(out)


def generate_markdown(data: dict) -> str:
    out = [f"Model `{data.get('model')}`, float32, batch {data.get('batch')}, prompt width "
           f"{data.get('prompt_width')}, {data.get('new_tokens')} new tokens, greedy, no early "
           f"stop; tokens/s = batch x new tokens / wall time of one whole generate call; median "
           f"(min–max) over {data.get('runs')} calls after one warm-up call."]
    rows = []
    for key, name in (("ppo_jax", "ppo_jax jitted KV-cache sampler"),
                      ("transformers", "transformers `generate` (PyTorch CPU)")):
        r = data.get(key)
        if r:
            rows.append([name, _spread(r.get("tokens_per_s"), 1), _spread(r.get("seconds"), 3),
                         _f(r.get("first_call_s"))])
    out.append("\n" + table(["implementation", "tokens/s", "s per call", "first call s"], rows))
    extras = []
    if data.get("ratio") is not None:
        paired = data.get("paired_ratio")
        extras.append(f"ratio ppo_jax / transformers (medians): ×{data['ratio']:.2f}"
                      + (f" (paired runs ×{paired['min']:.2f}–×{paired['max']:.2f})" if paired else ""))
    if data.get("compile_s") is not None:
        extras.append(f"ppo_jax compile: {data['compile_s']:.1f} s")
    if data.get("identical_rows") is not None:
        extras.append(f"greedy rows identical token for token: {data['identical_rows']}/{data.get('batch')}")
    if extras:
        out.append("\n" + "; ".join(extras) + ".")
    return "\n".join(out)


# --------------------------------------------------------------------------- gpu
def gpu_section(gpu: dict) -> str:
    """The GPU section of results.md from a gpu.json (bench/gpu.sh --json)."""
    from gpu import markdown as gpu_markdown

    st = gpu["settings"]
    dry = ", DRY RUN on a tiny model" if gpu.get("dry_run") else ""
    out = [f"## PPO step on {gpu['devices']} x {gpu['device_kind']} (bench/gpu.sh{dry})", "",
           f"ppo_jax only, random weights, {st['dtype']}, batch {st['batch']} (one minibatch), "
           f"{st['new_tokens']} new tokens per response (no early stop), prompts up to "
           f"{st['max_prompt_length']} tokens, {st['warmup']} warm-up + {st['steps']} measured "
           f"steps per configuration (medians). Measured {gpu['date']}"
           + (f" with jax {gpu['jax']}" if gpu.get("jax") else "")
           + (f", code at commit `{gpu['commit']}`" if gpu.get("commit") else "")
           + (f"; command `{gpu['command']}`" if gpu.get("command") else "") + ".", ""]
    shapes = gpu.get("shapes") or {}
    if shapes:
        out += ["Shapes: " + "; ".join(
            f"{m}: hidden {d['hidden']}, {d['layers']} layers, intermediate {d['intermediate']}, "
            f"{d['heads']} heads / {d['kv_heads']} KV heads of {d['head_dim']}"
            for m, d in shapes.items()) + "; SmolLM2's 49152-token vocabulary, tied embeddings.",
            ""]
    out.append(gpu_markdown(gpu["results"], gpu["peak_tflops"], gpu["peak_source"],
                            gpu["devices"], gpu.get("peak_hbm_tbs"),
                            gpu.get("peak_hbm_source", "unknown")))
    for key, what in (("skipped", "skipped (time budget)"), ("failed", "FAILED")):
        if gpu.get(key):
            out += ["", f"{what}: " + ", ".join(f"{x['model']} / {x['mode']} critic / "
                                                 f"{x['epochs']} epochs" for x in gpu[key])]
    return "\n".join(out)


# --------------------------------------------------------------------------- main
def load(raw: Path, name: str) -> dict | None:
    path = raw / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def render(raw: Path) -> str:
    core, gen, step = load(raw, "core"), load(raw, "generate"), load(raw, "ppo_step")
    roof = load(raw, "roofline")
    m = machine_info()
    rel = raw.relative_to(ROOT) if raw.is_relative_to(ROOT) else raw
    now = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    trl = next((r for r in (step or {}).get("results", []) if r["config"] == "trl"), None)
    ours = next((r for r in (step or {}).get("results", []) if r["config"] != "trl"), None)
    out = ["# Benchmark results", "",
           f"Generated {now} by `bench/report.py` from `{rel}`. "
           "All figures are wall-clock times on the machine below; other load on the machine "
           "inflates them (the load average at the end of each benchmark is given).", "",
           "## Machine and software", "",
           f"- CPU: {m['cpu']}, {m['cores']} logical cores"
           + (f", {m['memory_gib']:.0f} GiB memory" if m["memory_gib"] else ""),
           f"- OS: {m['os']}; Python {m['python']}"]
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
    loads = [(n, d.get("load_average")) for n, d in (("core", core), ("generate", gen),
                                                     ("ppo_step", step), ("roofline", roof)) if d]
    if loads:
        out.append("- load average (1 min) at the end of each benchmark: "
                   + ", ".join(f"{n} {la:.2f}" for n, la in loads if la is not None))
    out += ["", "## Reproduce", "", "```bash",
            "make bench   # sets up .venv and .venv-bench, runs the four benchmarks, writes bench/results.md",
            "# or one at a time:"]
    for name, d in (("core", core), ("generate", gen), ("ppo_step", step), ("roofline", roof)):
        if d and d.get("command"):
            out.append(d["command"])
        elif name not in ("ppo_step", "roofline"):
            out.append(f".venv/bin/python bench/{name}.py")
    out += [f".venv/bin/python bench/report.py {rel}",
            "```", ""]

    out += ["## PPO step: ppo_jax vs TRL 0.11 `PPOTrainer` (bench/ppo_step.py)", ""]
    out.append(ppo_step_markdown(step) if step else "_not run (no ppo_step.json)_")
    out += ["", "## Roofline: the PPO update's FLOP rate vs a large matmul (bench/roofline.py)", ""]
    out.append(roofline_markdown(roof) if roof else "_not run (no roofline.json)_")
    out += ["", "## Generation: ppo_jax sampler vs transformers `generate` (bench/generate.py)", ""]
    out.append(generate_markdown(gen) if gen else "_not run (no generate.json)_")
    out += ["", "## PPO math: ppo_jax.core vs TRL 0.11-style torch (bench/core.py)", ""]
    out.append(core_markdown(core) if core else "_not run (no core.json)_")
    gpu = load(raw, "gpu")
    if gpu:  # optional: bench/gpu.sh --json <raw>/gpu.json on an accelerator machine
        out += ["", gpu_section(gpu)]
    return "\n".join(out) + "\n"


GPU_HEADING = "## PPO step on "


def replace_gpu_section(text: str, section: str) -> str:
    """`text` (a results.md) with its GPU section (from `GPU_HEADING` to the next `## ` heading
    or the end) replaced by `section`, or `section` appended where there is none."""
    start = text.find("\n" + GPU_HEADING)
    if start < 0:
        return text.rstrip("\n") + "\n\n" + section.strip("\n") + "\n"
    end = text.find("\n## ", start + 1)
    rest = "" if end < 0 else "\n" + text[end:].lstrip("\n")
    return text[:start].rstrip("\n") + "\n\n" + section.strip("\n") + "\n" + rest


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
    text = render(args.raw.resolve())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
