"""Summarise a finished run from its metrics.jsonl: reward and KL at the start and the end
(means over windows of steps, since one batch of 8 is noisy), and the median time per phase;
with `eval.*`, the held-out reward and KL of the first and the last evaluation.

Usage: .venv/bin/python scripts/summarize_run.py runs/default [--window 5]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from ppo_jax.trainer.tracking.metrics import read_metrics


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--window", type=int, default=5, help="steps averaged at each end")
    args = parser.parse_args()
    path = args.run_dir / "metrics.jsonl"
    if not path.is_file():
        raise SystemExit(f"no metrics file: {path}")
    rows = read_metrics(path)  # non-finite values come back as floats
    evals = [r for r in rows if "eval/reward_mean" in r]
    rows = [r for r in rows if r["step"] > 0]  # step 0 holds only the starting policy's evaluation
    if rows:
        summarize_training(rows, args.window)
    if evals:
        summarize_evals(evals)


def summarize_training(rows: list[dict], window: int) -> None:
    w = min(window, len(rows))
    first, last = rows[:w], rows[-w:]

    def mean(rs, key):
        return statistics.fmean(r[key] for r in rs)

    print(f"{len(rows)} steps; windows of {w} steps (steps {first[0]['step']}-{first[-1]['step']} "
          f"and {last[0]['step']}-{last[-1]['step']})")
    for key in ("score_mean", "kl", "non_score_reward", "entropy_per_token", "response_length", "approxkl"):
        if key in rows[0]:
            print(f"  {key:18s} start {mean(first, key):8.3f}   end {mean(last, key):8.3f}")
    print(f"  {'max kl':18s} {max(r['kl'] for r in rows):8.3f}")
    steady = rows[1:] or rows  # step 1 holds the compilation
    # time/scoring: runs before time/experience was its name (docs/history.md)
    for key in ("time/generation", "time/experience", "time/scoring", "time/update", "time/step"):
        if key in rows[0]:
            print(f"  {key:18s} median {statistics.median(r[key] for r in steady):6.1f} s "
                  f"(step 1: {rows[0][key]:.1f} s)")


def summarize_evals(evals: list[dict]) -> None:
    """The held-out evaluation (eval.*): the first and the last one, and its cost."""
    a, b = evals[0], evals[-1]
    print(f"{len(evals)} held-out evaluations (steps {a['step']}..{b['step']}); first vs last")
    for key in ("eval/reward_mean", "eval/reward_std", "eval/kl", "eval/response_length",
                "eval/ended_fraction"):
        if key in a:
            print(f"  {key:20s} first {a[key]:8.3f}   last {b[key]:8.3f}")
    if "time/eval" in a:
        steady = evals[1:] or evals  # the first one holds the compilation
        print(f"  {'time/eval':20s} median {statistics.median(r['time/eval'] for r in steady):6.1f} s "
              f"(first: {a['time/eval']:.1f} s)")

if __name__ == "__main__":
    main()
