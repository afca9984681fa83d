#!/usr/bin/env python
"""Run a stage of RLHF from a config:
`python train.py [--config FILE] [--set key=value ...] [--resume [auto|STEP] [--resume-fallback]]`.

The config's `stage` picks what runs: `sft` (stage 1), `reward_model` (stage 2) or `ppo`
(stage 3, the default).

Examples:
  python train.py                                   # configs/default.yaml (SmolLM2-135M, VADER)
  python train.py --config configs/sft.yaml         # stage 1: SFT -> runs/pipeline/sft/actor_hf
  python train.py --config configs/reward_model.yaml  # stage 2 -> runs/pipeline/reward_model/reward_model_hf
  python train.py --config configs/ppo_rlhf.yaml    # stage 3 with the two above (four models)
  python train.py --config configs/tiny.yaml        # a tiny random model, seconds
  python train.py --set ppo.kl_coef=0.05 --set train.steps=100
  python train.py --resume                          # continue from the latest checkpoint
  python train.py --resume --set train.steps=80     # ... with the run's config, one key changed
  python train.py --resume auto                     # resume if a run is there, else start (pods)
  python train.py --resume 20 --resume-fallback     # from step 20, or the newest earlier that reads
  python train.py --import my_losses --set ppo.policy_loss=my_loss   # a fork's registered loss
  python train.py --config configs/llama_8b_gpu_tpu.yaml --compile-for v5p-128 \
      --set model.actor=configs/model_shapes/meta-llama-3-8b-instruct   # fits? (docs/scaling.md)

`--compile-for TOPOLOGY` runs nothing: it compiles every program of the run for a TPU slice with
libtpu on this host (`pip install -e .[tpu]`), or for GPU nodes (`h100-8`, `h200-8`) with the
CUDA PJRT plugin (`pip install -e .[gpu-aot]`), prints per-chip memory, FLOPs, collectives and
estimated time, and exits 0 when every program fits the chips' HBM, 3 when one does not, 2 on a
bad topology or config. It reads only config.json files and writes only `--json PATH`.

`--resume` continues the run in `train.output_dir` and refuses a directory with no checkpoint
(exit 2, naming it); `--resume auto` starts a new run there instead, and its first line on stderr
says which it did. Without `--config`, a resume runs under the run's own saved config with only
`--set` on top; changes are listed at start-up and written to `config.resume-<step>.json`
(`config.json` is kept), and a change that cannot apply to the saved state (model, LoRA, data,
batch sizes, sequence lengths, seed, ...) is refused by name, exit 2. A checkpoint that cannot
be read is named (step, file, cause), exit 2; `--resume-fallback` then uses the newest earlier
one that reads (docs/reliability.md, "Resume").

SIGTERM (or Ctrl-C) during training stops every process after the step in progress, saves it
and exits 0 with "preempted at step N; resume with --resume" on stderr; a second Ctrl-C kills
at once, unsaved. A checkpoint that cannot be written exits 1 naming the step and the cause; a
step whose losses are not finite exits 1 naming the metrics, the step and the checkpoint kept.
A reward function or environment that fails mid-run exits 1 naming it, the step and the
checkpoint kept (one that fails its check at load exits 2 before any model loads).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from ppo_jax.fork_imports import import_modules


DEFAULT_CONFIG = "configs/default.yaml"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="RLHF (SFT, reward model, PPO) in JAX")
    parser.add_argument("--config", help=f"YAML config file (default {DEFAULT_CONFIG}; with "
                        "--resume: the run's saved config)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="dotted override, e.g. --set ppo.kl_coef=0.05 (repeatable)")
    parser.add_argument("--resume", nargs="?", const="latest", metavar="auto|STEP",
                        help="continue the run in train.output_dir from its latest checkpoint "
                             "(refused when there is none); STEP: from that checkpoint; auto: "
                             "resume when a run is there, else start one")
    parser.add_argument("--resume-fallback", action="store_true",
                        help="with --resume: when the checkpoint cannot be read (damaged), use "
                             "the newest earlier one that can, saying so")
    parser.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                        help="import a module first, e.g. one that registers a policy loss, "
                             "advantage estimator, reward function or environment (repeatable)")
    parser.add_argument("--compile-for", metavar="TOPOLOGY",
                        help="compile the run for a TPU slice (v5e-8, v5p-128, v6e-256, v4-8, "
                             "v5p:4x4x4) or GPUs (h100-8, h200-8; see docs/scaling.md) without "
                             "running it, on any host; report memory and estimated speed")
    parser.add_argument("--json", metavar="PATH", help="with --compile-for: write the report here")
    parser.add_argument("--help-config", action="store_true",
                        help="print every config key with its type, default and meaning (and "
                             "the value --config gives it where that differs), then exit")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.compile_for is not None:  # libtpu compiles; the host's own devices do the tracing
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    from ppo_jax.trainer.config import ConfigError

    if not import_modules(args.imports):
        return 2
    try:
        cfg, plan = start_config(args)
    except (ConfigError, FileNotFoundError, ValueError) as e:  # CheckpointReadError too
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.help_config:
        from ppo_jax.trainer.config import describe

        print(describe(cfg, args.config + (" + --set" if args.overrides else "")))
        return 0
    if args.compile_for is not None:
        return compile_only(args, cfg)
    if args.json:
        print("error: --json goes with --compile-for (a training run writes its metrics to "
              "train.output_dir)", file=sys.stderr)
        return 2
    if plan is not None:  # the first line: resuming, or (auto) starting a new run
        print(plan.headline, file=sys.stderr, flush=True)
    return run_training(cfg, plan)


def run_training(cfg, plan) -> int:
    """Build the stage's trainer for `cfg`, resuming by `plan` when given, and train. Returns
    the exit status: 2 when building is refused; 1 when a checkpoint write, a non-finite step or
    the user's code failed mid-run, each said in one `error:` line; 0 otherwise."""
    from ppo_jax.trainer.config import ConfigError
    from ppo_jax.trainer.host.distributed import initialize

    initialize(cfg.distributed)
    from ppo_jax.trainer.stages import trainer_class

    start = time.perf_counter()
    try:
        trainer = trainer_class(cfg.stage)(cfg, resume=plan or False)
    except (ConfigError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from ppo_jax.trainer.lifecycle.checkpoint import CheckpointWriteError
    from ppo_jax.trainer.faults import UserCodeError

    try:
        history = trainer.train()
    except (CheckpointWriteError, FloatingPointError, UserCodeError) as e:  # a write failed; a
        # non-finite step; a reward function or an environment that failed mid-run
        print(f"error: {e}", file=sys.stderr)
        return 1
    if trainer.preempted_at is not None:  # SIGTERM / SIGINT: saved, said so on stderr
        return 0
    if history and trainer.process_index == 0:
        print(f"done: step {trainer.step_count} ({len(history)} run now) in "
              f"{time.perf_counter() - start:.0f} s; "
              f"{summary(cfg.stage, history)}; outputs in {trainer.out}")
    return 0


def start_config(args):
    """The (config, resume plan or None) of this start, from `--config` (default
    DEFAULT_CONFIG) and `--set`. With `--resume` and no `--config`, the run's saved config is
    used; changes the saved state cannot take are refused here, before the first line. Sets
    `args.config` to the file read.

    Raises:
      ConfigError / FileNotFoundError: a bad file, override or `--resume`.
      CheckpointReadError: the checkpoint's metadata files are damaged (without fallback).
    """
    from ppo_jax.trainer.config import ConfigError, load_config

    explicit, args.config = args.config is not None, args.config or DEFAULT_CONFIG
    if args.resume_fallback and args.resume is None:
        raise ConfigError("--resume-fallback goes with --resume")
    if args.resume is None or args.help_config or args.compile_for is not None:
        return load_config(args.config, args.overrides), None
    from ppo_jax.trainer.lifecycle.resume import resume_changes, resume_config

    cfg, plan = resume_config(args.config, args.overrides, args.resume, explicit=explicit,
                              fallback=args.resume_fallback)
    resume_changes(cfg, plan)
    return cfg, plan


def compile_only(args, cfg) -> int:
    """`--compile-for`: compile, print the report, write `--json`; 0 fits, 3 not, 2 bad input."""
    import json

    from ppo_jax.aot.compile_for import compile_for, format_report, over_message
    from ppo_jax.aot.topology import resolve_slice
    from ppo_jax.trainer.stages import trainer_class

    def log(message):
        print(message, file=sys.stderr, flush=True)

    if args.json and (os.path.isdir(args.json)
                      or not os.path.isdir(os.path.dirname(os.path.abspath(args.json)))):
        print(f"error: --json {args.json}: not a file in an existing directory", file=sys.stderr)
        return 2
    try:
        target = resolve_slice(args.compile_for)
        report = compile_for(trainer_class(cfg.stage), cfg, target, log=log)
    except (ValueError, FileNotFoundError) as e:  # ConfigError and TopologyError among them
        print(f"error: {e}", file=sys.stderr)
        return 2
    report.update(config=args.config, overrides=list(args.overrides))
    print(format_report(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    if not report["fits"]:
        print(f"error: {over_message(report)}", file=sys.stderr)
        return 3
    return 0


def summary(stage: str, history: list[dict]) -> str:
    """One line of first -> last figures of a run."""
    first, last = history[0], history[-1]
    if stage == "ppo":
        return (f"reward mean {first['score_mean']:.3f} -> {last['score_mean']:.3f}, "
                f"kl {first['kl']:.3f} -> {last['kl']:.3f}")
    line = f"loss {first['loss']:.4f} -> {last['loss']:.4f}"
    evals = {k: v for k, v in last.items() if k in ("eval/loss", "eval/perplexity", "eval/accuracy")}
    return line + "".join(f", {k} {v:.4f}" for k, v in evals.items())


if __name__ == "__main__":
    # XLA:CPU then reuses its freed buffers instead of faulting them in again (trainer/host/memory.py)
    from ppo_jax.trainer.host.env import quiet_tpu_probe
    from ppo_jax.trainer.host.memory import reexec_with_malloc_settings

    if not any(a.startswith("--compile-for") for a in sys.argv):
        quiet_tpu_probe()  # no libtpu start-up errors on a host without TPU chips
    reexec_with_malloc_settings()
    sys.exit(main())
