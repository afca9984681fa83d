"""Whole training runs of `train.py`, measured from outside: wall time, peak resident memory,
page faults and CPU time of each run's process (the kernel's own account, `os.wait4`), beside
the per-step phase times and rewards its `metrics.jsonl` logs.

Each variant is one `train.py` command line, run as a child process with its own fresh output
directory; `--rounds N` runs every variant once per round, the order reversed every other round.
The default variant is `make train` itself: `train.py` with `configs/default.yaml`.

A variant is `--variant NAME SPEC`: SPEC is split like a shell line; leading `VAR=VALUE` words
go to the child's environment, the rest to `train.py` (e.g. `--variant "malloc off"
"PPO_JAX_MALLOC_TUNING=0 --set train.steps=6"`). train.py re-executes itself under its glibc
malloc settings (ppo_jax/trainer/host_memory.py) in the same process, so the child's resource
usage covers the whole run; this script itself does not re-execute, so a variant that turns the
settings off (`PPO_JAX_MALLOC_TUNING=0`) runs without them. `train.output_dir` is always set by
this script: a fresh directory per run under `--work-dir` (kept), or under a temporary directory
whose run directories are removed as soon as each run is measured (a default run's checkpoints
take about 3 GB) unless `--keep`.

Figures per run:
- `wall_s`: from start to exit of the child, load and compilation included;
- `max_rss_kib`, `minor_faults`, `major_faults`, `user_s`, `system_s`: `ru_maxrss` (KiB on
  Linux), `ru_minflt`, `ru_majflt`, `ru_utime`, `ru_stime` of the child (`getrusage(2)`);
- from metrics.jsonl: the steps run, step 1's phase times (compilation included) and the median
  of each phase over steps 2..N (`time/generation`, `time/scoring`, `time/update`, `time/step`),
  the column widths of each step and the median over the steps whose widths an earlier step
  had (with `data.prompt_buckets` / `generation.response_buckets` > 1 a new width compiles),
  the held-out evaluations (`eval/reward_mean` at each evaluated step, `time/eval` summed) and
  the training reward / KL means over the first and last `--window` logged steps.

With `--json`, the file is rewritten after every run (`complete: false` until the last), so a
failure or an interrupt keeps what was measured before it.

Usage (from a checkout with .venv; `make bench-train` runs the first line, with `--title`, and
writes into `$(BENCH_RAW)`):
    .venv/bin/python bench/train_run.py --json bench/results_raw/train_run.json
    .venv/bin/python bench/train_run.py --rounds 2 \\
        --variant "buckets 1" "--set data.prompt_buckets=1" \\
        --variant "buckets 4" "--set data.prompt_buckets=4" --json out.json
Nothing is downloaded: the configs load local files only. Raises SystemExit naming the variant
when a run fails (its last output lines are printed) and when a SPEC sets `train.output_dir`.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, cpu_info, cpu_line, machine_load, run_record, write_json  # noqa: E402
sys.path.insert(0, str(ROOT))  # ppo_jax from a checkout, uninstalled
from ppo_jax.trainer.metrics import read_metrics  # noqa: E402

PHASES = ("time/generation", "time/scoring", "time/update", "time/step")
DEFAULT_VARIANT = ("make train", "")


def parse_spec(spec: str) -> tuple[dict[str, str], list[str]]:
    """Split a variant's SPEC into (environment, train.py arguments): the leading `VAR=VALUE`
    words are environment variables, everything from the first other word on goes to train.py.
    Raises ValueError when the arguments set `train.output_dir` (this script owns it)."""
    words = shlex.split(spec)
    env: dict[str, str] = {}
    while words and "=" in words[0] and not words[0].startswith("-") \
            and words[0].split("=", 1)[0].isidentifier():
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    if any("train.output_dir" in w for w in words):
        raise ValueError(f"variant spec {spec!r}: train.output_dir is set by bench/train_run.py")
    return env, words


def summarize_metrics(rows: list[dict], window: int = 5) -> dict:
    """Per-run figures from metrics.jsonl rows: `steps` (the last step logged), `first_step`
    (step 1's phase times, compilation included; absent when step 1 was not logged), `median`
    (each phase's median over the logged steps after the first, or the first alone in a
    one-step run), `per_step` ([step, prompt_width, response_width, time/step, time/update] of
    every logged step), `width_pairs` (distinct (prompt, response) column widths: each one
    compiled), `repeated_widths` (`n` and each phase's median over the steps whose width pair an
    earlier step had: no compilation in them), `evals` ([[step, eval/reward_mean], ...]),
    `eval_s` (time/eval summed), and `score_start` / `score_end` / `kl_start` / `kl_end` / `kl_max` (means over the first and
    last `window` training steps; max over all)."""
    steps = [r for r in rows if r.get("step", 0) > 0 and "time/step" in r]
    evals = [r for r in rows if "eval/reward_mean" in r]
    out: dict = {"steps": int(steps[-1]["step"]) if steps else 0,
                 "evals": [[r["step"], r["eval/reward_mean"]] for r in evals],
                 "eval_s": sum(r.get("time/eval", 0.0) for r in evals)}
    if not steps:
        return out
    steady = steps[1:] or steps
    if steps[0]["step"] == 1:  # with train.log_every > 1 step 1 is not logged
        out["first_step"] = {k: steps[0][k] for k in PHASES if k in steps[0]}
    out["median"] = {k: statistics.median(r[k] for r in steady) for k in PHASES if k in steps[0]}
    # every logged step: [step, prompt_width, response_width, time/step, time/update]; a step
    # whose width pair an earlier step had compiled nothing new (trainer/columns.py buckets)
    out["per_step"] = [[r["step"], r.get("prompt_width"), r.get("response_width"),
                        r["time/step"], r.get("time/update")] for r in steps]
    seen, repeated = set(), []
    for r in steps:
        pair = (r.get("prompt_width"), r.get("response_width"))
        if pair in seen:
            repeated.append(r)
        seen.add(pair)
    out["width_pairs"] = len(seen)
    out["repeated_widths"] = {"n": len(repeated), **(
        {k: statistics.median(r[k] for r in repeated) for k in PHASES if k in steps[0]}
        if repeated else {})}
    w = min(window, len(steps))
    for key, name in (("score_mean", "score"), ("kl", "kl")):
        if key in steps[0]:
            out[f"{name}_start"] = statistics.fmean(r[key] for r in steps[:w])
            out[f"{name}_end"] = statistics.fmean(r[key] for r in steps[-w:])
    if "kl" in steps[0]:
        out["kl_max"] = max(r["kl"] for r in steps)
    return out


def child_malloc_settings(env_extra: dict[str, str]) -> bool | None:
    """Whether train.py, started with `env_extra` added to this environment, runs under its glibc
    malloc settings (after its own re-execution); None where ppo_jax cannot be imported."""
    try:
        from ppo_jax.trainer.host_memory import malloc_env, malloc_settings_active
    except ImportError:
        return None
    env = {**os.environ, **env_extra}
    return malloc_settings_active(env) or malloc_env(env) is not None


def run_variant(name: str, spec: str, out_dir: Path, python: str, window: int) -> dict:
    """Run `train.py` for one variant into `out_dir` and measure it (module docstring)."""
    env_extra, args = parse_spec(spec)
    cmd = [python, str(ROOT / "train.py"), *args, "--set", f"train.output_dir={out_dir}"]
    log_path = out_dir.parent / f"{out_dir.name}.log"
    print(f"[{name}] {' '.join(f'{k}={v}' for k, v in env_extra.items())} {shlex.join(cmd[1:])}",
          flush=True)
    with open(log_path, "w") as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **env_extra}, stdout=log,
                                stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-30:])
        raise SystemExit(f"variant {name!r}: train.py exited with {proc.returncode}\n{tail}")
    metrics = out_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise SystemExit(f"variant {name!r}: train.py wrote no {metrics}")
    return {"wall_s": wall, "max_rss_kib": usage.ru_maxrss, "minor_faults": usage.ru_minflt,
            "major_faults": usage.ru_majflt, "user_s": usage.ru_utime,
            "system_s": usage.ru_stime, **summarize_metrics(read_metrics(metrics), window)}


def merge_runs(runs: list[dict]) -> dict:
    """One variant's figures over its rounds: the median of each number (wall, memory, faults,
    CPU time, phase medians), its min and max beside it; single runs are kept as they are."""
    keys = ("wall_s", "max_rss_kib", "minor_faults", "major_faults", "user_s", "system_s")
    merged = {k: statistics.median(r[k] for r in runs) for k in keys}
    merged["range"] = {k: [min(r[k] for r in runs), max(r[k] for r in runs)] for k in keys}
    phases = [k for k in PHASES if all(k in r.get("median", {}) for r in runs)]
    merged["median"] = {k: statistics.median(r["median"][k] for r in runs) for k in phases}
    merged["median_range"] = {k: [min(r["median"][k] for r in runs),
                                  max(r["median"][k] for r in runs)] for k in phases}
    return merged


def describe(name: str, run: dict) -> str:
    med = run.get("median", {})
    phases = " / ".join(f"{med[k]:.1f}" for k in PHASES if k in med)
    return (f"[{name}] {run['wall_s'] / 60:.1f} min, {run['steps']} steps, median "
            f"gen/scoring/update/step {phases} s, peak RSS {run['max_rss_kib'] / 2**20:.2f} GiB, "
            f"{run['minor_faults'] / 1e6:.2f}M minor faults, user {run['user_s']:.0f} s, "
            f"system {run['system_s']:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", nargs=2, action="append", metavar=("NAME", "SPEC"),
                        help="a train.py command line to measure (default: make train's)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--window", type=int, default=5, help="steps averaged at each end")
    parser.add_argument("--title", default="", help="heading of this run in results.md")
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="where the runs write (default: a temporary directory)")
    parser.add_argument("--keep", action="store_true",
                        help="keep the temporary directory of the runs (a --work-dir is kept)")
    parser.add_argument("--python", default=sys.executable, help="interpreter that runs train.py")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    variants = args.variant or [DEFAULT_VARIANT]
    names = [n for n, _ in variants]
    slugs = ["".join(c if c.isalnum() else "_" for c in n) for n in names]
    if len(set(slugs)) != len(slugs):
        raise SystemExit(f"--variant names must differ (in their letters and digits): {names}")
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be >= 1, got {args.rounds}")
    for name, spec in variants:
        try:
            parse_spec(spec)
        except ValueError as err:
            raise SystemExit(f"variant {name!r}: {err}") from None
    print(f"CPU: {cpu_line(cpu_info())}", flush=True)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="train_run_"))
    work.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict]] = {n: [] for n in names}
    command = ".venv/bin/python bench/train_run.py " + shlex.join(sys.argv[1:])

    def save(complete: bool) -> None:
        if not args.json:
            return
        write_json(args.json, {
            "benchmark": "train_run", "title": args.title, **run_record(), **machine_load(),
            "command": command, "complete": complete, "rounds": args.rounds,
            "window": args.window,
            "variants": [{"name": n, "spec": s, "env": parse_spec(s)[0],
                          "args": parse_spec(s)[1],
                          "malloc_settings": child_malloc_settings(parse_spec(s)[0]),
                          "runs": runs[n], "merged": merge_runs(runs[n])}
                         for n, s in variants if runs[n]]})

    try:
        for rnd in range(args.rounds):
            order = list(zip(variants, slugs))
            for (name, spec), slug in (order if rnd % 2 == 0 else order[::-1]):
                out_dir = work / f"{slug}_round{rnd + 1}"
                if out_dir.exists():
                    raise SystemExit(f"{out_dir} exists: give a fresh --work-dir")
                run = run_variant(name, spec, out_dir, args.python, args.window)
                run["round"] = rnd + 1
                runs[name].append(run)
                print(describe(name, run), flush=True)
                save(complete=False)
                if not args.keep and args.work_dir is None:  # checkpoints: GBs per run
                    shutil.rmtree(out_dir, ignore_errors=True)
    finally:
        if not args.keep and args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    save(complete=True)


if __name__ == "__main__":
    main()
