"""Critic-free advantage estimators in the trainer: groups of samples per prompt, no critic
loaded or trained, ReMax's greedy baseline. The settings that need a critic are refused at load
with the other settings that have no effect: tests/trainer/test_no_effect_settings.py."""

from __future__ import annotations

import math
import sys
from dataclasses import replace
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from ppo_jax.trainer.config import ConfigError, load_config  # noqa: E402

TINY = ROOT / "configs/tiny.yaml"
PROMPTS = f"data.prompts={ROOT / 'configs/prompts/reviews.jsonl'}"


def trainer_for(tmp_path, estimator, *sets):
    from ppo_jax.trainer.stages.ppo.trainer import PPOTrainer

    return PPOTrainer(load_config(TINY, [PROMPTS, f"ppo.advantage_estimator={estimator}",
                                         "generation.samples_per_prompt=4", "ppo.batch_size=8",
                                         "ppo.mini_batch_size=4", "ppo.micro_batch_size=2",
                                         f"train.output_dir={tmp_path / 'run'}", "train.progress=false",
                                         *sets]))


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_plus_plus",
                                       "reinforce_plus_plus_baseline", "remax"])
def test_a_critic_free_step_trains_the_actor_and_no_critic(estimator, tmp_path, monkeypatch):
    monkeypatch.setenv("PPO_JAX_CACHE", str(tmp_path / "cache"))
    trainer = trainer_for(tmp_path, estimator)
    assert trainer.models.critic is None and trainer.state["critic"] is None
    before = jax.tree.map(np.asarray, trainer.state["actor"].params)
    metrics = trainer.step()
    assert math.isfinite(metrics["pg_loss"]) and "vf_loss" not in metrics
    assert metrics["ratio_first_minibatch"] == pytest.approx(1.0, abs=1e-6)
    assert metrics["data_position"] == 2  # 8 rows = 2 prompts x 4 samples
    moved = jax.tree.map(lambda a, b: float(np.abs(a - np.asarray(b)).max()), before,
                         trainer.state["actor"].params)
    assert max(jax.tree.leaves(moved)) > 0


def test_grpo_advantages_are_the_group_normalised_scores_of_the_rollout(tmp_path, monkeypatch):
    """The experience of one GRPO step: rows of a prompt share a group; each row's advantage on
    every token is (score - group mean) / (unbiased group std + 1e-6), whitened over the batch
    (ppo.whiten_advantages is on by default; off here to read the raw formula)."""
    monkeypatch.setenv("PPO_JAX_CACHE", str(tmp_path / "cache"))
    trainer = trainer_for(tmp_path, "grpo", "ppo.whiten_advantages=false", "ppo.kl_coef=0.0")
    captured = {}
    experience = trainer.jit.experience

    def spy(*args):
        out = experience(*args)
        captured["exp"] = out.experience
        return out

    trainer.jit = replace(trainer.jit, experience=spy)
    trainer.step()
    exp = captured["exp"]
    np.testing.assert_array_equal(exp.group_ids, [0, 0, 0, 0, 1, 1, 1, 1])
    scores, mask = np.asarray(exp.scores, np.float64), np.asarray(exp.response_mask)
    for g in range(2):
        s = scores[4 * g: 4 * g + 4]
        want = (s - s.mean()) / (s.std(ddof=1) + 1e-6)
        for i in range(4):
            row = 4 * g + i
            adv = np.asarray(exp.advantages[row])[mask[row] > 0]
            np.testing.assert_allclose(adv, want[i], atol=1e-5)
    # prompts of a group are the same prompt
    q = np.asarray(exp.query_ids)
    assert (q[0] == q[3]).all() and (q[4] == q[7]).all()


def test_remax_baseline_is_the_greedy_response_score(tmp_path, monkeypatch):
    monkeypatch.setenv("PPO_JAX_CACHE", str(tmp_path / "cache"))
    trainer = trainer_for(tmp_path, "remax", "generation.samples_per_prompt=1")
    ids = jnp.asarray(trainer.prompts.ids[:8])
    mask = jnp.asarray(trainer.prompts.mask[:8])
    actor = trainer.ppo_models(trainer.state["actor"].params).actor
    baseline = trainer.greedy_baseline(actor, ids, mask, jax.random.PRNGKey(0),
                                       trainer.prompts.texts[:8])
    g_resp, g_mask = trainer.jit.sampler(actor, ids, mask, jax.random.PRNGKey(1),
                                         trainer.settings.greedy_baseline)[:2]
    texts = trainer.decode(np.asarray(g_resp), np.asarray(g_mask))
    want = trainer.reward_fn(trainer.prompts.texts[:8], texts)  # greedy: the key does not matter
    np.testing.assert_allclose(np.asarray(baseline), want, atol=1e-6)


def test_batch_must_hold_whole_groups():
    with pytest.raises(ConfigError, match="samples_per_prompt=3"):
        load_config(TINY, ["generation.samples_per_prompt=3"])
