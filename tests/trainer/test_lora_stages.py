"""LoRA in stages 1 and 2 and the chain LoRA SFT -> LoRA PPO through a PEFT adapter directory
(`model.lora.adapter`): the base stays bit for bit, adapters (and the score head) train, the
exports are merged HF directories plus PEFT adapters, and an adapter that does not fit the
config is a named error at start-up."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from ppo_jax.models.functional import flat_params  # noqa: E402
from ppo_jax.trainer.config import ConfigError, load_config  # noqa: E402
from test_stages import data_dir, rm_cfg, sft_cfg  # noqa: E402,F401  (the shared fixture)

LORA = ("model.lora.rank=4", "model.lora.alpha=8")


def host(tree):
    return {k: np.asarray(v) for k, v in flat_params(tree).items()}


@pytest.fixture(scope="module")
def sft_run(tiny_checkpoint, data_dir, tmp_path_factory):  # noqa: F811
    from ppo_jax.trainer.stages.sft import SFTTrainer

    out = tmp_path_factory.mktemp("lora_sft") / "run"
    trainer = SFTTrainer(sft_cfg(tiny_checkpoint, data_dir, out, *LORA, "train.steps=3"))
    base = host(trainer.frozen)
    history = trainer.train(progress=False)
    return trainer, base, history, out


def test_lora_sft_trains_adapters_on_a_frozen_base(sft_run, tiny_checkpoint):
    from flax import nnx

    from ppo_jax.models import load_model, split_model

    trainer, base, history, _ = sft_run
    assert {p.rsplit("/", 1)[-1] for p in flat_params(trainer.state["model"].params)} == {"lora_a", "lora_b"}
    checkpoint = host(nnx.to_pure_dict(split_model(load_model(tiny_checkpoint)[0])[1]))
    now = host(trainer.frozen)
    assert now.keys() == checkpoint.keys() == base.keys()
    for k in checkpoint:
        np.testing.assert_array_equal(now[k], checkpoint[k], err_msg=k)
    assert history[-1]["loss"] < history[0]["loss"]


def test_lora_sft_exports_a_merged_actor_and_its_adapter(sft_run):
    from ppo_jax.models import causal_lm_logits, load_model, split_model

    trainer, _, _, out = sft_run
    assert (out / "actor_adapter" / "adapter_model.safetensors").is_file()
    merged = split_model(load_model(out / "actor_hf")[0])
    ids = np.array([[5, 6, 7, 8, 9], [0, 0, 7, 8, 9]], np.int32)
    mask = (ids > 0).astype(np.int32)
    want = causal_lm_logits(trainer.model.graphdef, trainer.params(), ids, mask)
    np.testing.assert_allclose(np.asarray(causal_lm_logits(*merged, ids, mask)), np.asarray(want),
                               atol=2e-5, rtol=0)


def test_lora_ppo_starts_from_the_sft_adapter_and_anchors_to_it(sft_run, tiny_checkpoint, tmp_path,
                                                                monkeypatch):
    monkeypatch.setenv("PPO_JAX_CACHE", str(tmp_path / "cache"))
    from ppo_jax.trainer.stages.ppo.trainer import PPOTrainer

    trainer, _, _, out = sft_run
    sets = [f"model.actor={tiny_checkpoint}", f"model.lora.adapter={out / 'actor_adapter'}",
            f"data.prompts={ROOT / 'configs/prompts/reviews.jsonl'}", f"train.output_dir={tmp_path / 'ppo'}",
            "train.progress=false", "train.steps=1", "eval.every=0", "train.export_hf=false", *LORA]
    ppo = PPOTrainer(load_config(ROOT / "configs/tiny.yaml", sets))
    start, sft = host(ppo.state["actor"].params), host(trainer.state["model"].params)
    assert start.keys() == sft.keys()
    for k in sft:
        np.testing.assert_array_equal(start[k], sft[k], err_msg=k)
    # the reference is the SFT policy (base + the adapter as loaded), not the bare base
    assert not ppo.ref_params is ppo.frozen["actor"]
    metrics = ppo.step()
    assert metrics["kl"] == 0.0 and metrics["ratio_first_minibatch"] == pytest.approx(1.0, abs=1e-6)
    for k, v in host(ppo.ref_params).items():  # the reference's copy did not train
        if k.endswith(("lora_a", "lora_b")):
            np.testing.assert_array_equal(v, sft[k], err_msg=k)

    for key, value in (("model.lora.rank", "8"), ("model.lora.alpha", "16"),
                       ("model.lora.target_modules", "[q_proj,v_proj]")):
        bad = load_config(ROOT / "configs/tiny.yaml",
                          sets + [f"{key}={value}", f"train.output_dir={tmp_path / key}"])
        with pytest.raises(ConfigError, match="model.lora.adapter") as e:
            PPOTrainer(bad)
        assert key in str(e.value), str(e.value)


def test_lora_reward_model_trains_adapters_and_score_head(tiny_checkpoint, data_dir, tmp_path):  # noqa: F811
    from ppo_jax.trainer.stages.reward_model import RewardModelTrainer

    out = tmp_path / "rm"
    trainer = RewardModelTrainer(rm_cfg(tiny_checkpoint, data_dir, out, *LORA, "train.steps=3"))
    base, start = host(trainer.frozen), host(trainer.state["model"].params)
    assert {p.split("/")[0] for p in start} == {"backbone", "score"}
    trainer.train(progress=False)
    after = host(trainer.state["model"].params)
    assert not np.array_equal(after["score/kernel"], start["score/kernel"])
    assert any(not np.array_equal(after[k], start[k]) for k in after if k.endswith("lora_b"))
    for k, v in host(trainer.frozen).items():
        np.testing.assert_array_equal(v, base[k], err_msg=k)
    assert (out / "reward_model_adapter" / "adapter_config.json").is_file()
    assert (out / "reward_model_hf" / "config.json").is_file()
