"""The typed configuration of a run, of any stage, loaded from YAML with dotted command-line
overrides.

The schema is a tree of dataclasses. `omegaconf` merges the YAML file and the overrides onto
it and rejects unknown keys and values of the wrong type, naming the key (`ppo.kl_coeff` ->
``ConfigKeyError: Key 'kl_coeff' not in 'PPOConfig'``). `validate` then checks the relations
between fields, such as batch sizes that must divide and names that must be registered,
before anything is loaded or compiled. `describe` is the text of `train.py --help-config`.

The schema's defaults are the shipped default run, `configs/default.yaml`: `load_config(None)`
is that run, and a file naming three keys is that run with those three changed. A file may
name another as its `base:`, for recipes that differ in a few keys (configs/rlvr/*.yaml).

Import config names from this module. It imports nothing from the trainer above it, which is
why the stage names (`STAGES`, `Stage`) live in the schema.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ppo_jax.trainer.config.checks import validate
from ppo_jax.trainer.config.help import describe, leaves, type_name
from ppo_jax.trainer.config.schema import (
    SMOLLM2, STAGES, Config, ConfigError, DataConfig, DistributedConfig, EnvConfig, EvalConfig,
    GenerationConfig, MeshConfig, ModelsConfig, OptimConfig, PPOConfig, RewardConfig, Stage,
    SupervisedConfig, TrainConfig, opt, section,
)

_leaves = leaves  # the name tests and older callers use

__all__ = [
    "SMOLLM2", "STAGES", "Config", "ConfigError", "DataConfig", "DistributedConfig", "EnvConfig",
    "EvalConfig", "GenerationConfig", "MeshConfig", "ModelsConfig", "OptimConfig", "PPOConfig",
    "RewardConfig", "Stage", "SupervisedConfig", "TrainConfig", "describe", "eval_enabled", "leaves",
    "load_config", "opt", "section", "static_kwargs", "to_dict", "type_name", "validate",
]


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Build a `Config` from an optional YAML file and dotted overrides (`ppo.kl_coef=0.05`).

    Raises:
      FileNotFoundError: the YAML file does not exist.
      ConfigError: an unknown key, a value of the wrong type, a malformed override, or fields
        that contradict each other; the message names the key and value.
    """
    schema = OmegaConf.structured(Config)
    try:
        merged = [schema] + (config_files(Path(path)) if path is not None else [])
        for item in overrides:
            if "=" not in item:
                raise ConfigError(f"override {item!r} is not of the form key=value")
        merged.append(OmegaConf.from_dotlist(list(overrides)))
        cfg = OmegaConf.to_object(OmegaConf.merge(*merged))
    except OmegaConfBaseException as e:
        raise ConfigError(_merge_error(e, overrides)) from None
    validate(cfg)
    return cfg


def _merge_error(e: OmegaConfBaseException, overrides) -> str:
    """omegaconf's merge error as one line naming the key; a list-valued key given a bare value
    (`--set model.lora.target_modules=c_attn`) gets the bracket form to write instead."""
    key = getattr(e, "full_key", None)
    first = str(e).splitlines()[0]
    if key and "is not a ListConfig" in first:
        given = [o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0].strip() == key]
        value = given[-1] if given else "..."
        return (f"config key {key!r} takes a list, got {value!r}: write it in brackets, "
                f"--set {key}=[{value}] (several: [a,b])")
    return f"config key {key!r}: {first}" if key else first


def _read_yaml(path: Path):
    """`path`'s YAML as an omegaconf mapping.

    Raises:
      ConfigError: not UTF-8, not valid YAML (with the line and column), or a top level that
        is not a mapping of sections (a list, a bare value).
    """
    try:
        conf = OmegaConf.load(path)
    except UnicodeDecodeError as e:
        raise ConfigError(f"config {path}: not UTF-8 text (byte {e.object[e.start]:#04x} at "
                          f"offset {e.start})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"config {path}{where}: not valid YAML: {problem}") from None
    if not isinstance(conf, DictConfig):
        kind = "list" if isinstance(conf, ListConfig) else type(conf).__name__
        raise ConfigError(f"config {path}: the top level is a {kind}, not a mapping "
                          "of sections (ppo:, data:, generation:, ...)")
    return conf


def config_files(path: Path, _chain: tuple = ()) -> list:
    """The YAML of `path`, after the files it builds on: a top-level `base: FILE` (relative to
    `path`'s directory) is loaded first, recursively, and `path`'s keys override it.

    Raises:
      FileNotFoundError: `path` or a base does not exist.
      ConfigError: a file that is its own base (through a chain), or one `_read_yaml` refuses.
    """
    if not path.is_file():
        raise FileNotFoundError(f"config file not found: {path}" + (
            f" (the base of {_chain[-1]})" if _chain else ""))
    if path.resolve() in _chain:
        raise ConfigError(f"config {path}: base files form a cycle: "
                          f"{' -> '.join(map(str, _chain + (path.resolve(),)))}")
    conf = _read_yaml(path)
    base = conf.pop("base", None)
    if base is None:
        return [conf]
    return config_files(path.parent / str(base), _chain + (path.resolve(),)) + [conf]


def static_kwargs(kwargs: dict) -> tuple:
    """A config kwargs dict as sorted (key, value) pairs: hashable, for static jit settings."""
    return tuple(sorted(kwargs.items()))


def to_dict(cfg: Config) -> dict:
    """Plain nested dict of `cfg`, for logging and checkpoint metadata."""
    return dataclasses.asdict(cfg)


def eval_enabled(e: EvalConfig) -> bool:
    """Whether a run evaluates at all: a prompt file and `every` > 0."""
    return e.prompts is not None and e.every > 0
