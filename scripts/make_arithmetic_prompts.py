"""Write synthetic multiplication problems as prompt files: a training set and a held-out set
that share no problem (`ppo_jax/trainer/data/arithmetic.py`).

Usage:
  .venv/bin/python scripts/make_arithmetic_prompts.py --out runs/arithmetic \
      [--train 4000] [--held-out 256] [--digits 2 3] [--seed 0] [--instruction TEXT] [--overwrite]

Writes `train.jsonl` and `held_out.jsonl` in --out: one `{"prompt", "answer"}` record a line,
for `data.prompts` / `eval.prompts` (with `reward.function: math_verify`, or the "calculator"
environment, which adds its own tool instruction; without it, pass an --instruction such as
"Give the final answer as <answer>NUMBER</answer>."). Same arguments -> identical files.
Exit 2 with `error: ...` on bad arguments or outputs already there without --overwrite.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ppo_jax.trainer.data.arithmetic import multiplication_records

OUTPUTS = ("train.jsonl", "held_out.jsonl")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--train", type=int, default=4000, help="training problems (default 4000)")
    p.add_argument("--held-out", type=int, default=256, help="held-out problems (default 256)")
    p.add_argument("--digits", type=int, nargs=2, default=(2, 3), metavar=("A", "B"),
                   help="digits of the two operands (default 2 3)")
    p.add_argument("--seed", type=int, default=0, help="seed of the draws (default 0)")
    p.add_argument("--instruction", default="", help="text appended to every prompt")
    p.add_argument("--overwrite", action="store_true", help="replace existing outputs")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    existing = [name for name in OUTPUTS if (out / name).exists()]
    if existing and not args.overwrite:
        print(f"error: {out} already holds {existing}; pass --overwrite", file=sys.stderr)
        return 2
    try:
        sets = {name: multiplication_records(n, digits=tuple(args.digits), seed=args.seed,
                                             split=split, instruction=args.instruction)
                for name, n, split in (("train.jsonl", args.train, "train"),
                                       ("held_out.jsonl", args.held_out, "held_out"))}
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    for name, records in sets.items():
        with open(out / name, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
        print(f"{out / name}: {len(records)} problems")
    return 0


if __name__ == "__main__":
    sys.exit(main())
