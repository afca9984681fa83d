"""Run a run's own held-out evaluation again, for any saved actor.

Usage:
  python -m ppo_jax.evaluate --run runs/tiny                    # its latest checkpoint
  python -m ppo_jax.evaluate --run runs/tiny --step 0           # the starting actor
  python -m ppo_jax.evaluate --run runs/rlvr --actor runs/rlvr/actor_hf --json figures.json
  python -m ppo_jax.evaluate --run runs/rlvr --step 40 --set eval.num_prompts=256

The run's trainer is built from the config the step trained under, as the run built it, and
nothing is written to the run. Its actor comes from checkpoint `--step` (default the latest;
0 is the starting actor) or from `--actor`, an HF directory such as `<run>/actor_hf` or a
PEFT adapter on the run's `model.actor`. The trainer's own evaluation then runs once. For PPO
it uses `eval.*` with the fixed key `eval.seed`, so a checkpoint's figures are the ones the run
logged at that step: reward mean / std, KL to the reference, response length, the fraction
that ended, a verifier's `accuracy` and, with `eval.samples_per_prompt` = k > 1, `pass@k`. SFT
and reward-model runs give their held-out loss and accuracy.

`--set KEY=VALUE` changes `eval.*` keys only (e.g. `eval.num_prompts`, `eval.prompts`,
`eval.seed`); any other key is refused with exit 2, since the run's model, reward and sampling
settings are what is evaluated. A run logged with `eval.every: 0` is evaluated all the same.
The figures are printed one per line; `--json` prints them as JSON, `--json PATH` writes them
there. Bad input (no such run, step or actor; a run without held-out prompts) prints
`error: ...` naming it and exits 2 before any model loads. A checkpoint that cannot be read
prints one line and exits 2: `error: checkpoint of step N cannot be read: FILE: CAUSE; the
step trained under CONFIG; earlier checkpoints: steps [...] (give one with --step M)`. One that
reads but does not fit the config the step trained under says it `does not fit`, exit 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from ppo_jax.fork_imports import import_modules
from ppo_jax.trainer.config import Config, ConfigError
from ppo_jax.saved_actor import (
    EXIT_STATUS, actor_dir_kind, build_trainer, read_run_config, restore_step, run_config_path,
    set_actor, step_or_latest, with_adapter,
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m ppo_jax.evaluate",
                                description=__doc__.splitlines()[0], epilog=EXIT_STATUS)
    p.add_argument("--run", required=True, help="run directory (train.output_dir of the run)")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--step", type=int, help="checkpoint step (default: the latest; 0: the "
                       "starting actor)")
    which.add_argument("--actor", help="an HF directory (<run>/actor_hf) or a PEFT adapter "
                       "directory (<run>/actor_adapter) to evaluate in the run's setting")
    p.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                   help="import a module first, as train.py's --import: one that registers what "
                        "the run's config names (a policy loss, a reward function, an "
                        "environment; repeatable)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override of an eval.* key, as train.py's (repeatable)")
    p.add_argument("--json", nargs="?", const="-", metavar="PATH",
                   help="the figures as JSON, on stdout or to PATH")
    args = p.parse_args(argv)
    if args.step is not None and args.step < 0:
        p.error(f"--step {args.step} must be >= 0")
    return args


def eval_config(run: str, overrides: list[str], step: int | None = None) -> Config:
    """The run's config of `step` (None: its last step) with the `eval.*` `overrides`, and
    evaluation switched on (`eval.every` 0 -> 1).

    Raises:
      ConfigError: no run there, a bad override or one of another key, or a PPO run without
        `eval.prompts`.
    """
    other = [o.split("=", 1)[0].strip() for o in overrides
             if not o.split("=", 1)[0].strip().startswith("eval.")]
    if other:
        raise ConfigError(f"--set {', '.join(other)}: evaluate changes eval.* keys only (the "
                          "run's own model, reward and sampling settings are evaluated)")
    cfg = read_run_config(run, overrides, step=step)
    if cfg.stage != "ppo":
        return cfg
    if cfg.eval.prompts is None:
        raise ConfigError(f"--run {run!r}: the run has no held-out prompts (eval.prompts is "
                          "null); give some with --set eval.prompts=FILE (or 'task')")
    if cfg.eval.every == 0:
        cfg = dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, every=1))
    return cfg


def check_actor(cfg: Config, actor: str) -> None:
    """Refuse an `--actor` that cannot go into the run: only a PPO run takes one, and only a
    LoRA run takes an adapter.

    Raises:
      ConfigError: naming `--actor` and the path, or the run's stage / `model.lora.rank`.
    """
    if actor_dir_kind(actor, "--actor") == "adapter":
        with_adapter(cfg, actor)
    if cfg.stage != "ppo":
        raise ConfigError(f"--actor: the run's stage is {cfg.stage!r}; an actor goes into a ppo "
                          "run only (evaluate a checkpoint with --step)")


def evaluate(cfg: Config, run: str, *, step: int | None = None, actor: str | None = None) -> dict:
    """The trainer's held-out figures for the actor of checkpoint `step` (0: the starting one)
    or of the directory `actor`, in the run's setting.

    Returns:
      `{"eval/<name>": float}`, the figures the stage logs for its evaluation, without
      `time/eval`.

    Raises:
      ConfigError / FileNotFoundError / ValueError: as `ppo_jax.saved_actor`.
    """
    trainer = build_trainer(cfg)
    if actor is not None:
        set_actor(trainer, actor)
    else:
        restore_step(trainer, run, step)
    figures = trainer.evaluate()
    if cfg.stage != "ppo":
        if not figures:
            raise ConfigError(f"--run {run!r}: the {cfg.stage} run holds out no rows to evaluate")
        figures = {f"eval/{k}": v for k, v in figures.items()}
    return {k: float(v) for k, v in figures.items() if not k.startswith("time/")}


def report(args, step, figures: dict, seconds: float) -> None:
    """Print the figures (or their JSON) and write `--json PATH`."""
    what = f"actor {args.actor}" if args.actor else f"step {step}"
    record = {"run": args.run, "step": step, "actor": args.actor, "overrides": args.overrides,
              "figures": figures}
    if args.json == "-":
        print(json.dumps(record, indent=2))
        return
    print(f"held-out evaluation of {args.run}, {what} ({seconds:.0f} s):")
    width = max(map(len, figures), default=0)
    for k in sorted(figures):
        print(f"  {k:<{width}}  {figures[k]:.6g}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(record, indent=2) + "\n")


def main(argv=None) -> int:
    args = parse_args(argv)
    if not import_modules(args.imports):
        return 2
    start = time.perf_counter()
    try:
        run_config_path(args.run)
        step = None if args.actor is not None else step_or_latest(args.run, args.step)
        cfg = eval_config(args.run, args.overrides, step)
        if args.actor is not None:
            check_actor(cfg, args.actor)
        figures = evaluate(cfg, args.run, step=step, actor=args.actor)
    except (ConfigError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    report(args, step, figures, time.perf_counter() - start)
    return 0


if __name__ == "__main__":
    from ppo_jax.trainer.host.env import quiet_tpu_probe

    quiet_tpu_probe()  # no libtpu start-up errors on a host without TPU chips
    sys.exit(main())
