"""Simulate the pod-scale gain of asynchronous RL (issue 57) from `train.py --compile-for` reports.

Reads the JSON reports of one config compiled for slices of 8, 16 and 32 chips (the paged
engine at tensor 8: one engine replica per 8 chips), builds the cost model of
`ppo_jax.aot.async_sim` from their programs (`engine_prefill`, `engine_decode`,
`experience`, `update`, `rollout_copy`: estimated seconds and model FLOPs), and simulates, for
two response-length distributions, the synchronous step on all chips against asynchronous RL
on every split of them into a rollout group and a trainer group (multiples of 8 chips),
staleness 1 and 2, with and without partial rollouts. It prints one markdown table (the best
split per row) and, with `--json`, writes every simulated case.

How a split's costs are read (docs/async_simulator.md):
- rollout group of R chips: R / 8 engine replicas sharing `slots` (the batch: 512, rounded down
  to whole groups per replica); a decode chunk's and a prefill's seconds per replica are read
  from the report whose replicas hold as many slots, linearly interpolated in slots per replica
  between reports (24 chips: 168 a replica, between the 32-chip report's 128 and the 16-chip
  report's 256).
- trainer group of T chips: experience and update seconds of the T-chip report; T = 24 (no
  slice of 24 chips takes a batch of 512 rows) from the 16- and 32-chip reports, chips' rates
  interpolated: 1 / t(24) = (1 / t(16) + 1 / t(32)) / 2.
- weights after an update: the trainer's `rollout_copy` seconds, plus on a split the bf16 copy
  sent to every rollout replica over ICI at half the chip's bidirectional rate each way.
- the live-slot dependence of a decode chunk: `--decode-fixed FRACTION` of its seconds does not
  shrink with fewer live slots (weights and the pool relayout); the rest scales with the bucket.

Usage:
  .venv/bin/python scripts/simulate_async.py results/async_sim/*.json \
      [--rlvr results/rlvr/make_rlvr_seed0.metrics.jsonl ...] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ppo_jax.aot.async_sim import (  # noqa: E402
    SYNCHRONOUS, BatchShape, FlopModel, RolloutCost, Schedule, TrainerCost, simulate,
)
from ppo_jax.aot.response_lengths import lognormal_lengths, step_mixture_lengths  # noqa: E402
from ppo_jax.aot.topology import CHIPS  # noqa: E402

TENSOR = 8  # chips per engine replica (mesh.tensor of the reports)
RLVR = [ROOT / "results/rlvr/make_rlvr_seed0.metrics.jsonl",
        ROOT / "results/rlvr/make_rlvr_seed1.metrics.jsonl"]
# name: (schedule, in-flight KV recomputed under new weights, as AReaL does)
SCHEDULES = {"synchronous": (SYNCHRONOUS, False),
             "staleness 1": (Schedule(1), False),
             "staleness 1, partial": (Schedule(1, True), False),
             "staleness 2": (Schedule(2), False),
             "staleness 2, partial": (Schedule(2, True), False),
             "staleness 2, partial, KV recomputed": (Schedule(2, True), True)}


def read_reports(paths) -> dict:
    """`{chips: report}` of `--compile-for --json` files (one per chip count)."""
    out = {}
    for path in paths:
        report = json.loads(Path(path).read_text())
        if report["mesh"].get("tensor") != TENSOR:
            raise SystemExit(f"{path}: mesh tensor {report['mesh']} (tensor {TENSOR} expected)")
        out[report["chips"]] = report
    return out


def batch_shape(report) -> BatchShape:
    """The batch of the compiled config (its file and `--set` overrides)."""
    from ppo_jax.trainer.config import load_config

    cfg = load_config(str(ROOT / report["config"]), report["overrides"])
    n = cfg.generation.samples_per_prompt
    return BatchShape(cfg.ppo.batch_size // n, n, cfg.data.max_prompt_length,
                      cfg.generation.max_new_tokens, cfg.generation.response_buckets)


def _program(report, name) -> dict:
    return report["programs"][name]


def engine_points(reports, shape) -> list:
    """Per report: (slots per replica, decode chunk s, prefill call s), ascending slots."""
    points = []
    for chips, r in reports.items():
        slots = shape.groups * shape.group_size // (chips // TENSOR)
        points.append((slots, _program(r, "engine_decode")["seconds_estimate"],
                       _program(r, "engine_prefill")["seconds_estimate"]))
    return sorted(points)


def rollout_cost(reports, shape, chips: int, decode_fixed: float, k: int,
                 recompute: bool = False) -> RolloutCost:
    """The engine on `chips` chips: the batch's slots, whole groups per replica. With
    `recompute`, a weight swap re-prefills every in-flight token at the prefill's cost per
    prompt token (linear in the context: attention's quadratic share is left out)."""
    replicas = chips // TENSOR
    per_replica = shape.groups * shape.group_size // replicas // shape.group_size * shape.group_size
    xs, decode, prefill = zip(*engine_points(reports, shape))
    chunk = float(np.interp(per_replica, xs, decode))
    call = float(np.interp(per_replica, xs, prefill))  # admits per_replica / n groups a replica
    slots = per_replica * replicas
    return RolloutCost(chips=chips, slots=slots, decode_chunk=k,
                       decode_seconds=((0.0, decode_fixed * chunk), (1.0, chunk)),
                       prefill_seconds_per_group=call / (slots / shape.group_size),
                       recompute_seconds_per_token=(call / (slots * shape.prompt_width)
                                                    if recompute else 0.0))


def _trainer_seconds(reports, chips: int, name: str) -> float:
    if chips in reports:
        return _program(reports[chips], name)["seconds_estimate"]
    lo, hi = max(c for c in reports if c < chips), min(c for c in reports if c > chips)
    w = (chips - lo) / (hi - lo)  # rates (1 / seconds) linear in chips between the two
    rate = (1 - w) / _trainer_seconds(reports, lo, name) + w / _trainer_seconds(reports, hi, name)
    return 1.0 / rate


def trainer_cost(reports, chips: int, rollout_chips: int) -> TrainerCost:
    """The trainer on `chips` chips; weights sent to `rollout_chips` (0: the same chips)."""
    sync = _trainer_seconds(reports, chips, "rollout_copy")
    if rollout_chips:
        any_report = next(iter(reports.values()))
        copy = _program(any_report, "rollout_copy")["output_bytes"]  # bf16 / tensor, per chip
        replicas = rollout_chips // TENSOR
        one_way = CHIPS[any_report["chip_kind"]].ici_bandwidth / 2
        sync += max(copy, copy * TENSOR * replicas / chips) / one_way
    return TrainerCost(chips=chips, experience_seconds=_trainer_seconds(reports, chips,
                                                                        "experience"),
                       update_seconds=_trainer_seconds(reports, chips, "update"),
                       weight_sync_seconds=sync)


def fits(reports, rollout_chips: int, trainer_chips: int) -> bool:
    """Whether each side's programs fit its chips: the engine's without the train state a
    rollout group does not hold (peak less the other resident arrays), the trainer's as
    compiled (24 chips: as the 16-chip report's, which holds more per chip)."""
    def report(chips):
        return reports.get(chips) or reports[max(c for c in reports if c < chips)]

    engine = report(rollout_chips)
    rollout_ok = all(engine["programs"][n]["peak_bytes"] - engine["programs"][n]["resident_bytes"]
                     <= engine["hbm_bytes_per_chip"] for n in ("engine_prefill", "engine_decode"))
    trainer = report(trainer_chips)["programs"]
    return rollout_ok and all(trainer[n]["fits"] for n in ("experience", "update", "rollout_copy"))


def flop_model(report, shape, k: int) -> FlopModel:
    """Model FLOPs per unit of work from one report (global counts: the same on any slice)."""
    rows = shape.groups * shape.group_size
    replicas = report["chips"] // TENSOR
    slots = rows // replicas * replicas
    return FlopModel(
        decode_per_token=_program(report, "engine_decode")["model_flops"] / (slots * k),
        prefill_per_sample=_program(report, "engine_prefill")["model_flops"] / slots,
        experience_per_row=_program(report, "experience")["model_flops"] / rows,
        update_per_row=_program(report, "update")["model_flops"] / rows,
        peak_flops_per_chip=report["peak_bf16_flops"])


def rlvr_steps(paths, budget: int) -> list:
    """`[(mean fraction of the budget of the responses that ended, fraction cut), ...]` per
    logged step: `response_length` is the mean of all, `1 - ended_fraction` were cut at
    `budget` (generation.max_new_tokens of the runs), so the ended ones average
    `(mean - cut x budget) / (1 - cut)`."""
    steps = []
    for path in paths:
        for line in Path(path).read_text().splitlines():
            row = json.loads(line)
            if "response_length" not in row:
                continue
            cut = 1.0 - row["ended_fraction"]
            ended = (row["response_length"] - cut * budget) / max(1.0 - cut, 1e-9)
            steps.append((min(max(ended / budget, 1.0 / budget), 1.0), cut))
    return steps


def distributions(rlvr_paths, budget: int, max_new_tokens: int) -> dict:
    steps = rlvr_steps(rlvr_paths, budget)
    return {"make rlvr": step_mixture_lengths(steps, max_new_tokens),
            "DAPO-shaped": lognormal_lengths(max_new_tokens / 4, 0.8, max_new_tokens)}


def cases(reports, shape, lengths, args):
    """Every schedule on every placement: `[(schedule, rollout chips, trainer chips, result)]`."""
    total = max(reports)
    flops = flop_model(reports[total], shape, args.decode_chunk)
    out = []
    for name, (schedule, recompute) in SCHEDULES.items():
        splits = [(total, total)] if schedule.colocated else [
            (r, total - r) for r in range(TENSOR, total, TENSOR) if fits(reports, r, total - r)]
        for r, t in splits:
            roll = rollout_cost(reports, shape, r, args.decode_fixed, args.decode_chunk, recompute)
            train = trainer_cost(reports, t, 0 if schedule.colocated else r)
            res = simulate(roll, train, schedule, shape, lengths, updates=args.updates,
                           warmup=args.warmup, seed=args.seed, flops=flops)
            out.append((name, r, t, res))
    return out


def table(rows_by_dist: dict) -> str:
    lines = ["| lengths | schedule | rollout : trainer chips | step s | x sync | gen tok/s/chip "
             "| MFU | staleness 0 / 1 / 2 | refused | rollout / trainer busy |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for dist, rows in rows_by_dist.items():
        sync = next(res for name, _, _, res in rows if name == "synchronous")
        for name in SCHEDULES:
            best = min((row for row in rows if row[0] == name), key=lambda row: row[3].step_seconds)
            _, r, t, res = best
            split = f"{r} (all)" if name == "synchronous" else f"{r} : {t}"
            st = " / ".join(f"{100 * res.staleness.get(i, 0):.0f}%" for i in range(3))
            lines.append(
                f"| {dist} | {name} | {split} | {res.step_seconds:.1f} | "
                f"{sync.step_seconds / res.step_seconds:.2f} | {res.tokens_per_s_per_chip:.0f} | "
                f"{100 * res.mfu:.1f}% | {st} | {100 * res.refused_fraction:.1f}% | "
                f"{100 * res.rollout_busy:.0f}% / {100 * res.trainer_busy:.0f}% |")
    return "\n".join(lines)


def splits_table(rows_by_dist: dict) -> str:
    """Step seconds of every split (rollout : trainer chips) per schedule."""
    splits = sorted({(r, t) for rows in rows_by_dist.values() for n, r, t, _ in rows
                     if n != "synchronous"})
    lines = ["| lengths | schedule | " + " | ".join(f"{r} : {t}" for r, t in splits) + " |",
             "| --- | --- | " + " | ".join("---" for _ in splits) + " |"]
    for dist, rows in rows_by_dist.items():
        for name in list(SCHEDULES)[1:]:
            step = {(r, t): res.step_seconds for n, r, t, res in rows if n == name}
            lines.append(f"| {dist} | {name} | " + " | ".join(
                f"{step[sp]:.1f}" if sp in step else "-" for sp in splits) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("reports", nargs="+", help="--compile-for --json reports, one per chip count")
    p.add_argument("--rlvr", nargs="+", default=[str(x) for x in RLVR],
                   help="metrics.jsonl of the make rlvr runs (response lengths per step)")
    p.add_argument("--rlvr-budget", type=int, default=16,
                   help="generation.max_new_tokens of those runs")
    p.add_argument("--decode-chunk", type=int, default=8, help="generation.decode_chunk")
    p.add_argument("--decode-fixed", type=float, default=1.0,
                   help="share of a decode chunk's seconds that fewer live slots do not lower")
    p.add_argument("--updates", type=int, default=40)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write every simulated case here")
    args = p.parse_args(argv)
    reports = read_reports(args.reports)
    shape = batch_shape(reports[max(reports)])
    dists = distributions(args.rlvr, args.rlvr_budget, shape.max_new_tokens)
    rows = {name: cases(reports, shape, lengths, args) for name, lengths in dists.items()}
    print(table(rows))
    print()
    print(splits_table(rows))
    if args.json:
        doc = [{"lengths": d, "schedule": n, "rollout_chips": r, "trainer_chips": t,
                **{k: v for k, v in vars(res).items() if k != "update_ends"}}
               for d, rs in rows.items() for n, r, t, res in rs]
        Path(args.json).write_text(json.dumps(doc, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
