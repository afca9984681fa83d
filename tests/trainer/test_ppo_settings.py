"""`stages.ppo.settings`: every static setting of a PPO step is built once from the config, each
field written out from its key; every field that has a config key's name carries its value (the
dataclasses have no defaults of their own to hold equal)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import pytest

from ppo_jax.trainer.config import load_config
from ppo_jax.trainer.stages.ppo.settings import engine_settings, settings_for

ROOT = Path(__file__).resolve().parents[2]


def test_each_setting_is_the_config_value_of_the_same_name():
    cfg = load_config(ROOT / "configs/tiny.yaml", [
        "ppo.gamma=0.9", "ppo.lam=0.7", "ppo.cliprange=0.3", "generation.temperature=0.8",
        "model.logprob_chunk_size=16", "ppo.advantage_kwargs={method: scan}",
        "eval.temperature=0.5", "eval.greedy=true", "eval.max_new_tokens=6"])
    s = settings_for(cfg, stop_token_ids=(2, 7), pad_token_id=3)
    assert (s.experience.gamma, s.experience.lam, s.update.cliprange) == (0.9, 0.7, 0.3)
    assert s.experience.advantage_kwargs == (("method", "scan"),)  # hashable: a static argument
    assert s.experience.forward.temperature == s.update.temperature == s.sampling.temperature == 0.8
    assert s.experience.forward.logprob_chunk_size == s.update.logprob_chunk_size == 16
    assert s.experience.forward.micro_batch_size == s.update.micro_batch_size == cfg.ppo.micro_batch_size
    assert s.update.max_response_length == cfg.generation.max_new_tokens
    assert (s.sampling.stop_token_ids, s.sampling.pad_token_id) == ((2, 7), 3)
    ev = s.eval
    assert (ev.sampling.temperature, ev.sampling.greedy, ev.sampling.max_new_tokens) == (0.5, True, 6)
    assert ev.forward.temperature == 0.5 and ev.sampling.top_p == s.sampling.top_p
    hash(s)  # every part is a static jit argument


def test_ignore_eos_samples_without_stop_tokens():
    cfg = load_config(ROOT / "configs/tiny.yaml", ["generation.ignore_eos=true"])
    s = settings_for(cfg, stop_token_ids=(2,))
    assert s.sampling.stop_token_ids == () and s.eval.sampling.stop_token_ids == ()


# every key a settings field is named after, set away from its default: (key, value)
CHANGED = [
    ("ppo.ppo_epochs", 3), ("ppo.mini_batch_size", 4), ("ppo.micro_batch_size", 2),
    ("ppo.policy_loss", "ppo_clip"), ("ppo.cliprange", 0.3), ("ppo.cliprange_high", 0.28),
    ("ppo.dual_clip", 3.0), ("ppo.cliprange_value", 0.4), ("ppo.loss_aggregation", "seq-mean-token-sum"),
    ("ppo.entropy_coef", 0.01), ("ppo.kl_loss_coef", 0.02), ("ppo.kl_loss_estimator", "kl"),
    ("ppo.vf_coef", 0.3), ("ppo.rollout_correction", "tis"), ("ppo.rollout_correction_cap", 3.0),
    ("ppo.kl_estimator", "abs"), ("ppo.reward_clip", 5.0), ("ppo.score_scale", 2.0),
    ("ppo.missing_eos_penalty", -1.0), ("ppo.whiten_rewards", True), ("ppo.whiten_advantages", False),
    ("ppo.gamma", 0.9), ("ppo.lam", 0.7), ("ppo.overlong_buffer", 2), ("ppo.overlong_penalty_factor", 0.5),
    ("ppo.critic_lam", 1.0), ("ppo.lam_length_alpha", 0.05),
    ("generation.temperature", 0.8), ("generation.top_k", 5), ("generation.top_p", 0.9),
    ("generation.greedy", True), ("generation.max_new_tokens", 7), ("model.logprob_chunk_size", 16),
    ("generation.page_size", 4), ("generation.num_pages", 64), ("generation.max_concurrent", 4),
    ("generation.decode_chunk", 2), ("generation.decode_buckets", 2),
]


def _fields(obj) -> dict:
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


def test_every_field_named_after_a_config_key_carries_its_value():
    """Each `(key, value)` of CHANGED reaches every settings field of the key's name, with
    max_new_tokens also as max_response_length (the overlong punishment's and
    seq-mean-token-sum's length)."""
    cfg = load_config(ROOT / "configs/tiny.yaml", [f"{k}={v}" for k, v in CHANGED]  # vf_coef:
                      + ["generation.engine=paged", "ppo.batch_size=8", "model.shared_critic=true"])
    s = settings_for(cfg)
    parts = [s.sampling, s.experience, s.experience.forward, s.update, engine_settings(cfg)]
    want = {k.split(".")[1]: v for k, v in CHANGED}
    want["max_response_length"] = want["max_new_tokens"]
    seen = set()
    for part in parts:
        for name, value in _fields(part).items():
            if name in want:
                assert value == want[name], f"{type(part).__name__}.{name}: {value!r}"
                seen.add(name)
    assert seen == set(want), sorted(set(want) - seen)


@pytest.mark.parametrize("share,want", [(True, 4), (False, 1)])
def test_the_training_sampler_shares_each_groups_prefill_unless_switched_off(share, want):
    cfg = load_config(ROOT / "configs/tiny.yaml", [
        "generation.samples_per_prompt=4", "ppo.batch_size=8", "ppo.advantage_estimator=grpo",
        f"generation.share_prompt_prefill={str(share).lower()}"])
    s = settings_for(cfg)
    assert s.sampling.samples_per_prompt == want
    assert s.eval.sampling.samples_per_prompt == 1  # held-out prompts: one sample each


def test_the_gae_lambda_keys_reach_the_estimator_only_when_set():
    """ppo.critic_lam null and ppo.lam_length_alpha 0 (the defaults) pass nothing new to the
    estimator (a fork's estimator need not take them): one lambda, today's GAE."""
    s = settings_for(load_config(ROOT / "configs/tiny.yaml")).experience
    assert (s.critic_lam, s.lam_length_alpha) == (None, 0.0)
    assert s.estimator_fixed_kwargs() == {"gamma": s.gamma, "lam": s.lam}
    s = settings_for(load_config(ROOT / "configs/tiny.yaml", [
        "ppo.critic_lam=1.0", "ppo.lam_length_alpha=0.05"])).experience
    assert s.estimator_fixed_kwargs() == {"gamma": s.gamma, "lam": s.lam, "critic_lam": 1.0,
                                          "lam_length_alpha": 0.05}
