"""The PPO update phase: `ppo_epochs` x minibatches of actor and critic steps, one pure function.

Built from nested `lax.scan`s (purejaxrl's shape): epochs -> minibatches (a fresh permutation
per epoch, reshaped into `[n_minibatches, mini_batch_size]`) -> micro-batches (gradient
accumulation). Each micro-batch loss is a token SUM divided by the minibatch's total token
count, so the accumulated gradient and stats are exact minibatch token means, not means of
means. Actor and critic have separate train states and optimisers
(DeepSpeed-Chat step 3).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from ppo_jax.core import get_policy_loss, get_value_loss, masked_sum
from ppo_jax.parallel import shard_rows_tree
from ppo_jax.rollout.experience import Experience
from ppo_jax.rollout.scoring import critic_values, policy_logprobs, policy_logprobs_and_values
from ppo_jax.trainer.accumulate import accumulate_gradients


@dataclass(frozen=True)
class UpdateSettings:
    """Static settings of the update (hashable)."""

    ppo_epochs: int = 4
    mini_batch_size: int = 4
    micro_batch_size: int = 4
    temperature: float = 1.0
    policy_loss: str = "ppo_clip"
    value_loss: str = "clipped_mse"
    cliprange: float = 0.2
    cliprange_high: Optional[float] = None
    dual_clip: Optional[float] = None
    cliprange_value: float = 0.2
    policy_loss_kwargs: tuple = ()  # extra (name, value) keyword arguments of the losses
    value_loss_kwargs: tuple = ()
    shared_critic: bool = False  # one state {"policy", "value_head"}; loss = pg + vf_coef * vf
    vf_coef: float = 0.1
    mesh: Optional[Mesh] = None  # split minibatch / micro-batch rows over ("data", "fsdp")
    train_actor: bool = True  # False: critic-only update (ppo.critic_warmup_steps)

    def policy_fixed_kwargs(self) -> dict:
        """The trainer's own keyword arguments of a policy-loss call (besides loss_normalizer)."""
        kw = {"cliprange": self.cliprange}
        if self.cliprange_high is not None:
            kw["cliprange_high"] = self.cliprange_high
        if self.dual_clip is not None:
            kw["dual_clip"] = self.dual_clip
        return kw

    def policy_kwargs(self) -> dict:
        """Keyword arguments of every policy-loss call besides `loss_normalizer`."""
        return {**self.policy_fixed_kwargs(), **dict(self.policy_loss_kwargs)}

    def value_kwargs(self) -> dict:
        """Keyword arguments of every value-loss call besides `loss_normalizer`."""
        return {"cliprange_value": self.cliprange_value, **dict(self.value_loss_kwargs)}


def ppo_update(actor_state, critic_state, exp: Experience, rng, *, actor_graphdef, critic_graphdef,
               actor_tx: optax.GradientTransformation, critic_tx: optax.GradientTransformation,
               settings: UpdateSettings):
    """Run the whole PPO update on one batch of experience.

    Args:
      actor_state, critic_state: `TrainState`s. With `settings.shared_critic` the actor state
        holds `{"policy", "value_head"}` params, trained on `pg_loss + vf_coef * vf_loss` (TRL
        0.11 `PPOTrainer.loss`), and `critic_state` / `critic_graphdef` / `critic_tx` are None.
      exp: `Experience` with batch B (a multiple of mini_batch_size).
      rng: PRNG key for the per-epoch permutations.
      actor_graphdef, critic_graphdef, actor_tx, critic_tx, settings: static.

    Returns:
      `(actor_state, critic_state, stats)`; every stat has shape `[ppo_epochs, n_minibatches]`
      (with `settings.train_actor=False` the actor state is returned unchanged and only the
      critic's stats are reported)
      (one value per optimiser step; `stats[k][0, 0]` is the first minibatch of the first epoch).

    Raises:
      ValueError: batch sizes that do not divide, or a critic-only update of a shared critic.
    """
    s = settings
    if s.shared_critic and not s.train_actor:
        raise ValueError("a critic-only update (train_actor=False) needs a separate critic")
    batch = exp.response_ids.shape[0]
    if batch % s.mini_batch_size or s.mini_batch_size % s.micro_batch_size:
        raise ValueError(f"batch {batch}, ppo.mini_batch_size={s.mini_batch_size} and "
                         f"ppo.micro_batch_size={s.micro_batch_size} must divide each other")
    n_mb = batch // s.mini_batch_size
    policy_loss_fn = get_policy_loss(s.policy_loss)
    value_loss_fn = get_value_loss(s.value_loss)

    def actor_loss(params, m: Experience, n_tokens):
        """(loss, stats) of the actor on micro-batch `m`."""
        rollout = (m.query_ids, m.query_mask, m.response_ids, m.response_mask)
        logprobs, entropy = policy_logprobs(actor_graphdef, params, *rollout,
                                            temperature=s.temperature, with_entropy=True)
        loss, stats = policy_loss_fn(logprobs, m.logprobs, m.advantages, m.response_mask,
                                     loss_normalizer=n_tokens, **s.policy_kwargs())
        stats = dict(stats, entropy=masked_sum(jax.lax.stop_gradient(entropy), m.response_mask) / n_tokens)
        return loss, stats

    def critic_loss(params, m: Experience, n_tokens):
        rollout = (m.query_ids, m.query_mask, m.response_ids, m.response_mask)
        values = critic_values(critic_graphdef, params, *rollout)
        loss, stats = value_loss_fn(values, m.values, m.returns, m.response_mask,
                                    loss_normalizer=n_tokens, **s.value_kwargs())
        return loss, dict(stats)

    def joint_loss(params, m: Experience, n_tokens):
        """(pg_loss + vf_coef * vf_loss, stats) of the shared policy/value model."""
        rollout = (m.query_ids, m.query_mask, m.response_ids, m.response_mask)
        logprobs, entropy, values = policy_logprobs_and_values(actor_graphdef, params, *rollout,
                                                               temperature=s.temperature)
        pg, p_stats = policy_loss_fn(logprobs, m.logprobs, m.advantages, m.response_mask,
                                     loss_normalizer=n_tokens, **s.policy_kwargs())
        vf, v_stats = value_loss_fn(values, m.values, m.returns, m.response_mask,
                                    loss_normalizer=n_tokens, **s.value_kwargs())
        entropy = masked_sum(jax.lax.stop_gradient(entropy), m.response_mask) / n_tokens
        return pg + s.vf_coef * vf, {**p_stats, **v_stats, "entropy": entropy}

    def accumulate(loss_fn, params, mb: Experience, n_tokens):
        """Sum of micro-batch gradients and stats (each a token sum / minibatch token count)."""
        return accumulate_gradients(lambda p, m: loss_fn(p, m, n_tokens), params, mb,
                                    micro_batch_size=s.micro_batch_size, mesh=s.mesh)

    def minibatch_step(carry, idx):
        a_state, c_state = carry
        mb = shard_rows_tree(jax.tree.map(lambda x: x[idx], exp), s.mesh)
        n_tokens = jnp.maximum(jnp.sum(mb.response_mask).astype(jnp.float32), 1.0)
        a_stats = {}
        if s.train_actor:
            a_grads, a_stats = accumulate(joint_loss if s.shared_critic else actor_loss,
                                          a_state.params, mb, n_tokens)
            a_stats["actor_grad_norm"] = optax.global_norm(a_grads)
            a_state = a_state.apply_gradients(a_grads, actor_tx)
        if s.shared_critic:
            return (a_state, c_state), a_stats
        c_grads, c_stats = accumulate(critic_loss, c_state.params, mb, n_tokens)
        c_stats["critic_grad_norm"] = optax.global_norm(c_grads)
        c_state = c_state.apply_gradients(c_grads, critic_tx)
        return (a_state, c_state), {**a_stats, **c_stats}

    def epoch_step(carry, key):
        perm = jax.random.permutation(key, batch)
        return jax.lax.scan(minibatch_step, carry, perm.reshape(n_mb, s.mini_batch_size))

    keys = jax.random.split(rng, s.ppo_epochs)
    (actor_state, critic_state), stats = jax.lax.scan(epoch_step, (actor_state, critic_state), keys)
    return actor_state, critic_state, stats
