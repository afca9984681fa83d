"""ppo_jax.core: the pure, jit-able math of PPO for language models.

Rewards, KL, GAE, reward shaping, per-token losses (PPO, GSPO, GSPO-token, GMPO, CISPO, SAPO,
Clip-Cov, KL-Cov; SFT next-token NLL; Bradley-Terry)
and their one reduction (loss aggregation), DAPO's overlong penalty and dynamic-sampling group
selection, masked statistics, KL controllers, name registries, the rollout / trainer
log-prob mismatch (measured, and corrected by importance weights), and the staleness of
asynchronous rollouts. Every function works on ``[B, T]`` response-token arrays with a 0/1
``mask`` (1 on real tokens up to and including EOS) or on their ``[B]`` rows, is NaN-safe on
masked slots, and validates shapes and dtypes at trace time (``ValueError`` naming the
argument). Imports only jax / chex / numpy.
"""

from ppo_jax.core.actions import action_order, compact_actions, expand_actions
from ppo_jax.core.aggregation import (
    LOSS_AGGREGATIONS,
    Normalizers,
    aggregate,
    check_aggregation,
    loss_normalizers,
    reduce_loss,
    token_mean_stats,
)
from ppo_jax.core.gae import GAE_METHODS, compute_gae
from ppo_jax.core.decoupled_gae import decoupled_gae, length_adaptive_lam
from ppo_jax.core import estimators, outcome  # registers the advantage estimators
from ppo_jax.core.estimators import needs_greedy_baseline, needs_groups, uses_critic
from ppo_jax.core.outcome import group_baseline_explained_variance
from ppo_jax.core.kl import KL_ESTIMATORS, check_estimator, full_kl, kl_penalty, sequence_kl
from ppo_jax.core.kl_control import (
    KL_CONTROLLER_KINDS,
    KLControllerState,
    init_kl_controller,
    update_kl_controller,
)
from ppo_jax.core.logprobs import entropy_from_logits, logprobs_from_logits
from ppo_jax.core.chunked_logprobs import chunked_logprobs_and_entropy
from ppo_jax.core.loss_inputs import LossInputs, masked_inputs
from ppo_jax.core.losses import (
    clipped_value_loss,
    policy_loss,
    policy_regularizers,
    ppo_clip_loss,
    value_loss,
)
from ppo_jax.core.preference import bradley_terry_loss
from ppo_jax.core.supervised import nll_loss, shift_for_next_token
from ppo_jax.core.masked import (
    explained_variance,
    masked_count,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    safe_divide,
)
from ppo_jax.core.registry import (
    Registry,
    get_advantage_estimator,
    get_policy_loss,
    get_reward_shaping,
    get_value_loss,
    register_advantage_estimator,
    register_policy_loss,
    register_reward_shaping,
    register_value_loss,
    registered_names,
    unregister,
)
from ppo_jax.core.rollout_correction import (
    ICEPOP_BAND,
    ROLLOUT_CORRECTIONS,
    check_rollout_correction,
    rollout_correction_weights,
    rollout_mismatch,
)
from ppo_jax.core.rewards import (
    compute_rewards, compute_rewards_from_kl, ended_rows, last_valid_onehot,
)
from ppo_jax.core.sequence_losses import gmpo_loss, gspo_loss, gspo_token_loss, sequence_log_ratio
from ppo_jax.core.token_losses import cispo_loss, sapo_loss
from ppo_jax.core.covariance_losses import clip_cov_loss, kl_cov_loss, token_covariance
from ppo_jax.core.loss_kwargs import LossKwargError, check_loss_kwargs, reads_cliprange
from ppo_jax.core.staleness import sample_staleness, staleness_metrics
from ppo_jax.core.shaping import kl_penalty_shaping
from ppo_jax.core.dapo import group_rows, informative_groups, overlong_penalty, select_groups

__all__ = [
    "estimators",
    "outcome",
    "GAE_METHODS",
    "KLControllerState",
    "KL_CONTROLLER_KINDS",
    "ICEPOP_BAND",
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "LossInputs",
    "LossKwargError",
    "Normalizers",
    "ROLLOUT_CORRECTIONS",
    "Registry",
    "action_order",
    "aggregate",
    "bradley_terry_loss",
    "check_aggregation",
    "check_estimator",
    "check_loss_kwargs",
    "cispo_loss",
    "clip_cov_loss",
    "check_rollout_correction",
    "chunked_logprobs_and_entropy",
    "clipped_value_loss",
    "compact_actions",
    "compute_gae",
    "compute_rewards",
    "compute_rewards_from_kl",
    "decoupled_gae",
    "entropy_from_logits",
    "expand_actions",
    "explained_variance",
    "full_kl",
    "get_advantage_estimator",
    "get_policy_loss",
    "get_reward_shaping",
    "get_value_loss",
    "gmpo_loss",
    "group_baseline_explained_variance",
    "group_rows",
    "gspo_loss",
    "gspo_token_loss",
    "informative_groups",
    "init_kl_controller",
    "kl_penalty",
    "kl_cov_loss",
    "kl_penalty_shaping",
    "sequence_kl",
    "ended_rows",
    "last_valid_onehot",
    "length_adaptive_lam",
    "logprobs_from_logits",
    "loss_normalizers",
    "masked_count",
    "masked_inputs",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "needs_greedy_baseline",
    "needs_groups",
    "nll_loss",
    "overlong_penalty",
    "policy_loss",
    "policy_regularizers",
    "ppo_clip_loss",
    "reads_cliprange",
    "reduce_loss",
    "register_advantage_estimator",
    "register_policy_loss",
    "register_reward_shaping",
    "register_value_loss",
    "registered_names",
    "rollout_correction_weights",
    "rollout_mismatch",
    "safe_divide",
    "sapo_loss",
    "sample_staleness",
    "select_groups",
    "sequence_log_ratio",
    "shift_for_next_token",
    "staleness_metrics",
    "token_covariance",
    "token_mean_stats",
    "unregister",
    "update_kl_controller",
    "uses_critic",
    "value_loss",
]
