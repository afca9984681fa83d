"""`--resume`: which checkpoint a start continues from, under which config, and what it may change.

Modes (train.py's `--resume [auto|STEP]`, the trainers' `resume=`; `resume_mode`):

- `latest` (plain `--resume`, `resume=True`): the newest finished checkpoint in
  `train.output_dir`. A directory with no checkpoint (missing, misspelled, empty) is refused,
  naming it: a resume never silently starts over.
- `STEP`: that checkpoint; the checkpoints after it move to `checkpoints.superseded/` (kept) when
  the run goes on, since it writes those steps again.
- `auto`: `latest` when the directory holds a checkpoint, else a new run (a new or empty
  directory, or a run stopped before its first checkpoint), for pod schedulers that relaunch the
  same command after a preemption. train.py's first line on stderr says which it did.
- with `fallback` (`--resume-fallback`): a checkpoint that cannot be read (`CheckpointReadError`:
  a truncated or damaged file) gives way to the newest earlier one that can, said on stderr.
  Without it, the damaged checkpoint is named (step, file, cause) and nothing runs.

The config of a resume is the run's own (its `config.json`, or the `config.resume-<step>.json` a
later resume wrote; `run_dir.config_in_effect`). What the new start gives that differs from it
(`--set`, or another `--config`) is listed at start-up and written to a new
`config.resume-<step>.json`; `config.json` is never overwritten. `UNSAFE` keys cannot change: they
change the shapes or the meaning of what the checkpoint holds; a change to one is refused by
name before anything loads (`resume_changes`). The list, with the reason for each, is in
docs/reliability.md ("Resume").
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Union

from ppo_jax.trainer.lifecycle.checkpoint import (CheckpointReadError, check_files, finished_steps,
                                                  misfit)
from ppo_jax.trainer.config import Config, ConfigError, load_config, to_dict
from ppo_jax.trainer.lifecycle.run_dir import config_in_effect, logged_steps, plural

LATEST, AUTO = "latest", "auto"
Resume = Union[None, bool, str, int, "ResumePlan"]


def resume_mode(value: Resume) -> Optional[Union[str, int]]:
    """`value` as a mode: None (no resume: False, None), "latest" (True, "latest"), "auto", or a
    step (an int >= 0, or its digits).

    Raises:
      ConfigError: any other value, named.
    """
    if value is None or value is False:
        return None
    if value is True or value == LATEST:
        return LATEST
    if value == AUTO:
        return AUTO
    if isinstance(value, int) or (isinstance(value, str) and value.isdigit()):
        return int(value)
    raise ConfigError(f"--resume {value!r}: give nothing (the latest checkpoint), 'auto' or a "
                      "step number")


@dataclass(frozen=True)
class ResumePlan:
    """What a start with `--resume` does (`plan_resume`; read, not yet done).

    `steps`: the checkpoints to try, newest first (the earlier ones are tried with `fallback`;
    empty: a new run, auto mode); `later`: the run's checkpoints after `steps[0]`. `config`: the
    run's config file in effect at `steps[0]` (None: the run has none, or a new run).
    `headline`: one line saying which it does."""

    out: Path
    mode: Union[str, int]
    steps: tuple[int, ...]
    later: tuple[int, ...]
    fallback: bool
    config: Optional[Path]
    headline: str


def _why_no_run(out: Path) -> str:
    if not out.exists():
        return "no such directory"
    if not any(out.iterdir()):
        return "an empty directory"
    return "no finished checkpoint under checkpoints/"


def _how_to_start(out: Path) -> str:
    if logged_steps(out):  # a step-0 row (a run stopped before training): a new start refuses
        return "use --resume auto (moves its step-0 row aside, kept)"
    return ("leave out --resume, or use --resume auto (resumes a run when there is one, else "
            "starts one)")


def check_run_dir(out: Path, key: str, resume: Resume) -> None:
    """Refuse to overwrite a run: `out` must be new or empty unless resuming. Metrics of
    training steps and no checkpoint (a run stopped before its first save: a non-finite step, a
    crash) are refused under every mode, a new start too, advising a new directory; with only
    the step-0 record (`start_metrics`) the run starts over under `--resume auto`. Reads only.

    Raises:
      ConfigError: naming `key` (the config key of the directory) and what it holds.
    """
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{key}={str(out)!r} is a file, not a directory")
    done, logged = finished_steps(out / "checkpoints"), logged_steps(out)
    trained = sorted({step for step in logged if step > 0})  # step 0: the starting model's row
    if trained and not done:
        which = f"steps {trained[0]}-{trained[-1]}" if len(trained) > 1 else f"step {trained[0]}"
        raise ConfigError(
            f"{'--resume: ' if resume_mode(resume) is not None else ''}{key}={str(out)!r} holds "
            f"metrics of {plural(len(trained), 'training step')} ({which}) but no checkpoint "
            "to continue them from (the run stopped before its first save): it can be neither "
            f"resumed nor started over (metrics are never overwritten); choose a new {key}, or "
            f"delete {str(out)!r} to start again there (nothing was written)")
    if resume_mode(resume) is None and (done or logged):
        held = (f"checkpoints (steps {done}); pass --resume to continue that run" if done else
                "the step-0 metrics of a run stopped before its first training step (no "
                "checkpoint); pass --resume auto to start over there (the row is moved aside)")
        raise ConfigError(f"{key}={str(out)!r} already holds {held}, or choose a new {key} "
                          "(nothing was written)")


def plan_resume(out: Path, resume: Resume, *, fallback: bool = False,
                key: str = "train.output_dir") -> Optional[ResumePlan]:
    """The plan of a start in `out` (`check_run_dir` first); None when not resuming. A plan
    passes through. Reads only.

    Raises:
      ConfigError: see `check_run_dir`; `latest` or STEP on a directory with no checkpoint (its
        path and what is there named), or a STEP that is not among its checkpoints.
      CheckpointReadError: without `fallback`, the checkpoint's metadata files are missing or
        damaged (`checkpoint.check_files`).
    """
    if isinstance(resume, ResumePlan):
        return resume
    mode = resume_mode(resume)
    check_run_dir(out, key, mode)
    if mode is None:
        return None
    done = finished_steps(out / "checkpoints")
    if not done:
        if mode != AUTO:
            raise ConfigError(
                f"--resume: {key}={str(out)!r} holds no run to resume ({_why_no_run(out)}); "
                f"check the path. To start a new run there, {_how_to_start(out)}. Nothing was "
                "written")
        return ResumePlan(out, mode, (), (), fallback, None, f"--resume auto: no run to resume "
                          f"in {out} ({_why_no_run(out)}); starting a new run")
    target = done[-1] if mode in (LATEST, AUTO) else mode
    if target not in done:
        raise ConfigError(f"--resume {mode}: {key}={str(out)!r} has no checkpoint of step {mode}; "
                          f"its checkpoints are steps {done}. Nothing was written")
    flag = "--resume" if mode == LATEST else f"--resume {mode}"
    later = tuple(s for s in done if s > target)
    headline = f"{flag}: resuming the run in {out} from step {target}" + (
        f" (later checkpoints: steps {list(later)})" if later else "")
    plan = ResumePlan(out, mode, tuple(s for s in reversed(done) if s <= target), later,
                      fallback, config_in_effect(out, target), headline)
    if not fallback:  # a missing or cut metadata file: said now, not after the models load
        try:
            check_files(target, out / "checkpoints" / str(target))
        except CheckpointReadError as e:
            raise _read_failure([e], plan) from None
    return plan


# --- what a resume may change -------------------------------------------------------------------

def _structure(v: float) -> str:
    return "one" if v == 1 else "zero" if v == 0 else "other"


# (key or "section." prefix, the stages it holds for (None: all), why, refused only when
# when(old, new)); see docs/reliability.md
UNSAFE: tuple[tuple[str, Optional[tuple[str, ...]], str, Optional[Callable]], ...] = (
    ("stage", None, "what the run trains and its checkpoint holds", None),
    *((f"model.{m}", None, "a model the checkpoint's params, KL or scores come from", None)
      for m in ("actor", "reference", "reward_model", "critic")),
    ("model.shared_critic", ("ppo",), "which train states the checkpoint holds", None),
    ("model.param_dtype", None, "the dtype of the checkpoint's params and optimiser state", None),
    ("model.lora.", None, "the checkpoint's adapters have the run's rank, targets, scale and "
     "starting adapter", None),
    ("data.", None, "the prompts the checkpoint's data position counts into", None),
    ("generation.max_new_tokens", ("ppo",), "a sequence length of the steps so far", None),
    ("generation.samples_per_prompt", ("ppo",), "the group size: prompts per step, and the "
     "data position", None),
    *((f"ppo.{k}", ("ppo",), "a batch size: the data position and the optimiser steps per PPO "
       "step follow it", None) for k in ("batch_size", "mini_batch_size")),
    ("ppo.advantage_estimator", ("ppo",), "decides whether the checkpoint holds a critic", None),
    *((f"ppo.{k}", ("ppo",), "held by the checkpoint's KL controller: a new value would be "
       "ignored", None) for k in ("kl_controller", "kl_coef", "target_kl", "horizon")),
    ("reward.kind", ("ppo",), "decides the critic's starting model and the models held", None),
    ("optim.max_grad_norm", None, "0 and > 0 give optimiser states of other structures",
     lambda old, new: (old > 0) != (new > 0)),
    *((f"{s}.{k}", (s,), "the rows the checkpoint's data position counts into", None)
      for s in ("sft", "reward_model")
      for k in ("data", "eval_data", "eval_fraction", "max_length", "batch_size",
                "eos_after_truncated")),
    ("reward_model.backbone_lr_scale", ("reward_model",), "1, 0 and other values give "
     "optimiser states of other structures", lambda old, new: _structure(old) != _structure(new)),
    ("train.seed", None, "seeds the data order the checkpoint's data position counts into", None),
)
SAFE_WITHIN = ("data.prompt_buckets",)  # under an unsafe prefix, but only a padding width


def unsafe_reason(key: str, old: Any, new: Any, stage: str) -> Optional[str]:
    """Why `key` may not change from `old` to `new` under a resume of a `stage` run (None: it
    may)."""
    if key in SAFE_WITHIN:
        return None
    for name, stages, why, when in UNSAFE:
        hit = key.startswith(name) if name.endswith(".") else key == name
        if hit and (stages is None or stage in stages) and (when is None or when(old, new)):
            return why
    return None


def flat(tree: dict, prefix: str = "") -> dict:
    """A nested dict as {"section.key": value} (dict values flattened too; an empty one
    reads as absent)."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_changes(saved: dict, now: dict) -> dict[str, tuple[Any, Any]]:
    """{key: (saved value, new value)} for every dotted key whose value differs (a key one
    side lacks reads as None)."""
    a, b = flat(saved), flat(now)
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


def saved_config(path: Path) -> Config:
    """The config in the run's file `path`, as `load_config` reads it.

    Raises:
      ConfigError: the file no longer reads as a config (naming it and the cause).
    """
    try:
        return load_config(path)
    except (ConfigError, FileNotFoundError) as e:
        raise ConfigError(f"--resume: the run's config {path} cannot be read: {e}") from None


def resume_changes(cfg: Config, plan: Optional[ResumePlan],
                   path: Optional[Path] = None) -> dict[str, tuple[Any, Any]]:
    """What `cfg` changes against the run's config (`path`, default `plan.config`); {} when
    not resuming a checkpoint or the run has no config file. Reads only.

    Raises:
      ConfigError: every change of an `UNSAFE` key, named with both values and the reason.
    """
    path = path or (plan.config if plan is not None and plan.steps else None)
    if path is None:
        return {}
    changes = config_changes(to_dict(saved_config(path)), to_dict(cfg))
    refused = [f"  {k}={new!r} but the run was started with {old!r} ({why})"
               for k, (old, new) in changes.items()
               if (why := unsafe_reason(k, old, new, cfg.stage)) is not None]
    if refused:
        raise ConfigError(
            f"--resume: {len(refused)} setting(s) cannot change when a run resumes "
            f"(the run's config: {path}):\n" + "\n".join(refused) + "\nResume with the run's "
            "values, or start a new run in another train.output_dir. Nothing was written")
    return changes


def format_changes(changes: dict, path: Path, step: int, tentative: bool = False) -> str:
    """The start-up listing of the settings a resume changes; `tentative` (with
    `--resume-fallback`, listed before the checkpoint is read): the step they apply from is
    the one after the checkpoint that reads."""
    lines = [f"  {k}: {old!r} -> {new!r}" for k, (old, new) in changes.items()]
    start = (f"the step after the checkpoint resumed from (step {step + 1} if step {step} "
             "reads)" if tentative else f"step {step + 1}")
    return (f"--resume: {len(lines)} setting(s) differ from the run's config ({path}); they "
            f"apply from {start}:\n" + "\n".join(lines))


# --- reading the checkpoint ---------------------------------------------------------------------

def restore_planned(checkpointer, plan: ResumePlan, like: Any,
                    log: Callable[[str], None] = None) -> tuple[int, Any, dict]:
    """Restore the first checkpoint of `plan.steps` that reads into `like` (only the first
    without `plan.fallback`); returns (step, state, meta). Each one skipped is said by `log`
    (default: stderr).

    Raises:
      CheckpointReadError: the checkpoint cannot be read (without fallback: naming the earlier
        ones to fall back to), or none of them can (each named).
      ValueError: a checkpoint that reads but does not fit `like` (other stage or model
        settings).
    """
    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    failed: list[CheckpointReadError] = []
    for i, step in enumerate(plan.steps):
        try:
            state, meta = checkpointer.restore(step, like)
            return step, state, meta
        except CheckpointReadError as e:
            failed.append(e)
            if not plan.fallback:
                break
            if i + 1 < len(plan.steps):
                log(f"--resume-fallback: {e}; falling back to step {plan.steps[i + 1]}")
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(misfit(checkpointer.directory / str(step), e,
                                    "this run's train state")) from None
    raise _read_failure(failed, plan)


def _read_failure(failed: list[CheckpointReadError], plan: ResumePlan) -> CheckpointReadError:
    first, earlier = failed[0], [s for s in plan.steps if s < failed[0].step]
    if plan.fallback:
        hint = "; ".join(f"step {e.step}: {e.file}: {e.cause}" for e in failed[1:])
        return CheckpointReadError(first.step, first.file, first.cause + (
            f"\nno earlier checkpoint reads either ({hint})" if hint else
            "\nthere is no earlier checkpoint to fall back to"))
    if not earlier:
        return CheckpointReadError(first.step, first.file, first.cause +
                                   "\nthere is no earlier checkpoint to fall back to")
    return CheckpointReadError(first.step, first.file, first.cause + (
        f"\nearlier checkpoints: steps {earlier}. Add --resume-fallback to resume from the newest "
        f"of them that reads, or name one: --resume {earlier[0]}"))


# --- train.py: the config a start runs with -----------------------------------------------------

def output_dir_of(config: str, overrides: list[str]) -> Path:
    """`train.output_dir` as the last `--set train.output_dir=...` gives it, else as the config
    file alone does (without the other overrides, which may be meant for the run's config).

    Raises:
      ConfigError / FileNotFoundError: as `load_config`.
    """
    given = [o for o in overrides if o.split("=", 1)[0].strip() == "train.output_dir"]
    if given:
        from omegaconf import OmegaConf

        return Path(str(OmegaConf.from_dotlist(given[-1:]).train.output_dir))
    return Path(load_config(config).train.output_dir)


def resume_config(config: str, overrides: list[str], resume: Resume, *, explicit: bool,
                  fallback: bool = False) -> tuple[Config, Optional[ResumePlan]]:
    """The config and resume plan of a train.py start. Not resuming, or resuming with an
    `explicit` `--config`: that file and the overrides (a resume then compares them with the
    run's config). Resuming without `--config`: the run's own config in effect at the checkpoint,
    with only the overrides on top (and `train.output_dir` where the run was found).

    Raises:
      ConfigError / FileNotFoundError: a bad file or override, a refused plan (`plan_resume`),
        or a run without a config file resumed without `--config`.
    """
    if resume_mode(resume) is None:
        return load_config(config, overrides), None
    out = output_dir_of(config, overrides)
    plan = plan_resume(out, resume, fallback=fallback)
    if plan.steps and plan.config is None and not explicit:
        raise ConfigError(f"--resume: the run in {out} has no config.json to resume under; pass "
                          "the run's own --config (and --set). Nothing was written")
    if explicit or plan.config is None:
        return load_config(config, overrides), plan
    saved_out = saved_config(plan.config).train.output_dir
    here = [] if Path(saved_out).resolve() == out.resolve() else [f"train.output_dir={out}"]
    return load_config(plan.config, [*overrides, *here]), plan


def supersede_later(checkpointer, plan: ResumePlan, step: int, process_index: int) -> list[Path]:
    """A run going on from checkpoint `step` while later ones exist (`plan` says so, alike on
    every process): process 0 moves them to checkpoints.superseded/
    (`run_dir.supersede_checkpoints`; kept, and said), every process then reads the checkpoint
    list again. Collective with several processes."""
    import jax

    from ppo_jax.trainer.lifecycle.run_dir import supersede_checkpoints

    if not plan.later and step == plan.steps[0]:
        return []
    out = plan.out
    moved = supersede_checkpoints(out, step) if process_index == 0 else []
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("ppo_jax supersede_later")
    checkpointer.reload()
    if moved:
        print(f"--resume: the checkpoints after step {step} moved to {moved[0].parent} (kept): "
              f"{', '.join(p.name for p in moved)}; this run writes those steps again")
    return moved
