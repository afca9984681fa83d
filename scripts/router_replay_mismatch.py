"""The rollout/trainer log-prob mismatch of an MoE actor with and without router replay.

    .venv/bin/python scripts/router_replay_mismatch.py --steps 10 --out results/router_replay

Runs `train.py` on `configs/tiny.yaml` with the tiny Qwen3-MoE (`model.actor: tiny-random-moe`:
2 sparse layers of 8 experts, 2 per token) four times: the rollout copy of the actor in
bfloat16 (`generation.param_dtype=bfloat16`) or float32, each with `model.router_replay` none
and rollout. Every run keeps its `metrics.jsonl` in `OUT/<run>/`; the script prints, per run,
the mean over the steps of the `mismatch/*` figures (the sampler's log-probs against the
experience pass's, `core.rollout_mismatch`) and of the update's first-minibatch ratio, and the
ratio of each bfloat16 figure without replay to the one with it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIGURES = ("mismatch/abs_logprob_diff", "mismatch/k3_kl", "mismatch/max_ratio",
           "mismatch/min_ratio", "router_aux_loss")
RUNS = {  # name -> (rollout copy dtype or None: the trained params, replay)
    "bf16_none": ("bfloat16", "none"), "bf16_replay": ("bfloat16", "rollout"),
    "f32_none": (None, "none"), "f32_replay": (None, "rollout"),
}


def run(name: str, dtype, replay: str, args) -> list[dict]:
    out = args.out / name
    sets = ["model.actor=tiny-random-moe", f"model.router_replay={replay}",
            f"train.steps={args.steps}", f"train.output_dir={out}", "train.progress=false",
            "train.export_hf=false", "train.save_every=0", "eval.prompts=null",
            "ppo.batch_size=16", "ppo.mini_batch_size=8", "ppo.micro_batch_size=4",
            "generation.max_new_tokens=16", f"train.seed={args.seed}"]
    if dtype:
        sets.append(f"generation.param_dtype={dtype}")
    cmd = [sys.executable, str(ROOT / "train.py"), "--config", str(ROOT / "configs/tiny.yaml")]
    for s in sets:
        cmd += ["--set", s]
    subprocess.run(cmd, cwd=ROOT, check=True)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "mismatch/k3_kl" in r]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "results/router_replay")
    args = parser.parse_args(argv)
    means = {}
    for name, (dtype, replay) in RUNS.items():
        rows = run(name, dtype, replay, args)
        means[name] = {k: statistics.mean(r[k] for r in rows) for k in FIGURES}
        means[name]["ratio_first_minibatch"] = statistics.mean(
            r["ratio_first_minibatch"] for r in rows)
    cols = (*FIGURES, "ratio_first_minibatch")
    print("| run | " + " | ".join(cols) + " |")
    print("|" + " --- |" * (len(cols) + 1))
    for name, m in means.items():
        print(f"| {name} | " + " | ".join(f"{m[c]:.3g}" for c in cols) + " |")
    for k in ("mismatch/abs_logprob_diff", "mismatch/k3_kl"):
        print(f"bfloat16 rollout, {k}: without replay / with = "
              f"{means['bf16_none'][k] / max(means['bf16_replay'][k], 1e-30):.2f}")
    (args.out / "summary.json").write_text(json.dumps(means, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
