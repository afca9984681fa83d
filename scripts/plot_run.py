"""One PNG of one or more runs from their metrics.jsonl, overlaid with the runs' names.

Panels against the PPO step: reward (the training batch's mean score, dashed, and the held-out
`eval/reward_mean`, solid, where the run evaluated), held-out reward against wall-clock minutes
(steps plus evaluations), KL to the reference (summed over the response), entropy per token,
response length, and seconds per step by phase (generation, experience, update).

`--metric eval/accuracy` draws another held-out figure in place of `eval/reward_mean` (the
training batch's `reward/accuracy` beside it when the runs log it). `--extra KEY` draws `KEY`
in place of the response length (an `env/*` figure with its held-out `eval/*` twin as dots,
e.g. `--extra env/used_tool`).

Usage:
  .venv/bin/python scripts/plot_run.py runs/default [runs/other ...] --out docs/default_run.png
      [--names a b ...] [--title TEXT] [--metric eval/reward_mean] [--extra KEY]
Errors: a run directory without metrics.jsonl exits with status 2 and names it.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from ppo_jax.trainer.tracking.metrics import read_metrics as metrics_rows


def read_metrics(run_dir: Path) -> list[dict]:
    """Rows of `<run_dir>/metrics.jsonl` (ppo_jax.trainer.tracking.metrics.read_metrics).

    Raises:
      FileNotFoundError: no metrics.jsonl there.
    """
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no metrics file: {path}")
    return metrics_rows(path)


def series(rows: list[dict], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of the rows that have `key` with a finite value."""
    pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))
           and math.isfinite(r[key])]
    return [p[0] for p in pts], [p[1] for p in pts]


def wall_minutes(rows: list[dict]) -> dict[int, float]:
    """Step -> minutes since the start (sum of `time/step` and `time/eval` up to that step)."""
    out, total = {}, 0.0
    for r in rows:
        total += r.get("time/step", 0.0) + r.get("time/eval", 0.0)
        out[r["step"]] = total / 60.0
    return out


PANELS = (("reward", "reward (dashed: training batch; solid: held-out)"),
          ("eval_time", "held-out reward vs wall-clock minutes"),
          ("kl", "KL(actor || reference), summed over the response"),
          ("entropy_per_token", "entropy per token (nats)"),
          ("response_length", "response length (tokens)"),
          ("time", "seconds per step (dotted: generation, dashed: update)"))


def draw(ax, panel: str, rows: list[dict], color, name: str, metric: str = "eval/reward_mean") -> None:
    if panel == "reward":
        train_key = "reward/" + metric.split("/", 1)[1] if metric != "eval/reward_mean" else "score_mean"
        if metric == "eval/accuracy" and not series(rows, train_key)[0]:
            train_key = "env/reward/correct"  # an episode run's training accuracy
        ax.plot(*series(rows, train_key), "--", color=color, alpha=0.6)
        ax.plot(*series(rows, metric), "o-", color=color, label=name)
    elif panel == "eval_time":
        steps, values = series(rows, metric)
        minutes = wall_minutes(rows)
        ax.plot([minutes.get(s, 0.0) for s in steps], values, "o-", color=color, label=name)
    elif panel == "time":
        ax.plot(*series(rows, "time/step"), "-", color=color, label=name)
        ax.plot(*series(rows, "time/generation"), ":", color=color)
        ax.plot(*series(rows, "time/update"), "--", color=color)
    else:
        ax.plot(*series(rows, panel), "-", color=color, label=name)
        if panel.startswith("env/"):  # the held-out twin of an episode figure
            ax.plot(*series(rows, "eval/" + panel[len("env/"):]), "o", color=color)


def plot(runs: dict[str, list[dict]], out: Path, title: str | None = None,
         metric: str = "eval/reward_mean", extra: str | None = None) -> Path:
    """Write the PNG of `runs` ({name: metrics rows}) to `out`, the held-out panels of `metric`
    (and `extra` in place of the response length); returns `out`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    panels = PANELS if extra is None else (*PANELS[:4], (extra, extra), *PANELS[5:])
    for ax, (panel, label) in zip(axes.flat, panels):
        for i, (name, rows) in enumerate(runs.items()):
            draw(ax, panel, rows, colors[i % len(colors)], name, metric)
        ax.set_title(label.replace("reward", metric.split("/", 1)[1], 2) if metric !=
                     "eval/reward_mean" and panel in ("reward", "eval_time") else label, fontsize=10)
        ax.set_xlabel("minutes" if panel == "eval_time" else "step")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories (train.output_dir)")
    parser.add_argument("--out", type=Path, required=True, help="PNG to write")
    parser.add_argument("--names", nargs="*", help="legend names (default: directory names)")
    parser.add_argument("--title")
    parser.add_argument("--metric", default="eval/reward_mean", help="the held-out figure drawn")
    parser.add_argument("--extra", help="a figure drawn in place of the response length")
    args = parser.parse_args(argv)
    names = args.names or [p.name for p in args.runs]
    if len(names) != len(args.runs):
        print(f"error: {len(names)} --names for {len(args.runs)} runs", file=sys.stderr)
        return 2
    try:
        runs = {n: read_metrics(p) for n, p in zip(names, args.runs)}
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(plot(runs, args.out, args.title, args.metric, args.extra))
    return 0


if __name__ == "__main__":
    sys.exit(main())
