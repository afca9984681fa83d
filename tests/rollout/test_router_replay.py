"""Router replay (issue 56): the sampler records the experts each response token went through,
and the actor's passes routed through them give the sampler's own log-probs; routed afresh, a
bfloat16 rollout copy's tokens meet other experts in the float32 passes.

The model is the tiny Qwen3-MoE of `models.tiny_random` (8 experts, 2 per token, both layers
sparse) with random weights: its router's probabilities are close to uniform, so a small
change of the weights flips experts, as a trained model's near-ties do.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ppo_jax.models import split_model
from ppo_jax.models.heads import init_model
from ppo_jax.models.tiny_random import TINY_MOE, tiny_config
from ppo_jax.rollout.draws import ROUTE_DTYPE
from ppo_jax.rollout.engine import PagedEngine
from ppo_jax.rollout.forward import policy_logprobs, sequence_routes
from ppo_jax.rollout.static_batch import generate
from tests.rollout.sampling_settings import engine_settings, sampling_settings

VOCAB, NEW = 96, 10


@pytest.fixture(scope="module")
def moe():
    cfg = tiny_config(VOCAB, **TINY_MOE)
    graphdef, params = split_model(init_model(cfg, seed=5))
    return cfg, graphdef, params


def prompts(batch=6, width=7, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(4, VOCAB, (batch, width)).astype(np.int32)
    mask = np.ones_like(ids)
    for b in range(batch):
        mask[b, :rng.integers(0, width - 1)] = 0
    ids[mask == 0] = 0
    return ids, mask


def sample_static(graphdef, params, ids, mask, key=0):
    return generate(graphdef, params, ids, mask, jax.random.PRNGKey(key), max_new_tokens=NEW,
                    stop_token_ids=(1,), return_logprobs=True, record_routes=True)


def sample_paged(cfg, graphdef, params, ids, mask, key=0):
    settings = sampling_settings(NEW, stop_token_ids=(1,), record_routes=True)
    engine = PagedEngine(graphdef, cfg, settings, engine_settings(page_size=4, max_concurrent=4),
                         batch=ids.shape[0], prompt_width=ids.shape[1])
    out = engine.generate(params, jnp.asarray(ids), jnp.asarray(mask), jax.random.PRNGKey(key))
    return out.response_ids, out.response_mask, out.logprobs, out.routes


def recomputed_experts(graphdef, params, ids, mask, resp, resp_mask):
    """The experts the float32 full-sequence pass routes each response token to (no replay)."""
    from flax import nnx

    model = nnx.merge(graphdef, params)
    seq = jnp.concatenate([ids, resp], axis=1)
    seq_mask = jnp.concatenate([mask, resp_mask], axis=1)
    _, _, routing = model.backbone.run(seq, seq_mask)
    return np.asarray(routing.experts[:, ids.shape[1]:])


@pytest.mark.parametrize("sampler", ["static", "paged"])
def test_replayed_passes_give_the_samplers_own_logprobs(moe, sampler):
    cfg, graphdef, params = moe
    ids, mask = prompts()
    if sampler == "static":
        resp, resp_mask, logprobs, routes = sample_static(graphdef, params, ids, mask)
    else:
        resp, resp_mask, logprobs, routes = sample_paged(cfg, graphdef, params, ids, mask)
    routes, resp_mask = np.asarray(routes), np.asarray(resp_mask)
    assert routes.shape == (6, NEW, cfg.num_moe_layers, 2) and routes.dtype == ROUTE_DTYPE
    # fed tokens carry their experts; the last column and columns after a row's end none
    fed = resp_mask.copy()
    fed[:, -1] = 0
    ends = resp_mask.sum(axis=1)
    for b, n in enumerate(ends):
        if n < NEW:
            fed[b, n - 1] = 0  # the stop token is drawn, never fed
    assert (routes[fed > 0] >= 0).all() and (routes[fed == 0] == -1).all()
    assert (routes[fed > 0] < cfg.num_experts).all()
    replayed = policy_logprobs(graphdef, params, ids, mask, resp, resp_mask, routes=routes)
    valid = resp_mask > 0
    np.testing.assert_allclose(np.asarray(replayed)[valid], np.asarray(logprobs)[valid],
                               atol=2e-5)
    # the replayed experts are the ones recorded: the pass's own routing gives them back
    from flax import nnx

    seq = jnp.concatenate([ids, resp], axis=1)
    seq_mask = jnp.concatenate([mask, resp_mask], axis=1)
    _, _, routing = nnx.merge(graphdef, params).backbone.run(
        seq, seq_mask, routes=sequence_routes(jnp.asarray(routes), ids.shape[1]))
    used = np.asarray(routing.experts[:, ids.shape[1]:])
    np.testing.assert_array_equal(used[fed > 0], routes[fed > 0])


def test_a_bfloat16_rollout_meets_other_experts_without_replay(moe):
    """The tokens sampled by a bfloat16 copy of the weights: the float32 pass routes some of
    them to other experts than they went through; replayed, its log-probs come closer to the
    sampler's."""
    cfg, graphdef, params = moe
    ids, mask = prompts(batch=8, seed=1)
    rollout_params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    resp, resp_mask, logprobs, routes = sample_static(graphdef, rollout_params, ids, mask, key=3)
    routes, valid = np.asarray(routes), np.asarray(resp_mask) > 0
    fed = routes[..., 0] >= 0
    again = recomputed_experts(graphdef, params, ids, mask, resp, resp_mask)
    differ = (np.sort(again, axis=-1) != np.sort(routes, axis=-1)).any(axis=-1) & fed
    assert differ.sum() > 0, "no token changed experts: the test would show nothing"
    free = policy_logprobs(graphdef, params, ids, mask, resp, resp_mask)
    replay = policy_logprobs(graphdef, params, ids, mask, resp, resp_mask, routes=routes)
    gap_free = np.abs(np.asarray(free) - np.asarray(logprobs))[valid].mean()
    gap_replay = np.abs(np.asarray(replay) - np.asarray(logprobs))[valid].mean()
    assert gap_replay < gap_free


def test_dense_models_record_no_routes():
    cfg = tiny_config(VOCAB)
    graphdef, params = split_model(init_model(cfg, seed=0))
    ids, mask = prompts()
    out = generate(graphdef, params, ids, mask, jax.random.PRNGKey(0), max_new_tokens=4,
                   return_logprobs=True, record_routes=True)
    assert len(out) == 3
    with pytest.raises(ValueError, match="routes"):
        policy_logprobs(graphdef, params, ids, mask, out[0], out[1],
                        routes=np.zeros((6, 4, 1, 2), np.int16))
