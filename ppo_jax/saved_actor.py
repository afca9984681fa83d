"""A run's saved actor, loaded again after the run for `python -m ppo_jax.generate` and
`python -m ppo_jax.evaluate`.

An actor comes from one of three sources, each loaded by the trainer's own code so nothing
drifts from what ran:
- an HF directory (`<run>/actor_hf`, or any local causal LM), loaded as the trainer loads
  `model.actor`;
- a PEFT adapter directory (`<run>/actor_adapter` of a LoRA run), loaded as the run's
  `model.actor` with the adapter as `model.lora.adapter`;
- a checkpoint step of a run directory: the stage's trainer is built from the config that step
  trained under, without touching the run directory (no lock, nothing written), and its train
  state is read from `checkpoints/<step>`. Step 0 is the starting actor.

A step trained under `config.json`, or, after a resume with changed settings, under the newest
`config.resume-<k>.json` with k < step: a resume from checkpoint k applies from step k + 1. An
exported actor was written after the run's last step, so it reads the config of the newest
checkpoint.

Bad input (a missing directory, a directory that is no run or no model, a step with no
checkpoint) raises `ConfigError` naming the flag and the path before any model loads. A
checkpoint that cannot be read raises `CheckpointReadError` naming the step, the file, the
cause, the config and the run's earlier checkpoints. A checkpoint that reads but does not fit
the train state of its config raises `ConfigError`.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Optional, Sequence

import jax

from ppo_jax.models.functional import Model
from ppo_jax.models.peft_io import CONFIG_FILE as ADAPTER_CONFIG
from ppo_jax.trainer.lifecycle.checkpoint import (
    Checkpointer, CheckpointReadError, check_files, finished_steps, misfit,
)
from ppo_jax.trainer.config import Config, ConfigError, load_config
from ppo_jax.trainer.loading.lora import LoadedModel, adapters_from, base_dtype, lora_settings
from ppo_jax.trainer.loading.models import actor_kind, load_split, resolve_model_path
from ppo_jax.trainer.lifecycle.run_dir import config_of_step
from ppo_jax.trainer.state import full_params

RUN_CONFIG = "config.json"  # written by the trainer into `train.output_dir`
ACTOR_STAGES = ("ppo", "sft")  # stages whose trained model is an actor (a causal LM)
# the exit status of `python -m ppo_jax.generate` / `evaluate` on what this module raises (--help)
EXIT_STATUS = ("exit status 2: bad input, or a checkpoint that cannot be read (one error: line "
               "naming its step, file, cause and the config the step trained under) or that does "
               "not fit that config")


def run_config_path(run_dir: str | Path, key: str = "--run") -> Path:
    """`<run_dir>/config.json`.

    Raises:
      ConfigError: naming `key` and the path, when the directory or its config.json is missing.
    """
    run = Path(run_dir)
    if not run.is_dir():
        raise ConfigError(f"{key} {str(run)!r}: no such directory")
    if not (run / RUN_CONFIG).is_file():
        raise ConfigError(f"{key} {str(run)!r}: no {RUN_CONFIG} there, so it is not a run "
                          "directory (train.output_dir of a run)")
    return run / RUN_CONFIG


def run_config_at(run_dir: str | Path, step: Optional[int] = None, key: str = "--run") -> Path:
    """The config file that step `step` of the run trained under; step None means the
    exported actor, i.e. the newest checkpoint.

    Raises:
      ConfigError: as `run_config_path`.
    """
    first = run_config_path(run_dir, key)
    if step is None:
        steps = finished_steps(Path(run_dir) / "checkpoints")
        step = steps[-1] if steps else sys.maxsize
    return config_of_step(Path(run_dir), step) or first


def read_run_config(run_dir: str | Path, overrides: Sequence[str] = (),
                    key: str = "--run", step: Optional[int] = None) -> Config:
    """The validated config that checkpoint `step` trained under (None: the exported
    actor's), with the dotted `overrides` of `--set` applied on top.

    Raises:
      ConfigError: as `run_config_path`, or a bad override, naming the key.
    """
    return load_config(run_config_at(run_dir, step, key), list(overrides))


def run_of(actor_dir: str | Path) -> Optional[Path]:
    """The run directory an `actor_hf` or `actor_adapter` directory was written into: its parent
    when that holds a run's config.json, else None."""
    parent = Path(actor_dir).resolve().parent
    return parent if (parent / RUN_CONFIG).is_file() else None


def actor_dir_kind(path: str | Path, key: str) -> str:
    """"hf" for an HF directory, "adapter" for a PEFT adapter directory.

    Raises:
      ConfigError: naming `key` and the path, when it is neither.
    """
    p = Path(path)
    if not p.is_dir():
        raise ConfigError(f"{key} {str(p)!r}: no such directory")
    if (p / ADAPTER_CONFIG).is_file():
        return "adapter"
    if (p / "config.json").is_file() and any(p.glob("*.safetensors")):
        return "hf"
    raise ConfigError(f"{key} {str(p)!r}: neither an HF model directory (config.json + "
                      f"*.safetensors, e.g. <run>/actor_hf) nor a PEFT adapter ({ADAPTER_CONFIG}, "
                      "e.g. <run>/actor_adapter)")


def check_step(run_dir: str | Path, step: int, key: str = "--step") -> int:
    """`step` when `<run_dir>/checkpoints/<step>` is a finished checkpoint whose metadata
    files read (no model is loaded); 0, the starting actor, is always accepted.

    Raises:
      ConfigError: naming `key`, the step and the steps the run holds.
      CheckpointReadError: a metadata file of the checkpoint is missing or damaged.
    """
    if step == 0:
        return 0
    steps = finished_steps(Path(run_dir) / "checkpoints")
    if step not in steps:
        held = f"steps {steps}" if steps else "no checkpoint"
        raise ConfigError(f"{key} {step}: {Path(run_dir) / 'checkpoints'} holds {held} (0 is the "
                          "starting actor)")
    try:
        check_files(step, Path(run_dir) / "checkpoints" / str(step))
    except CheckpointReadError as e:
        raise damaged(run_dir, e) from None
    return step


def damaged(run_dir: str | Path, error: CheckpointReadError) -> CheckpointReadError:
    """`error` extended, on the same line, with the config the step trained under and the run's
    earlier checkpoints, which `--step` can name instead."""
    earlier = [s for s in finished_steps(Path(run_dir) / "checkpoints") if s < error.step][::-1]
    other = (f"earlier checkpoints: steps {earlier} (give one with --step {earlier[0]})"
             if earlier else "no earlier checkpoint (--step 0 is the starting actor)")
    cause = " ".join(error.cause.split())  # one line
    return CheckpointReadError(error.step, error.file, f"{cause}; the step trained under "
                               f"{run_config_at(run_dir, error.step)}; {other}")


def step_or_latest(run_dir: str | Path, step: Optional[int], key: str = "--run") -> int:
    """`step`, or when None the run's newest checkpoint step, checked by `check_step`.

    Raises:
      ConfigError: no run in `run_dir`; a step the run does not hold, or no checkpoint at all.
      CheckpointReadError: as `check_step`.
    """
    run_config_path(run_dir, key)
    if step is not None:
        return check_step(run_dir, step)
    steps = finished_steps(Path(run_dir) / "checkpoints")
    if not steps:
        raise ConfigError(f"{key} {str(run_dir)!r}: no checkpoint under "
                          f"{Path(run_dir) / 'checkpoints'}; give --step 0 (the starting actor) "
                          "or an actor directory")
    return check_step(run_dir, steps[-1])


def adapter_overrides(adapter_dir: str | Path, base: Optional[str]) -> list[str]:
    """Config overrides that load the PEFT adapter at `adapter_dir` without a run's config:
    `model.lora.*` from its adapter_config.json, and `model.actor` = `base`, else the adapter's
    `base_model_name_or_path`.

    Raises:
      ConfigError: an unreadable adapter_config.json, or no base given nor recorded.
    """
    path = Path(adapter_dir) / ADAPTER_CONFIG
    try:
        conf = json.loads(path.read_text(encoding="utf-8"))
        lora = [f"model.lora.rank={int(conf['r'])}",
                f"model.lora.alpha={float(conf['lora_alpha'])}",
                f"model.lora.target_modules=[{','.join(sorted(conf['target_modules']))}]"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{path}: not a readable PEFT LoRA config "
                          f"({type(e).__name__}: {e})") from None
    base = base or conf.get("base_model_name_or_path")
    if not base:
        raise ConfigError(f"{path} records no base_model_name_or_path: give the base with --base")
    return [f"model.actor={base}", *lora]


def with_adapter(cfg: Config, adapter_dir: str | Path) -> Config:
    """`cfg` with the actor starting from the adapter at `adapter_dir`.

    Raises:
      ConfigError: `cfg` is not a LoRA run (`model.lora.rank` 0).
    """
    if not cfg.model.lora.rank:
        raise ConfigError(f"{str(adapter_dir)!r} is a PEFT adapter but the run's model.lora.rank "
                          "is 0 (not a LoRA run); give its actor_hf instead")
    lora = dataclasses.replace(cfg.model.lora, adapter=str(adapter_dir))
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, lora=lora))


def load_actor(cfg: Config, source: str | Path, *, kind: str = "causal_lm", lora: bool = False,
               sharding_fn=None) -> tuple[LoadedModel, Path]:
    """The actor at `source` (an HF directory, or a PEFT adapter on `cfg.model.actor`), loaded
    with the dtypes and remat the trainer uses for `model.actor`.

    Args:
      kind: "causal_lm", or "causal_lm_value" for a shared-critic run, whose value head is then
        fresh.
      lora: give an HF directory the run's LoRA adapters, zero-initialised, so that the params
        have the train state's structure. An adapter source always has them.
      sharding_fn: `Placement.sharding_fn`, or None for the default device.

    Returns:
      `(LoadedModel, tokenizer directory)`, params split into trained and frozen as the trainer
      splits them.

    Raises:
      ConfigError / FileNotFoundError / ValueError: a missing model, or an adapter that does not
        fit `cfg.model.lora` or the base.
    """
    m = cfg.model
    kwargs = dict(param_dtype=m.param_dtype, dtype=m.dtype, remat=m.remat,
                  attention=m.attention, sharding_fn=sharding_fn,
                  seed=cfg.train.seed)
    if actor_dir_kind(source, "actor") == "adapter":
        cfg = with_adapter(cfg, source)
        path = resolve_model_path(cfg.model.actor, "model.actor")
        return load_split(path, kind, **base_dtype(cfg, kwargs), lora=lora_settings(cfg),
                          adapters=adapters_from(cfg, path, kind)), path
    settings = lora_settings(cfg) if lora else None
    kwargs = base_dtype(cfg, kwargs) if settings else kwargs
    return load_split(Path(source), kind, **kwargs, lora=settings), Path(source)


def build_trainer(cfg: Config, devices=None):
    """The trainer of `cfg.stage` at step 0, built as `StageTrainer.__init__` builds it on
    the mesh of `cfg.mesh` over `devices`, but without the run directory: nothing is locked,
    created or written.

    Raises:
      ConfigError / FileNotFoundError / ValueError: as the trainer's start-up.
    """
    from ppo_jax.trainer.stages import trainer_class

    cls = trainer_class(cfg.stage)
    trainer = cls.__new__(cls)
    trainer.cfg, trainer.out = cfg, Path(cfg.train.output_dir)
    trainer.process_index, trainer.step_count, trainer._lock = jax.process_index(), 0, None
    trainer._check_inputs()
    try:
        trainer.place = trainer._make_placement(devices, abstract=False)
    except ValueError as e:
        raise ConfigError(f"mesh: {e} (on this host: --set mesh.data=-1 --set mesh.fsdp=1 "
                          "--set mesh.tensor=1)") from None
    trainer._build()
    return trainer


def restore_step(trainer, run_dir: str | Path, step: int) -> None:
    """Read the train state of checkpoint `step` of `run_dir` into `trainer`, which must be
    built from the config that step trained under. Step 0 leaves the starting state.

    Raises:
      CheckpointReadError: a file of the checkpoint is missing, truncated or damaged.
      ConfigError: the checkpoint reads but does not fit the trainer's state (other model
        settings, or a `--set`).
    """
    if step == 0:
        return
    checkpointer = Checkpointer(Path(run_dir) / "checkpoints")
    try:
        trainer.state, meta = checkpointer.restore(step, trainer.state)
    except CheckpointReadError as e:  # damage, not a mismatch
        raise damaged(run_dir, e) from None
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(misfit(checkpointer.directory / str(step), e, "the train state of "
                                 f"{run_config_at(run_dir, step)} (the config step {step} "
                                 "trained under, with any --set)")) from None
    finally:
        checkpointer.close()
    trainer.step_count = trainer.saved_step = int(meta["step"])


def trainer_at_step(run_dir: str | Path, step: int, overrides: Sequence[str] = ()):
    """The trainer of the run's config (with `overrides`) holding checkpoint `step`.

    Raises:
      ConfigError, CheckpointReadError: as `read_run_config`, `check_step` and `restore_step`.
    """
    cfg = read_run_config(run_dir, overrides, step=step)
    check_step(run_dir, step)
    trainer = build_trainer(cfg)
    restore_step(trainer, run_dir, step)
    return trainer


def check_actor_stage(cfg: Config, run_dir: str | Path) -> None:
    """Refuse a run whose stage trains no actor.

    Raises:
      ConfigError: naming the run and its stage.
    """
    if cfg.stage not in ACTOR_STAGES:
        raise ConfigError(f"--run {str(run_dir)!r}: stage={cfg.stage!r} trains no actor (stages "
                          f"with one: {list(ACTOR_STAGES)})")


def trainer_actor(trainer) -> Model:
    """The actor of a PPO or SFT trainer as one `Model`, a LoRA actor's frozen base joined.

    Raises:
      ConfigError: a stage without an actor (reward_model).
    """
    stage = trainer.cfg.stage
    if stage == "ppo":
        return trainer.ppo_models(trainer.state["actor"].params).actor
    if stage == "sft":
        return Model(trainer.model.graphdef, trainer.params())
    raise ConfigError(f"stage={stage!r}: the run trains no actor (stages with one: "
                      f"{list(ACTOR_STAGES)})")


def set_actor(trainer, source: str | Path) -> None:
    """Swap the actor at `source` into a PPO trainer's train state. The reference, reward and
    settings stay the run's; a LoRA run's HF directory becomes the frozen base with zero adapters.

    Raises:
      ConfigError: a trainer of another stage, params of another architecture; as `load_actor`.
    """
    if trainer.cfg.stage != "ppo":
        raise ConfigError(f"--actor: stage={trainer.cfg.stage!r}; an actor can be swapped into "
                          "a ppo run only (use --step)")
    loaded, _ = load_actor(trainer.cfg, source, kind=actor_kind(trainer.cfg), lora=True,
                           sharding_fn=trainer.place.sharding_fn)
    def shapes(frozen, params):
        tree = full_params(frozen, params)
        return jax.tree.structure(tree), [x.shape for x in jax.tree.leaves(tree)]

    if shapes(loaded.frozen, loaded.params) != shapes(trainer.frozen["actor"],
                                                      trainer.state["actor"].params):
        raise ConfigError(f"--actor {str(source)!r} does not have the run's actor's params "
                          "(another architecture?)")
    trainer.state["actor"] = trainer.state["actor"].replace(params=loaded.params)
    trainer.frozen["actor"] = loaded.frozen  # the reference keeps its own arrays
