"""The typed config: YAML + dotted overrides, rejected keys and types, cross-field checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from ppo_jax.rollout.forward import ROUTER_REPLAYS
from ppo_jax.trainer.config import Config, ConfigError, load_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_the_defaults_are_the_shipped_default_run():
    """One source for every setting: the schema's defaults are configs/default.yaml's run, so
    `train.py` with no file, with that file and a `Config()` built in Python are one run."""
    cfg = load_config()
    assert isinstance(cfg, Config)
    assert cfg == load_config(CONFIGS / "default.yaml") == Config()
    assert (cfg.ppo.kl_coef, cfg.ppo.kl_controller, cfg.data.prompts, cfg.train.steps) == (
        0.05, "fixed", "configs/prompts/everyday.jsonl", 40)


def test_a_file_naming_three_keys_is_the_default_run_with_those_three(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("ppo:\n  kl_coef: 0.1\ngeneration:\n  max_new_tokens: 24\n"
                    "train:\n  output_dir: runs/mine\n")
    want = Config()
    want.ppo.kl_coef, want.generation.max_new_tokens, want.train.output_dir = 0.1, 24, "runs/mine"
    assert load_config(path) == want
    assert load_config(path) == load_config(CONFIGS / "default.yaml", [
        "ppo.kl_coef=0.1", "generation.max_new_tokens=24", "train.output_dir=runs/mine"])


def test_keys_the_default_run_leaves_unset_follow_trl():
    cfg = load_config()
    assert (cfg.ppo.target_kl, cfg.ppo.horizon) == (6.0, 10000)
    assert (cfg.ppo.cliprange, cfg.ppo.cliprange_value, cfg.ppo.gamma, cfg.ppo.lam) == (0.2, 0.2, 1.0, 0.95)
    assert (cfg.generation.temperature, cfg.generation.top_k, cfg.generation.top_p) == (1.0, 0, 1.0)


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
    (["ppo.kl_estimator=k9"], "config key 'ppo.kl_estimator': Invalid value 'k9'"),
    (["generation.temperature=0"], "generation.temperature=0"),
    (["reward.kind=model"], "model.reward_model"),
    (["mesh.fsdp=0"], "mesh.fsdp=0"),
    (["data.truncation=right"], "config key 'data.truncation': Invalid value 'right'"),
    (["model.logprob_chunk_size=-1"], "model.logprob_chunk_size=-1"),
    (["ppo.critic_lam=1.5"], "ppo.critic_lam=1.5 must lie in [0, 1]"),
    (["ppo.packing=true", "ppo.micro_batch_tokens=40", "data.max_prompt_length=32",
      "generation.max_new_tokens=16"],
     "ppo.micro_batch_tokens=40 is less than the longest sequence, data.max_prompt_length + "
     "generation.max_new_tokens = 48 tokens"),
    (["ppo.critic_lam=-0.1"], "ppo.critic_lam=-0.1 must lie in [0, 1]"),
    (["ppo.lam_length_alpha=-0.05"], "ppo.lam_length_alpha=-0.05 must be >= 0"),
    (["ppo.lam_length_alpha=inf"], "ppo.lam_length_alpha=inf must be a finite number"),
    (["ppo.advantage_kwargs.critic_lam=1.0"], "ppo.advantage_kwargs.critic_lam: the trainer passes"),
    (["ppo.advantage_kwargs.lam_length_alpha=0.05"], "ppo.advantage_kwargs.lam_length_alpha"),
    (["train.max_minutes=0"], "train.max_minutes=0.0 must be > 0 minutes"),
    (["train.max_minutes=nan"], "train.max_minutes=nan must be a finite number"),
    (["train.max_minutes=-5"], "train.max_minutes=-5.0 must be > 0 minutes"),
    (["ppo.rollout_correction=is"], "config key 'ppo.rollout_correction': Invalid value 'is'"),
    (["ppo.rollout_correction=tis", "ppo.rollout_correction_cap=0.5"],
     "ppo.rollout_correction_cap=0.5"),
    (["ppo.rollout_correction=mis", "ppo.rollout_correction_cap=inf"],
     "ppo.rollout_correction_cap=inf"),
    (["stage=sft", "sft.data=x.jsonl", "sft.backbone_lr_scale=0.5"], "sft.backbone_lr_scale=0.5"),
    (["optim.value_head_lr=1e-4"], "optim.value_head_lr=0.0001 sets the learning rate"),
    (["model.shared_critic=true", "optim.value_head_lr=0"], "optim.value_head_lr=0.0 must be > 0"),
    (["stage=reward_model", "model.reward_model=m", "reward_model.data=x.jsonl",
      "reward_model.backbone_lr_scale=-1"], "reward_model.backbone_lr_scale=-1.0"),
    (["env.name=calculator", "env.concurrency=0"],
     "env.concurrency=0 must be an int >= 1 (environment calls a process runs at once)"),
    (["env.name=calculator", "env.concurrency=-3"], "env.concurrency=-3 must be an int >= 1"),
    (["env.name=calculator", "env.concurrency=1.5"],
     "config key 'env.concurrency': Value '1.5' of type 'float' could not be converted"),
    (["env.name=calculator", "env.concurrency=true"],
     "config key 'env.concurrency': Value 'True' of type 'bool' could not be converted"),
])
def test_inconsistent_fields_name_the_field(overrides, field):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert field in str(err.value)


def test_shipped_configs_load(tmp_path):
    """Every shipped config loads (none sets a key that another leaves without effect), and so
    does the config.json a run of it writes (every key, the defaults spelled out)."""
    import json

    from ppo_jax.trainer.config import to_dict

    for path in sorted(CONFIGS.glob("*.yaml")) + sorted(CONFIGS.glob("rlvr/*.yaml")):
        cfg = load_config(path)
        saved = tmp_path / f"{path.stem}.json"
        saved.write_text(json.dumps(to_dict(cfg)))
        assert load_config(saved) == cfg, path.name
    assert load_config(CONFIGS / "default.yaml").model.actor == "smollm2"
    big = load_config(CONFIGS / "llama_8b_gpu_tpu.yaml", ["model.actor=/ckpt/llama"])
    assert big.mesh.tensor == 8 and big.model.frozen_param_dtype == "bfloat16"
    assert big.model.logprob_chunk_size == 4096  # no [B, T, V] float32 logits at V = 128k


def _code_accepts():
    """config key -> (the code's list of names, a call of the code that uses the name)."""
    import dataclasses

    import jax.numpy as jnp

    from ppo_jax.core import check_estimator, init_kl_controller
    from ppo_jax.core.aggregation import LOSS_AGGREGATIONS, aggregate
    from ppo_jax.core.gae import GAE_METHODS, compute_gae
    from ppo_jax.core.kl import KL_ESTIMATORS
    from ppo_jax.core.kl_control import KL_CONTROLLER_KINDS
    from ppo_jax.core.rollout_correction import ROLLOUT_CORRECTIONS, check_rollout_correction
    from ppo_jax.models.config import DTYPES, remat_policy_names
    from ppo_jax.models.lora import INITS, fresh_adapter
    from ppo_jax.models.tiny_random import tiny_config, tiny_tokenizer
    from ppo_jax.rollout.engine_layout import ATTENTION_KERNELS, ENGINES, engine_layout
    from tests.rollout.sampling_settings import engine_settings
    from ppo_jax.rollout.observations import OBSERVATION_ROLES, observation_frame
    from ppo_jax.rollout.stream import KV_ON_SWITCH
    from ppo_jax.rollout.weights import PLACEMENTS, ROLLOUT_LAYOUTS, resolve_layout
    from ppo_jax.trainer.data.prompts import TRUNCATIONS, tokenize_prompts
    from ppo_jax.trainer.optim import SCHEDULES, make_schedule
    from ppo_jax.trainer.rewards.functions import REWARD_KINDS
    from ppo_jax.trainer.stages import STAGES, trainer_class

    from ppo_jax.models.attention_kernels import ATTENTION_KERNELS as SEQUENCE_ATTENTION

    model = tiny_config(64)
    tok = tiny_tokenizer()
    ones = jnp.ones((1, 3))
    dtype = (DTYPES, lambda v: dataclasses.replace(model, dtype=v, param_dtype=v))
    return {
        "stage": (STAGES, trainer_class),
        "model.param_dtype": dtype, "model.dtype": dtype, "model.frozen_param_dtype": dtype,
        "model.remat": (remat_policy_names(), lambda v: dataclasses.replace(model, remat=v)),
        "model.attention": (SEQUENCE_ATTENTION, lambda v: dataclasses.replace(model, attention=v)),
        "model.lora.init": (INITS, lambda v: fresh_adapter("x/lora_a", (1, 4, 2), "float32", 0, v)),
        "data.truncation": (TRUNCATIONS, lambda v: tokenize_prompts(
            ["the bus was late"], tok, max_prompt_length=32, truncation=v, pad_token_id=0)),
        "ppo.kl_controller": (tuple(KL_CONTROLLER_KINDS), lambda v: init_kl_controller(v, 0.1, 6.0, 10000)),
        "ppo.kl_estimator": (KL_ESTIMATORS, check_estimator),
        "ppo.kl_loss_estimator": (KL_ESTIMATORS, check_estimator),
        "ppo.loss_aggregation": (LOSS_AGGREGATIONS, lambda v: aggregate(ones, ones, v)),
        "ppo.rollout_correction": (ROLLOUT_CORRECTIONS, lambda v: check_rollout_correction(v, 2.0)),
        "ppo.advantage_kwargs.method": (GAE_METHODS, lambda v: compute_gae(
            ones, ones, ones, gamma=1.0, lam=0.9, method=v)),
        "optim.schedule": (SCHEDULES, lambda v: make_schedule(1e-3, schedule=v, warmup_steps=0, total_steps=3)),
        "reward.kind": (REWARD_KINDS, None),
        "model.router_replay": (ROUTER_REPLAYS, None),
        "env.observation_role": (OBSERVATION_ROLES, lambda v: observation_frame(tok, v)),
        "generation.engine": (ENGINES, None),
        "generation.attention": (ATTENTION_KERNELS, lambda v: engine_layout(
            engine_settings(attention=v), batch=2, prompt_width=8, max_new_tokens=8,
            group_size=1, replicas=1)),
        "generation.rollout_layout": (ROLLOUT_LAYOUTS, lambda v: resolve_layout(v, "paged")),
        "generation.placement": (PLACEMENTS, None),
        "generation.kv_on_switch": (KV_ON_SWITCH, None),
    }


def test_every_enumerated_choice_is_accepted_by_config_exactly_when_the_code_accepts_it():
    """Issue 12: one source of truth per choice: the config takes its list from the code that uses
    the name, so each name the code lists passes the config and works in the code, and a name
    the code does not know is refused by both, the config's error naming the key and the list."""
    import typing
    import warnings

    from ppo_jax.core.kl import KL_ESTIMATORS
    from ppo_jax.trainer.config import _leaves

    accepts = _code_accepts()
    kinds = {k: t for k, _, t in _leaves(Config())}
    literal_keys = {k for k, t in kinds.items() if typing.get_origin(t) is typing.Literal}
    assert literal_keys == set(accepts) - {"ppo.advantage_kwargs.method"}  # every enumerated field
    extra = {"stage=reward_model": ["reward_model.data=x.jsonl", "model.reward_model=smollm2"],
             "stage=sft": ["sft.data=x.jsonl"], "reward.kind=model": ["model.reward_model=rm"],
             # keys read only under another setting (config.no_effect): that setting too
             "generation.attention=pallas": ["generation.engine=paged"],
             "generation.placement=split": ["generation.rollout_devices=2"],
             "generation.kv_on_switch=keep": [
                 "ppo.max_staleness=1", "generation.placement=split",
                 "generation.rollout_devices=2", "generation.engine=paged",
                 "ppo.rollout_correction=tis"],
             **{f"ppo.kl_loss_estimator={n}": ["ppo.kl_loss_coef=0.1"] for n in KL_ESTIMATORS},
             "env.observation_role=tool": ["env.name=calculator"]}
    for key, (names, use) in accepts.items():
        if key in kinds:
            assert set(typing.get_args(kinds[key])) == set(names), key
        for name in names:
            item = f"{key}={name}"
            cfg = load_config(None, [item] + extra.get(item, []))
            assert str(eval(f"cfg.{key}") if "kwargs" not in key else cfg.ppo.advantage_kwargs["method"]) == name
            if use is not None:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    use(name)  # the code takes it
        with pytest.raises(ConfigError) as err:
            load_config(None, [f"{key}=bogus"])
        assert key in str(err.value) and "bogus" in str(err.value)
        assert all(repr(n) in str(err.value) for n in names), str(err.value)
        if use is not None:
            with pytest.raises(ValueError):
                use("bogus")


def test_remat_names_of_the_model_layer_pass_the_config():
    """The failing case of issue 12: `dots` (listed by an old comment) is refused by the config with
    the accepted names; `dots_saveable`, a name the model layer takes, is accepted."""
    with pytest.raises(ConfigError, match=r"model.remat.*'dots'.*'dots_saveable'"):
        load_config(None, ["model.remat=dots"])
    assert load_config(None, ["model.remat=dots_saveable"]).model.remat == "dots_saveable"


def test_help_config_lists_every_key_with_type_default_and_help(capsys):
    import train
    from ppo_jax.trainer.config import _leaves, describe

    text = describe()
    for key, value, _ in _leaves(Config()):
        line = next(ln for ln in text.splitlines() if ln.strip().startswith(f"{key}:"))
        assert repr(value) in line
        help_line = text.splitlines()[text.splitlines().index(line) + 1].strip()
        assert help_line, f"{key} has no help text"
    assert "model.remat: one of: none | full | dots_saveable" in text
    assert train.main(["--config", str(CONFIGS / "tiny.yaml"), "--help-config"]) == 0
    out = capsys.readouterr().out
    assert "model.actor: str = 'smollm2'" in out and "tiny.yaml: 'tiny-random'" in out


def test_logprob_chunk_size_reaches_the_experience_and_update_settings():
    from ppo_jax.trainer.stages.ppo.settings import settings_for

    assert load_config(None).model.logprob_chunk_size == 0  # full logits unless asked
    settings = settings_for(load_config(None, ["model.logprob_chunk_size=4096"]))
    assert settings.experience.forward.logprob_chunk_size == 4096
    assert settings.update.logprob_chunk_size == 4096


def test_a_bad_rollout_correction_is_refused_at_load_and_a_good_one_reaches_the_update():
    from ppo_jax.trainer.config.checks import validate
    from ppo_jax.trainer.stages.ppo.settings import settings_for

    with pytest.raises(ConfigError, match=r"ppo.rollout_correction.*'is'.*\['none', 'tis', 'mis', "
                                          r"'icepop'\]"):
        load_config(None, ["ppo.rollout_correction=is"])
    with pytest.raises(ConfigError, match=r"ppo.rollout_correction='tis', "
                                          r"ppo.rollout_correction_cap=0.9: .*>= 1"):
        load_config(None, ["ppo.rollout_correction=tis", "ppo.rollout_correction_cap=0.9"])
    cfg = Config()
    cfg.ppo.rollout_correction = "sis"  # a Config built in Python is checked too
    with pytest.raises(ConfigError, match="ppo.rollout_correction='sis'"):
        validate(cfg)
    upd = settings_for(load_config(None, ["ppo.rollout_correction=mis",
                                          "ppo.rollout_correction_cap=3"])).update
    assert (upd.rollout_correction, upd.rollout_correction_cap) == ("mis", 3.0)
    assert settings_for(load_config(None)).update.rollout_correction == "none"
