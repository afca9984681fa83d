"""Issue 57, the trainer side of asynchronous RL (`ppo.max_staleness` > 0,
`stages.ppo.async_rollout`): the loss weight of a planted stale sample (the TIS weight over its
recorded rollout log-probs, or 0 once it is too stale), the staleness figures of hand-made
versions, the driver's bookkeeping on a real stream (the synchronous step's prompts and keys,
s + 1 batches ahead, the versions each batch was drawn by), and the settings refused by name.

The multi-device runs (staleness 1 and 2 on 8 CPU devices, kill -9 / SIGTERM and resume) are in
tests/parallel/test_async_step.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ppo_jax.core.staleness import sample_staleness
from ppo_jax.models import split_model
from ppo_jax.models.heads import init_model
from ppo_jax.models.tiny_random import tiny_config
from ppo_jax.rollout.engine import PagedEngine
from ppo_jax.trainer.config import ConfigError, load_config
from ppo_jax.trainer.data.order import DataOrder
from ppo_jax.trainer.stages.ppo.async_rollout import (
    AsyncRollout, refuse_stale, staleness_figures,
)
from ppo_jax.trainer.stages.ppo.step_data import PromptBatch
from ppo_jax.trainer.stages.ppo.step_programs import split_keys
from tests.rollout.sampling_settings import engine_settings, sampling_settings
from tests.rollout.test_paged_engine import mixed_prompts
from tests.trainer.default_settings import update_settings
from tests.trainer.test_update import B, experience, models, run_update  # noqa: F401 (fixture)

ASYNC = ["ppo.max_staleness=1", "generation.placement=split", "generation.rollout_devices=1",
         "generation.engine=paged", "ppo.rollout_correction=tis"]


def test_a_stale_sample_weighs_its_tis_ratio_and_a_too_stale_one_nothing(models):
    """Trainer version 5, bound 1. Rows of 5, 3, 1 and 4 tokens: row 0 drawn by version 5
    (staleness 0), row 1 by versions 4 then 5 (a partial rollout: staleness 1, kept), row 2 by
    version 3 (staleness 2: refused, its rollout log-probs NaN to show they reach nothing),
    row 3 by version 4. With new log-probs equal to the old ones the per-token PPO loss is
    -A, so pg_loss = sum_t w_t (-A_t) / N over the kept tokens, with the TIS weight
    w_t = min(pi_old / pi_rollout, 2) = min(exp(shift_t), 2) (Yao et al. 2025)."""
    exp, _, _ = experience(models)
    valid = np.asarray(exp.response_mask) > 0
    versions = np.where(valid, np.array([[5] * 5, [4, 4, 5, 5, 5], [3] * 5, [4] * 5]), -1)
    staleness = sample_staleness(versions, valid, 5)
    np.testing.assert_array_equal(staleness, [0, 1, 2, 1])
    shift = np.random.default_rng(5).choice([1.0, -0.5, 0.3], valid.shape)  # old - rollout
    rollout_lp = np.asarray(exp.logprobs) - shift
    rollout_lp[2] = np.nan
    mask = refuse_stale(exp.action_mask, staleness, 1)
    exp = exp.replace(rollout_logprobs=jnp.asarray(rollout_lp, jnp.float32), action_mask=mask)
    settings = update_settings(ppo_epochs=1, mini_batch_size=B, micro_batch_size=1,
                               rollout_correction="tis", rollout_correction_cap=2.0)
    _, _, stats = run_update(models, exp, settings)
    kept = valid & (np.arange(B) != 2)[:, None]
    weights = np.minimum(np.exp(shift), 2.0)
    adv = np.asarray(exp.advantages, np.float64)
    want = (weights * -adv)[kept].sum() / kept.sum()
    np.testing.assert_allclose(stats["pg_loss"][0, 0], want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(stats["rollout_correction/weight_mean"][0, 0],
                               weights[kept].mean(), rtol=1e-5)
    assert np.isfinite(stats["vf_loss"][0, 0])
    np.testing.assert_array_equal(np.asarray(mask)[2], 0)
    np.testing.assert_array_equal(np.asarray(mask)[[0, 1, 3]], valid[[0, 1, 3]])


def test_staleness_figures_of_hand_made_versions():
    """Trainer version 3, bound 1: the oldest real token of each row decides (-1: no token)."""
    versions = np.array([[3, 3, -1], [1, 2, 2], [0, -1, -1], [-1, -1, -1]], np.int32)
    staleness, m = staleness_figures(versions, 3, current_version=3, max_staleness=1)
    np.testing.assert_array_equal(staleness, [0, 2, 3, 0])
    assert m["rollout/refused"] == 2.0
    assert m["rollout/version_spread"] == 3.0 and m["rollout/staleness_max"] == 3.0
    assert m["rollout/mixed_version_frac"] == 0.25
    assert (m["rollout/staleness_hist_0"], m["rollout/staleness_hist_2"],
            m["rollout/staleness_hist_3"]) == (0.5, 0.25, 0.25)
    cut, _ = staleness_figures(versions, 1, current_version=3, max_staleness=1)
    np.testing.assert_array_equal(cut, [0, 2, 3, 0])  # the first column holds every oldest


VOCAB, BATCH, WIDTH, N, POOL = 96, 4, 8, 10, 12


def test_the_driver_submits_ahead_with_the_synchronous_prompts_and_keys():
    """Bound 1, 3 steps: two batches submitted at once; batch 1 is `generate`'s under the
    synchronous step's prompts and key; the pump finishes batch 2 under version 0; after
    version 1 comes in, batch 3 is drawn by it alone; each taken batch carries the prompt
    position and run key a checkpoint after it holds; nothing is submitted past the last step."""
    cfg = tiny_config(VOCAB)
    graphdef, params = split_model(init_model(cfg, seed=3))
    _, other = split_model(init_model(cfg, seed=4))
    engine = PagedEngine(graphdef, cfg, sampling_settings(N, temperature=1.0,
                                                          stop_token_ids=(5, 7, 9),
                                                          pad_token_id=0),
                         engine_settings(page_size=4, max_concurrent=4, decode_chunk=3,
                                         decode_buckets=1), batch=BATCH, prompt_width=WIDTH)
    pool_ids, pool_mask = mixed_prompts(POOL, WIDTH, seed=7)

    def draw(order):
        idx = order.next_indices(BATCH)
        return PromptBatch(indices=idx, ids=jnp.asarray(pool_ids[idx]),
                           mask=jnp.asarray(pool_mask[idx]), width=WIDTH, texts=[], rows=None)

    keys = jax.jit(split_keys)
    driver = AsyncRollout(engine.stream(params, 0, max_batches_in_flight=2),
                          order=DataOrder(POOL, 0), rng=jax.random.PRNGKey(0), next_step=1,
                          last_step=3, max_staleness=1, draw=draw, split_keys=keys,
                          to_rollout=lambda *a: a)
    driver.fill()
    assert [s.step for s in driver.pending] == [1, 2]
    rng, order = jax.random.PRNGKey(0), DataOrder(POOL, 0)
    rng, gen_key, update_key = keys(rng)
    idx = order.next_indices(BATCH)
    first = driver.take(1)
    sub = first.submitted
    assert sub.position == order.position == BATCH
    np.testing.assert_array_equal(sub.prompts.indices, idx)
    np.testing.assert_array_equal(jax.random.key_data(sub.rng), jax.random.key_data(rng))
    np.testing.assert_array_equal(jax.random.key_data(sub.update_key),
                                  jax.random.key_data(update_key))
    want = engine.generate(params, jnp.asarray(pool_ids[idx]), jnp.asarray(pool_mask[idx]),
                           gen_key)
    for got, ref in zip(first.batch.generation[:3], want[:3]):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    real = np.asarray(want.response_mask) > 0
    assert (first.batch.versions[real] == 0).all() and (first.batch.versions[~real] == -1).all()

    driver.pump()
    assert 2 in driver.ready
    driver.set_params(other, 1)
    driver.fill()
    assert [s.step for s in driver.pending] == [2, 3]
    second = driver.take(2)
    staleness, figures = staleness_figures(second.batch.versions, N, 1, 1)
    np.testing.assert_array_equal(staleness, 1)
    assert figures["rollout/refused"] == 0
    assert second.submitted.position == 2 * BATCH
    third = driver.take(3)
    v = third.batch.versions
    assert (v[v >= 0] == 1).all()
    driver.fill()
    assert not driver.pending and driver.stream.in_flight == 0
    with pytest.raises(RuntimeError, match="step 4"):
        driver.take(4)


@pytest.mark.parametrize("sets, message", [
    (["generation.placement=colocated", "generation.rollout_devices=0"],
     r"ppo.max_staleness=1 .* generation.placement='colocated'"),
    (["generation.engine=static", "generation.page_size=16"],
     r"generation.engine='static'"),
    (["ppo.rollout_correction=none"], r"ppo.rollout_correction='none'.* tis, mis or icepop"),
    (["ppo.advantage_estimator=remax"], r"'remax': its baseline is a greedy response"),
    (["ppo.dynamic_sampling=true", "generation.samples_per_prompt=2", "ppo.batch_size=4"],
     r"ppo.dynamic_sampling=true draws and scores rounds"),
    (["ppo.max_staleness=-1"], r"ppo.max_staleness=-1 must be an int >= 0"),
])
def test_settings_the_asynchronous_step_cannot_run_are_refused_by_name(sets, message):
    with pytest.raises(ConfigError, match=message):
        load_config("configs/tiny.yaml", ASYNC + sets)


def test_stream_settings_without_staleness_have_no_effect():
    with pytest.raises(ConfigError, match="generation.partial_rollouts=False has no effect"):
        load_config("configs/tiny.yaml", ["generation.partial_rollouts=false"])
    cfg = load_config("configs/tiny.yaml", ASYNC + ["ppo.max_staleness=2"])
    assert cfg.ppo.max_staleness == 2 and cfg.generation.partial_rollouts
