"""The typed config: YAML + dotted overrides, rejected keys and types, cross-field checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from ppo_jax.trainer.config import Config, ConfigError, load_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_defaults_follow_trl():
    cfg = load_config()
    assert isinstance(cfg, Config)
    assert (cfg.ppo.kl_coef, cfg.ppo.target_kl, cfg.ppo.horizon) == (0.2, 6.0, 10000)
    assert (cfg.ppo.cliprange, cfg.ppo.cliprange_value, cfg.ppo.gamma, cfg.ppo.lam) == (0.2, 0.2, 1.0, 0.95)


def test_dotted_override_sets_typed_value():
    cfg = load_config(CONFIGS / "tiny.yaml", ["ppo.kl_coef=0.05", "train.steps=7", "ppo.reward_clip=3"])
    assert cfg.ppo.kl_coef == 0.05 and cfg.train.steps == 7
    assert cfg.ppo.reward_clip == 3.0 and isinstance(cfg.ppo.reward_clip, float)
    assert cfg.model.actor == "tiny-random"  # from the file


def test_unknown_key_is_rejected_with_its_name():
    with pytest.raises(ConfigError, match="kl_coeff"):
        load_config(None, ["ppo.kl_coeff=0.1"])


def test_wrong_type_is_rejected_with_its_name():
    with pytest.raises(ConfigError, match="ppo.batch_size"):
        load_config(None, ["ppo.batch_size=eight"])


def test_malformed_override_is_rejected():
    with pytest.raises(ConfigError, match="key=value"):
        load_config(None, ["ppo.kl_coef"])


def test_missing_config_file():
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        load_config("nope.yaml")


@pytest.mark.parametrize("overrides, field", [
    (["ppo.batch_size=6", "ppo.mini_batch_size=4"], "ppo.batch_size=6"),
    (["ppo.mini_batch_size=4", "ppo.micro_batch_size=3"], "ppo.mini_batch_size=4"),
    (["ppo.kl_estimator=k9"], "ppo.kl_estimator='k9'"),
    (["generation.temperature=0"], "generation.temperature=0"),
    (["reward.kind=model"], "model.reward_model"),
    (["mesh.fsdp=0"], "mesh.fsdp=0"),
    (["data.truncation=right"], "data.truncation='right'"),
])
def test_inconsistent_fields_name_the_field(overrides, field):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert field in str(err.value)


def test_shipped_configs_load():
    assert load_config(CONFIGS / "default.yaml").model.actor == "smollm2"
    big = load_config(CONFIGS / "llama_8b_gpu_tpu.yaml", ["model.actor=/ckpt/llama"])
    assert big.mesh.tensor == 4 and big.model.frozen_param_dtype == "bfloat16"
