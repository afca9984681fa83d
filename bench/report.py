"""Assemble `bench/results.md` from the JSON files the benchmark scripts write with `--json`.

Reads `core.json` (bench/core.py), `generate.json` (bench/generate.py), `ppo_step.json`
(bench/ppo_step.py), `roofline.json` (bench/roofline.py) and `decode_floor.json`
(bench/decode_floor.py) from a directory (any of them may be missing; its section then says so),
plus `gpu.json` (bench/gpu.sh --json) when present,
and writes one markdown file: the date, the git commit(s) the figures came from (with a warning
when the raw files come from different commits, a dirty tree, or record none), the machine (CPU
model, cores, memory, load average and wall time of each benchmark), the software versions,
the commands to reproduce, and one section of tables per benchmark with the figures as measured
(median, with min-max over the runs).

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
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from provenance import provenance_lines  # noqa: E402
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
        comp_rows = [[r["label"], _f(r.get("load_s")), _f(r.get("first_step_s")),
                      _f(_sum(r.get("load_s"), r.get("first_step_s"))),
                      _f(r["stats"]["time/step"]["median"])]
                     + [_f((r.get("compile_s") or {}).get(f"time/{k}")) for k, _ in PHASES]
                     for r in rs]
        out.append("\nLoad and first step, beside the steady-state median step (compile = first "
                   "step minus the steady-state median; TRL runs eagerly, so its first step "
                   "holds no compilation):\n")
        out.append(table(["configuration", "load s", "first step s", "load + first step s",
                          "steady step s (median)"]
                         + [f"compile {n} s" for _, n in PHASES], comp_rows))
        cols = columns_table(rs, s["batch"])
        if cols:
            out.append("\nColumns per step (means over the measured steps): real tokens against "
                       "the padded prompt + response width each side computes over:\n")
            out.append(cols)
    return "\n".join(out)


def _sum(a, b):
    return None if a is None or b is None else a + b


def columns_table(rs: list[dict], batch: int) -> str | None:
    """Real prompt + response tokens per step against `padded_seq_len_mean` (the prompt +
    response columns each side's passes run over) x `batch` rows, per result that has it."""
    rows = []
    for r in rs:
        width = r.get("padded_seq_len_mean")
        if width is None:
            continue
        real = r.get("seq_tokens_mean")
        padded = batch * width
        rows.append([r["label"], _f(real, 1), _f(width, 1), _f(padded, 0),
                     "n/a" if not real else f"{padded / real - 1:.1%}"])
    if not rows:
        return None
    return table(["configuration", "real tokens / step", "padded width (prompt + response)",
                  "padded tokens / step", "padding overhead"], rows)


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
def _ratio(x) -> str:
    return "n/a" if x is None else f"×{x:.1f}"


def _paired(p: dict | None) -> str:
    """`×median (×min–×max)` of per-round ratios (bench/core.py's `paired_ratio`)."""
    if not p:
        return "n/a"
    return f"×{p['median']:.1f} (×{p['min']:.1f}–×{p['max']:.1f}, {p['n']} rounds)"


def core_markdown(data: dict) -> str:
    if "rounds" in data:
        how = (f"{data['rounds']} interleaved rounds, each timing every JAX version and then "
               f"torch, in blocks of {data['jax_block']} (JAX) and {data['torch_block']} (torch) "
               "timed calls, every block right after its own warm-up (untimed calls of the same "
               f"function: at least {data['warmup_calls']}, and for at least "
               f"{data['warmup_s']:g} s, both sides)")
    else:  # a core.json from before the interleaved timing
        how = f"torch {data['runs']} runs, then JAX {data['jax_runs']} runs each (not interleaved)"
    out = [f"B={data['batch']}, T={data['length']}, float32. One pass of reward shaping + GAE + "
           "advantage whitening + clipped policy/value loss forward and gradient; torch: TRL 0.11 "
           "semantics written for the bench (Python loops as TRL has them). Median (min) ms per "
           f"call over every timed call; {how}. Speed-up vs torch: ratio of medians, ratio of "
           "minima, and the median of the per-round ratios (torch block median / JAX block "
           "median of the same round) with their min–max."]
    t = data["torch"]
    rows = [["torch, TRL 0.11 style", f"{t['median_ms']:.3f} ({t['min_ms']:.3f})", "×1.0", "×1.0",
             "—", "—"]]
    for label, r in data["jax"].items():
        default = " (default)" if label == data.get("default_gae") else ""
        minima = r.get("ratio_of_minima")
        rows.append([f"jax jit, GAE {label}{default}", f"{r['median_ms']:.3f} ({r['min_ms']:.3f})",
                     _ratio(t["median_ms"] / r["median_ms"]), _ratio(minima),
                     _paired(r.get("paired_ratio")), f"{r['compile_s']:.2f}"])
    out.append("\n" + table(["implementation", "ms per call", "median / median", "min / min",
                              "per-round ratios", "compile s"], rows))
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
    if data.get("ppo_jax"):
        r = data["ppo_jax"]
        rows.append(["ppo_jax jitted KV-cache sampler", _spread(r.get("tokens_per_s"), 1),
                     _spread(r.get("seconds"), 3), _f(r.get("first_call_s")), "—"])
    for name, r, ratio, paired in transformers_rows(data):
        cell = "n/a" if ratio is None else f"×{ratio:.2f}"
        if paired:
            cell += f" (paired runs ×{paired['min']:.2f}–×{paired['max']:.2f})"
        rows.append([name, _spread(r.get("tokens_per_s"), 1), _spread(r.get("seconds"), 3),
                     _f(r.get("first_call_s")), cell])
    out.append("\n" + table(["implementation", "tokens/s", "s per call", "first call s",
                              "ppo_jax / this (medians)"], rows))
    extras = []
    if data.get("ratio") is not None:
        best = (data.get("transformers") or {}).get("torch_threads")
        vs = f" at its fastest thread setting ({best} threads)" if best is not None else ""
        extras.append(f"headline ratio ppo_jax / transformers{vs} (medians): ×{data['ratio']:.2f}")
    if data.get("compile_s") is not None:
        extras.append(f"ppo_jax compile: {data['compile_s']:.1f} s")
    if data.get("identical_rows") is not None:
        extras.append(f"greedy rows identical token for token: {data['identical_rows']}/{data.get('batch')}")
    if extras:
        out.append("\n" + "; ".join(extras) + ".")
    return "\n".join(out)


def transformers_rows(data: dict) -> list[tuple[str, dict, float | None, dict | None]]:
    """(name, figures, ppo_jax / it, paired-run ratio stats) of each torch thread setting
    bench/generate.py timed, the fastest (the one the headline ratio is taken against) first and
    marked; one row from a generate.json that has no per-setting figures."""
    base = "transformers `generate` (PyTorch CPU)"
    by = data.get("transformers_by_threads") or {}
    best = (data.get("transformers") or {}).get("torch_threads")
    if not by or best is None:
        r = data.get("transformers")
        return [(base, r, data.get("ratio"), data.get("paired_ratio"))] if r else []
    ratios = data.get("ratio_by_threads") or {}
    paired = data.get("paired_ratio_by_threads") or {str(best): data.get("paired_ratio")}
    order = sorted(by, key=lambda th: (th != str(best), int(th)))
    return [(f"{base}, {th} thread{'' if th == '1' else 's'}"
             + (" (fastest)" if th == str(best) else ""), by[th],
             ratios.get(th), paired.get(th)) for th in order]


# --------------------------------------------------------------------------- decode floor
def decode_floor_markdown(data: dict) -> str:
    """bench/decode_floor.py's JSON: our decode step against the weight matmuls alone."""
    n, ms = data["new_tokens"], lambda x: _f(x * 1e3, 1)
    mb, gflop = data["weight_bytes"] / 1e6, data["weight_flops_per_step"] / 1e9
    out = [f"Model `{data['model']}`, {data['dtype']}, batch {data['batch']}, prompt width "
           f"{data['prompt_width']}, {n} new tokens, greedy, no stop tokens; ms per call: median "
           f"(min–max) of {data['runs']} alternating runs (after one warm-up call each). Weight "
           f"matmuls: q/k/v/o/gate/up/down in every layer plus the LM head with the model's own "
           f"weights ({mb:.0f} MB read per step, {gflop:.2f} GFLOP = 2 x rows x weights), in a "
           f"jitted loop of {n - 1} steps with nothing else but an RMS norm per layer; ours: "
           f"decode step = (generate - prefill) / {n - 1}; torch {data['torch_threads']} threads.",
           ""]
    rows = [["ppo_jax `generate`, whole call", _spread_ms(data["generate_s"]), "—", "—", "—", "—"],
            ["ppo_jax prefill (`generate` with 1 new token)", _spread_ms(data["prefill_s"]), "—",
             "—", "—", "—"],
            ["ppo_jax decode step", "—", ms(data["decode_step_s"]), "—",
             _f(data["decode_gflops_per_s"], 1), "100%"]]
    for form, d in data["forms"].items():
        floor = " (floor)" if form == data["floor_form"] else ""
        rows.append([f"weight matmuls alone, layers {form}{floor}",
                     _spread_ms(data["floor_loop_s"][form]), ms(d["step_s"]),
                     _f(d["gb_per_s"], 1), _f(d["gflops_per_s"], 1),
                     f"{d['fraction_of_decode_step']:.0%}"])
    rows.append(["transformers `generate`, whole call", _spread_ms(data["transformers_s"]), "—",
                 "—", "—", "—"])
    out.append(table(["what", "ms per call", "ms per decode step", "weights GB/s",
                      "weight-matmul GFLOP/s", "of our decode step"], rows))
    out.append(f"\nRatio transformers / ppo_jax (medians of whole calls): ×{data['ratio_now']:.2f}; "
               f"best case, everything but the weight matmuls free (prefill + {n - 1} floor "
               f"steps): **×{data['best_case_ratio']:.2f}**; a ×2 sampler needs decode steps of "
               f"{ms(data['step_for_2x_s'])} ms.")
    return "\n".join(out)


def _spread_ms(st: dict) -> str:
    """A seconds stats dict as `median (min–max)` in ms."""
    return _spread({k: (v * 1e3 if k != "n" else v) for k, v in st.items()}, 1)


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


# the benchmarks `make bench` runs, in its order, with their results.md sections
BENCHES = ("core", "generate", "ppo_step", "roofline", "decode_floor")
SECTIONS = (
    ("ppo_step", "PPO step: ppo_jax vs TRL 0.11 `PPOTrainer` (bench/ppo_step.py)",
     ppo_step_markdown),
    ("roofline", "Roofline: the PPO update's FLOP rate vs a large matmul (bench/roofline.py)",
     roofline_markdown),
    ("generate", "Generation: ppo_jax sampler vs transformers `generate` (bench/generate.py)",
     generate_markdown),
    ("decode_floor", "Decode floor: the sampler's decode step vs its weight matmuls alone "
     "(bench/decode_floor.py)", decode_floor_markdown),
    ("core", "PPO math: ppo_jax.core vs TRL 0.11-style torch (bench/core.py)", core_markdown),
)


def machine_lines(raws: dict[str, dict | None]) -> list[str]:
    """The machine / software bullet list (read now), with each benchmark's load and wall time."""
    m, step = machine_info(), raws.get("ppo_step")
    results = (step or {}).get("results", [])
    trl = next((r for r in results if r["config"] == "trl"), None)
    ours = next((r for r in results if r["config"] != "trl"), None)
    out = [f"- CPU: {m['cpu']}, {m['cores']} logical cores"
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
    loads = [(n, d.get("load_average")) for n, d in raws.items() if d]
    if any(la is not None for _, la in loads):
        out.append("- load average (1 min) at the end of each benchmark: "
                   + ", ".join(f"{n} {la:.2f}" for n, la in loads if la is not None))
    walls = [(n, d["wall_s"]) for n, d in raws.items() if d and d.get("wall_s") is not None]
    if walls:
        out.append("- wall time of each benchmark (its whole process): "
                   + ", ".join(f"{n} {w / 60:.1f} min" for n, w in walls)
                   + f"; {sum(w for _, w in walls) / 60:.1f} min in all")
    return out


def render(raw: Path) -> str:
    raws = {name: load(raw, name) for name in BENCHES}
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
            "make bench   # sets up .venv and .venv-bench, runs the five benchmarks, writes "
            "bench/results.md", "# or one at a time:"]
    for name, d in raws.items():
        if d and d.get("command"):
            out.append(d["command"])
        elif name not in ("ppo_step", "roofline"):
            out.append(f".venv/bin/python bench/{name}.py --json {rel}/{name}.json")
    out += [f".venv/bin/python bench/report.py {rel}", "```"]
    for name, heading, markdown in SECTIONS:
        d = raws[name]
        out += ["", f"## {heading}", "", markdown(d) if d else f"_not run (no {name}.json)_"]
    if gpu:
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
