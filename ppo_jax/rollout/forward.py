"""The forward passes of PPO over query + response: actor / reference log-probs, critic values,
reward-model scores.

Every function takes `(graphdef, params, ...)` and the rollout arrays
`query_ids [B, P]`, `query_mask [B, P]` (left-padded prompt), `response_ids [B, N]`,
`response_mask [B, N]`, and reads the model over the concatenation `[B, P + N]`. The output for
response token `t` is read at position `P - 1 + t` (the state before the token was emitted),
as TRL 0.11 `batched_forward_pass` does (`logits[:, start - 1 : end - 1]`). The same function
computes rollout ("old"), reference and new log-probs, with the same temperature, so the first
PPO minibatch sees `ratio == 1` exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Literal, Optional

import jax
import jax.numpy as jnp
from flax import nnx, struct
from jax.sharding import Mesh

from ppo_jax.core import chunked_logprobs_and_entropy, entropy_from_logits, logprobs_from_logits
from ppo_jax.models.functional import Model
from ppo_jax.parallel.mesh import shard_rows
from ppo_jax.rollout.packing import (
    PackedBatch, PackedRows, gather_response, pack, packed_rows, scatter_response, unpack,
)
from ppo_jax.parallel.rules import vocab_shards


# `model.router_replay`: whether the actor's passes replay the experts the sampler recorded
ROUTER_REPLAYS = ("none", "rollout")
RouterReplay = Literal[ROUTER_REPLAYS]


@struct.dataclass
class Rollout:
    """Prompts and sampled responses, the input of every forward pass: `query_ids`,
    `query_mask` `[B, P]` int32 (left-padded prompts), `response_ids`, `response_mask` `[B, N]`
    int32 (mask 1 up to and including the stop token), and `routes`: None, or the experts each
    response token went through when it was sampled, `[B, N, moe_layers, k]` int (-1: none
    recorded), which the actor's passes then replay (`model.router_replay: rollout`)."""

    query_ids: jax.Array
    query_mask: jax.Array
    response_ids: jax.Array
    response_mask: jax.Array
    routes: Optional[jax.Array] = None

    def arrays(self) -> tuple:
        return self.query_ids, self.query_mask, self.response_ids, self.response_mask


@dataclass(frozen=True)
class ForwardSettings:
    """Static settings of the forward passes that score a rollout (hashable: a static jit
    argument), shared by the experience pass and the held-out evaluation; built from the config
    by `stages.ppo.settings.forward_settings`.

    temperature: the sampling temperature; log-probs are those of softmax(logits / T).
    micro_batch_size: rows per forward pass (`ppo.micro_batch_size`).
    logprob_chunk_size: vocabulary columns per block of the log-prob / entropy head; 0: the
      whole `[B, N, V]` logits at once.
    mesh: the rows of every chunk split over ("data", "fsdp"), or None.
    score_normalizer: `(mean, std)` measured when the reward model was trained: its scores become
      (score - mean) / std (`reward.normalize`), or None.
    reward_eos_id: the EOS id written over the last response token before the reward model
      reads it (`reward.eos_at_end`), or None: the response as sampled.
    """

    temperature: float
    micro_batch_size: int
    logprob_chunk_size: int
    mesh: Optional[Mesh]
    score_normalizer: Optional[tuple[float, float]]
    reward_eos_id: Optional[int]


def _sequence(query_ids, query_mask, response_ids, response_mask):
    ids = jnp.concatenate([query_ids, response_ids], axis=1).astype(jnp.int32)
    mask = jnp.concatenate([query_mask, response_mask], axis=1).astype(jnp.int32)
    return ids, mask


def sequence_routes(routes, prompt_len: int):
    """Response routes `[B, N, moe_layers, k]` -> routes of the whole sequence `[B, P + N,
    moe_layers, k]` int32, -1 (route by the router) on the prompt; None stays None."""
    if routes is None:
        return None
    routes = routes.astype(jnp.int32)
    prompt = jnp.full((routes.shape[0], prompt_len, *routes.shape[2:]), -1, jnp.int32)
    return jnp.concatenate([prompt, routes], axis=1)


def backbone_pass(model, ids, mask, routes=None, mesh=None):
    """`(hidden [B, L, D], aux_loss)` of one backbone pass over `[B, L]` ids and mask, routing
    with `routes` `[B, L, moe_layers, k]` where they are >= 0 (`models.moe`); aux_loss is the
    MoE load-balancing loss of the pass (transformers' `load_balancing_loss_func`, unscaled),
    0.0 for a dense model. With the run's `mesh`, an MoE layer computes each device's own
    tokens (`models.moe_dispatch`)."""
    hidden, _, routing = model.backbone.run(ids, mask, routes=routes, mesh=mesh)
    aux = jnp.zeros((), jnp.float32) if routing is None else routing.aux_loss
    return hidden, aux


def aux_loss_weight(model_cfg, coef: Optional[float]) -> float:
    """The weight of a model's MoE load-balancing loss in its training loss: `coef`
    (`model.router_aux_loss_coef`), else the checkpoint's `router_aux_loss_coef`; 0 for a
    dense model."""
    if not getattr(model_cfg, "num_moe_layers", 0):
        return 0.0
    return float(model_cfg.router_aux_loss_coef if coef is None else coef)


def _response_slice(x: jax.Array, prompt_len: int, response_len: int) -> jax.Array:
    return x[:, prompt_len - 1: prompt_len - 1 + response_len]


def response_states(run, query_ids, query_mask, response_ids, response_mask, *, routes=None,
                    mesh=None, packing: Optional[PackedRows] = None, packed: bool = False):
    """`(out [B, N, ...], aux)`: `run(ids, mask, routes) -> (out [B, L, ...], aux)` over the
    sequences (a backbone's hidden states, a ValueModel's values), read for each response
    token before it (module doc). With `packing` it runs over the packed rows of the plan
    (`rollout.packing`) and its outputs come back to `[B, N, ...]`: equal to the padded pass's
    on every real response token, to float32 rounding; with `packed` they stay in the packed
    rows, `[S * R, W, ...]`."""
    ids, mask = _sequence(query_ids, query_mask, response_ids, response_mask)
    seq_routes = sequence_routes(routes, query_ids.shape[1])
    if packing is not None:
        ids, mask = (shard_rows(x, mesh) for x in packed_rows(ids, packing))
        seq_routes = None if seq_routes is None else shard_rows(pack(seq_routes, packing, -1), mesh)
    out, aux = run(ids, mask, seq_routes)
    if packing is None:
        return _response_slice(out, query_ids.shape[1], response_ids.shape[1]), aux
    return (out if packed else shard_rows(unpack(out, packing), mesh)), aux


def response_head(model, packed_hidden, response_ids, packing: PackedRows, temperature: float,
                  chunk_size: int, mesh=None):
    """`(logprobs, entropy)` `[B, N]` float32 from the packed rows' hidden states
    `[S * R, W, D]`, the LM head run over the real response tokens only
    (`rollout.packing.gather_response`): a padded `[B, N]` head would pay for every padding
    slot. Both are 0 on the other slots."""
    hidden = shard_rows(gather_response(packed_hidden, packing), mesh)
    s, per, n = packing.dst.shape
    flat = response_ids.reshape(s, per * n)
    tokens = jax.vmap(lambda t, i: t[jnp.minimum(i, per * n - 1)])(flat, packing.head_dst)
    out = head_logprobs(model, hidden, tokens, temperature, chunk_size=chunk_size, mesh=mesh)
    return tuple(shard_rows(scatter_response(x, packing), mesh) for x in out)


def _head(model, states, response_ids, packing, temperature, chunk_size, mesh):
    """`(logprobs, entropy, hidden [B, N, D])` of `response_states(..., packed=bool(packing))`'s
    output: over the real response tokens where the plan lists them (`response_head`)."""
    if packing is not None and packing.head_src is not None:
        out = response_head(model, states, response_ids, packing, temperature, chunk_size, mesh)
        return (*out, shard_rows(unpack(states, packing), mesh))
    if packing is not None:
        states = shard_rows(unpack(states, packing), mesh)
    out = head_logprobs(model, states, response_ids, temperature, chunk_size=chunk_size,
                        mesh=mesh)
    return (*out, states)


def head_logprobs(model, hidden: jax.Array, tokens: jax.Array, temperature: float = 1.0, *,
                  with_entropy: bool = True, chunk_size: int = 0, mesh=None):
    """Log-probs (and entropies) of `tokens [B, T]` under `softmax(lm_head(hidden) / temperature)`
    of a CausalLM `model`, from its final hidden states `hidden [B, T, D]`.

    `chunk_size == 0`: from the full `[B, T, V]` float32 logits (`core.logprobs_from_logits`,
    `core.entropy_from_logits`). `chunk_size > 0` (`model.logprob_chunk_size`): over blocks of
    that many vocabulary columns (`core.chunked_logprobs_and_entropy`): the same values and
    gradients to float32 rounding, with at most one `[B, T, chunk_size]` block of logits alive,
    forward and backward. With a `mesh` whose `tensor` axis splits the head's vocabulary
    (`parallel.vocab_shards`), each block takes `chunk_size` columns of every device's shard, so
    no device gathers the head.

    Returns:
      logprobs `[B, T]` float32, or `(logprobs, entropy)` when `with_entropy`.
    """
    if chunk_size == 0:
        logits = model.lm_head(hidden)
        logprobs = logprobs_from_logits(logits, tokens, temperature)
        return (logprobs, entropy_from_logits(logits, temperature)) if with_entropy else logprobs
    kernel, vocab_axis = model.head_kernel()
    out = chunked_logprobs_and_entropy(
        hidden.astype(kernel.dtype), kernel, tokens, temperature, chunk_size=chunk_size,
        vocab_axis=vocab_axis, vocab_shards=vocab_shards(mesh, kernel.shape[vocab_axis]))
    return out if with_entropy else out[0]


def policy_logprobs(graphdef, params, query_ids, query_mask, response_ids, response_mask, *,
                    temperature: float = 1.0, with_entropy: bool = False,
                    logprob_chunk_size: int = 0, mesh=None, routes=None, with_aux: bool = False,
                    packing: Optional[PackedRows] = None):
    """Log-probs of the response tokens under a CausalLM (actor or reference).

    Args:
      graphdef, params: a split `CausalLM`.
      query_ids, query_mask: `[B, P]` int32, left-padded prompts.
      response_ids, response_mask: `[B, N]` int32.
      temperature: the sampling temperature (logits are divided by it).
      with_entropy: also return the entropy of the full next-token distribution.
      logprob_chunk_size, mesh: 0, or the vocabulary block size of `head_logprobs` (static),
        and the run's mesh (None on one device).
      routes: None, or the response tokens' experts `[B, N, moe_layers, k]` to replay
        (`Rollout.routes`); the prompt is routed by the router.
      with_aux: also return the pass's MoE load-balancing loss (`backbone_pass`).
      packing: None, or the `rollout.packing.PackedRows` of these rows: the backbone runs over
        packed rows (`response_states`).

    Returns:
      logprobs `[B, N]` float32, or `(logprobs, entropy)` with entropy `[B, N]` float32 in
      nats; with `with_aux` the aux loss (float32 scalar) last. Values on masked response
      slots are finite but meaningless.
    """
    model = nnx.merge(graphdef, params)
    h, aux = response_states(partial(backbone_pass, model, mesh=mesh), query_ids, query_mask,
                             response_ids, response_mask, routes=routes, mesh=mesh,
                             packing=packing, packed=True)
    logprobs, entropy, _ = _head(model, h, response_ids, packing, temperature,
                                 logprob_chunk_size, mesh)
    out = (logprobs, entropy) if with_entropy else logprobs
    if not with_aux:
        return out
    return (*out, aux) if with_entropy else (out, aux)


def critic_values(graphdef, params, query_ids, query_mask, response_ids, response_mask, *,
                  mesh=None, packing: Optional[PackedRows] = None):
    """Values `[B, N]` float32 of a ValueModel for the states before each response token;
    with `packing`, over packed rows (`response_states`)."""
    model = nnx.merge(graphdef, params)
    return response_states(lambda ids, mask, _: (model(ids, mask, mesh=mesh)[0], None),
                           query_ids, query_mask, response_ids, response_mask, mesh=mesh,
                           packing=packing)[0]


def end_with_eos(response_ids: jax.Array, response_mask: jax.Array, eos_id: int) -> jax.Array:
    """`response_ids [B, N]` with the last real token (mask 1) of every row set to `eos_id`:
    a response that stopped keeps its stop token as EOS, one cut at max_new_tokens has EOS
    written over its last token (OpenRLHF's `process_sequences` makes every sequence it scores
    end in EOS the same way). Rows with no real token are unchanged."""
    n = response_ids.shape[1]
    last = jnp.max(jnp.where(response_mask != 0, jnp.arange(n)[None, :], -1), axis=1)
    at_last = jnp.arange(n)[None, :] == last[:, None]
    return jnp.where(at_last, jnp.asarray(eos_id, response_ids.dtype), response_ids)


def reward_model_scores(graphdef, params, query_ids, query_mask, response_ids, response_mask, *,
                        eos_id: int | None = None, mesh=None):
    """Scores `[B]` float32 of a RewardModel, read at the last real token of query + response.

    With `eos_id` (`reward.eos_at_end`) that token is first made EOS (`end_with_eos`), so the
    model reads every response at an EOS, as a reward model trained with
    `reward_model.eos_after_truncated=true` saw its pairs. mesh: the run's, for the
    attention kernel (`layers.make_context`)."""
    if eos_id is not None:
        response_ids = end_with_eos(response_ids, response_mask, eos_id)
    ids, mask = _sequence(query_ids, query_mask, response_ids, response_mask)
    scores, _ = nnx.merge(graphdef, params)(ids, mask, mesh=mesh)
    return scores


def map_in_chunks(fn, chunk_size: int, *arrays, mesh=None):
    """Apply `fn(*chunk)` to consecutive chunks of `chunk_size` rows with `lax.map`; concatenate.
    `arrays` may be pytrees of arrays with rows first (a `Rollout`).

    Bounds activation memory and gives every chunk the same shape as a PPO micro-batch (so
    rollout and update log-probs come from identical computations). With a `mesh`, the rows of
    each chunk are split over its ("data", "fsdp") axes, so every device works on every chunk.

    Raises:
      ValueError: the batch is not a multiple of `chunk_size`.
    """
    batch = jax.tree.leaves(arrays)[0].shape[0]
    if batch % chunk_size:
        raise ValueError(f"batch {batch} is not a multiple of the chunk size {chunk_size}")
    n = batch // chunk_size
    if n == 1:
        return fn(*arrays)
    chunked = jax.tree.map(
        lambda a: shard_rows(a.reshape(n, chunk_size, *a.shape[1:]), mesh, axis=1), arrays)
    out = jax.lax.map(lambda xs: fn(*xs), chunked)
    return jax.tree.map(lambda y: shard_rows(y.reshape(batch, *y.shape[2:]), mesh), out)


def policy_logprobs_and_values(graphdef, params, query_ids, query_mask, response_ids, response_mask,
                               *, temperature: float = 1.0, logprob_chunk_size: int = 0,
                               mesh=None, routes=None, with_aux: bool = False,
                               packing: Optional[PackedRows] = None):
    """Shared-backbone policy and critic (`models.CausalLMWithValueHead`, TRL's
    `AutoModelForCausalLMWithValueHead`).

    Args:
      graphdef, params: a split `CausalLMWithValueHead`.
      (others as `policy_logprobs`)

    Returns:
      `(logprobs [B, N], entropy [B, N], values [B, N])`, float32, from ONE backbone pass;
      with `with_aux` the MoE aux loss last.
    """
    model = nnx.merge(graphdef, params)
    h, aux = response_states(partial(backbone_pass, model, mesh=mesh), query_ids, query_mask,
                             response_ids, response_mask, routes=routes, mesh=mesh,
                             packing=packing, packed=True)
    logprobs, entropy, h = _head(model, h, response_ids, packing, temperature,
                                 logprob_chunk_size, mesh)
    out = (logprobs, entropy, model.values_from_hidden(h))
    return (*out, aux) if with_aux else out


def _chunked(fn, rollout: Rollout, s: ForwardSettings, packing: Optional[PackedBatch] = None):
    """`fn(*arrays, routes, packing)` of every micro-batch chunk of `rollout`. With `packing`
    (a `PackedBatch`), the chunks take the rows in `packing.order`, each chunk over its packed
    rows, and the outputs come back in the rollout's order."""
    if packing is None:
        return map_in_chunks(lambda r: fn(*r.arrays(), r.routes, None), s.micro_batch_size,
                             rollout, mesh=s.mesh)
    plans, n = packing.rows, packing.rows.src.shape[0]
    rows = jax.tree.map(lambda a: shard_rows(a[packing.order], s.mesh), rollout)
    if n == 1:
        out = fn(*rows.arrays(), rows.routes, jax.tree.map(lambda x: x[0], plans))
    else:
        chunks = jax.tree.map(
            lambda a: shard_rows(a.reshape(n, -1, *a.shape[1:]), s.mesh, axis=1), rows)
        out = jax.lax.map(lambda xs: fn(*xs[0].arrays(), xs[0].routes, xs[1]), (chunks, plans))
        out = jax.tree.map(lambda y: y.reshape(-1, *y.shape[2:]), out)
    back = jnp.argsort(packing.order)
    return jax.tree.map(lambda y: shard_rows(y[back], s.mesh), out)


def rollout_logprobs(model: Model, rollout: Rollout, s: ForwardSettings, *,
                     with_entropy: bool = False, replay: bool = True,
                     packing: Optional[PackedBatch] = None):
    """`policy_logprobs` of a CausalLM (actor or reference) over a rollout, in micro-batch
    chunks (packed rows with `packing`, `_chunked`): logprobs `[B, N]` float32, or
    `(logprobs, entropy)`. With `replay` the rollout's `routes` (when it has them) route the
    model's MoE layers; the reference passes `replay=False`: the routes are the actor's."""
    return _chunked(lambda *r: policy_logprobs(
        model.graphdef, model.params, *r[:4], temperature=s.temperature,
        with_entropy=with_entropy, logprob_chunk_size=s.logprob_chunk_size, mesh=s.mesh,
        routes=r[4] if replay else None, packing=r[5]), rollout, s, packing)


def rollout_logprobs_and_values(model: Model, rollout: Rollout, s: ForwardSettings,
                                packing: Optional[PackedBatch] = None):
    """`policy_logprobs_and_values` of the shared policy / value model, in micro-batch chunks:
    `(logprobs, entropy, values)`, each `[B, N]` float32."""
    return _chunked(lambda *r: policy_logprobs_and_values(
        model.graphdef, model.params, *r[:4], temperature=s.temperature,
        logprob_chunk_size=s.logprob_chunk_size, mesh=s.mesh, routes=r[4], packing=r[5]),
        rollout, s, packing)


def rollout_values(critic: Model, rollout: Rollout, s: ForwardSettings,
                   packing: Optional[PackedBatch] = None) -> jax.Array:
    """`critic_values` over a rollout, in micro-batch chunks: `[B, N]` float32."""
    return _chunked(lambda *r: critic_values(critic.graphdef, critic.params, *r[:4],
                                             mesh=s.mesh, packing=r[5]), rollout, s, packing)


def rollout_scores(reward: Model, rollout: Rollout, s: ForwardSettings) -> jax.Array:
    """The reward model's scores `[B]` float32 of a rollout (`reward_model_scores`, in
    micro-batch chunks, padded rows), normalised by `s.score_normalizer` when set:
    `(score - mean) / std` with the mean / std measured when the reward model was trained
    (OpenRLHF's `normalize_reward`)."""
    scores = _chunked(lambda *r: reward_model_scores(reward.graphdef, reward.params, *r[:4],
                                                     eos_id=s.reward_eos_id, mesh=s.mesh),
                      rollout, s)
    if s.score_normalizer is None:
        return scores
    mean, std = s.score_normalizer
    return (scores - mean) / std
