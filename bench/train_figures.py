"""Markdown for the whole-run measurements of bench/train_run.py (`train_run*.json`): one
results.md section per file, with every variant's wall time, peak resident memory, page faults,
CPU time and per-phase step medians, its training and held-out figures, and with several rounds
each run and the ratios to the first variant per round (standard library only)."""

from __future__ import annotations

import statistics

from sections import _f, table

PHASE_KEYS = ("time/generation", "time/scoring", "time/update", "time/step")


def _spread(median, lo_hi, digits: int = 2) -> str:
    if lo_hi is None or lo_hi[0] == lo_hi[1]:
        return _f(median, digits)
    return f"{_f(median, digits)} ({_f(lo_hi[0], digits)}–{_f(lo_hi[1], digits)})"


def _gib(kib) -> str:
    return f"{kib / 2**20:.2f}"


def _phases(med: dict) -> str:
    return " / ".join(_f(med[k]) for k in PHASE_KEYS if k in med) or "n/a"


def _variant_row(v: dict) -> list[str]:
    m, rng = v["merged"], v["merged"]["range"]
    first = v["runs"][0]
    steps = sorted({r["steps"] for r in v["runs"]})
    return [v["name"], f"`{v['spec']}`" if v["spec"] else "none (configs/default.yaml)",
            "/".join(str(s) for s in steps),
            _spread(m["wall_s"] / 60, [x / 60 for x in rng["wall_s"]], 1),
            _f((first.get("first_step") or {}).get("time/step")),
            _phases(m["median"]),
            _spread(m["max_rss_kib"] / 2**20, [x / 2**20 for x in rng["max_rss_kib"]], 2),
            _spread(m["minor_faults"] / 1e6, [x / 1e6 for x in rng["minor_faults"]], 2),
            f"{m['major_faults']:,.0f}",
            _spread(m["user_s"], rng["user_s"], 0), _spread(m["system_s"], rng["system_s"], 0),
            "on" if v.get("malloc_settings") else "off" if v.get("malloc_settings") is False
            else "n/a"]


def _repeated(rep: dict | None) -> str:
    if not rep or not rep.get("n"):
        return "none"
    return (f"{_f(rep.get('time/step'))} / {_f(rep.get('time/update'))} ({rep['n']})")


def _training_rows(data: dict) -> list[list[str]]:
    rows = []
    for v in data["variants"]:
        for r in v["runs"]:
            if "score_start" not in r:
                continue
            evals = r.get("evals", [])
            held = (" → ".join(f"{e[1]:.3f} (step {e[0]})" for e in (evals[0], evals[-1]))
                    if len(evals) > 1 else f"{evals[0][1]:.3f} (step {evals[0][0]})" if evals
                    else "none")
            rows.append([v["name"] + (f", round {r['round']}" if data["rounds"] > 1 else ""),
                         f"{r['score_start']:.3f} → {r['score_end']:.3f}",
                         f"{r['kl_end']:.2f} / {r['kl_max']:.2f}", held,
                         f"{r['eval_s']:.0f}" if evals else "—"])
    return rows


def round_ratio_rows(data: dict) -> list[list[str]]:
    """Each later variant against the first, per round: the first's / the variant's median step,
    median update and wall time (above 1: the variant is faster) and the variant's / the
    first's peak RSS, minor faults and system CPU time; median (min-max) over the rounds."""
    base, *others = data["variants"]
    rows = []
    for v in others:
        pairs = [(b, r) for b in base["runs"] for r in v["runs"] if b["round"] == r["round"]]
        if not pairs:
            continue

        def ratio(f):
            xs = [f(b, r) for b, r in pairs]
            med = statistics.median(xs)
            return (f"×{med:.2f}" if len(xs) == 1
                    else f"×{med:.2f} (×{min(xs):.2f}–×{max(xs):.2f})")

        def phase(key):
            if not all(key in b.get("median", {}) and key in r.get("median", {})
                       for b, r in pairs):
                return "n/a"
            return ratio(lambda b, r: b["median"][key] / r["median"][key])

        rows.append([v["name"], phase("time/step"), phase("time/update"),
                     ratio(lambda b, r: b["wall_s"] / r["wall_s"]),
                     ratio(lambda b, r: r["max_rss_kib"] / b["max_rss_kib"]),
                     ratio(lambda b, r: r["minor_faults"] / max(b["minor_faults"], 1)),
                     ratio(lambda b, r: r["system_s"] / max(b["system_s"], 1e-9))])
    return rows


def train_run_markdown(data: dict) -> str:
    """One bench/train_run.py JSON as markdown (module docstring)."""
    n = data["rounds"]
    out = [f"`{data.get('command', 'bench/train_run.py')}`: every run a fresh `train.py` process "
           "with its own output directory"
           + (f", every variant once in each of {n} rounds (the order reversed every other "
              "round); median over the rounds (min–max)" if n > 1 else "")
           + ". Wall time from start to exit (load, compilation and evaluations included); peak "
           "RSS, page faults and CPU time: the kernel's account of the process (`wait4`, "
           "`ru_maxrss`, `ru_minflt`, `ru_majflt`, `ru_utime`, `ru_stime`); step times: its "
           "metrics.jsonl, step 1 (compilation included; of the first round) apart, median over "
           "steps 2 to the last (step 1 in a one-step run)."
           + ("" if data.get("complete", True) else
              " **Incomplete: the measurement stopped before its last run.**"),
           "",
           table(["variant", "environment, train.py arguments", "steps", "wall, minutes",
                  "step 1 s",
                  "median generation / scoring / update / step s", "peak RSS GiB",
                  "minor faults (M)", "major faults", "user CPU s", "system CPU s",
                  "malloc settings"],
                 [_variant_row(v) for v in data["variants"]])]
    if len(data["variants"]) > 1:
        rows = round_ratio_rows(data)
        if rows:
            first = data["variants"][0]["name"]
            out += ["", f"Against `{first}`"
                    + (f", per round (median (min–max) over {n} rounds)" if n > 1 else "")
                    + f": time ratios are {first}'s / the variant's (above 1: the variant is "
                    f"faster); memory, fault and system-time ratios are the variant's / {first}'s.",
                    "", table(["variant", "median step", "median update", "wall",
                               "peak RSS", "minor faults", "system CPU"], rows)]
    if n > 1:
        out += ["", "Every run:", "",
                table(["variant", "round", "wall, minutes", "median generation / scoring / update / "
                       "step s", "peak RSS GiB", "minor faults (M)", "system CPU s"],
                      [[v["name"], str(r["round"]), f"{r['wall_s'] / 60:.1f}",
                        _phases(r.get("median", {})), _gib(r["max_rss_kib"]),
                        f"{r['minor_faults'] / 1e6:.2f}", f"{r['system_s']:.0f}"]
                       for v in data["variants"] for r in sorted(v["runs"],
                                                                 key=lambda r: r["round"])])]
    widths = [(v["name"], r) for v in data["variants"] for r in v["runs"]]
    if any(r.get("width_pairs", 1) > 1 for _, r in widths):
        out += ["", "Column widths (prompt + response columns a step computes over, "
                "trainer/columns.py): every new width pair compiles the scoring and update "
                "programs (and a new prompt width the sampler), so the median over the steps "
                "whose width pair an earlier step had is the per-step cost without compilation:",
                "", table(["run", "width pairs met", "widths per step (prompt + response)",
                           "median step s, steps 2 to the last",
                           "median step / update s, repeated widths only (steps)"],
                          [[name + (f", round {r['round']}" if data["rounds"] > 1 else ""),
                            str(r.get("width_pairs", "n/a")),
                            " ".join(f"{p:.0f}+{q:.0f}" for _, p, q, *_ in r.get("per_step", [])
                                     if p is not None and q is not None) or "n/a",
                            _f(r.get("median", {}).get("time/step")),
                            _repeated(r.get("repeated_widths"))]
                           for name, r in widths])]
    training = _training_rows(data)
    if training:
        w = data.get("window", 5)
        out += ["", f"What the runs learned (training reward and KL: means over the first and "
                f"last {w} steps; KL: last {w} steps / maximum; held-out reward: first and last "
                "evaluation):", "",
                table(["run", "training reward", "KL end / max", "held-out reward",
                       "evaluation s"], training)]
    return "\n".join(out)
