"""The models of a LoRA run (`model.lora.rank > 0`): which params train, where the frozen base
lives, the reference as the base with adapters off, and a LoRA critic on the actor's base.

A loaded model is split once into `params`, which train, and `frozen`, which do not. With LoRA
the trained part is the adapters plus any value or score head, and the frozen part is the base:
an input of every jitted function that is never differentiated, never in an optimiser state
and never in a checkpoint. Without LoRA everything trains and `frozen` is `{}`, so
`lora.join(frozen, params)` is the params as they were. Sources: TRL's `disable_adapter()` for
the reference, PEFT's `modules_to_save` for the heads (docs/lora.md).
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import jax
import numpy as np
from flax import nnx

from ppo_jax.models import abstract_model, load_model_config
from ppo_jax.models.config import lora_target_names
from ppo_jax.models.lora import LoraSettings, adapter_params, fresh_adapter, is_adapter
from ppo_jax.trainer.config import ConfigError
from ppo_jax.trainer.state import full_params, split_trainable

TRAINED_HEADS = ("value_head", "score")  # a value / score head trains with the adapters


@dataclass
class LoadedModel:
    """A loaded model: its static graphdef, its trained params (nested dict), its
    `ModelConfig`, and its frozen params (a LoRA model's base; `{}` without LoRA)."""

    graphdef: Any
    params: Any
    cfg: Any
    frozen: Any = field(default_factory=dict)


def lora_settings(cfg) -> Optional[LoraSettings]:
    """The adapters of a run's trained models (`model.lora`), None when rank is 0."""
    lo = cfg.model.lora
    if not lo.rank:
        return None
    return LoraSettings(lo.rank, lo.alpha, tuple(lo.target_modules), lo.init)


def base_dtype(cfg, load_kwargs: dict) -> dict:
    """`load_kwargs` for a LoRA model, its frozen base stored in `model.frozen_param_dtype`;
    the adapters and heads are float32 whatever it is."""
    return {**load_kwargs, "param_dtype": cfg.model.frozen_param_dtype}


def is_trained(path: str) -> bool:
    """The trainable filter of a LoRA model: adapters and value / score heads train, the rest is
    the frozen base."""
    return is_adapter(path) or path.split("/", 1)[0] in TRAINED_HEADS


def split_trained(model: LoadedModel) -> LoadedModel:
    """A LoRA model's params split into trained (adapters, heads) and frozen (base); a model
    without adapters is returned as it is."""
    if not model.cfg.lora_rank:
        return model
    trained, frozen = split_trainable(model.params, is_trained)
    return LoadedModel(model.graphdef, trained, model.cfg, frozen)


def base_model(model: LoadedModel) -> LoadedModel:
    """The base of a LoRA causal LM as a plain causal LM, the graph of `cfg.without_lora()` over
    the same frozen arrays. It is the reference of a LoRA PPO run, so the base is in memory once,
    as with TRL's `disable_adapter()`."""
    cfg = model.cfg.without_lora()
    graphdef, _ = abstract_model(cfg, "causal_lm")
    return LoadedModel(graphdef, model.frozen, cfg)


def reference_model(actor: LoadedModel, from_adapter: bool) -> LoadedModel:
    """The reference of a LoRA PPO run, over the actor's frozen base: the base with the adapters
    off; or, when the actor starts from a PEFT adapter (`model.lora.adapter`), the base plus a
    frozen copy of that adapter, so that the KL penalty anchors to the policy PPO starts from.
    Only the adapters are copied, since the train state takes over the actor's buffers."""
    if not from_adapter:
        return base_model(actor)
    graphdef, _ = abstract_model(actor.cfg, "causal_lm")
    start = adapter_params(actor.params)
    if not isinstance(jax.tree.leaves(start)[0], jax.ShapeDtypeStruct):
        start = jax.tree.map(jax.numpy.copy, start)
    return LoadedModel(graphdef, full_params(actor.frozen, start), actor.cfg)


def critic_on_base(actor: LoadedModel, *, seed: int, init: str,
                   place: Optional[Callable] = None) -> LoadedModel:
    """A LoRA critic over the actor's frozen backbone: fresh adapters (from `seed`, B = 0) and a
    zero value head train; the backbone arrays are the actor's own, not a copy. `place(path,
    array)` puts a new array on the mesh (None: the default device); abstract builds pass
    `jax.ShapeDtypeStruct`s through it."""
    graphdef, shapes = abstract_model(actor.cfg, "value")
    shapes = nnx.to_pure_dict(shapes)
    base = actor.frozen["backbone"]

    def fill(tree, base_tree, prefix):
        out = {}
        for k, v in tree.items():
            p = prefix + k
            if isinstance(v, dict):
                out[k] = fill(v, (base_tree or {}).get(k), p + "/")
            elif base_tree is not None and k in base_tree and not is_adapter(p):
                out[k] = base_tree[k]
            else:
                arr = (fresh_adapter(p, v.shape, v.dtype, seed, init) if is_adapter(p)
                       else np.zeros(v.shape, v.dtype))  # the value head: zeros (TRL)
                out[k] = place(p, arr) if place is not None else jax.numpy.asarray(arr)
        return out

    params = fill(shapes, {"backbone": base}, "")
    return split_trained(LoadedModel(graphdef, params, actor.cfg))


def policy_models(cfg, load: Callable, trained_load: dict, frozen_load: dict, *,
                  actor_kind: str, with_critic: bool, critic_from_actor: bool, from_adapter: bool,
                  place: Callable):
    """`(actor, reference, critic)` of a PPO run as `LoadedModel`s; the critic is None unless
    `with_critic`.

    `load(key, kind, load_kwargs, lora)` loads the model of config key `key`; `trained_load` and
    `frozen_load` are the load kwargs of trained and frozen models. Without LoRA these are three
    plain loads. With LoRA the actor has adapters on a base in `frozen_param_dtype`, and the
    reference is that base unless `model.reference` names another checkpoint. With
    `model.lora.critic` the critic has adapters too: on the actor's base when it starts from the
    actor (new arrays put by `place`), else on its own.
    """
    m, lora = cfg.model, lora_settings(cfg)
    actor_load = base_dtype(cfg, trained_load) if lora else trained_load
    actor = load("model.actor", actor_kind, actor_load, lora)
    if lora and not m.reference:
        reference = reference_model(actor, from_adapter)
    else:
        reference = load("model.reference", "causal_lm", frozen_load, None)
    if not with_critic:
        return actor, reference, None
    if lora and m.lora.critic and critic_from_actor:
        return actor, reference, critic_on_base(actor, seed=cfg.train.seed + 1, init=lora.init,
                                                place=place)
    critic_lora = lora if m.lora.critic else None
    critic_load = base_dtype(cfg, trained_load) if critic_lora else trained_load
    critic = load("model.critic", "value", critic_load, critic_lora)
    return actor, reference, critic


def check_targets(cfg, path: Path, key: str) -> None:
    """Refuse `model.lora.target_modules` that are not projections of the model at `path`.

    Raises:
      ConfigError: naming `key`, the architecture and its PEFT names.
    """
    lora = lora_settings(cfg)
    if lora is None:
        return
    model_type = load_model_config(path).model_type
    names = lora_target_names(model_type)
    bad = [t for t in lora.target_modules if t not in names]
    if bad:
        raise ConfigError(f"model.lora.target_modules={list(lora.target_modules)}: {bad} are not "
                          f"projections of {key}={str(path)!r}, a {model_type} model; set "
                          f"model.lora.target_modules to some of {list(names)}")


def _warn_other_base(adapter_dir: str, path: Path) -> None:
    """Warn when the adapter's recorded `base_model_name_or_path` is not `path` (by name)."""
    try:
        base = json.loads((Path(adapter_dir) / "adapter_config.json").read_text()).get(
            "base_model_name_or_path")
    except (OSError, ValueError):
        return
    if base and Path(str(base)).name != Path(path).name:
        warnings.warn(f"model.lora.adapter={adapter_dir!r} was made on {base!r}, and is loaded "
                      f"on {str(path)!r}: adapters only fit the base they were trained on",
                      stacklevel=3)


def adapters_from(cfg, path: Path, kind: str) -> Optional[dict]:
    """The adapters of the PEFT directory `model.lora.adapter` for the model at `path`, as
    `{param path: array}`; None when the key is unset.

    Raises:
      ConfigError: naming `model.lora.adapter`, when the directory does not fit `model.lora` or
        the model (rank, alpha, target modules, shapes).
    """
    lora = lora_settings(cfg)
    if lora is None or not cfg.model.lora.adapter:
        return None
    from ppo_jax.models.peft_io import AdapterError, load_adapter

    model_cfg = load_model_config(path, **lora.config_fields())
    _warn_other_base(cfg.model.lora.adapter, path)
    try:
        return load_adapter(cfg.model.lora.adapter, model_cfg, kind=kind)
    except AdapterError as e:
        raise ConfigError(f"model.lora.adapter={cfg.model.lora.adapter!r}: {e}") from None
