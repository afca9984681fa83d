"""The recipe comparison of results/rlvr/log.md, re-read from its kept data: one markdown table and one PNG.

Each run is a pair of files in `--dir` (default results/rlvr): `<name>_seed<S>.metrics.jsonl`
(the run's metrics.jsonl) and `<name>_seed<S>.accuracy.json` (scripts/compare_accuracy.py
`--json` over three sampling seeds). A missing pair is skipped and named on stderr.

The table has one row per run: steps, median seconds per step (step 1 compiles: steps 2 on),
the held-out format-free accuracy at step 0 and at the last evaluation (the trainer's, one
key), the three-seed means after training (verifier, format-free, plain instruction), the KL,
entropy per token, response length and ended fraction at the end (means of the last 5 steps),
and the critic's explained variance (median over the last 10 steps; `-` without a critic) with
its group-baseline reference where the run logged it. A second table gives, per recipe, the
means over its training seeds of the three-seed format-free and plain-instruction accuracy
and their rise over the base.

The PNG: held-out format-free accuracy against minutes of training (steps plus evaluations),
one line per run (a recipe one colour, seed 1 dashed); the format-free and plain-instruction
accuracy after training per recipe (bars: mean over seeds, dots: each seed); response length
and entropy per token per step.

Usage:
  .venv/bin/python scripts/rlvr_recipes_report.py [--names make_rlvr ppo ...] [--seeds 0 1]
      [--dir results/rlvr] [--out docs/rlvr_recipes_45min.png]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

NAMES = ["make_rlvr", "make_rlvr_token_mean", "grpo", "dr_grpo", "gspo_paper",
         "gspo_paper_overlong", "gspo_paper_overlong_dynamic_sampling", "gspo", "dapo",
         "ppo_critic_warmup2", "ppo", "ppo_shared_no_overlong", "ppo_shared", "dapo_format_free",
         "dapo_format_free_format_weight0", "ppo_shared_format_free",
         "ppo_shared_format_free_format_weight0"]
FREE, PLAIN = "accuracy_format_free", "accuracy_plain"


def load(folder: Path, name: str, seed: int) -> dict | None:
    """`{"rows": [...], "accuracy": {...}}` of one run, or None when a file is missing."""
    metrics = folder / f"{name}_seed{seed}.metrics.jsonl"
    accuracy = folder / f"{name}_seed{seed}.accuracy.json"
    if not (metrics.is_file() and accuracy.is_file()):
        return None
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return {"rows": rows, "accuracy": json.loads(accuracy.read_text())}


def last_mean(rows: list[dict], key: str, n: int = 5) -> float:
    values = [r[key] for r in rows if key in r and "time/step" in r][-n:]
    return statistics.fmean(values) if values else float("nan")


def last_median(rows: list[dict], key: str, n: int = 10) -> float | None:
    values = [r[key] for r in rows if key in r][-n:]
    return statistics.median(values) if values else None


def summary(run: dict) -> dict:
    """The table's figures of one run."""
    rows, fig = run["rows"], run["accuracy"]["figures"]
    evals = [r[f"eval/{FREE}"] for r in rows if f"eval/{FREE}" in r]
    steps = [r["time/step"] for r in rows if "time/step" in r]
    return {
        "steps": max(r["step"] for r in rows), "step_s": statistics.median(steps[1:] or steps),
        "eval_start": evals[0], "eval_end": evals[-1],
        "verifier": fig["accuracy"]["mean_trained"], "free": fig[FREE]["mean_trained"],
        "plain": fig[PLAIN]["mean_trained"], "free_base": fig[FREE]["mean_base"],
        "plain_base": fig[PLAIN]["mean_base"], "verifier_base": fig["accuracy"]["mean_base"],
        "kl": last_mean(rows, "kl"), "entropy": last_mean(rows, "entropy_per_token"),
        "length": last_mean(rows, "response_length"), "ended": last_mean(rows, "ended_fraction"),
        "ev": last_median(rows, "values_explained_variance"),
        "ev_group": last_median(rows, "group_baseline_explained_variance"),
    }


def _ev(s: dict) -> str:
    if s["ev"] is None:
        return "-"
    return f"{s['ev']:.2f}" + ("" if s["ev_group"] is None else f" ({s['ev_group']:.2f})")


def run_table(runs: dict) -> str:
    head = ("| run | seed | steps | median step s | held-out format-free, step 0 -> end | "
            "three seeds: verifier | format-free | plain | KL | entropy / token | length | "
            "ended | critic EV (group baseline) |")
    out = [head, "|" + " --- |" * 14]
    for (name, seed), s in runs.items():
        out.append(f"| {name} | {seed} | {s['steps']} | {s['step_s']:.1f} | {s['eval_start']:.3f} -> "
                   f"{s['eval_end']:.3f} | {s['verifier']:.3f} | {s['free']:.3f} | {s['plain']:.3f} | "
                   f"{s['kl']:.1f} | {s['entropy']:.2f} | {s['length']:.1f} | {s['ended']:.2f} | "
                   f"{_ev(s)} |")
    return "\n".join(out)


def recipe_means(runs: dict) -> dict:
    """`{name: {"seeds": [...], "free": mean, "plain": mean, "free_rise": ..., "plain_rise": ...}}`."""
    out: dict = {}
    for (name, seed), s in runs.items():
        out.setdefault(name, []).append((seed, s))
    means = {}
    for name, items in out.items():
        ss = [s for _, s in items]
        m = {k: statistics.fmean(s[k] for s in ss) for k in ("free", "plain", "free_base",
                                                              "plain_base")}
        means[name] = {"seeds": [seed for seed, _ in items], **m,
                       "free_rise": m["free"] - m["free_base"], "plain_rise": m["plain"] - m["plain_base"]}
    return means


def means_table(means: dict) -> str:
    out = ["| recipe | training seeds | format-free (rise) | plain instruction (rise) |",
           "| --- | --- | --- | --- |"]
    for name, m in means.items():
        out.append(f"| {name} | {', '.join(map(str, m['seeds']))} | {m['free']:.3f} "
                   f"({m['free_rise']:+.3f}) | {m['plain']:.3f} ({m['plain_rise']:+.3f}) |")
    return "\n".join(out)


def minutes(rows: list[dict]) -> list[tuple[float, float]]:
    """`(minutes of steps and evaluations so far, held-out format-free accuracy)` per evaluation."""
    t, out = 0.0, []
    for r in rows:
        t += r.get("time/step", 0.0) + r.get("time/eval", 0.0)
        if f"eval/{FREE}" in r:
            out.append((t / 60, r[f"eval/{FREE}"]))
    return out


def plot(data: dict, summaries: dict, means: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(16, 9))
    palette = plt.get_cmap("tab20").colors  # 20 colours: one per recipe, however many
    colours = {name: palette[i % len(palette)] for i, name in enumerate(means)}
    for (name, seed), run in data.items():
        style = dict(color=colours[name], linestyle="--" if seed else "-",
                     label=f"{name}, seed {seed}")
        xy = minutes(run["rows"])
        axes[0, 0].plot(*zip(*xy), marker="o", **style)
        steps = [r for r in run["rows"] if "time/step" in r]
        axes[1, 0].plot([r["step"] for r in steps], [r["response_length"] for r in steps], **style)
        axes[1, 1].plot([r["step"] for r in steps], [r["entropy_per_token"] for r in steps], **style)
    names = list(means)
    for j, (key, label) in enumerate((("free", "format-free"), ("plain", "plain instruction"))):
        x = [i + 0.4 * j for i in range(len(names))]
        axes[0, 1].bar(x, [means[n][key] for n in names], width=0.4, label=label,
                       color=f"C{7 + j}", alpha=0.7)
        for i, name in enumerate(names):
            seeds = [s for (n, _), s in summaries.items() if n == name]
            axes[0, 1].plot([x[i]] * len(seeds), [s[key] for s in seeds], "k.")
    axes[0, 1].axhline(means[names[0]]["free_base"], color="C7", linestyle=":", label="base, format-free")
    axes[0, 1].axhline(means[names[0]]["plain_base"], color="C8", linestyle=":", label="base, plain")
    axes[0, 1].set_xticks([i + 0.2 for i in range(len(names))], names, rotation=30, ha="right")
    titles = ["held-out format-free accuracy (one key) vs minutes", "after training, 3 sampling seeds",
              "response length (tokens)", "entropy per token"]
    for ax, title in zip(axes.flat, titles):
        ax.set_title(title)
        ax.grid(alpha=0.3)
    fig.legend(*axes[0, 0].get_legend_handles_labels(), loc="center right", fontsize=7)  # the runs
    axes[0, 1].legend(fontsize=7)
    axes[1, 0].set_xlabel("PPO step")
    axes[1, 1].set_xlabel("PPO step")
    fig.tight_layout(rect=(0, 0, 0.8, 1))  # the right fifth for the runs' legend
    fig.savefig(out, dpi=80)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--names", nargs="+", default=NAMES)
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    p.add_argument("--dir", type=Path, default=Path("results/rlvr"))
    p.add_argument("--out", type=Path, default=None, help="the PNG (none without)")
    args = p.parse_args(argv)
    data = {}
    for name in args.names:
        for seed in args.seeds:
            if (run := load(args.dir, name, seed)) is None:
                print(f"skipped: no {name}_seed{seed}.metrics.jsonl / .accuracy.json in {args.dir}",
                      file=sys.stderr)
            else:
                data[(name, seed)] = run
    if not data:
        print(f"error: no run found in {args.dir}", file=sys.stderr)
        return 2
    summaries = {key: summary(run) for key, run in data.items()}
    means = recipe_means(summaries)
    print(run_table(summaries) + "\n\n" + means_table(means))
    if args.out:
        plot(data, summaries, means, args.out)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
