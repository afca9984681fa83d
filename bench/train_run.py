"""Whole `train.py` runs measured from outside: wall time, peak RSS, page faults and CPU time of
each run's process (`os.wait4`), beside the phase times and rewards of its metrics.jsonl; no
peer. A variant (`--variant NAME SPEC`; default: `make train` itself) is one command line
(leading `VAR=VALUE` words: environment); `--rounds N` interleaves the variants. This script
does not re-execute under train.py's malloc settings (a variant may turn them off).

Usage: see `make bench-train`; .venv/bin/python bench/train_run.py [--variant NAME SPEC ...]
    [--rounds 1] [--title T] [--work-dir DIR] [--keep] [--python PY] [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import ROOT, alternate, finish, fmt, log, options, ratio, spread, stats, table
from ppo_jax.trainer.host.memory import malloc_env, malloc_settings_active
from ppo_jax.trainer.tracking.metrics import read_metrics

PHASES = ("time/generation", "time/experience", "time/update", "time/step")
USAGE = ("wall_s", "max_rss_kib", "minor_faults", "major_faults", "user_s", "system_s")
WINDOW = 5  # steps averaged at each end of a run


def parse_spec(spec: str) -> tuple[dict[str, str], list[str]]:
    """(environment: the leading `VAR=VALUE` words, train.py arguments: the rest) of a SPEC;
    ValueError when it sets `train.output_dir` (this script owns it)."""
    words, env = shlex.split(spec), {}
    while words and "=" in words[0] and not words[0].startswith("-") \
            and words[0].split("=", 1)[0].isidentifier():
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    if any("train.output_dir" in w for w in words):
        raise ValueError(f"variant spec {spec!r}: train.output_dir is set by bench/train_run.py")
    return env, words


def summarize_metrics(rows: list[dict], window: int = WINDOW) -> dict:
    """Per-run figures from metrics.jsonl rows: `steps`, `first_step`, `median` (steps 2..N),
    `evals`, `eval_s`, the means over the first / last `window` steps of score and KL, `kl_max`."""
    steps = [r for r in rows if r.get("step", 0) > 0 and "time/step" in r]
    evals = [r for r in rows if "eval/reward_mean" in r]
    out: dict = {"steps": int(steps[-1]["step"]) if steps else 0,
                 "evals": [[r["step"], r["eval/reward_mean"]] for r in evals],
                 "eval_s": sum(r.get("time/eval", 0.0) for r in evals)}
    if not steps:
        return out
    phases = [k for k in PHASES if k in steps[0]]
    if steps[0]["step"] == 1:  # with train.log_every > 1 step 1 is not logged
        out["first_step"] = {k: steps[0][k] for k in phases}
    out["median"] = {k: statistics.median(r[k] for r in steps[1:] or steps) for k in phases}
    w = min(window, len(steps))
    for key, name in (("score_mean", "score"), ("kl", "kl")):
        if key in steps[0]:
            out[f"{name}_start"] = statistics.fmean(r[key] for r in steps[:w])
            out[f"{name}_end"] = statistics.fmean(r[key] for r in steps[-w:])
    if "kl" in steps[0]:
        out["kl_max"] = max(r["kl"] for r in steps)
    return out


def child_malloc_settings(env_extra: dict[str, str]) -> bool:
    """Whether train.py started with `env_extra` runs under its malloc settings (after re-executing)."""
    env = {**os.environ, **env_extra}
    return malloc_settings_active(env) or malloc_env(env) is not None


def run_variant(name: str, env_extra: dict[str, str], args: list[str], out_dir: Path, python: str) -> dict:
    """Run `train.py` for one variant (`parse_spec`'s environment and arguments) into `out_dir`
    and measure it."""
    cmd = [python, str(ROOT / "train.py"), *args, "--set", f"train.output_dir={out_dir}"]
    log_path = out_dir.parent / f"{out_dir.name}.log"
    print(f"[{name}] {' '.join(f'{k}={v}' for k, v in env_extra.items())} {shlex.join(cmd[1:])}", flush=True)
    with open(log_path, "w") as out:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **env_extra}, stdout=out,
                                stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-30:])
        raise SystemExit(f"variant {name!r}: train.py exited with {proc.returncode}\n{tail}")
    if not (metrics := out_dir / "metrics.jsonl").is_file():
        raise SystemExit(f"variant {name!r}: train.py wrote no {metrics}")
    return {"wall_s": wall, "max_rss_kib": usage.ru_maxrss, "minor_faults": usage.ru_minflt,
            "major_faults": usage.ru_majflt, "user_s": usage.ru_utime, "system_s": usage.ru_stime,
            **summarize_metrics(read_metrics(metrics))}


def merge_runs(runs: list[dict]) -> dict:
    """One variant over its rounds: the stats of wall, memory, faults, CPU time, phase medians."""
    phases = [k for k in PHASES if all(k in r.get("median", {}) for r in runs)]
    return {**{k: stats(r[k] for r in runs) for k in USAGE},
            "median": {k: stats(r["median"][k] for r in runs) for k in phases}}


# --------------------------------------------------------------------------- markdown
def _phases(med: dict) -> str:
    return " / ".join(fmt(med[k]) for k in PHASES if k in med) or "n/a"


def round_ratio_rows(data: dict) -> list[list[str]]:
    """Each later variant against the first, per round (median, min-max over the rounds): times
    the first's / the variant's, memory, faults and system CPU the variant's / the first's."""
    base, *others = data["variants"]
    fns = [*(lambda b, r, k=k: b["median"][k] / r["median"][k] for k in ("time/step", "time/update")),
           lambda b, r: b["wall_s"] / r["wall_s"], lambda b, r: r["max_rss_kib"] / b["max_rss_kib"],
           lambda b, r: r["minor_faults"] / max(b["minor_faults"], 1),
           lambda b, r: r["system_s"] / max(b["system_s"], 1e-9)]

    def over_rounds(pairs, f) -> str:
        try:
            xs = [f(b, r) for b, r in pairs]
        except KeyError:  # a stage without this phase
            return "n/a"
        return ratio(statistics.median(xs), 2, stats(xs) if len(xs) > 1 else None)

    return [[v["name"]] + [over_rounds(pairs, f) for f in fns] for v in others
            if (pairs := [(b, r) for b in base["runs"] for r in v["runs"] if b["round"] == r["round"]])]


def markdown(data: dict) -> str:
    n, variants = data["rounds"], data["variants"]
    run_name = lambda name, r: name + (f", round {r['round']}" if n > 1 else "")  # noqa: E731
    rows = [[v["name"], f"`{v['spec']}`" if v["spec"] else "none (configs/default.yaml)",
             "/".join(str(s) for s in sorted({r["steps"] for r in v["runs"]})), spread(m["wall_s"], 1, 1 / 60),
             fmt((v["runs"][0].get("first_step") or {}).get("time/step")),
             _phases({k: st["median"] for k, st in m["median"].items()}), spread(m["max_rss_kib"], 2, 2 ** -20),
             spread(m["minor_faults"], 2, 1e-6), f"{m['major_faults']['median']:,.0f}", spread(m["user_s"], 0),
             spread(m["system_s"], 0), {True: "on", False: "off"}.get(v.get("malloc_settings"), "n/a")]
            for v in variants for m in [v["merged"]]]
    out = [f"`{data.get('command', 'bench/train_run.py')}`: every run a fresh `train.py` process"
           + (f", every variant once in each of {n} rounds (the order reversed every other "
              "round); median over the rounds (min–max)" if n > 1 else "")
           + ". Wall time: start to exit; peak RSS, faults, CPU time: the kernel's account "
           "(`wait4`); step times: metrics.jsonl, step 1 (compilation; of the first round) apart, "
           "then the median over steps 2 to the last."
           + ("" if data.get("complete", True) else " **Incomplete: the measurement stopped before its last "
                                                     "run.**"),
           "", table(["variant", "environment, train.py arguments", "steps", "wall, minutes", "step 1 s",
                      "median generation / experience / update / step s", "peak RSS GiB", "minor faults (M)",
                      "major faults", "user CPU s", "system CPU s", "malloc settings"], rows)]
    if len(variants) > 1 and (rows := round_ratio_rows(data)):
        first = variants[0]["name"]
        out += ["", f"Against `{first}`" + (f", per round (median (min–max) over {n} rounds)" if n > 1 else "")
                + f": time ratios are {first}'s / the variant's (above 1: the variant is faster); "
                f"memory, fault and system-time ratios are the variant's / {first}'s.", "",
                table(["variant", "median step", "median update", "wall", "peak RSS", "minor faults",
                       "system CPU"], rows)]
    runs = [(v["name"], r) for v in variants for r in v["runs"]]
    held = lambda ev: " → ".join(f"{e[1]:.3f} (step {e[0]})"  # noqa: E731
                                 for e in (ev[:1] + ev[-1:] if len(ev) > 1 else ev)) or "none"
    if rows := [[run_name(name, r), f"{r['score_start']:.3f} → {r['score_end']:.3f}",
                 f"{r['kl_end']:.2f} / {r['kl_max']:.2f}", held(r.get("evals", [])),
                 f"{r['eval_s']:.0f}" if r.get("evals") else "—"] for name, r in runs if "score_start" in r]:
        out += ["", f"What the runs learned (training reward, KL: means over the first and last {WINDOW} "
                f"steps; KL: last {WINDOW} steps / maximum; held-out reward: first and last evaluation):", "",
                table(["run", "training reward", "KL end / max", "held-out reward", "evaluation s"], rows)]
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", nargs=2, action="append", metavar=("NAME", "SPEC"))
    args = options(__doc__, parser=parser, rounds=1, title="", work_dir=None, keep=False,
                   python=sys.executable, json=None)
    variants = args.variant or [("make train", "")]
    names = [n for n, _ in variants]
    slugs = ["".join(c if c.isalnum() else "_" for c in n) for n in names]
    if len(set(slugs)) != len(slugs):
        raise SystemExit(f"--variant names must differ (in their letters and digits): {names}")
    parsed = {}
    for name, spec in variants:
        try:
            parsed[name] = parse_spec(spec)
        except ValueError as err:
            raise SystemExit(f"variant {name!r}: {err}") from None
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="train_run_"))
    work.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict]] = {n: [] for n in names}

    def save(complete: bool) -> None:
        finish({"bench": "train_run", "title": args.title, "complete": complete, "rounds": args.rounds,
                "window": WINDOW, "variants": [
                    {"name": n, "spec": s, "env": parsed[n][0], "args": parsed[n][1], "runs": runs[n],
                     "malloc_settings": child_malloc_settings(parsed[n][0]), "merged": merge_runs(runs[n])}
                    for n, s in variants if runs[n]]},
               markdown, args.json, show=complete)

    try:
        for rnd in range(args.rounds):
            for name, slug in alternate(zip(names, slugs), rnd):
                out_dir = work / f"{slug}_round{rnd + 1}"
                if out_dir.exists():
                    raise SystemExit(f"{out_dir} exists: give a fresh --work-dir")
                runs[name].append(run := {**run_variant(name, *parsed[name], out_dir, args.python), "round": rnd + 1})
                log(f"[{name}] {run['wall_s'] / 60:.1f} min, {run['steps']} steps, median generation / "
                    f"experience / update / step {_phases(run.get('median', {}))} s, peak RSS "
                    f"{run['max_rss_kib'] / 2**20:.2f} GiB")
                save(complete=False)
                if not args.keep and args.work_dir is None:  # checkpoints: GBs per run
                    shutil.rmtree(out_dir, ignore_errors=True)
    finally:
        if not args.keep and args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    save(complete=True)


if __name__ == "__main__":
    main()
