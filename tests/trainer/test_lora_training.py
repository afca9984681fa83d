"""LoRA in the three stages on the tiny random Llama (`model.lora`): only adapters and heads
train, the frozen base is bit for bit the checkpoint after training and is the reference
model (in memory once, shared by a LoRA critic), step 0 is the base model exactly, resume is
bit-exact, and the exports are merged (HF) and PEFT adapters."""

from __future__ import annotations

import json
import math
import sys
from dataclasses import replace
from pathlib import Path

import jax
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from ppo_jax.models.functional import flat_params  # noqa: E402
from ppo_jax.trainer.config import ConfigError, load_config  # noqa: E402

TINY = ROOT / "configs/tiny.yaml"
LORA = ["model.lora.rank=4", "model.lora.alpha=8", "optim.actor_lr=1e-2", "optim.critic_lr=1e-2"]


def ppo_cfg(out, *extra, lora=LORA):
    return load_config(TINY, [f"data.prompts={ROOT / 'configs/prompts/reviews.jsonl'}",
                              f"train.output_dir={out}", "train.progress=false",
                              "train.tensorboard=false", *lora, *extra])


def host(tree):
    return {k: np.asarray(v) for k, v in flat_params(tree).items()}


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A 2-step LoRA PPO run (LoRA critic on the actor's base), with the first experience
    captured and the base as loaded kept on the host."""
    import os

    from ppo_jax.trainer.stages.ppo.trainer import PPOTrainer

    tmp = tmp_path_factory.mktemp("lora_ppo")
    os.environ["PPO_JAX_CACHE"] = str(tmp / "cache")
    trainer = PPOTrainer(ppo_cfg(tmp / "run", "model.lora.critic=true", "train.steps=2",
                                 "train.save_every=0"))
    loaded = {"actor": host(trainer.frozen["actor"]), "critic": host(trainer.frozen["critic"])}
    start = {"actor": host(trainer.state["actor"].params), "critic": host(trainer.state["critic"].params)}
    captured = []
    experience = trainer.jit.experience

    def spy(*args):
        out = experience(*args)
        captured.append(jax.tree.map(np.asarray, out.experience))
        return out

    trainer.jit = replace(trainer.jit, experience=spy)
    history = trainer.train(progress=False)
    return trainer, loaded, start, captured, history, tmp / "run"


def test_train_states_hold_only_adapters_and_heads(lora_run):
    trainer = lora_run[0]
    actor, critic = trainer.state["actor"], trainer.state["critic"]
    assert {p.rsplit("/", 1)[-1] for p in flat_params(actor.params)} == {"lora_a", "lora_b"}
    assert {p.split("/")[0] for p in flat_params(critic.params)} == {"backbone", "value_head"}
    assert all(p.startswith("value_head/") or p.endswith(("lora_a", "lora_b"))
               for p in flat_params(critic.params))
    # Adam moments only for what trains: a few scalars besides the params' own shapes
    params = sum(x.size for x in jax.tree.leaves(actor.params))
    moments = sum(x.size for x in jax.tree.leaves(actor.opt_state))
    base = sum(x.size for x in jax.tree.leaves(trainer.frozen["actor"]))
    cfg = trainer.models.actor.cfg  # 7 projections x layers x r (in + out)
    d, f, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_kv_heads * cfg.head_dim
    per_layer = 4 * ((d + d) * 2 + (d + kv) * 2 + (d + f) * 2 + (f + d))
    assert params == cfg.num_layers * per_layer and params < base / 10
    assert moments <= 2 * params + 8


def test_the_base_is_in_memory_once(lora_run):
    trainer = lora_run[0]
    base = trainer.frozen["actor"]
    assert trainer.ref_params is base and trainer.shared_base
    same = [a is b for a, b in zip(jax.tree.leaves(trainer.frozen["critic"]["backbone"]),
                                   jax.tree.leaves(base["backbone"]))]
    assert same and all(same)


def test_step_zero_is_the_base_model_and_the_reference_its_log_probs(lora_run):
    _, _, _, captured, history, _ = lora_run
    first = captured[0]
    np.testing.assert_array_equal(first.logprobs, first.ref_logprobs)
    assert history[0]["kl"] == 0.0
    # as for full fine-tuning: the update's forward is another program, equal to float32 rounding
    assert history[0]["ratio_first_minibatch"] == pytest.approx(1.0, abs=1e-6)
    # the second step's policy moved away from the reference
    assert np.abs(captured[1].logprobs - captured[1].ref_logprobs).max() > 1e-4


def test_after_training_the_base_is_bit_identical_and_only_adapters_moved(lora_run, tiny_checkpoint):
    from ppo_jax.models import load_model, split_model
    from flax import nnx

    trainer, loaded, start, _, _, _ = lora_run
    checkpoint = host(nnx.to_pure_dict(split_model(load_model(trainer.models.actor_path)[0])[1]))
    now = host(trainer.frozen["actor"])
    assert now.keys() == checkpoint.keys() == loaded["actor"].keys()
    for k in checkpoint:
        np.testing.assert_array_equal(now[k], checkpoint[k], err_msg=k)
    for name in ("actor", "critic"):
        after = host(trainer.state[name].params)
        moved = [k for k in after if not np.array_equal(after[k], start[name][k])]
        assert any(k.endswith("lora_b") for k in moved), name
    assert np.abs(host(trainer.state["critic"].params)["value_head/kernel"]).max() > 0


def test_exports_are_merged_and_peft(lora_run):
    from ppo_jax.models import causal_lm_logits, load_model, split_model
    from ppo_jax.models.lora import join

    trainer, *_, out = lora_run
    assert (out / "actor_adapter" / "adapter_config.json").is_file()
    config = json.loads((out / "actor_adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8
    merged, _ = load_model(out / "actor_hf")
    ids = np.array([[5, 6, 7, 8, 9, 10], [0, 0, 7, 8, 9, 10]], np.int32)
    mask = (ids > 0).astype(np.int32)
    want = causal_lm_logits(trainer.models.actor.graphdef,
                            join(trainer.frozen["actor"], trainer.state["actor"].params), ids, mask)
    got = causal_lm_logits(*split_model(merged), ids, mask)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=0)


@pytest.mark.slow  # default-run budget (13 s; bit-exact resume stays in the default run through test_preemption.py); `make test-slow`
def test_resume_is_bit_exact(tmp_path, monkeypatch):
    monkeypatch.setenv("PPO_JAX_CACHE", str(tmp_path / "cache"))
    from ppo_jax.trainer.stages.ppo.trainer import PPOTrainer

    common = ("train.save_every=1", "train.export_hf=false", "eval.every=0",
              "model.lora.critic=true")
    straight = PPOTrainer(ppo_cfg(tmp_path / "a", "train.steps=3", *common))
    straight.train(progress=False)
    PPOTrainer(ppo_cfg(tmp_path / "b", "train.steps=1", *common)).train(progress=False)
    # the checkpoint holds adapters, the value head, Adam moments, KL and RNG: no base param
    tree = (tmp_path / "b" / "checkpoints" / "1" / "state" / "_METADATA").read_text()
    assert "lora_b" in tree and "value_head" in tree
    assert tree.count('"kernel"') == 3  # value_head/kernel: param, mu, nu
    assert not any(name in tree for name in ("embed_tokens", "layernorm", '"scale"'))
    resumed = PPOTrainer(ppo_cfg(tmp_path / "b", "train.steps=3", *common), resume=True)
    assert resumed.step_count == 1
    resumed.train(progress=False)
    for name in ("actor", "critic"):
        a, b = host(straight.state[name].params), host(resumed.state[name].params)
        for k in a:
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    rows = [[json.loads(x) for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
            for d in "ab"]
    for x, y in zip(rows[0], rows[1]):
        assert {k: v for k, v in x.items() if not k.startswith("time/") and "per_s" not in k} == \
               {k: v for k, v in y.items() if not k.startswith("time/") and "per_s" not in k}


@pytest.mark.slow  # default-run budget (23 s); `make test-slow`
def test_shared_critic_and_grpo_run_with_lora(tmp_path, monkeypatch):
    monkeypatch.setenv("PPO_JAX_CACHE", str(tmp_path / "cache"))
    from ppo_jax.trainer.stages.ppo.trainer import PPOTrainer

    shared = PPOTrainer(ppo_cfg(tmp_path / "s", "model.shared_critic=true", "train.steps=1",
                                "eval.every=0", "train.export_hf=false"))
    assert {p.split("/")[0] for p in flat_params(shared.state["actor"].params)} == {"backbone", "value_head"}
    m = shared.step()
    assert math.isfinite(m["vf_loss"]) and m["kl"] == 0.0
    grpo = PPOTrainer(ppo_cfg(tmp_path / "g", "ppo.advantage_estimator=grpo", "train.steps=1",
                              "generation.samples_per_prompt=2", "eval.every=0",
                              "train.export_hf=false", lora=LORA[:-1]))  # no critic: no critic_lr
    assert grpo.state["critic"] is None
    assert math.isfinite(grpo.step()["pg_loss"])


@pytest.mark.parametrize("sets, match", [
    (["model.lora.rank=-1"], "model.lora.rank=-1"),
    (["model.lora.rank=4", "model.lora.target_modules=[q_proj,qkv]"], r"unknown \['qkv'\]"),
    (["model.lora.critic=true"], "model.lora.critic=True needs model.lora.rank > 0"),
    (["model.lora.rank=4", "model.lora.alpha=0"], "model.lora.alpha"),
    (["model.lora.rank=4", "model.lora.target_modules=[q_proj,q_proj]"], "a name given twice"),
    (["model.lora.rank=4", "model.lora.critic=true", "stage=sft", "sft.data=x.jsonl"],
     "separate PPO critic only"),
    (["model.lora.rank=4", "model.lora.critic=true", "model.shared_critic=true"],
     "separate PPO critic only"),
    (["model.lora.rank=4", "stage=reward_model", "model.reward_model=tiny-random",
      "reward_model.data=x.jsonl", "reward_model.backbone_lr_scale=0"], "freezes the adapters"),
])
def test_bad_lora_settings_are_named_before_loading(sets, match):
    with pytest.raises(ConfigError, match=match):
        load_config(TINY, sets)


def test_targets_the_architecture_lacks_and_a_changed_lora_on_resume_are_named(tmp_path, monkeypatch):
    monkeypatch.setenv("PPO_JAX_CACHE", str(tmp_path / "cache"))
    from ppo_jax.trainer.stages.ppo.trainer import PPOTrainer

    with pytest.raises(ConfigError, match=r"model.lora.target_modules=\['c_attn'\].*a llama model"):
        PPOTrainer(ppo_cfg(tmp_path / "gpt2_names", "model.lora.target_modules=[c_attn]"))
    with pytest.raises(ConfigError, match="needs a critic"):
        PPOTrainer(ppo_cfg(tmp_path / "grpo", "model.lora.critic=true",
                           "ppo.advantage_estimator=grpo"))
    common = ("train.steps=1", "eval.every=0", "train.export_hf=false", "train.save_every=1")
    PPOTrainer(ppo_cfg(tmp_path / "run", *common)).train(progress=False)
    with pytest.raises(ConfigError, match=r"model.lora.alpha=16.0 but the run was started with 8"):
        PPOTrainer(ppo_cfg(tmp_path / "run", *common, "train.steps=2", "model.lora.alpha=16"),
                   resume=True)
