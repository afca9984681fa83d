"""A markdown table comparing runs from their metrics.jsonl and `<run>.time` files (written
by /usr/bin/time next to the run directory, as scripts/compare_estimators.sh does).

Columns: held-out reward at the start (step 0), at the last evaluation, its rise, the best
evaluation and its step, KL at the end (mean of the last 5 steps), median seconds per step
(steps 2 on; step 1 compiles), wall time, peak resident memory, the steps run, and the entropy
per token and response length at the end (means of the last 5 steps).

`--metric eval/accuracy` tabulates another held-out figure than `eval/reward_mean`.

Usage: .venv/bin/python scripts/summarize_runs.py RUN_DIR [RUN_DIR ...] [--metric KEY]
"""

from __future__ import annotations

import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plot_run import read_metrics, series  # noqa: E402


def row(run: Path, metric: str = "eval/reward_mean") -> str:
    rows = read_metrics(run)
    eval_steps, evals = series(rows, metric)
    steps = [r["time/step"] for r in rows if "time/step" in r][1:] or [float("nan")]
    timing = run.parent / f"{run.name}.time"
    wall, rss = "", ""
    if timing.is_file():
        m = re.search(r"([\d.]+) s wall, peak RSS (\d+) kB", timing.read_text())
        if m:
            wall, rss = f"{float(m.group(1)) / 60:.1f} min", f"{int(m.group(2)) / 2**20:.2f} GiB"
    start, end = (evals[0], evals[-1]) if evals else (float("nan"), float("nan"))
    best = max(range(len(evals)), key=lambda i: evals[i]) if evals else None
    best_text = f"{evals[best]:.3f} (step {eval_steps[best]})" if evals else ""
    return (f"| {run.name} | {start:.3f} | {end:.3f} | {end - start:+.3f} | {best_text} | "
            f"{_last_mean(rows, 'kl'):.2f} | {statistics.median(steps):.1f} | "
            f"{wall} | {rss} | {max(r['step'] for r in rows)} | "
            f"{_last_mean(rows, 'entropy_per_token'):.2f} | {_last_mean(rows, 'response_length'):.1f} |")


def _last_mean(rows: list[dict], key: str, last: int = 5) -> float:
    """The mean of `key` over the last `last` records that have it (nan without any)."""
    values = [r[key] for r in rows if key in r][-last:]
    return statistics.fmean(values) if values else float("nan")


def main(argv=None) -> int:
    args = list(argv if argv is not None else sys.argv[1:])
    metric = "eval/reward_mean"
    if "--metric" in args:
        i = args.index("--metric")
        metric, args = args[i + 1], args[:i] + args[i + 2:]
    runs = [Path(p) for p in args]
    if not runs:
        print(__doc__)
        return 2
    what = "reward" if metric == "eval/reward_mean" else metric.split("/", 1)[1]
    print(f"| run | held-out {what}, start | at the end | rise | best (step) | KL (last 5 steps) | "
          "s / step | wall | peak RSS | steps | entropy / token (last 5) | response length (last 5) |")
    print("|" + " --- |" * 12)
    for run in runs:
        try:
            print(row(run, metric))
        except FileNotFoundError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
