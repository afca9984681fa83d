#!/usr/bin/env python
"""Run RLHF-PPO from a config: `python train.py [--config FILE] [--set key=value ...] [--resume]`.

Examples:
  python train.py                                   # configs/default.yaml (SmolLM2-135M, VADER)
  python train.py --config configs/tiny.yaml        # a tiny random model, seconds
  python train.py --set ppo.kl_coef=0.05 --set train.steps=100
  python train.py --resume                          # continue from the latest checkpoint
  python train.py --import my_losses --set ppo.policy_loss=my_loss   # a fork's registered loss
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="RLHF with PPO in JAX")
    parser.add_argument("--config", default="configs/default.yaml", help="YAML config file")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="dotted override, e.g. --set ppo.kl_coef=0.05 (repeatable)")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    parser.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                        help="import a module first, e.g. one that registers a policy loss, "
                             "advantage estimator or reward function (repeatable)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from ppo_jax.trainer.config import ConfigError, load_config

    if args.imports:
        sys.path.insert(0, os.getcwd())  # modules of a research fork, next to where it runs
        for name in args.imports:
            try:
                importlib.import_module(name)
            except ImportError as e:
                print(f"error: --import {name}: {e}", file=sys.stderr)
                return 2

    try:
        cfg = load_config(args.config, args.overrides)
    except (ConfigError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from ppo_jax.trainer.distributed import initialize

    initialize(cfg.distributed)
    from ppo_jax.trainer.loop import PPOTrainer

    start = time.perf_counter()
    try:
        trainer = PPOTrainer(cfg, resume=args.resume)
    except (ConfigError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    history = trainer.train()
    if history and trainer.process_index == 0:
        first, last = history[0], history[-1]
        print(f"done: {trainer.step_count} steps in {time.perf_counter() - start:.0f} s; "
              f"reward mean {first['score_mean']:.3f} -> {last['score_mean']:.3f}, "
              f"kl {first['kl']:.3f} -> {last['kl']:.3f}; outputs in {trainer.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
