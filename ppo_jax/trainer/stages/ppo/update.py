"""The PPO update phase: `ppo_epochs` x minibatches of actor and critic steps, one pure function.

Built from nested `lax.scan`s (purejaxrl's shape): epochs -> minibatches (a fresh permutation
per epoch, reshaped into `[n_minibatches, mini_batch_size]`) -> micro-batches (gradient
accumulation). Actor and critic have separate train states and optimisers (DeepSpeed-Chat
step 3).

Losses: each micro-batch becomes one `LossInputs` (masked slots zeroed); the registered policy
loss returns a per-token loss, to which the built-in terms are added (`ppo.entropy_coef`,
`ppo.kl_loss_coef`; `core.policy_regularizers`); the sum is reduced ONCE by
`ppo.loss_aggregation` with the normalisers of the whole minibatch (`core.aggregation`), so
the accumulated gradients and stats equal those of the whole minibatch at once in every mode,
never means of means. Stats: each loss term's aggregate (`pg_loss`, `entropy_loss`, `kl_loss`,
`vf_loss`; 0 for a term that is off) and each per-token stat's minibatch token mean.
With `ppo.rollout_correction` "tis" / "mis" the registered loss's per-token `pg_loss` (not the
built-in terms) is multiplied by `core.rollout_correction_weights` (old vs the sampler's
log-probs), whose `rollout_correction/*` stats are minibatch-exact too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from ppo_jax.core import (
    LossInputs,
    aggregate,
    check_rollout_correction,
    get_policy_loss,
    get_value_loss,
    loss_normalizers,
    masked_inputs,
    policy_regularizers,
    reduce_loss,
    rollout_correction_weights,
)
from ppo_jax.parallel import shard_rows_tree
from ppo_jax.rollout.experience import Experience
from ppo_jax.rollout.forward import critic_values, policy_logprobs, policy_logprobs_and_values
from ppo_jax.trainer.accumulate import accumulate_gradients
from ppo_jax.trainer.state import over_trained


@dataclass(frozen=True)
class UpdateSettings:
    """Static settings of the update (hashable). The defaults are the config's (`ppo.*`,
    configs/default.yaml; tests/trainer/test_ppo_settings.py holds them equal); the trainer
    builds them from a run's config (`stages.ppo.settings.settings_for`)."""

    ppo_epochs: int = 2
    mini_batch_size: int = 8
    micro_batch_size: int = 8
    temperature: float = 1.0
    policy_loss: str = "ppo_clip"
    value_loss: str = "clipped_mse"
    cliprange: float = 0.2
    cliprange_high: Optional[float] = None
    dual_clip: Optional[float] = None
    cliprange_value: float = 0.2
    policy_loss_kwargs: tuple = ()  # extra (name, value) keyword arguments of the losses
    value_loss_kwargs: tuple = ()
    loss_aggregation: str = "token-mean"  # core.LOSS_AGGREGATIONS (policy and value losses)
    entropy_coef: float = 0.0  # per-token -entropy_coef * entropy added to the policy loss
    kl_loss_coef: float = 0.0  # per-token kl_loss_coef * KL(pi || ref) added to the policy loss
    kl_loss_estimator: str = "low_var_kl"  # core.KL_ESTIMATORS
    shared_critic: bool = False  # a CausalLMWithValueHead actor; loss = pg + vf_coef * vf
    vf_coef: float = 0.1
    mesh: Optional[Mesh] = None  # split minibatch / micro-batch rows over ("data", "fsdp")
    train_actor: bool = True  # False: critic-only update (ppo.critic_warmup_steps)
    # vocabulary columns per block of the log-prob / entropy head, forward and backward
    # (forward.head_logprobs); 0: the full [B, N, V] logits
    logprob_chunk_size: int = 0
    # the longest response the sampler may give (generation.max_new_tokens): seq-mean-token-sum's
    # constant T; None: the experience's response width (as ExperienceSettings' field). Pinned so
    # that cutting all-pad response columns (trainer.stages.ppo.columns) changes no loss.
    max_response_length: Optional[int] = None
    # core.ROLLOUT_CORRECTIONS: weights on pg_loss for the sampler / trainer log-prob mismatch
    rollout_correction: str = "none"
    rollout_correction_cap: float = 2.0  # C of tis (truncation) and mis (rejection)

    def policy_fixed_kwargs(self) -> dict:
        """The trainer's own keyword arguments of a policy-loss call."""
        kw = {"cliprange": self.cliprange}
        if self.cliprange_high is not None:
            kw["cliprange_high"] = self.cliprange_high
        if self.dual_clip is not None:
            kw["dual_clip"] = self.dual_clip
        return kw

    def policy_kwargs(self) -> dict:
        """Keyword arguments of every policy-loss call `fn(batch, **kwargs)`."""
        return {**self.policy_fixed_kwargs(), **dict(self.policy_loss_kwargs)}

    def value_kwargs(self) -> dict:
        """Keyword arguments of every value-loss call `fn(batch, **kwargs)`."""
        return {"cliprange_value": self.cliprange_value, **dict(self.value_loss_kwargs)}


def loss_inputs(m: Experience, group_ids: jax.Array, **new) -> LossInputs:
    """The `LossInputs` of micro-batch `m` plus this pass's outputs `new` (logprobs, entropy,
    values), masked slots zeroed (`core.masked_inputs`). The mask is the action mask: a
    multi-turn response's observation tokens are in no loss and no normaliser."""
    return masked_inputs(LossInputs(
        mask=m.action_mask, old_logprobs=m.logprobs, ref_logprobs=m.ref_logprobs,
        advantages=m.advantages, old_values=m.values, returns=m.returns, group_ids=group_ids,
        rollout_logprobs=m.rollout_logprobs, **new))


def policy_objective(batch: LossInputs, norms, s: UpdateSettings):
    """`(loss, stats)` of the actor: registered policy loss + built-in terms, one reduction.

    Stats: `pg_loss`, `entropy_loss`, `kl_loss` (each term's aggregate, 0 when off; they add up
    to the loss), the loss's per-token stats as token means, and `entropy` (token mean); with a
    rollout correction, `pg_loss` is the weighted term and `rollout_correction/*` its stats.
    """
    per_token, stats = get_policy_loss(s.policy_loss)(batch, **s.policy_kwargs())
    correction = {}
    if s.rollout_correction != "none":  # "none": the loss exactly as without the feature
        weights, correction = rollout_correction_weights(
            batch.old_logprobs, batch.rollout_logprobs, batch.mask, mode=s.rollout_correction,
            cap=s.rollout_correction_cap, normalizers=norms)
        per_token = per_token * weights
    terms = {"pg_loss": per_token, **policy_regularizers(
        batch, entropy_coef=s.entropy_coef, kl_loss_coef=s.kl_loss_coef,
        kl_loss_estimator=s.kl_loss_estimator)}
    loss, out = reduce_loss(terms, stats, batch.mask, s.loss_aggregation, norms)
    zero = jnp.zeros((), loss.dtype)
    out = {"entropy_loss": zero, "kl_loss": zero, **out, **correction}
    # token mean over the minibatch (TRL's ppo/policy/entropy); the experience's `entropy` is
    # the mean per-response sum (TRL's objective/entropy) and must not be overwritten by it
    out["policy_entropy"] = aggregate(jax.lax.stop_gradient(batch.entropy), batch.mask, "token-mean", norms)
    return loss, out


def value_objective(batch: LossInputs, norms, s: UpdateSettings):
    """`(loss, stats)` of the critic: registered value loss, one reduction (`vf_loss` and the
    loss's per-token stats as token means)."""
    per_token, stats = get_value_loss(s.value_loss)(batch, **s.value_kwargs())
    return reduce_loss({"vf_loss": per_token}, stats, batch.mask, s.loss_aggregation, norms)


def loss_functions(s: UpdateSettings, actor_graphdef, critic_graphdef, frozen=None):
    """`(actor_loss, critic_loss, joint_loss)`, each `fn(params, (m, group_ids), norms) ->
    (loss, stats)` on one micro-batch `m` with the whole minibatch's `norms`. `params` are the
    trained params; `frozen["actor" | "critic"]` the frozen rest of each model (a LoRA
    model's base; `{}` or None: none), joined to them in the forward pass
    (`trainer.state.over_trained`), never differentiated.

    Raises:
      ValueError: an unknown policy / value loss name or rollout correction; a bad cap.
    """
    get_policy_loss(s.policy_loss), get_value_loss(s.value_loss)  # unknown names fail here
    check_rollout_correction(s.rollout_correction, s.rollout_correction_cap)
    frozen = frozen or {}
    actor_base, critic_base = frozen.get("actor", {}), frozen.get("critic", {})

    def actor_loss(params, mb, norms):
        m, g = mb
        rollout = (m.query_ids, m.query_mask, m.response_ids, m.response_mask)
        logprobs, entropy = policy_logprobs(actor_graphdef, params, *rollout,
                                            temperature=s.temperature, with_entropy=True,
                                            logprob_chunk_size=s.logprob_chunk_size, mesh=s.mesh)
        return policy_objective(loss_inputs(m, g, logprobs=logprobs, entropy=entropy), norms, s)

    def critic_loss(params, mb, norms):
        m, g = mb
        rollout = (m.query_ids, m.query_mask, m.response_ids, m.response_mask)
        values = critic_values(critic_graphdef, params, *rollout)
        return value_objective(loss_inputs(m, g, values=values), norms, s)

    def joint_loss(params, mb, norms):
        """pg_loss + vf_coef * vf_loss of the shared policy/value model (TRL 0.11)."""
        m, g = mb
        rollout = (m.query_ids, m.query_mask, m.response_ids, m.response_mask)
        logprobs, entropy, values = policy_logprobs_and_values(
            actor_graphdef, params, *rollout, temperature=s.temperature,
            logprob_chunk_size=s.logprob_chunk_size, mesh=s.mesh)
        batch = loss_inputs(m, g, logprobs=logprobs, entropy=entropy, values=values)
        pg, p_stats = policy_objective(batch, norms, s)
        vf, v_stats = value_objective(batch, norms, s)
        return pg + s.vf_coef * vf, {**p_stats, **v_stats}

    return (over_trained(actor_loss, actor_base), over_trained(critic_loss, critic_base),
            over_trained(joint_loss, actor_base))


def ppo_update(actor_state, critic_state, exp: Experience, rng, *, actor_graphdef, critic_graphdef,
               actor_tx: optax.GradientTransformation, critic_tx: optax.GradientTransformation,
               settings: UpdateSettings, frozen=None):
    """Run the whole PPO update on one batch of experience.

    Args:
      actor_state, critic_state: `TrainState`s. With `settings.shared_critic` the actor state
        holds a `CausalLMWithValueHead`'s params, trained on `pg_loss + vf_coef * vf_loss` (TRL
        0.11 `PPOTrainer.loss`), and `critic_state` / `critic_graphdef` / `critic_tx` are None.
      exp: `Experience` with batch B (a multiple of mini_batch_size); its rows' group ids are
        `exp.group_ids` when it has that field, else `arange(B)` (every row its own group).
      rng: PRNG key for the per-epoch permutations.
      actor_graphdef, critic_graphdef, actor_tx, critic_tx, settings: static.
      frozen: `{"actor": ..., "critic": ...}`, the frozen params of each model (a LoRA model's
        base: the train states hold only adapters and heads), or None.

    Returns:
      `(actor_state, critic_state, stats)`; every stat has shape `[ppo_epochs, n_minibatches]`
      (with `settings.train_actor=False` the actor state is returned unchanged and only the
      critic's stats are reported)
      (one value per optimiser step; `stats[k][0, 0]` is the first minibatch of the first epoch).

    Raises:
      ValueError: batch sizes that do not divide, or a critic-only update of a shared critic;
        unknown loss names; an unknown rollout correction or a bad cap.
    """
    s = settings
    if s.shared_critic and not s.train_actor:
        raise ValueError("a critic-only update (train_actor=False) needs a separate critic")
    batch = exp.response_ids.shape[0]
    if batch % s.mini_batch_size or s.mini_batch_size % s.micro_batch_size:
        raise ValueError(f"batch {batch}, ppo.mini_batch_size={s.mini_batch_size} and "
                         f"ppo.micro_batch_size={s.micro_batch_size} must divide each other")
    n_mb = batch // s.mini_batch_size
    actor_loss, critic_loss, joint_loss = loss_functions(s, actor_graphdef, critic_graphdef, frozen)
    data = (exp, exp.group_ids)

    def accumulate(loss_fn, params, mb, norms):
        """Sum of micro-batch gradients and stats (each exact under the minibatch's norms)."""
        return accumulate_gradients(lambda p, m: loss_fn(p, m, norms), params, mb,
                                    micro_batch_size=s.micro_batch_size, mesh=s.mesh)

    def minibatch_step(carry, idx):
        a_state, c_state = carry
        mb = shard_rows_tree(jax.tree.map(lambda x: x[idx], data), s.mesh)
        norms = loss_normalizers(mb[0].action_mask, s.max_response_length)
        a_stats = {}
        if s.train_actor:
            a_grads, a_stats = accumulate(joint_loss if s.shared_critic else actor_loss,
                                          a_state.params, mb, norms)
            a_stats["actor_grad_norm"] = optax.global_norm(a_grads)
            a_state = a_state.apply_gradients(a_grads, actor_tx)
        if s.shared_critic or c_state is None:  # value head on the actor, or no critic at all
            return (a_state, c_state), a_stats
        c_grads, c_stats = accumulate(critic_loss, c_state.params, mb, norms)
        c_stats["critic_grad_norm"] = optax.global_norm(c_grads)
        c_state = c_state.apply_gradients(c_grads, critic_tx)
        return (a_state, c_state), {**a_stats, **c_stats}

    def epoch_step(carry, key):
        perm = jax.random.permutation(key, batch)
        return jax.lax.scan(minibatch_step, carry, perm.reshape(n_mb, s.mini_batch_size))

    keys = jax.random.split(rng, s.ppo_epochs)
    (actor_state, critic_state), stats = jax.lax.scan(epoch_step, (actor_state, critic_state), keys)
    return actor_state, critic_state, stats
