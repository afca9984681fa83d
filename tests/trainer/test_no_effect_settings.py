"""Settings that do nothing are refused at load (issue 54): for every row of
`config.no_effect.NO_EFFECT`, the key set under its condition is a `ConfigError` naming the key,
its value and the settings that leave it unread, while the same key where it applies loads; a
value equal to the default is never refused; train.py exits 2 with one error line and writes
nothing; docs/config.md lists every key of the table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ppo_jax.trainer.config import ConfigError, load_config
from ppo_jax.trainer.config import no_effect as ne

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs/tiny.yaml"  # gae, separate critic, adaptive KL, static engine, no env
GROUPS = ["ppo.advantage_estimator=grpo", "generation.samples_per_prompt=2"]
ASYNC = ["ppo.max_staleness=1", "generation.placement=split", "generation.rollout_devices=1",
         "generation.engine=paged", "ppo.rollout_correction=tis"]


def _when(key: str) -> ne.Condition:
    return next(r.when for r in ne.NO_EFFECT if r.key == key)


# condition name -> (overrides of tiny.yaml under which it holds, overrides where it does not)
CONDITIONS = {
    ne.CRITIC_FREE.name: (GROUPS, []),
    _when("ppo.lam").name: (GROUPS, []),
    _when("ppo.gamma").name: (GROUPS, ["ppo.advantage_estimator=reinforce_plus_plus"]),
    ne.SEPARATE_CRITIC.name: ([], ["model.shared_critic=true"]),
    ne.FIXED_KL.name: (["ppo.kl_controller=fixed"], []),
    ne.NO_DYNAMIC_SAMPLING.name: ([], ["ppo.dynamic_sampling=true",
                                       "generation.samples_per_prompt=2"]),
    ne.NO_OVERLONG.name: ([], ["ppo.overlong_buffer=2"]),
    ne.NO_CORRECTION.name: ([], ["ppo.rollout_correction=tis"]),
    ne.CAPLESS_CORRECTION.name: (["ppo.rollout_correction=icepop"], ["ppo.rollout_correction=mis"]),
    ne.NOT_ICEPOP.name: (["ppo.rollout_correction=tis"], ["ppo.rollout_correction=icepop"]),
    ne.NO_CLIP.name: (["ppo.policy_loss=sapo"], ["ppo.policy_loss=cispo"]),
    ne.NO_KL_LOSS.name: ([], ["ppo.kl_loss_coef=0.1"]),
    ne.STATIC_ENGINE.name: ([], ["generation.engine=paged"]),
    ne.COLOCATED.name: ([], ["generation.placement=split"]),
    ne.SPLIT.name: (["generation.placement=split", "generation.rollout_devices=4"], []),
    ne.SYNCHRONOUS.name: ([], ASYNC),
    ne.CONSISTENT.name: (ASYNC + ["generation.partial_rollouts=false"], ASYNC),
    ne.NO_ENV.name: ([], ["env.name=calculator"]),
    ne.REWARD_MODEL.name: (["reward.kind=model", "model.reward_model=rm"], []),
    ne.NO_TASK.name: ([], ["data.task.name=chain_sum", "data.prompts=task"]),
    ne.NOT_DISTRIBUTED.name: ([], ["distributed.enabled=true"]),
    _when("sft.data").name: ([], ["stage=sft", "sft.data=x.jsonl"]),
    ne.ONE_SEQUENCE.name: (["stage=sft", "sft.data=x.jsonl", "sft.micro_batch_size=1"],
                           ["stage=sft", "sft.data=x.jsonl"]),
    ne.ONE_ROLLOUT.name: (["ppo.micro_batch_size=1"], ["ppo.micro_batch_size=2"]),
    ne.UNPACKED.name: ([], ["ppo.packing=true"]),
    _when("reward_model.data").name: ([], ["stage=reward_model", "reward_model.data=x.jsonl",
                                           "model.reward_model=rm"]),
}
SUPERVISED = {"data": "x.jsonl", "eval_data": "y.jsonl", "eval_fraction": "0.2",
              "max_length": "256", "batch_size": "16", "micro_batch_size": "4", "lr": "1e-3",
              "eval_every": "2", "backbone_lr_scale": "0.5", "eos_after_truncated": "true",
              "packing": "true"}
# key -> a value other than its default (and what else it needs, both where refused and not)
VALUES = {
    "ppo.packing": ["ppo.packing=true"],
    "ppo.micro_batch_tokens": ["ppo.micro_batch_tokens=4096"],
    "model.shared_critic": ["model.shared_critic=true"],
    "ppo.critic_warmup_steps": ["ppo.critic_warmup_steps=1"],
    "model.critic": ["model.critic=somewhere"],
    "model.lora.critic": ["model.lora.critic=true", "model.lora.rank=4"],
    "ppo.critic_lam": ["ppo.critic_lam=1.0"],
    "ppo.lam_length_alpha": ["ppo.lam_length_alpha=0.05"],
    "ppo.vf_coef": ["ppo.vf_coef=0.5"],
    "ppo.value_loss": ["ppo.value_loss=my_value_loss"],
    "ppo.value_loss_kwargs": ["ppo.value_loss_kwargs.scale=2"],
    "ppo.cliprange_value": ["ppo.cliprange_value=0.3"],
    "optim.critic_lr": ["optim.critic_lr=1e-3"],
    "ppo.lam": ["ppo.lam=0.9"],
    "ppo.gamma": ["ppo.gamma=0.99"],
    "ppo.target_kl": ["ppo.target_kl=3.0"],
    "ppo.horizon": ["ppo.horizon=500"],
    "ppo.max_sampling_rounds": ["ppo.max_sampling_rounds=5"],
    "ppo.overlong_penalty_factor": ["ppo.overlong_penalty_factor=0.5"],
    "ppo.rollout_correction_cap": ["ppo.rollout_correction_cap=3.0"],
    "ppo.rollout_correction_band_low": ["ppo.rollout_correction_band_low=0.8"],
    "ppo.rollout_correction_band_high": ["ppo.rollout_correction_band_high=3.0"],
    "ppo.cliprange": ["ppo.cliprange=0.3"],
    "ppo.kl_loss_estimator": ["ppo.kl_loss_estimator=kl"],
    "generation.page_size": ["generation.page_size=8"],
    "generation.num_pages": ["generation.num_pages=64"],
    "generation.max_concurrent": ["generation.max_concurrent=2"],
    "generation.decode_chunk": ["generation.decode_chunk=4"],
    "generation.decode_buckets": ["generation.decode_buckets=2"],
    "generation.attention": ["generation.attention=pallas"],
    "generation.rollout_devices": ["generation.rollout_devices=4"],
    "generation.rollout_layout": ["generation.rollout_layout=tensor"],
    "generation.partial_rollouts": ["generation.partial_rollouts=false"],
    "generation.kv_on_switch": ["generation.kv_on_switch=keep"],
    "env.kwargs": ["env.kwargs.tool_call_cost=0.1"],
    "env.max_turns": ["env.max_turns=2"],
    "env.max_observation_tokens": ["env.max_observation_tokens=8"],
    "env.timeout_s": ["env.timeout_s=5"],
    "env.concurrency": ["env.concurrency=4"],
    "env.max_failed_steps": ["env.max_failed_steps=2"],
    "env.stop_strings": ["env.stop_strings=[</tool>]"],
    "env.observation_role": ["env.observation_role=tool"],
    "reward.function": ["reward.function=length"],
    "reward.function_kwargs": ["reward.function_kwargs.format_weight=0.1"],
    "reward.timeout_s": ["reward.timeout_s=30"],
    "data.task.kwargs": ["data.task.kwargs.min_terms=2"],
    "data.task.size": ["data.task.size=50"],
    "data.task.seed": ["data.task.seed=3"],
    "data.task.instruction": ["data.task.instruction=Answer."],
    "distributed.coordinator_address": ["distributed.coordinator_address=localhost:1234"],
    "distributed.num_processes": ["distributed.num_processes=2"],
    "distributed.process_id": ["distributed.process_id=1"],
    **{f"{s}.{k}": [f"{s}.{k}={v}"] for s in ("sft", "reward_model")
       for k, v in SUPERVISED.items()},
}
# where the key applies, it still needs ... (vf_coef: a value head on the actor)
APPLIES_TOO = {("ppo.vf_coef", ne.CRITIC_FREE.name): ["model.shared_critic=true"]}
NEVER_APPLIES = {"sft.backbone_lr_scale": "stage=sft refuses any value but 1 (no score head)"}
ROWS = [pytest.param(r, id=f"{r.key}|{r.when.keys[0]}") for r in ne.NO_EFFECT]


@pytest.mark.parametrize("row", ROWS)
def test_a_setting_is_refused_where_it_has_no_effect(row):
    holds, _ = CONDITIONS[row.when.name]
    cfg = load_config(TINY, holds)  # the condition alone loads
    assert row.when.holds(cfg)
    with pytest.raises(ConfigError) as err:
        load_config(TINY, holds + VALUES[row.key])
    message = str(err.value)
    assert message.startswith(f"{row.key}=") and " has no effect: " in message, message
    assert all(f"{k}=" in message for k in row.when.keys), message
    assert row.why in message and "drop it or " in message


@pytest.mark.parametrize("row", ROWS)
def test_the_same_setting_loads_where_it_applies(row):
    if row.key in NEVER_APPLIES:
        pytest.skip(NEVER_APPLIES[row.key])
    _, applies = CONDITIONS[row.when.name]
    extra = APPLIES_TOO.get((row.key, row.when.name), [])
    cfg = load_config(TINY, applies + extra + VALUES[row.key])
    assert not row.when.holds(cfg)
    assert ne.value_of(cfg, row.key) != ne.DEFAULTS[row.key]


@pytest.mark.parametrize("row", ROWS)
def test_the_default_value_is_never_refused(row):
    """A file that spells the default out, as every run's config.json does."""
    holds, _ = CONDITIONS[row.when.name]
    default = ne.DEFAULTS[row.key]
    if isinstance(default, (dict, list)) or default is None:
        return  # no dotted override spells an empty mapping / list or null the same way
    spelled = str(default).lower() if isinstance(default, bool) else default
    load_config(TINY, holds + [f"{row.key}={spelled}"])


def test_the_critic_free_error_line():
    with pytest.raises(ConfigError) as err:
        load_config(TINY, GROUPS + ["ppo.vf_coef=0.5"])
    assert str(err.value) == ("ppo.vf_coef=0.5 has no effect: ppo.advantage_estimator='grpo' "
                              "trains no critic (the value loss is not computed); drop it or "
                              "use 'gae'")


def test_packing_one_rollout_a_micro_batch_names_both_fixes():
    with pytest.raises(ConfigError) as err:
        load_config(TINY, ["ppo.packing=true", "ppo.micro_batch_size=1"])
    assert str(err.value).endswith("drop it or raise ppo.micro_batch_size or set "
                                   "ppo.micro_batch_tokens")


def test_train_py_exits_2_with_one_error_line_and_writes_nothing(tmp_path):
    out = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "--config", str(TINY), "--set",
         "ppo.advantage_estimator=grpo", "--set", "generation.samples_per_prompt=2", "--set",
         "ppo.vf_coef=0.5", "--set", f"train.output_dir={out}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: ppo.vf_coef=0.5 has no effect: ppo.advantage_estimator='grpo' "
                      "trains no critic (the value loss is not computed); drop it or use 'gae'"]
    assert not out.exists()


def test_the_table_names_keys_of_the_schema_and_docs_list_them_all():
    docs = (ROOT / "docs/config.md").read_text(encoding="utf-8")
    section = docs.split("## Settings refused where they have no effect", 1)[1]
    for row in ne.NO_EFFECT:
        assert row.key in ne.DEFAULTS and all(k in ne.DEFAULTS for k in row.when.keys)
        assert f"`{row.key}`" in section, row.key
    pairs = [(r.key, r.when.name) for r in ne.NO_EFFECT]
    assert len(set(pairs)) == len(pairs)  # one copy of each idea


def test_the_builtin_estimators_named_ignore_the_argument():
    """The lam / gamma conditions list only estimators that take no such parameter."""
    import inspect

    from ppo_jax.core import get_advantage_estimator

    for key, arg in (("ppo.lam", "lam"), ("ppo.gamma", "gamma")):
        names = _when(key).name.split("(", 1)[1].rstrip(")").split(", ")
        assert names and "gae" not in names
        for name in names:
            fn = get_advantage_estimator(name)
            assert arg not in inspect.signature(fn).parameters, (name, arg)
