"""`stages.ppo.settings`: every static setting of a PPO step is built once from the config, each
field read from the config section of the same name, with no hand copy."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import pytest

from ppo_jax.trainer.config import load_config
from ppo_jax.trainer.stages.ppo.settings import settings_for, settings_from

ROOT = Path(__file__).resolve().parents[2]


def test_each_setting_is_the_config_value_of_the_same_name():
    cfg = load_config(ROOT / "configs/tiny.yaml", [
        "ppo.gamma=0.9", "ppo.lam=0.7", "ppo.cliprange=0.3", "generation.temperature=0.8",
        "model.logprob_chunk_size=16", "ppo.advantage_kwargs={method: scan}",
        "eval.temperature=0.5", "eval.greedy=true", "eval.max_new_tokens=6"])
    s = settings_for(cfg, stop_token_ids=(2, 7), pad_token_id=3)
    assert (s.experience.gamma, s.experience.lam, s.update.cliprange) == (0.9, 0.7, 0.3)
    assert s.experience.advantage_kwargs == (("method", "scan"),)  # hashable: a static argument
    assert s.experience.scoring.temperature == s.update.temperature == s.sampling.temperature == 0.8
    assert s.experience.scoring.logprob_chunk_size == s.update.logprob_chunk_size == 16
    assert s.experience.scoring.micro_batch_size == s.update.micro_batch_size == cfg.ppo.micro_batch_size
    assert s.update.max_response_length == cfg.generation.max_new_tokens
    assert (s.sampling.stop_token_ids, s.sampling.pad_token_id) == ((2, 7), 3)
    ev = s.eval
    assert (ev.sampling.temperature, ev.sampling.greedy, ev.sampling.max_new_tokens) == (0.5, True, 6)
    assert ev.scoring.temperature == 0.5 and ev.sampling.top_p == s.sampling.top_p
    hash(s)  # every part is a static jit argument


def test_ignore_eos_samples_without_stop_tokens():
    cfg = load_config(ROOT / "configs/tiny.yaml", ["generation.ignore_eos=true"])
    s = settings_for(cfg, stop_token_ids=(2,))
    assert s.sampling.stop_token_ids == () and s.eval.sampling.stop_token_ids == ()


def test_a_field_in_no_section_or_in_two_must_be_given():
    @dataclass(frozen=True)
    class Wants:
        gamma: float
        temperature: float

    cfg = load_config(ROOT / "configs/tiny.yaml")
    assert settings_from(Wants, (cfg.ppo, cfg.generation)) == Wants(cfg.ppo.gamma,
                                                                    cfg.generation.temperature)
    with pytest.raises(TypeError, match="Wants.temperature: in no config section"):
        settings_from(Wants, (cfg.ppo,))
    with pytest.raises(TypeError, match=r"Wants.temperature: in \['GenerationConfig', 'EvalConfig'\]"):
        settings_from(Wants, (cfg.ppo, cfg.generation, cfg.eval))
    assert settings_from(Wants, (cfg.ppo, cfg.generation, cfg.eval), temperature=2.0).temperature == 2.0
    assert dataclasses.is_dataclass(settings_from(Wants, (cfg.ppo,), temperature=1.0))


@pytest.mark.parametrize("share,want", [(True, 4), (False, 1)])
def test_the_training_sampler_shares_each_groups_prefill_unless_switched_off(share, want):
    cfg = load_config(ROOT / "configs/tiny.yaml", [
        "generation.samples_per_prompt=4", "ppo.batch_size=8", "ppo.advantage_estimator=grpo",
        f"generation.share_prompt_prefill={str(share).lower()}"])
    s = settings_for(cfg)
    assert s.sampling.samples_per_prompt == want
    assert s.eval.sampling.samples_per_prompt == 1  # held-out prompts: one sample each
