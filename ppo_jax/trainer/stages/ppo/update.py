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
With `ppo.rollout_correction` "tis" / "mis" / "icepop" the registered loss's per-token `pg_loss` (not the
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
    get_policy_loss,
    get_value_loss,
    loss_normalizers,
    masked_inputs,
    policy_regularizers,
    reduce_loss,
    rollout_correction_weights,
)
from ppo_jax.parallel import shard_rows_tree
from ppo_jax.trainer.stages.ppo.experience import Experience
from ppo_jax.rollout.forward import critic_values, policy_logprobs, policy_logprobs_and_values
from ppo_jax.trainer.accumulate import accumulate_gradients
from ppo_jax.trainer.state import loss_of_trained


@dataclass(frozen=True)
class UpdateSettings:
    """Static settings of the update, hashable, built by `stages.ppo.settings.update_settings`.

    Most fields are the `ppo.*` keys of the same name; `*_kwargs` are `(name, value)` tuples.
    temperature: `generation.temperature`. logprob_chunk_size: `model.logprob_chunk_size`.
    shared_critic: the actor is a `CausalLMWithValueHead` trained on pg + vf_coef * vf.
    mesh: splits the rows of minibatches and micro-batches over the "data" and "fsdp" axes.
    train_actor: False in the critic warm-up's update.
    max_response_length: `generation.max_new_tokens`, the constant T of seq-mean-token-sum.
      It is pinned so that cutting all-pad response columns changes no loss; None uses the
      response width.
    rollout_correction_band: `(ppo.rollout_correction_band_low, ppo.rollout_correction_band_high)`,
      icepop's band.
    router_aux_loss_coef: the weight of an MoE actor's load-balancing loss in its loss
      (`model.router_aux_loss_coef`, else the checkpoint's); 0 for a dense actor."""

    ppo_epochs: int
    mini_batch_size: int
    micro_batch_size: int
    temperature: float
    policy_loss: str
    value_loss: str
    cliprange: float
    cliprange_high: Optional[float]
    dual_clip: Optional[float]
    cliprange_value: float
    policy_loss_kwargs: tuple
    value_loss_kwargs: tuple
    loss_aggregation: str
    entropy_coef: float
    kl_loss_coef: float
    kl_loss_estimator: str
    shared_critic: bool
    vf_coef: float
    mesh: Optional[Mesh]
    train_actor: bool
    logprob_chunk_size: int
    max_response_length: Optional[int]
    rollout_correction: str
    rollout_correction_cap: float
    rollout_correction_band: tuple
    router_aux_loss_coef: float

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
            cap=s.rollout_correction_cap, band=s.rollout_correction_band, normalizers=norms)
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


def with_router_aux(loss, stats, aux, m: Experience, s: UpdateSettings):
    """`loss + router_aux_loss_coef * aux`, with `router_aux_loss` among the stats. The aux
    loss of micro-batch `m` is a mean over its tokens, so it is weighted by the micro-batch's
    share of the minibatch's rows (those with a prompt: a token-budget micro-batch's absent
    places have none): the accumulated sum is the mean over micro-batches. A dense actor
    (coefficient 0) gets neither term nor stat."""
    rows = jnp.sum(jnp.any(m.query_mask != 0, axis=1), dtype=jnp.float32)
    if not s.router_aux_loss_coef:
        return loss, stats
    aux = aux * (rows / s.mini_batch_size)
    return loss + s.router_aux_loss_coef * aux, {**stats, "router_aux_loss": aux}


def loss_functions(s: UpdateSettings, actor_graphdef, critic_graphdef, frozen=None):
    """`(actor_loss, critic_loss, joint_loss)`, each `fn(params, mb, norms) -> (loss, stats)`
    on one micro-batch `mb = ((m, group_ids), packing)` with the whole minibatch's `norms`;
    `packing` is None or the micro-batch's `rollout.packing.PackedRows`.

    `params` are the trained params. `frozen["actor"]` and `frozen["critic"]` hold the frozen
    rest of each model, a LoRA model's base; `{}` or None holds none. The frozen part joins the
    params in the forward pass and is never differentiated. The loss names were checked when
    the config loaded."""
    frozen = frozen or {}
    actor_base, critic_base = frozen.get("actor", {}), frozen.get("critic", {})

    def actor_loss(params, mb, norms):
        (m, g), packing = mb
        rollout = (m.query_ids, m.query_mask, m.response_ids, m.response_mask)
        logprobs, entropy, aux = policy_logprobs(
            actor_graphdef, params, *rollout, temperature=s.temperature, with_entropy=True,
            logprob_chunk_size=s.logprob_chunk_size, mesh=s.mesh, routes=m.routes,
            with_aux=True, packing=packing)
        loss, stats = policy_objective(loss_inputs(m, g, logprobs=logprobs, entropy=entropy),
                                       norms, s)
        return with_router_aux(loss, stats, aux, m, s)

    def critic_loss(params, mb, norms):
        (m, g), packing = mb
        rollout = (m.query_ids, m.query_mask, m.response_ids, m.response_mask)
        values = critic_values(critic_graphdef, params, *rollout, mesh=s.mesh, packing=packing)
        return value_objective(loss_inputs(m, g, values=values), norms, s)

    def joint_loss(params, mb, norms):
        """pg_loss + vf_coef * vf_loss of the shared policy/value model (TRL 0.11)."""
        (m, g), packing = mb
        rollout = (m.query_ids, m.query_mask, m.response_ids, m.response_mask)
        logprobs, entropy, values, aux = policy_logprobs_and_values(
            actor_graphdef, params, *rollout, temperature=s.temperature,
            logprob_chunk_size=s.logprob_chunk_size, mesh=s.mesh, routes=m.routes,
            with_aux=True, packing=packing)
        batch = loss_inputs(m, g, logprobs=logprobs, entropy=entropy, values=values)
        pg, p_stats = policy_objective(batch, norms, s)
        vf, v_stats = value_objective(batch, norms, s)
        return with_router_aux(pg + s.vf_coef * vf, {**p_stats, **v_stats}, aux, m, s)

    return (loss_of_trained(actor_loss, actor_base), loss_of_trained(critic_loss, critic_base),
            loss_of_trained(joint_loss, actor_base))


def budget_micro_batches(mb, micro: jax.Array):
    """A minibatch `(exp, group_ids)` of M rows -> its token-budget micro-batches' rows in a
    row, `[n_micro * K]`: row `micro[j, i]` at place `(j, i)` (`rollout.packing.
    plan_token_budget`); an absent place (index M) is row 0 with its masks zeroed, so it is in
    no loss, stat or packed row."""
    exp, group_ids = mb
    idx = micro.reshape(-1)
    present = (idx < group_ids.shape[0])[:, None]
    take = jnp.minimum(idx, group_ids.shape[0] - 1)
    exp, group_ids = jax.tree.map(lambda x: x[take], (exp, group_ids))
    masks = {k: jnp.where(present, getattr(exp, k), 0)
             for k in ("query_mask", "response_mask", "action_mask")}
    return exp.replace(**masks), group_ids


def epoch_permutations(rng, ppo_epochs: int, batch: int) -> jax.Array:
    """`[ppo_epochs, batch]` int32: each epoch's order of the rows (a fresh permutation per
    epoch), the one `ppo_update` takes its minibatches in; the host plans packing from it."""
    return jax.vmap(lambda k: jax.random.permutation(k, batch))(
        jax.random.split(rng, ppo_epochs))


def ppo_update(actor_state, critic_state, frozen, exp: Experience, rng, packing=None, *,
               actor_graphdef, critic_graphdef, actor_tx: optax.GradientTransformation,
               critic_tx: optax.GradientTransformation, settings: UpdateSettings):
    """The whole PPO update on one batch of experience: the step's jitted update program.

    Args:
      actor_state, critic_state: `TrainState`s. With `settings.shared_critic` the actor state
        holds a `CausalLMWithValueHead`'s params, trained on `pg_loss + vf_coef * vf_loss` (TRL
        0.11 `PPOTrainer.loss`), and `critic_state` / `critic_graphdef` / `critic_tx` are None;
        so are they without a critic (a critic-free estimator).
      frozen: `{"actor": ..., "critic": ...}`, the frozen params of each model (a LoRA model's
        base: the train states hold only adapters and heads), or None.
      exp: `Experience` of B rows; B a multiple of `mini_batch_size`, itself a multiple of
        `micro_batch_size` (the config's checks).
      rng: PRNG key of the per-epoch permutations (`epoch_permutations`).
      packing: None (padded rows), or a `rollout.packing.PackedBatch`
        (`stages.ppo.packing.Packer.update`): each epoch's row order (the permutation of
        `rng`, each minibatch's rows rearranged among its micro-batches), every micro-batch's
        packed rows and, with `ppo.micro_batch_tokens`, each micro-batch's rows of its
        minibatch (`budget_micro_batches`); the forward and backward passes run over packed
        rows, with the same minibatches, losses, gradients and stats.
      actor_graphdef, critic_graphdef, actor_tx, critic_tx, settings: static.

    Returns:
      `(actor_state, critic_state, stats)`; every stat is `[ppo_epochs, n_minibatches]`, one
      value per optimiser step. With `settings.train_actor=False` the actor state comes back
      unchanged and only the critic's stats are reported.
    """
    s = settings
    batch = exp.response_ids.shape[0]
    n_mb = batch // s.mini_batch_size
    actor_loss, critic_loss, joint_loss = loss_functions(s, actor_graphdef, critic_graphdef, frozen)
    data = (exp, exp.group_ids)

    def accumulate(loss_fn, params, mb, norms, plan, micro):
        """Sum of micro-batch gradients and stats (each exact under the minibatch's norms)."""
        if plan is None:
            return accumulate_gradients(lambda p, m: loss_fn(p, (m, None), norms), params, mb,
                                        micro_batch_size=s.micro_batch_size, mesh=s.mesh)
        size = s.micro_batch_size
        if micro is not None:  # token budget: each micro-batch's places, gathered in a row
            mb, size = budget_micro_batches(mb, micro), micro.shape[-1]
        return accumulate_gradients(lambda p, m: loss_fn(p, m, norms), params, mb,
                                    micro_batch_size=size, mesh=s.mesh, per_micro=plan)

    def minibatch_step(carry, xs):
        (a_state, c_state), (idx, plan, micro) = carry, xs
        mb = shard_rows_tree(jax.tree.map(lambda x: x[idx], data), s.mesh)
        norms = loss_normalizers(mb[0].action_mask, s.max_response_length)
        a_stats = {}
        if s.train_actor:
            a_grads, a_stats = accumulate(joint_loss if s.shared_critic else actor_loss,
                                          a_state.params, mb, norms, plan, micro)
            a_stats["actor_grad_norm"] = optax.global_norm(a_grads)
            a_state = a_state.apply_gradients(a_grads, actor_tx)
        if s.shared_critic or c_state is None:  # value head on the actor, or no critic at all
            return (a_state, c_state), a_stats
        c_grads, c_stats = accumulate(critic_loss, c_state.params, mb, norms, plan, micro)
        c_stats["critic_grad_norm"] = optax.global_norm(c_grads)
        c_state = c_state.apply_gradients(c_grads, critic_tx)
        return (a_state, c_state), {**a_stats, **c_stats}

    def epoch_step(carry, xs):
        perm, plan, micro = xs
        return jax.lax.scan(minibatch_step, carry,
                            (perm.reshape(n_mb, s.mini_batch_size), plan, micro))

    if packing is None:
        xs = (epoch_permutations(rng, s.ppo_epochs, batch), None, None)
    else:
        xs = (packing.order, packing.rows, packing.micro)
    (actor_state, critic_state), stats = jax.lax.scan(epoch_step, (actor_state, critic_state), xs)
    return actor_state, critic_state, stats
