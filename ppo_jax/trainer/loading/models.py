"""Build the four models, the tokenizer and the prompts of a run from its config.

Model sources are local HF directories, or names that build one locally: the packaged models
(`smollm2`, `gemma3-270m`: a GGUF inside an installed package, converted once into the cache;
`models.packaged`) and `tiny-random` (a 2-layer random Llama with a word-level tokenizer, for
tests). Nothing is downloaded.
"""

from __future__ import annotations

import warnings

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import jax
import numpy as np
from flax import nnx

from ppo_jax.core import get_advantage_estimator, uses_critic
from ppo_jax.models import abstract_model, load_model, load_tokenizer, split_model
from ppo_jax.models import load_model_config
from ppo_jax.models.hf_io import SafetensorsReader
from ppo_jax.models.packaged import PACKAGED, default_cache_dir, ensure_packaged
from ppo_jax.models.tiny_random import TINY_MOE, ensure_tiny_random, tiny_config, tiny_vocab
from ppo_jax.trainer.config import Config, ConfigError
from ppo_jax.trainer.data.prompts import PromptSet, prompt_records, tokenize_prompts
from ppo_jax.trainer.environments import build_environment, episode_prompts
from ppo_jax.trainer.loading.lora import (
    LoadedModel, adapters_from, check_targets, policy_models, split_trained,
)

TINY_RANDOM = "tiny-random"
TINY_RANDOM_MOE = "tiny-random-moe"  # the same, as a Qwen3-MoE (`models.tiny_random.TINY_MOE`)
# config.json-only directories of real models, for `train.py --compile-for` (no weights)
MODEL_SHAPES = Path(__file__).resolve().parents[3] / "configs" / "model_shapes"


def resolve_model_path(source: str, key: str) -> Path:
    """A local HF directory for a model source name.

    Raises:
      FileNotFoundError: `source` is neither a known name nor an existing directory (the
        message names the config key), or a packaged model's package is not installed (the
        message names the pip command).
    """
    if source in PACKAGED:
        return ensure_packaged(source)
    if source == TINY_RANDOM:
        return ensure_tiny_random(default_cache_dir() / "tiny-random-llama")
    if source == TINY_RANDOM_MOE:
        return ensure_tiny_random(default_cache_dir() / "tiny-random-qwen3-moe", moe=True)
    path = Path(source).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{key}={source!r}: no HF checkpoint directory (config.json) there; "
                                f"use a local directory, {_names()}")
    return path


def _names() -> str:
    """The source names, for error messages: 'smollm2', 'gemma3-270m', 'tiny-random' or
    'tiny-random-moe'."""
    return f"{', '.join(map(repr, (*PACKAGED, TINY_RANDOM)))} or {TINY_RANDOM_MOE!r}"


def model_shape_config(source: str, key: str, **overrides):
    """The `ModelConfig` of a model source from its config.json alone: no weights, no
    tokenizer, nothing written. `tiny-random` has a built-in config, a packaged model (`smollm2`,
    `gemma3-270m`) the shipped `configs/model_shapes/<its dir_name>`; any other source is a
    directory holding a config.json.

    Raises:
      FileNotFoundError: naming `key`, when `source` is none of these.
      ValueError: an unsupported or malformed config.json.
    """
    if source in (TINY_RANDOM, TINY_RANDOM_MOE):
        moe = TINY_MOE if source == TINY_RANDOM_MOE else {}
        return tiny_config(len(tiny_vocab()), **{**moe, **overrides})
    path = (MODEL_SHAPES / PACKAGED[source].dir_name if source in PACKAGED
            else Path(source).expanduser())
    if not (path / "config.json").is_file():
        shipped = sorted(p.name for p in MODEL_SHAPES.glob("*") if (p / "config.json").is_file())
        raise FileNotFoundError(f"{key}={source!r}: no config.json there; use a local HF "
                                f"directory, {_names()} or one of the shapes "
                                f"in configs/model_shapes/ ({', '.join(shipped)})")
    return load_model_config(path, **overrides)


def load_split(path: Path, kind: str, *, param_dtype: str, dtype: str, remat: str, seed: int = 0,
               sharding_fn=None, **kwargs) -> LoadedModel:
    """`load_model` as a `LoadedModel`, its params split into trained and frozen when it has
    LoRA adapters."""
    model, cfg = load_model(path, kind, param_dtype=param_dtype, dtype=dtype, remat=remat, seed=seed,
                            sharding_fn=sharding_fn, **kwargs)
    graphdef, params = split_model(model)
    return split_trained(LoadedModel(graphdef, nnx.to_pure_dict(params), cfg))


@dataclass
class Models:
    """actor / reference / critic, the optional reward model, and the tokenizer."""

    actor: LoadedModel
    reference: LoadedModel
    critic: Optional[LoadedModel]  # None with model.shared_critic (a CausalLMWithValueHead actor)
    reward: Optional[LoadedModel]
    tokenizer: Any
    actor_path: Path
    score_normalizer: Optional[tuple[float, float]] = None  # the reward model's (mean, std)


def build_models(cfg: Config, sharding_fn=None) -> Models:
    """Load the models named by `cfg.model`; reference and reward are frozen, in
    `frozen_param_dtype`. `sharding_fn(path, shape) -> Sharding` places each param on the mesh as
    it is read; None puts it on the default device.

    The critic comes from `model.critic` when set; else, with `reward.kind == "model"`, from the
    reward model, its value head initialised from the score head as DeepSpeed-Chat does; else from
    the actor with a zero value head. No critic is loaded with `model.shared_critic` (the actor
    then carries the value head, as TRL's `AutoModelForCausalLMWithValueHead`) or with a
    critic-free advantage estimator.

    Raises:
      FileNotFoundError: a model directory is missing.
      ConfigError: the tokenizer has no EOS token and no stop tokens are configured.
    """
    m = cfg.model
    actor_path = resolve_model_path(m.actor, "model.actor")
    ref_path = resolve_model_path(m.reference, "model.reference") if m.reference else actor_path
    rm_path = resolve_model_path(m.reward_model, "model.reward_model") if m.reward_model else None
    if m.critic:
        critic_path = resolve_model_path(m.critic, "model.critic")
    else:
        critic_path = rm_path if cfg.reward.kind == "model" else actor_path

    tokenizer = load_tokenizer(actor_path)
    if tokenizer.eos_token_id is None and not cfg.generation.stop_token_ids:
        raise ConfigError("the tokenizer has no EOS token: set generation.stop_token_ids")
    normalizer = None
    if cfg.reward.kind == "model":
        check_reward_model(rm_path, "model.reward_model", tokenizer, actor_path)
        normalizer = score_normalizer(rm_path) if cfg.reward.normalize else None
    if m.critic and not m.shared_critic:
        check_same_vocabulary(critic_path, "model.critic", tokenizer, actor_path)
    trained_load = dict(param_dtype=m.param_dtype, dtype=m.dtype, remat=m.remat,
                        attention=m.attention, sharding_fn=sharding_fn)
    frozen_load = dict(param_dtype=m.frozen_param_dtype, dtype=m.dtype, remat="none",
                       attention=m.attention, sharding_fn=sharding_fn)
    check_targets(cfg, actor_path, "model.actor")
    if m.lora.critic and critic_path != actor_path:
        check_targets(cfg, critic_path, "model.critic")
    paths = {"model.actor": actor_path, "model.reference": ref_path, "model.critic": critic_path}
    adapters = adapters_from(cfg, actor_path, actor_kind(cfg))

    def load(key, kind, kwargs, lora):
        return load_split(paths[key], kind, **kwargs, seed=cfg.train.seed, lora=lora,
                          adapters=adapters if key == "model.actor" else None)

    actor, reference, critic = policy_models(
        cfg, load, trained_load, frozen_load, actor_kind=actor_kind(cfg), with_critic=needs_critic(cfg),
        critic_from_actor=critic_path == actor_path,
        from_adapter=adapters is not None, place=_placer(sharding_fn))
    reward = load_split(rm_path, "reward", **frozen_load) if cfg.reward.kind == "model" else None
    if reference.cfg.vocab_size != actor.cfg.vocab_size:
        raise ConfigError(f"model.reference vocab_size {reference.cfg.vocab_size} != actor "
                          f"vocab_size {actor.cfg.vocab_size}")
    return Models(actor, reference, critic, reward, tokenizer, actor_path, normalizer)


def abstract_split(source: str, key: str, kind: str, *, sharding_fn=None, **overrides) -> LoadedModel:
    """A `LoadedModel` of `jax.ShapeDtypeStruct`s placed by `sharding_fn`, shaped by
    `model_shape_config(source, key, **overrides)`."""
    model_cfg = model_shape_config(source, key, **overrides)
    graphdef, params = abstract_model(model_cfg, kind, sharding_fn=sharding_fn)
    return split_trained(LoadedModel(graphdef, nnx.to_pure_dict(params), model_cfg))


def _placer(sharding_fn):
    """`place(path, array)` for `critic_on_base`: on the mesh by `sharding_fn`, else on the
    default device."""
    if sharding_fn is None:
        return lambda path, arr: jax.numpy.asarray(arr)
    return lambda path, arr: jax.make_array_from_callback(
        arr.shape, sharding_fn(path, arr.shape), lambda i: arr[i])


def _abstract_placer(sharding_fn):
    """`place(path, array)` of an abstract build: the array's shape with its sharding."""
    return lambda path, arr: jax.ShapeDtypeStruct(
        arr.shape, arr.dtype, sharding=None if sharding_fn is None else sharding_fn(path, arr.shape))


def abstract_models(cfg: Config, sharding_fn=None) -> Models:
    """`build_models` with shapes in place of arrays, for `train.py --compile-for`: the same
    models, kinds, dtypes and remat, from config.json alone. There is no tokenizer, so the stop
    and pad ids come from the actor's config.json. The reward normaliser is (0, 1) when
    `reward.normalize`, since its value changes no shape.

    Raises:
      FileNotFoundError / ValueError / ConfigError: as `model_shape_config` and `build_models`.
    """
    m = cfg.model
    trained_load = dict(param_dtype=m.param_dtype, dtype=m.dtype, remat=m.remat,
                        attention=m.attention, sharding_fn=sharding_fn)
    frozen_load = dict(param_dtype=m.frozen_param_dtype, dtype=m.dtype, remat="none",
                       attention=m.attention, sharding_fn=sharding_fn)
    by_model = cfg.reward.kind == "model"
    sources = {"model.actor": m.actor, "model.reference": m.reference or m.actor,
               "model.critic": m.critic or (m.reward_model if by_model else m.actor)}

    def load(key, kind, kwargs, lora):
        return abstract_split(sources[key], key, kind, **kwargs,
                              **(lora.config_fields() if lora else {}))

    actor, reference, critic = policy_models(
        cfg, load, trained_load, frozen_load, actor_kind=actor_kind(cfg), with_critic=needs_critic(cfg),
        critic_from_actor=not (m.critic or by_model),
        from_adapter=bool(m.lora.adapter), place=_abstract_placer(sharding_fn))
    reward = (abstract_split(m.reward_model, "model.reward_model", "reward", **frozen_load)
              if by_model else None)
    for key, other in (("model.reference", reference), ("model.critic", critic),
                       ("model.reward_model", reward)):
        if other is not None and other.cfg.vocab_size != actor.cfg.vocab_size:
            raise ConfigError(f"{key} vocab_size {other.cfg.vocab_size} != actor vocab_size "
                              f"{actor.cfg.vocab_size}")
    normalizer = (0.0, 1.0) if by_model and cfg.reward.normalize else None
    return Models(actor, reference, critic, reward, None, None, normalizer)


def abstract_prompts(rows: int, width: int) -> PromptSet:
    """`rows` prompts of zero ids, `width` real tokens each: the widest batch, whose shapes
    `train.py --compile-for` compiles."""
    ids, mask = np.zeros((rows, width), np.int32), np.ones((rows, width), np.int32)
    return PromptSet([""] * rows, ids, mask)


def actor_kind(cfg: Config) -> str:
    """"causal_lm_value" (a zero value head on the actor's backbone) with
    `model.shared_critic`, else "causal_lm"."""
    return "causal_lm_value" if cfg.model.shared_critic else "causal_lm"


def needs_critic(cfg: Config) -> bool:
    """Whether a separate critic is loaded and trained: not with `model.shared_critic`, nor with
    a critic-free advantage estimator (GRPO, RLOO, ...)."""
    return not cfg.model.shared_critic and uses_critic(get_advantage_estimator(cfg.ppo.advantage_estimator))


def check_same_vocabulary(path: Path, key: str, tokenizer, actor_path: Path) -> None:
    """The model at `path` reads the actor's token ids: same `vocab_size` in config.json and,
    when `path` holds tokenizer files, the same token -> id table.

    Raises:
      ConfigError: naming `key`, both sizes, or a token whose id differs.
    """
    size, actor_size = load_model_config(path).vocab_size, load_model_config(actor_path).vocab_size
    if size != actor_size:
        raise ConfigError(f"{key}={str(path)!r} has vocab_size {size} but the actor "
                          f"({actor_path}) has {actor_size}: their token ids do not match")
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return
    theirs, ours = load_tokenizer(path).get_vocab(), tokenizer.get_vocab()
    if theirs != ours:
        diff = sorted(set(theirs.items()) ^ set(ours.items()), key=lambda kv: kv[1])[:3]
        raise ConfigError(f"{key}={str(path)!r}: its tokenizer differs from the actor's "
                          f"({len(theirs)} vs {len(ours)} tokens; e.g. {diff}); the reward model "
                          "must read the actor's tokens")


def check_reward_model(path: Path, key: str, tokenizer, actor_path: Path) -> None:
    """Refuse a model at `path` that is not a reward model (no `score.weight` head) or that
    reads another vocabulary than the actor's.

    Raises:
      ConfigError: no score head (e.g. a causal LM given as the reward model), or another
        vocabulary.
    """
    if "score.weight" not in SafetensorsReader(path).names:
        raise ConfigError(f"{key}={str(path)!r} has no score head (score.weight): it is not a "
                          "reward model; train one with stage=reward_model (its output is "
                          "<output_dir>/reward_model_hf)")
    check_same_vocabulary(path, key, tokenizer, actor_path)


SCORE_STATS = ("score_mean", "score_std")  # config.json keys written by stage reward_model
MIN_SCORE_PAIRS = 16  # fewer held-out pairs behind the statistics: a warning


def score_normalizer(path: Path) -> tuple[float, float]:
    """The (mean, std) of a reward model's scores, read from the config.json that stage
    reward_model writes, for `reward.normalize`.

    Raises:
      ConfigError: the keys are missing, or std is not positive.
    """
    import json

    d = json.loads((path / "config.json").read_text())
    if not all(k in d for k in SCORE_STATS):
        raise ConfigError(f"reward.normalize=true: {path / 'config.json'} has no "
                          f"{' / '.join(SCORE_STATS)} (written by stage=reward_model); set "
                          "reward.normalize=false or add them")
    mean, std = float(d["score_mean"]), float(d["score_std"])
    if not std > 0:
        raise ConfigError(f"reward.normalize=true: score_std={std} in {path / 'config.json'} "
                          "must be > 0")
    pairs = d.get("score_pairs")
    if pairs is not None and pairs < MIN_SCORE_PAIRS:
        warnings.warn(f"reward.normalize=true: score_mean / score_std of {path} come from "
                      f"{pairs} pair(s) only (score_std={std:.3g}); normalised rewards may be "
                      "far from unit scale: hold out more pairs in stage 2", stacklevel=2)
    return mean, std


def stop_token_ids(cfg: Config, tokenizer, model_cfg) -> tuple[int, ...]:
    """Configured stop tokens, else the tokenizer's EOS plus the model config's EOS ids.

    Raises:
      ConfigError: a configured id is outside the model's vocabulary.
    """
    if cfg.generation.stop_token_ids:
        ids = tuple(int(t) for t in cfg.generation.stop_token_ids)
        bad = [t for t in ids if not 0 <= t < model_cfg.vocab_size]
        if bad:
            raise ConfigError(f"generation.stop_token_ids={list(ids)}: {bad} outside the "
                              f"vocabulary [0, {model_cfg.vocab_size})")
        return ids
    ids = {int(t) for t in model_cfg.eos_token_ids}
    if tokenizer is not None:  # None: an abstract build (config.json only)
        ids.add(int(tokenizer.eos_token_id))
    return tuple(sorted(ids))


def pad_token_id(tokenizer, model_cfg=None) -> int:
    """The tokenizer's pad id, else its EOS id; masks never rely on token equality. Without a
    tokenizer (an abstract build): the model config's pad id, else its first EOS id, else 0."""
    if tokenizer is None:
        pad, eos = model_cfg.pad_token_id, tuple(model_cfg.eos_token_ids)
        return int(pad if pad is not None else eos[0] if eos else 0)
    return int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)


def build_prompts(cfg: Config, tokenizer, model_cfg, *, path: str | None = None,
                  key: str = "data.prompts", max_new_tokens: int | None = None,
                  new_tokens_key: str = "generation.max_new_tokens") -> PromptSet:
    """Read, template and tokenise a prompt set, `data.prompts` by default; `path` and `key`
    name another, such as `eval.prompts`, which is tokenised with the same data.* settings. Checks
    that the prompts fit the context with `max_new_tokens` (default: generation's).

    Raises:
      FileNotFoundError / ValueError: an unreadable or malformed prompt file, naming `key`; with
        `env.name`, an unknown environment or bad episode prompts.
      ConfigError: prompt width + max_new_tokens exceeds the model's context (naming
        `new_tokens_key`), or the tokenizer gives prompt or pad ids outside the vocabulary.
    """
    d = cfg.data
    texts, rows = prompt_records(cfg, d.prompts if path is None else path, key)
    if cfg.env.name:  # the first observation of each episode: the prompt and its instruction
        env = build_environment(cfg.env.name, cfg.env.kwargs, timeout_s=cfg.env.timeout_s)
        texts, rows = episode_prompts(env, texts, rows, key, timeout_s=cfg.env.timeout_s,
                                      concurrency=cfg.env.concurrency)
    prompts = tokenize_prompts(texts, tokenizer, max_prompt_length=d.max_prompt_length,
                               truncation=d.truncation, use_chat_template=d.use_chat_template,
                               system_prompt=d.system_prompt, pad_token_id=pad_token_id(tokenizer),
                               response_prefix=d.response_prefix, rows=rows)
    pad = pad_token_id(tokenizer)
    if not 0 <= pad < model_cfg.vocab_size:
        raise ConfigError(f"the tokenizer's pad id {pad} is outside the model vocabulary "
                          f"[0, {model_cfg.vocab_size})")
    real = prompts.ids[prompts.mask > 0]
    if real.size and real.max() >= model_cfg.vocab_size:
        row = int(np.argwhere((prompts.ids >= model_cfg.vocab_size) & (prompts.mask > 0))[0, 0])
        raise ConfigError(f"{key}: prompt {row} ({texts[row][:40]!r}) has token id "
                          f"{int(real.max())} >= the model vocab_size {model_cfg.vocab_size}: "
                          "tokenizer and model do not match")
    new_tokens = cfg.generation.max_new_tokens if max_new_tokens is None else max_new_tokens
    total = prompts.ids.shape[1] + new_tokens
    if total > model_cfg.max_position_embeddings:
        raise ConfigError(
            f"{key}: prompt width {prompts.ids.shape[1]} + {new_tokens_key}={new_tokens} = "
            f"{total} exceeds the model context {model_cfg.max_position_embeddings}")
    return prompts


def prompt_set(cfg: Config, tokenizer, model_cfg, path: str, key: str, *, abstract: bool = False,
               new_tokens: int | None = None, rows: int = 0,
               new_tokens_key: str = "generation.max_new_tokens") -> PromptSet:
    """The tokenised prompt file `path`. In an abstract build (`train.py --compile-for`):
    `rows` prompts (default one batch) `data.max_prompt_length` wide, checked against the context.

    Raises:
      ConfigError / FileNotFoundError / ValueError: as `build_prompts`.
    """
    if not abstract:
        return build_prompts(cfg, tokenizer, model_cfg, path=path, key=key,
                             max_new_tokens=new_tokens, new_tokens_key=new_tokens_key)
    width, new = cfg.data.max_prompt_length, new_tokens or cfg.generation.max_new_tokens
    if width + new > model_cfg.max_position_embeddings:
        raise ConfigError(f"{key}: data.max_prompt_length={width} + {new_tokens_key}={new} "
                          f"exceeds the model context {model_cfg.max_position_embeddings}")
    return abstract_prompts(rows or cfg.ppo.batch_size, width)
