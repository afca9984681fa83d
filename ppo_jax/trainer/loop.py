"""What every stage's trainer shares: the run directory guards, the device mesh, orbax
checkpoints with `--resume`, metrics, the progress bar, and the loop build -> step -> log/save
-> export.

A stage subclasses `StageTrainer` and fills in four methods. `__init__` calls the first two,
then restores a checkpoint under `--resume`; `train()` calls the other two:

    _check_inputs()   read and validate config names and data files; nothing is written yet
    _build()          load models, create `self.state` (the pytree of arrays a checkpoint
                      holds) and `self.prompt_order`, jit the update
    step() -> dict    one optimiser step, or one PPO step; its metrics as floats
    export()          write the trained model as an HF directory, once, after the last step

A stage that `train.py --compile-for` can compile also gives `_check_config()`, `programs()`
and `resident()`; `Trainer.abstract(cfg, devices)` builds it with shapes in place of arrays.

SIGTERM or SIGINT during `train()` stops every process after the same step, which is saved;
`preempted_at` is then that step and the model is not exported. `train.max_minutes` makes the
step that crosses it the last one, evaluated, saved and exported as `train.steps` would be;
`budget_spent_at` records it.

A stage may override `start_metrics()`, `periodic_metrics(step)`, `after_log(step)`,
`finite_keys` / `finite_hint` (which metrics stop a run when not finite, and the advice
printed) and `progress_postfix`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import numpy as np

from ppo_jax.trainer.lifecycle.checkpoint import Checkpointer
from ppo_jax.trainer.config import Config, ConfigError, to_dict
from ppo_jax.trainer.faults import checkpoint_kept
from ppo_jax.trainer.host.memory import release_host_memory
from ppo_jax.trainer.placement import Placement
from ppo_jax.trainer.lifecycle.preemption import StopSignals, WallClockBudget
from ppo_jax.trainer.lifecycle.resume import (
    format_changes, plan_resume, restore_planned, resume_changes, supersede_later,
)
from ppo_jax.trainer.lifecycle.run_dir import (
    CONFIG, METRICS, OLD_SAMPLES, SAMPLES, SUPERSEDED, RunLock, check_writable, config_in_effect,
    plural, supersede_configs, supersede_rows, write_run_config,
)
from ppo_jax.trainer.tracking.loggers import Trackers
from ppo_jax.trainer.tracking.metrics import MetricsWriter
from ppo_jax.trainer.tracking.progress import progress_bar, trained_params_line


class StageTrainer:
    """The state, jitted update and outputs of one run of one stage.

    `Trainer(cfg, resume=False, resume_fallback=False, devices=None)` checks and loads everything,
    raising ConfigError / FileNotFoundError / ValueError before any compile. An error raised after
    the run directory and its lock were made removes them again when nothing else is in it.
    `resume` is False, True (the latest checkpoint), "auto", a step, or a `ResumePlan`.
    `train()` runs the remaining steps.
    """

    name = "stage"  # progress-bar label
    finite_keys: tuple[str, ...] = ()  # besides every "*loss" metric
    finite_hint = "Check learning rates, kl_coef and the reward scale"  # ends a non-finite stop

    is_abstract = False  # True: built by `abstract()`, shapes in place of arrays
    preempted_at: int | None = None  # the step `train()` stopped at on SIGTERM / SIGINT
    saved_step: int | None = None  # the step of the checkpoint this run last wrote or restored
    budget_spent_at: int | None = None  # the step `train()` ended at on `train.max_minutes`
    budget = WallClockBudget(None)  # `train.max_minutes`, started by `train()`

    def __init__(self, cfg: Config, *, resume=False, resume_fallback: bool = False, devices=None):
        self.cfg = cfg
        self.out = Path(cfg.train.output_dir)
        self._check_inputs()
        self.resume_plan = plan_resume(self.out, resume, fallback=resume_fallback)
        changes = resume_changes(cfg, self.resume_plan)  # unsafe ones refused, before any load
        self.process_index = jax.process_index()
        if changes and self.process_index == 0:
            print(format_changes(changes, self.resume_plan.config, self.resume_plan.steps[0],
                                 tentative=self.resume_plan.fallback))
        self._lock = None
        created = not self.out.exists()
        if self.process_index == 0:
            check_writable(self.out)
            self._lock = RunLock(self.out)
        try:
            try:
                self.place = self._make_placement(devices, abstract=False)
            except ValueError as e:
                raise ConfigError(f"mesh: {e}") from None
            self.step_count = 0
            self._build()
            self._open_outputs()
        except BaseException:  # refused at start-up: leave no lock file or empty directory
            if self._lock is not None:
                self._lock.abandon(remove_dir=created)
            raise

    @classmethod
    def abstract(cls, cfg: Config, devices=None) -> "StageTrainer":
        """The trainer of `cfg` on `devices` (default all) with `jax.ShapeDtypeStruct`s in place of
        every array, models built from config.json alone. Its jitted functions, shardings, dtypes,
        remat and donation are a run's, ready to be lowered and compiled. Reads no weights,
        tokenizer or data file, writes nothing, and cannot `step()`.

        Raises:
          ConfigError / FileNotFoundError / ValueError: as `__init__` does for the config.
        """
        self = cls.__new__(cls)
        self.cfg, self.is_abstract = cfg, True
        self.out = Path(cfg.train.output_dir)
        self.process_index, self.step_count, self._lock = 0, 0, None
        self._check_config()
        try:
            self.place = self._make_placement(devices, abstract=True)
        except ValueError as e:
            raise ConfigError(f"mesh: {e}") from None
        self._build()
        return self

    def _make_placement(self, devices, abstract: bool) -> Placement:
        """The placement of the train states: `cfg.mesh` over `devices` (None: all). A stage
        that keeps other devices for other work (PPO's `generation.placement: split`)
        overrides it. Raises ValueError (the loop names `mesh`) or ConfigError."""
        return Placement.from_config(self.cfg.mesh, devices, abstract)

    # --- the four steps of a stage --------------------------------------------------------
    def _check_inputs(self) -> None:
        """Validate names and data before anything is written (override)."""

    def _check_config(self) -> None:
        """The checks of `_check_inputs` that read no file; an abstract build runs only these."""

    def programs(self) -> list:  # pragma: no cover - abstract
        """The jitted functions of a step with abstract arguments, as `Program`s."""
        raise NotImplementedError

    def resident(self) -> dict:
        """What stays in device memory between the programs of a step (train states, frozen params):
        `{name: pytree}` of arrays or `ShapeDtypeStruct`s."""
        return {"state": self.state}

    def _build(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def step(self) -> dict:  # pragma: no cover - abstract
        raise NotImplementedError

    def export(self) -> Path:  # pragma: no cover - abstract
        raise NotImplementedError

    # --- optional hooks -------------------------------------------------------------------
    def start_metrics(self) -> dict:
        """Metrics of the starting model, such as a held-out evaluation. A non-empty dict is logged
        as step 0 and followed by `after_log(0)`, only when a run starts at step 0, not on
        resume. Not checked for finiteness."""
        return {}

    def periodic_metrics(self, step: int) -> dict:
        """Extra metrics merged into step `step`'s record, such as a held-out evaluation."""
        return {}

    def after_log(self, step: int) -> None:
        """Called after step `step` is logged, e.g. to write decoded samples."""

    def progress_postfix(self, metrics: dict) -> dict:
        loss = next((k for k in metrics if k.endswith("loss")), None)
        return {loss: f"{metrics[loss]:.4f}"} if loss else {}

    # --- shared machinery -----------------------------------------------------------------
    def _open_outputs(self) -> None:
        self.checkpointer = Checkpointer(self.out / "checkpoints", max_to_keep=self.cfg.train.max_to_keep)
        if self.resume_plan is not None:
            self._restore()
            if self.process_index == 0:
                self._supersede_logged()
        trackers = (Trackers.open(self.cfg.train, to_dict(self.cfg), self.out)
                    if self.process_index == 0 and self.step_count < self.cfg.train.steps else None)
        self.writer = MetricsWriter(self.out, tensorboard=self.cfg.train.tensorboard,
                                    enabled=self.process_index == 0, trackers=trackers)
        if self.process_index == 0 and self.step_count < self.cfg.train.steps:
            self._write_config()

    def _supersede_logged(self) -> None:
        """Move the rows of metrics.jsonl and samples.jsonl that will run again to their
        `.superseded.jsonl`: those past the restored step, or with no checkpoint the step-0 rows
        too."""
        keep = self.step_count if self.step_count else -1
        for name, aside in ((METRICS, SUPERSEDED), (SAMPLES, OLD_SAMPLES)):
            moved = supersede_rows(self.out, keep, name, aside)
            if moved:
                print(f"--resume: {plural(moved, 'row')} of {name} not covered by the restored "
                      f"state (step {self.step_count}) moved to {self.out / aside}; they run again")

    def _write_config(self) -> None:
        """Record this start's config. Config files that do not apply to it are moved aside first
        and kept: at step 0, any left by a start that wrote no checkpoint (unless its
        config.json says the same); on a resume, those of resumes from later checkpoints."""
        config, step = to_dict(self.cfg), self.step_count
        for old, new in supersede_configs(self.out, step if step else -1,
                                          same=None if step else config):
            why = (f"a resume from a later checkpoint than step {step}" if step else
                   "left by an earlier start that wrote no checkpoint")
            print(f"{old} ({why}) moved to {new.name} (kept); this run does not train under it")
        written = write_run_config(self.out, config, step)
        if written is not None and written.name != CONFIG:  # the first config.json is kept
            print(f"--resume: the config of this start written to {written}")

    def save(self) -> None:
        """Write an orbax checkpoint of the current step (collective over processes).

        Raises:
          CheckpointWriteError: the write failed; the message names the step and the cause.
        """
        meta = {"step": self.step_count, "data_position": self.prompt_order.position}
        self.checkpointer.save(self.step_count, self.state, meta)
        self.saved_step = self.step_count
        release_host_memory()  # orbax's write buffers, freed on its threads

    def _restore(self) -> None:
        """Read the planned checkpoint, or with fallback the newest that reads. A run that goes on
        from an earlier step than the newest moves the later checkpoints to
        checkpoints.superseded/."""
        plan = self.resume_plan
        if not plan.steps:  # --resume auto on a directory with no run: a new run
            return
        step, self.state, meta = restore_planned(self.checkpointer, plan, self.state)
        self.step_count = self.saved_step = int(meta["step"])
        self.prompt_order.position = int(meta["data_position"])
        print(f"resumed from step {self.step_count} ({self.checkpointer.directory / str(step)})")
        path = config_in_effect(self.out, step)
        if path is not None and path != plan.config:  # fell back past a resume's config file
            changes = resume_changes(self.cfg, plan, path)
            if changes and self.process_index == 0:
                print(format_changes(changes, path, step))
        if self.step_count < self.cfg.train.steps:
            supersede_later(self.checkpointer, plan, step, self.process_index)

    def write_hf(self, graphdef, params, model_cfg, out_dir: Path, select=None) -> Path:
        """Save a model as an HF directory with the run's tokenizer.

        Collective: every process gathers the sharded `params` to host memory, replicating one
        tensor at a time; process 0 writes. `select(params)` picks the model's params out of a
        larger tree, as the shared-critic actor needs."""
        from flax import nnx

        from ppo_jax.models import save_pretrained
        from ppo_jax.parallel.host import to_host

        params = to_host(params)
        if select is not None:
            params = select(params)
        if self.process_index == 0:
            save_pretrained(nnx.merge(graphdef, params), model_cfg, out_dir, self.tokenizer)
        return out_dir

    def write_adapter(self, params, model_cfg, out_dir: Path, kind: str, base_model: str = "") -> Path:
        """Save a LoRA model's adapters, and a reward model's score head, in PEFT's format
        (`adapter_config.json` + `adapter_model.safetensors`). Collective, as `write_hf`.
        `base_model` is recorded as PEFT's `base_model_name_or_path`."""
        from ppo_jax.models.peft_io import save_adapter
        from ppo_jax.parallel.host import to_host

        params = to_host(params)
        if self.process_index == 0:
            save_adapter(params, model_cfg, out_dir, base_model=str(base_model), kind=kind,
                         init=self.cfg.model.lora.init)
        return out_dir

    def _release(self) -> None:
        if self._lock is not None:
            self._lock.release()

    def _not_finite(self, metrics: dict) -> list[str]:
        return sorted(k for k, v in metrics.items()
                      if (k.endswith("loss") or k in self.finite_keys) and not np.isfinite(v))

    def _stop_if_not_finite(self, n: int, metrics: dict) -> None:
        bad = self._not_finite(metrics)
        if bad:
            kept = checkpoint_kept(self.checkpointer.latest_step())
            raise FloatingPointError(f"step {n}: {', '.join(bad)} not finite; stopped before "
                                     f"saving ({kept}). {self.finite_hint}")

    def is_last_step(self, step: int) -> bool:
        """Whether `step` ends the run: `train.steps`, or the one that spent `train.max_minutes`."""
        return step == self.cfg.train.steps or step == self.budget_spent_at

    def _check_budget(self, step: int) -> None:
        """Make step `step` the last when it is past `train.max_minutes` on any process's clock.
        Collective with several processes, so that all stop at the same step."""
        if step < self.cfg.train.steps and self.budget.spent():
            self.budget_spent_at = step
            if self.process_index == 0:
                print(f"train.max_minutes={self.cfg.train.max_minutes:g} spent at step {step} "
                      f"of {self.cfg.train.steps}: it is the last step (evaluated, saved, "
                      "exported)", flush=True)

    def _run_one(self) -> dict:
        cfg = self.cfg.train
        metrics = self.step()
        n = self.step_count
        self._check_budget(n)
        last = self.is_last_step(n)
        extra = self.periodic_metrics(n)
        metrics.update(extra)
        if n % cfg.log_every == 0 or last or extra or self._not_finite(metrics):
            self.writer.write(n, metrics)
        self._stop_if_not_finite(n, metrics)
        self.after_log(n)
        if (cfg.save_every and n % cfg.save_every == 0) or last:
            self.save()
        return metrics

    def frozen_params(self, name: str):
        """The frozen params of the trained model `name`: a LoRA model's base, else {}."""
        frozen = getattr(self, "frozen", {})
        return frozen.get(name, {}) if name in ("actor", "critic") else frozen

    def _log_start(self) -> None:
        """Step 0: the `start_metrics()` record, when there is one."""
        metrics = self.start_metrics()
        if metrics:
            self.writer.write(0, metrics)
            self.after_log(0)

    def _progress_bar(self, progress: bool | None):
        """On process 0, when `train.progress` (or `progress`) asks for one: a tqdm bar on a
        terminal, else a plain line every `train.log_every` steps. None otherwise."""
        show = self.cfg.train.progress if progress is None else progress
        if not (show and self.process_index == 0):
            return None
        print(trained_params_line(self.state, self.frozen_params))
        return progress_bar(total=self.cfg.train.steps, initial=self.step_count, desc=self.name,
                            every=self.cfg.train.log_every)

    def _stop_on_signal(self) -> None:
        """A stop signal was agreed at this step boundary: save this step unless it is saved already
        or no step ran (a resume then starts over), and record `preempted_at`. Collective, as
        `save`."""
        if self.step_count > 0 and self.saved_step != self.step_count:
            self.save()
        self.preempted_at = self.step_count

    def train(self, progress: bool | None = None) -> list[dict]:
        """Run steps until `train.steps`, logging and checkpointing, then export the model when
        `train.export_hf`. A run that starts at step 0 first logs `start_metrics()` as step 0.
        Returns the metrics of the steps run, step 0 not among them.

        SIGTERM or SIGINT to any process ends the step in progress on every process; each then
        saves that step, closes the metrics, releases the lock, prints "preempted at step N; resume
        with --resume" on stderr and returns without exporting (`preempted_at` = N). A signal
        during the last step lets the run finish.

        `train.max_minutes` is counted from this call, so a resume has a budget of its own; it ends
        the run after the step that crosses it, and a later `--resume` goes on towards
        `train.steps`.

        Raises:
          CheckpointWriteError: a checkpoint write failed; the metrics written stay.
          FloatingPointError: a step's losses were not finite; nothing of it is saved.
        """
        cfg = self.cfg.train
        self.preempted_at = self.budget_spent_at = None
        self.budget = WallClockBudget(cfg.max_minutes)
        if self.step_count >= cfg.steps:
            if self.process_index == 0:
                print(f"nothing to do: the run is at step {self.step_count} and train.steps="
                      f"{cfg.steps}; raise train.steps to continue it")
            self._release()
            return []
        history, bar = [], self._progress_bar(progress)
        with StopSignals() as signals:
            try:
                if self.step_count == 0:
                    self._log_start()
                # the same condition on every process, so the collective runs in step
                while (self.step_count < cfg.steps and self.budget_spent_at is None
                       and not signals.stop_agreed()):
                    metrics = self._run_one()
                    history.append(metrics)
                    if bar is not None:
                        bar.set_postfix(**self.progress_postfix(metrics))
                        bar.update(1)
                if self.step_count < cfg.steps and self.budget_spent_at is None:
                    self._stop_on_signal()
            finally:
                if bar is not None:
                    bar.close()
                self.writer.close(failed=sys.exc_info()[0] is not None)
                self._release()
            if cfg.export_hf and self.preempted_at is None:
                self.export()  # collective; process 0 writes
        if self.preempted_at is not None:
            # before the first checkpoint there is nothing to resume: `--resume auto` starts over
            how = "--resume" if self.preempted_at else "--resume auto (no step was saved)"
            print(f"preempted at step {self.preempted_at}; resume with {how}", file=sys.stderr,
                  flush=True)
        return history
