"""reward.kind=model: a score-head reward model over the actor's tokenizer, and a critic
initialised from it (DeepSpeed-Chat)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ppo_jax.models import init_model, load_model, load_tokenizer, save_pretrained
from ppo_jax.models.tiny_random import tiny_config
from ppo_jax.trainer.config import load_config
from ppo_jax.trainer.stages.ppo.trainer import PPOTrainer


@pytest.fixture(scope="module")
def reward_dir(tiny_checkpoint, tmp_path_factory):
    tok = load_tokenizer(tiny_checkpoint)
    rm = init_model(tiny_config(len(tok)), "reward", seed=7)
    # a score head with some weight, so scores differ between responses
    rm.score.kernel[...] = jax.random.normal(jax.random.PRNGKey(1), rm.score.kernel.shape)
    return save_pretrained(rm, tiny_config(len(tok)), tmp_path_factory.mktemp("rm") / "rm", tok)


def test_reward_model_scores_and_critic_from_reward_model(tiny_checkpoint, reward_dir, tmp_path):
    cfg = load_config("configs/tiny.yaml", [
        f"model.actor={tiny_checkpoint}", f"model.reward_model={reward_dir}", "reward.kind=model",
        f"train.output_dir={tmp_path}", "train.progress=false", "train.steps=1"])
    trainer = PPOTrainer(cfg)
    rm, _ = load_model(reward_dir, "reward")
    # the critic starts from the reward model: same backbone, value head = score head
    critic = trainer.state["critic"].params
    np.testing.assert_array_equal(critic["value_head"]["kernel"], nnx.to_pure_dict(nnx.state(rm))["score"]["kernel"])
    metrics = trainer.step()
    assert np.isfinite(metrics["pg_loss"]) and np.isfinite(metrics["vf_loss"])
    assert metrics["score_std"] > 0.0  # scores vary across the batch


def test_experience_scores_are_the_reward_model_at_the_last_real_token(tiny_checkpoint, reward_dir):
    from ppo_jax.core import init_kl_controller
    from ppo_jax.models import split_model
    from ppo_jax.models import Model
    from ppo_jax.trainer.stages.ppo.experience import PPOModels, make_experience
    from tests.trainer.default_settings import experience_settings, forward_settings
    from ppo_jax.rollout.forward import Rollout

    actor, _ = load_model(tiny_checkpoint, "causal_lm")
    critic, _ = load_model(reward_dir, "value")
    rm, _ = load_model(reward_dir, "reward")
    (ag, ap), (cg, cp), (rg, rp) = split_model(actor), split_model(critic), split_model(rm)
    rng = np.random.default_rng(0)
    q = rng.integers(4, 200, (2, 5)).astype(np.int32)
    qm = np.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], np.int32)
    r = rng.integers(4, 200, (2, 4)).astype(np.int32)
    rmask = np.array([[1, 1, 0, 0], [1, 1, 1, 1]], np.int32)
    models = PPOModels(Model(ag, ap), Model(ag, ap), Model(cg, cp), Model(rg, rp))
    exp, _, _ = make_experience(models, Rollout(q, qm, r, rmask), init_kl_controller("fixed", 0.1),
                                None, jnp.ones(2, bool),
                                settings=experience_settings(forward_settings(micro_batch_size=1)))
    for b in range(2):  # each row alone, without any padding
        ids = np.concatenate([q[b][qm[b] > 0], r[b][rmask[b] > 0]])[None]
        want = rm(jnp.asarray(ids), jnp.ones_like(jnp.asarray(ids)))[0][0]
        assert float(exp.scores[b]) == pytest.approx(float(want), abs=1e-5)


@pytest.mark.slow  # default-run budget (10 s); `make test-slow`
def test_eos_at_end_scores_every_response_at_an_eos(tiny_checkpoint, reward_dir):
    """reward.eos_at_end: the reward model reads each response with its last real token made
    EOS (a cut response loses its last token to EOS; one that stopped is unchanged)."""
    from ppo_jax.core import init_kl_controller
    from ppo_jax.models import split_model
    from ppo_jax.models import Model
    from ppo_jax.trainer.stages.ppo.experience import PPOModels, make_experience
    from tests.trainer.default_settings import experience_settings, forward_settings
    from ppo_jax.rollout.forward import Rollout
    from ppo_jax.rollout.forward import end_with_eos

    eos = 1
    r = np.array([[5, 6, eos, 0], [7, 8, 9, 10], [11, 0, 0, 0]], np.int32)
    rmask = np.array([[1, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]], np.int32)
    np.testing.assert_array_equal(end_with_eos(jnp.asarray(r), jnp.asarray(rmask), eos),
                                  [[5, 6, eos, 0], [7, 8, 9, eos], [11, 0, 0, 0]])

    actor, _ = load_model(tiny_checkpoint, "causal_lm")
    rm, _ = load_model(reward_dir, "reward")
    (ag, ap), (rg, rp) = split_model(actor), split_model(rm)
    q = np.array([[0, 3, 4], [3, 4, 5]], np.int32)
    qm = np.array([[0, 1, 1], [1, 1, 1]], np.int32)
    r, rmask = r[:2], rmask[:2]
    models = PPOModels(Model(ag, ap), Model(ag, ap), None, Model(rg, rp))
    rollout, kl = Rollout(q, qm, r, rmask), init_kl_controller("fixed", 0.1)
    exp, _, _ = make_experience(models, rollout, kl, None, jnp.array([True, False]),
                                settings=experience_settings(forward_settings(micro_batch_size=1,
                                                                            reward_eos_id=eos)))
    for b, resp in enumerate(([5, 6, eos], [7, 8, 9, eos])):
        ids = jnp.asarray([q[b][qm[b] > 0].tolist() + resp])
        want = rm(ids, jnp.ones_like(ids))[0][0]
        assert float(exp.scores[b]) == pytest.approx(float(want), abs=1e-5)
    plain, _, _ = make_experience(models, rollout, kl, None, jnp.array([True, False]),
                                  settings=experience_settings(forward_settings(micro_batch_size=1)))
    assert float(plain.scores[0]) == pytest.approx(float(exp.scores[0]), abs=1e-6)
    assert abs(float(plain.scores[1]) - float(exp.scores[1])) > 1e-4


def test_eos_at_end_is_for_a_reward_model_only(tiny_checkpoint):
    from ppo_jax.trainer.config import ConfigError
    with pytest.raises(ConfigError, match="reward.eos_at_end=true applies to reward.kind='model'"):
        load_config("configs/tiny.yaml", ["reward.eos_at_end=true"])
