"""Markdown for bench/results.md: the table and number formatting the benchmark scripts share,
and one function per benchmark that turns its raw JSON (`--json`) into that benchmark's section
(ppo_step, roofline, core, generate, decode_floor). bench/report.py assembles the file; the
scripts print their own section with the same functions (standard library only)."""

from __future__ import annotations

PHASES = (("generation", "generation"), ("scoring", "scoring"), ("update", "update"),
          ("step", "whole step"))


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
           f"{s['steps']} measured steps per configuration"
           + (f" in each of {s['rounds']} interleaved rounds (every configuration a fresh "
              "process once per round, the order reversed every other round); median of the "
              "round medians (min–max over every measured step)." if s.get("rounds", 1) > 1
              else "; median (min–max).")]
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
            per_round = round_ratios(data.get("rounds") or [], epochs)
            if per_round:
                n = max(len(v[PHASES[0][0]]) for v in per_round.values())
                rows = [[label] + [_ratio_spread(st[k]) for k, _ in PHASES]
                        for label, st in per_round.items()]
                out.append(f"\nTRL time / ours time per round ({n} rounds: each round's medians; "
                           "median (min–max) over the rounds):\n")
                out.append(table(["comparison"] + [n_ for _, n_ in PHASES], rows))
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


def round_ratios(rounds: list[dict], epochs: int) -> dict[str, dict[str, list[float]]]:
    """Per ppo_jax configuration (by label): per phase, TRL's median time / ours of the same
    round, for every round that has both (bench/ppo_step.py's `rounds`). Empty when fewer than
    two rounds have both."""
    by_round: dict[int, dict[str, dict]] = {}
    for r in rounds:
        if r.get("epochs") == epochs and "round" in r:
            by_round.setdefault(r["round"], {})[r["config"]] = r
    out: dict[str, dict[str, list[float]]] = {}
    for rnd in sorted(by_round):
        trl = by_round[rnd].get("trl")
        for config, r in by_round[rnd].items():
            if config == "trl" or trl is None:
                continue
            ratios = out.setdefault(r["label"], {k: [] for k, _ in PHASES})
            for k, _ in PHASES:
                ratios[k].append(trl["stats"][f"time/{k}"]["median"] / r["stats"][f"time/{k}"]["median"])
    return {label: v for label, v in out.items() if len(v[PHASES[0][0]]) >= 2}


def _ratio_spread(values: list[float]) -> str:
    """`×median (×min–×max)` of ratios."""
    ordered = sorted(values)
    mid = len(ordered) // 2
    median = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
    return f"×{median:.2f} (×{ordered[0]:.2f}–×{ordered[-1]:.2f})"


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


# --------------------------------------------------------------------------- ceiling
def ceiling_markdown(step: dict, roof: dict, floor: dict | None) -> str:
    """The fastest PPO step this machine allows ppo_jax, from three raw files of one run: every
    counted model FLOP of scoring and update (ppo_step.json `model_flops`) at the fastest large
    float32 matmul rate measured (roofline.json `matmul`, the max over its runs), generation at
    its measured time scaled by decode_floor.json's floor / decode step (or as measured without
    it), host work free. Against TRL's measured step, per `ppo_epochs` value: the ratio no
    implementation on XLA:CPU's matmul rate can pass without doing fewer FLOPs."""
    rate = roof["matmul"]["gflops_per_s"]["max"] * 1e9
    gen_scale = floor["floor_step_s"] / floor["decode_step_s"] if floor else 1.0
    rows = []
    for epochs in sorted({r["epochs"] for r in step["results"]}):
        rs = {r["config"]: r for r in step["results"] if r["epochs"] == epochs}
        trl, ours = rs.get("trl"), rs.get("jax-shared")
        if not trl or not ours or not ours.get("model_flops"):
            continue
        st = ours["stats"]
        flops = sum(ours["model_flops"][k]["flops"] for k in ("scoring", "update"))
        gen = st["time/generation"]["median"] * gen_scale
        best = gen + flops / rate
        t_trl = trl["stats"]["time/step"]["median"]
        rows.append([epochs, _f(st["time/step"]["median"], 2), _f(gen, 2), _f(flops / rate, 2),
                     _f(best, 2), _f(t_trl, 2), f"×{t_trl / st['time/step']['median']:.2f}",
                     f"**×{t_trl / best:.2f}**"])
    if not rows:
        return "_needs ppo_step.json with TRL and the shared-critic run, and roofline.json_"
    gen_txt = (f"generation at the decode floor (its measured time x {gen_scale:.2f}, the "
               "weight matmuls' share of a decode step in decode_floor.json)" if floor
               else "generation as measured (no decode_floor.json)")
    return "\n".join([
        f"ppo_jax's step if scoring and update ran every counted model FLOP at the fastest "
        f"{roof['matmul']['n']}^3 float32 matmul rate measured here ({_f(rate / 1e9, 1)} GFLOP/s, "
        f"roofline.json), {gen_txt}, and host work (decode, reward, GAE) took no time; against "
        "TRL's measured step (seconds, medians):", "",
        table(["epochs", "ppo_jax step", "generation at best", "scoring + update at best",
               "best step", "TRL step", "ratio now", "ratio at best"], rows)])


# --------------------------------------------------------------------------- update profile
def update_profile_markdown(data: dict) -> str:
    """bench/update_profile.py's JSON: the XLA-flag A/B of the update's forward + backward (with
    torch as the peer) and where each side's op time goes."""
    cpu, ab = data["cpu"], data["flags_ab"]
    dry = " DRY RUN on the tiny random model: not a figure to quote." if data.get("tiny") else ""
    out = [f"CPU {cpu['model']}, {cpu['cores']} logical cores, instruction sets "
           f"{' '.join(cpu['isa']) or 'n/a'}; measured {data['date']}.{dry} Work: the actor's "
           f"forward + backward of one update minibatch, `{data['model']}`, {data['batch']} rows "
           f"x ({data['prompt']} prompt + {data['response']} response) tokens, float32, loss on "
           f"the response log-probs, no optimiser step. {data['rounds']} interleaved rounds, each "
           f"setting in a fresh process, median of {data['calls']} calls per round; ratio = "
           "the setting's median / the default's in the same round, median (min–max) over "
           "rounds (< 1 is faster).", ""]
    rows = []
    for r in ab["rows"]:
        what = "PyTorch peer (transformers, eager)" if r["side"] == "torch" else \
            (f"`{r['xla_flags']}`" if r["xla_flags"] else "XLA:CPU defaults")
        rows.append([r["name"], what, _spread(r["seconds"], 2), _spread(r["ratio_to_default"], 2),
                     _f(r["gflops_per_s"], 1), _f(r["first_call_s"]["median"], 1)])
    out.append(table(["setting", "flags", "seconds per call", "ratio to default", "GFLOP/s",
                      "first call s"], rows))
    fl = ab["flops"]
    out.append(f"\nFLOPs per call, counted: jax {_gflop(fl.get('jax'))} GFLOP (LM head on the "
               "response positions)" + (f", torch {_gflop(fl['torch'])} GFLOP (LM head on every "
                                        "position, as TRL)" if "torch" in fl else "") + ".")
    prof = data.get("profiles", {})
    if prof:
        kinds = ("matmul", "layout copies", "layer-scan stacking", "other")
        sides = [s for s in ("jax", "torch") if s in prof]
        rows = [[k] + [f"{_f(prof[s]['kinds'][k]['ms_per_call'], 1)} ms "
                       f"({100 * prof[s]['kinds'][k]['share']:.0f}%)" for s in sides] for k in kinds]
        rows.append(["all ops"] + [f"{_f(prof[s]['total_ms_per_call'], 1)} ms" for s in sides])
        out += ["", f"Op time per call by kind ({data['profile_calls']} traced calls; jax: "
                "`jax.profiler.trace`, XLA:CPU's ops may overlap on its threads; torch: "
                "`torch.profiler` self CPU time):", "",
                table(["kind"] + [("ppo_jax (XLA:CPU)" if s == "jax" else "PyTorch") for s in sides],
                      rows)]
        for s in sides:
            top = ", ".join(f"`{n}` {_f(t, 1)} ms" for n, t in prof[s]["top_ops"][:6])
            out.append(f"\nLargest {s} ops per call: {top}.")
    return "\n".join(out)


# --------------------------------------------------------------------------- logprob_memory
def logprob_memory_markdown(data: dict) -> str:
    """The log-prob head's memory and time, full logits vs vocabulary blocks; the whole PPO
    update's memory before / after; the Llama-3-8B arithmetic."""
    mib = 2 ** 20
    h = data["head"]
    out = [f"XLA's own memory account of each compiled program (`memory_analysis()`), jax "
           f"{data['jax']}, float32. **The head alone**: hidden `[{h['batch']}, {h['length']}, "
           f"{h['hidden']}]` and a tied head `[{h['vocab']}, {h['hidden']}]`, the taken tokens' "
           "log-probs and entropies and the gradient of `sum(a * logprobs + c * entropy)` w.r.t. "
           f"both; time: median of {data['runs']} calls.", "",
           table(["path", "scratch MiB", "outputs MiB", "arguments MiB", "s per call"],
                 [[name, f"{m['temp'] / mib:.1f}", f"{m['output'] / mib:.1f}",
                   f"{m['argument'] / mib:.1f}", f"{m['time']:.3f}"]
                  for name, m in (("full `[B, T, V]` logits", h["plain"]),
                                  (f"blocks of {h['chunk']} columns", h["chunked"]))]),
           "", f"Scratch full / blocks: ×{h['plain']['temp'] / max(h['chunked']['temp'], 1):.1f}; "
           f"time blocks / full: ×{h['chunked']['time'] / h['plain']['time']:.2f}; max |blocks - "
           f"full| of (loss, d_hidden, d_head): {h['max_abs_diff']}."]
    upd = data.get("update") or {}
    if upd.get("settings"):
        u0 = upd["settings"][0]
        out += ["", f"**The whole PPO update** of `{upd['config']}` (one compiled program: "
                f"{u0['epochs']} epochs over the batch of {u0['batch']} rows in minibatches of "
                f"{u0['mini_batch']}, micro-batches of {u0['micro_batch']}, prompt width "
                f"{u0['prompt_width']:.0f} + response width {u0['response_width']:.0f}, "
                f"V = {u0['vocab']:,}, {'shared' if u0['shared_critic'] else 'separate'} critic, "
                "forward, backward and AdamW); peak = arguments + outputs - aliased (donated) + "
                "scratch:", "",
                table(["`model.logprob_chunk_size`", "arguments MiB", "outputs MiB",
                       "aliased MiB", "scratch MiB", "peak MiB"],
                      [[f"{u['chunk']} ({'full logits' if u['chunk'] == 0 else 'blocks'})",
                        *(f"{u[k] / mib:,.1f}" for k in ("argument", "output", "alias", "temp",
                                                         "peak"))]
                       for u in upd["settings"]])]
        if len(upd["settings"]) > 1:
            a, b = upd["settings"][0], upd["settings"][-1]
            out += ["", f"Blocks against full logits: scratch {a['temp'] / mib:,.1f} → "
                    f"{b['temp'] / mib:,.1f} MiB, peak {a['peak'] / mib:,.1f} → "
                    f"{b['peak'] / mib:,.1f} MiB."]
    ll = data.get("llama_8b")
    if ll:
        out += ["", f"**Llama-3-8B at `configs/llama_8b_gpu_tpu.yaml`'s sizes** (arithmetic): "
                f"micro-batch {ll['micro_batch']} x {ll['length']} response tokens x V = "
                f"{ll['vocab']:,}: the full float32 logits are {ll['logits_bytes'] / mib:,.0f} MiB "
                f"({3 * ll['logits_bytes'] / mib:,.0f} MiB with their log-softmax and gradient) "
                f"against {ll['block_bytes'] / mib:,.0f} MiB per block of {ll['chunk']} columns; "
                f"the `[V, D]` head gradient ({ll['head_grad_bytes'] / mib:,.0f} MiB) is held "
                "either way."]
    return "\n".join(out)
