"""RLVR in the trainer (issue 25): the tiny RLVR config end to end, DAPO's dynamic sampling
(the batch keeps its shape and holds exactly the informative groups) and overlong shaping in
the experience, and every recipe config loading."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from ppo_jax.core import init_kl_controller
from ppo_jax.trainer.stages.ppo.experience import PPOModels, make_experience
from tests.trainer.default_settings import experience_settings, forward_settings
from ppo_jax.rollout.forward import Rollout
from ppo_jax.trainer.config import load_config
from ppo_jax.trainer.data.tasks import PLAIN_INSTRUCTION
from ppo_jax.trainer.rewards.functions import register_reward_function
from ppo_jax.trainer.stages.ppo.dynamic import select_rollout

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import train  # noqa: E402

TINY_RLVR = ROOT / "configs/rlvr/tiny.yaml"


def rows_of(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_tiny_rlvr_config_runs_and_logs_accuracy_and_pass_at_k(tmp_path, monkeypatch):
    """... and the figures format cannot inflate: the format rate, the format-free accuracy
    and, with eval.plain_instruction, the plain-instruction accuracy (docs/rlvr.md)."""
    monkeypatch.setenv("PPO_JAX_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    assert train.main(["--config", str(TINY_RLVR), "--set", f"train.output_dir={out}",
                       "--set", "train.progress=false", "--set", "eval.every=2",
                       "--set", "train.save_every=0", "--set", "train.export_hf=false",
                       "--set", f"eval.plain_instruction={PLAIN_INSTRUCTION}"]) == 0
    rows = rows_of(out)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in (rows[0], rows[2]):  # the evaluations
        assert 0.0 <= r["eval/accuracy"] <= r["eval/pass@2"] <= 1.0
        for key in ("eval/format", "eval/accuracy_format_free", "eval/accuracy_plain"):
            assert 0.0 <= r[key] <= 1.0
    for r in rows[1:]:
        assert {"reward/accuracy", "reward/format", "reward/accuracy_format_free", "pg_loss",
                "kl"} <= set(r)
        assert r["score_mean"] == pytest.approx(r["reward/accuracy"] + 0.1 * r["reward/format"],
                                                abs=1e-6)
    samples = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert all(s["response"].startswith("<answer>") for s in samples)  # data.response_prefix
    config = json.loads((out / "config.json").read_text())
    assert config["data"]["task"]["name"] == "chain_sum" and config["ppo"]["advantage_estimator"] == "grpo"


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "gspo", "dapo", "ppo", "ppo_shared"])
def test_recipe_configs_load_on_the_rlvr_base(name):
    cfg = load_config(ROOT / f"configs/rlvr/{name}.yaml")
    assert cfg.data.prompts == "task" and cfg.reward.function == "reasoning_gym"
    assert cfg.generation.samples_per_prompt == 8 and cfg.train.output_dir == f"runs/rlvr_{name}"
    want = {"gspo": ("gspo", 0.2)}.get(name, ("ppo_clip", 0.2))
    assert (cfg.ppo.policy_loss, cfg.ppo.cliprange) == want
    if name == "gspo":  # the paper's clip and unbounded lengths fail at 6 tokens (results/rlvr/log.md)
        assert cfg.ppo.cliprange_high == 0.28 and cfg.ppo.overlong_buffer == 4
    if name == "ppo_shared":  # ppo.yaml's critic on the actor, its head at its own rate
        assert cfg.model.shared_critic and cfg.ppo.advantage_estimator == "gae"
        assert cfg.optim.value_head_lr == 1e-3 and cfg.ppo.critic_warmup_steps == 0
        assert cfg.ppo.dynamic_sampling and (cfg.ppo.lam, cfg.ppo.critic_lam) == (1.0, 1.0)
    if name == "ppo":  # no value pre-training: it lost on both seeds (results/rlvr/log.md)
        assert cfg.ppo.critic_warmup_steps == 0 and not cfg.model.shared_critic


def test_select_rollout_keeps_the_shape_and_exactly_the_informative_groups():
    """Two rounds of 3 groups x 2 samples; informative groups (scores differ): round 0 group 1,
    round 1 groups 0 and 2. Keep 3: those three, in the order drawn."""
    n, b = 2, 6
    ids = [jnp.arange(b)[:, None] + 100 * r for r in range(2)]  # row r*100 + i marks its source
    rollouts = tuple(Rollout(x, x, x, x) for x in ids)
    scores = (jnp.asarray([1., 1., 0., 1., 0., 0.]), jnp.asarray([0., 1., 1., 1., 1., 0.]))
    rollout, kept_scores, rows, kept = select_rollout(rollouts, scores, keep=3, n=n)
    np.testing.assert_array_equal(np.asarray(rows), [2, 3, 6, 7, 10, 11])
    np.testing.assert_array_equal(np.asarray(rollout.response_ids[:, 0]), [2, 3, 100, 101, 104, 105])
    np.testing.assert_array_equal(np.asarray(kept_scores), [0, 1, 0, 1, 1, 0])
    assert int(kept) == 3 and rollout.query_ids.shape == (b, 1)
    # one informative group only: the batch is filled with the first uninformative ones
    flat = (jnp.asarray([1., 1., 0., 0., 1., 0.]),)
    _, s, rows, kept = select_rollout(rollouts[:1], flat, keep=3, n=n)
    np.testing.assert_array_equal(np.asarray(rows), [4, 5, 0, 1, 2, 3])
    assert int(kept) == 1


@register_reward_function("test_parity", override=True)
def parity_reward(format_weight: float = 0.0):  # the recipe's function_kwargs, unused
    """1 for responses with an even number of characters: some groups differ, some do not."""
    return lambda prompts, responses: np.asarray([len(r) % 2 == 0 for r in responses], np.float32)


def test_dynamic_sampling_trains_on_informative_groups_with_a_static_batch(tmp_path, monkeypatch):
    monkeypatch.setenv("PPO_JAX_CACHE", str(tmp_path / "cache"))
    from ppo_jax.trainer.stages.ppo.trainer import PPOTrainer

    cfg = load_config(TINY_RLVR, [f"train.output_dir={tmp_path / 'run'}", "train.progress=false",
                                  "reward.function=test_parity",
                                  "generation.samples_per_prompt=2", "ppo.batch_size=8",
                                  "ppo.mini_batch_size=4", "ppo.dynamic_sampling=true",
                                  "ppo.max_sampling_rounds=4", "eval.prompts=null"])
    trainer = PPOTrainer(cfg)
    sampled = trainer.dynamic_rollout()
    scores = np.asarray(sampled.scores).reshape(4, 2)
    stats = sampled.reward_stats
    kept = round(4 * (1 - stats["dynamic_sampling/filled_fraction"]))
    assert sampled.rollout.response_ids.shape[0] == 8 and sampled.rollout.query_ids.shape[0] == 8
    assert np.all(scores[:kept, 0] != scores[:kept, 1])  # the informative groups come first
    assert np.all(scores[kept:, 0] == scores[kept:, 1])
    rounds = stats["dynamic_sampling/rounds"]
    assert 1 <= rounds <= 4 and trainer.prompt_order.position == 4 * rounds
    assert kept == 4 or rounds == 4  # stopped early only with a full batch
    metrics = trainer.step()
    assert np.isfinite(metrics["pg_loss"]) and "dynamic_sampling/kept_fraction" in metrics


def test_overlong_punishment_is_added_to_the_score_before_shaping(tiny_checkpoint):
    from ppo_jax.models import Model, load_model, split_model

    actor, _ = load_model(tiny_checkpoint, "causal_lm")
    graphdef, params = split_model(actor)
    lengths = np.array([5, 3, 1, 4])
    mask = jnp.asarray(np.arange(5)[None] < lengths[:, None], jnp.int32)
    ids = jnp.full((4, 5), 7, jnp.int32)
    models = PPOModels(Model(graphdef, params), Model(graphdef, params))
    settings = experience_settings(forward=forward_settings(micro_batch_size=4), overlong_buffer=2,
                                  overlong_penalty_factor=0.5, max_response_length=5,
                                  advantage_estimator="grpo", whiten_advantages=False)
    exp, _, stats = make_experience(models, Rollout(ids, jnp.ones_like(ids), ids, mask),
                                    init_kl_controller("fixed", 0.0), jnp.ones(4),
                                    jnp.ones(4, bool), settings=settings)
    # L_max 5, L_cache 2: lengths 5, 3, 1, 4 -> -1, 0, 0, -0.5; times 0.5
    np.testing.assert_allclose(np.asarray(exp.scores), [0.5, 1.0, 1.0, 0.75])
    assert float(stats["overlong_penalty"]) == pytest.approx(-0.1875)
    assert float(stats["score_mean"]) == 1.0  # the raw score
