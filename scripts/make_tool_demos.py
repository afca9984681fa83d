"""Write tool-call demonstrations for a short SFT warm-up before multi-turn RL (docs/environments.md):
for training problems of a run's `data.task` (never its held-out ones), the episode's first
prompt exactly as the run's environment gives it (`env.reset`) and, as the assistant's reply,
one calculator call on the problem's operands: `<calc>141*365</calc>`; with `--answer`, a
second row per problem continues the conversation: the calculator's result as the user's
message (as the rollout frames an observation) and the final answer `<answer>51465</answer>`.

Usage:
  .venv/bin/python scripts/make_tool_demos.py --config configs/tools.yaml --out runs/tool_demos \
      [--train 256] [--eval 32] [--answer]

Writes `sft.jsonl` and `sft_eval.jsonl` (`{"messages": [...]}` rows, the last message the
assistant's: the completion-only loss) in --out.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ppo_jax.trainer.config import load_config  # noqa: E402
from ppo_jax.trainer.data.tasks import task_splits  # noqa: E402
from ppo_jax.trainer.environments import get_environment  # noqa: E402
from ppo_jax.trainer.environments.tool_calls import call_text  # noqa: E402

OPERANDS = re.compile(r"(\d+(?:\s*[*x×]\s*\d+)+)")


def demo(env, record: dict, answer: bool = False) -> list[dict]:
    """`{"messages"}` rows: the environment's first prompt and a call on the operands; with
    `answer`, also the conversation after the call's result, ending in the final answer."""
    match = OPERANDS.search(record["entry"]["question"])
    if match is None:
        raise ValueError(f"no product in {record['entry']['question']!r}")
    expression = re.sub(r"\s*[*x×]\s*", "*", match.group(1))
    _, prompt = env.reset({**{k: v for k, v in record.items() if k != "prompt"},
                           "prompt": record["prompt"]})
    call = [{"role": "user", "content": prompt},
            {"role": "assistant", "content": call_text(env.format, expression)}]
    rows = [{"messages": call}]
    if answer:
        result = str(record["answer"])
        rows.append({"messages": call + [
            {"role": "user", "content": result},
            {"role": "assistant", "content": f"<answer>{result}</answer>"}]})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="the RL run's config (data.task, env.*)")
    p.add_argument("--out", required=True)
    p.add_argument("--train", type=int, default=256)
    p.add_argument("--eval", type=int, default=32)
    p.add_argument("--answer", action="store_true", help="also the answer turn after the result")
    args = p.parse_args(argv)
    cfg = load_config(args.config)
    env = get_environment(cfg.env.name, **cfg.env.kwargs)
    splits = task_splits(cfg.data.task, eval_seed=cfg.eval.task_seed,
                         eval_size=cfg.eval.num_prompts)
    train = splits.train[:args.train + args.eval]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("sft.jsonl", train[:args.train]), ("sft_eval.jsonl", train[args.train:])):
        with open(out / name, "w", encoding="utf-8") as f:
            for r in rows:
                for row in demo(env, r, args.answer):
                    f.write(json.dumps(row) + "\n")
        print(f"{out / name}: {len(rows)} problems")
    return 0


if __name__ == "__main__":
    sys.exit(main())
