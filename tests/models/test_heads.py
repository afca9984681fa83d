"""Reward (score) head parity with HF `LlamaForSequenceClassification`; critic construction
from reward and causal-LM checkpoints."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ppo_jax.models import load_model, reward_scores, save_pretrained, split_model, values
from hf_tiny import HF_CONFIGS, build_hf, torch, transformers

PAD = 0


@pytest.fixture(scope="module")
def reward_dir(tmp_path_factory):
    cfg = HF_CONFIGS["llama_tied"]()
    cfg.num_labels = 1
    cfg.pad_token_id = PAD
    hf = build_hf(transformers.AutoModelForSequenceClassification, cfg, seed=7)
    d = tmp_path_factory.mktemp("llama_rm")
    hf.save_pretrained(d)
    return d, hf


def mixed_padding_batch():
    """Row 0 left-padded, row 1 right-padded, row 2 unpadded; pad slots hold PAD (never a real token)."""
    rng = np.random.default_rng(5)
    ids = rng.integers(3, 256, size=(3, 9)).astype(np.int32)
    mask = np.ones_like(ids)
    ids[0, :3], mask[0, :3] = PAD, 0
    ids[1, -4:], mask[1, -4:] = PAD, 0
    return ids, mask


def hf_scores(hf, ids, mask):
    pos = np.maximum(np.cumsum(mask, -1) - 1, 0)
    with torch.no_grad():
        out = hf(input_ids=torch.tensor(ids).long(), attention_mask=torch.tensor(mask).long(),
                 position_ids=torch.tensor(pos).long())
    return out.logits[:, 0].numpy()


@pytest.fixture(scope="module")
def reward_model(reward_dir):
    model, cfg = load_model(reward_dir[0], "reward")
    return model, cfg


def test_reward_scores_match_hf_sequence_classification_at_last_real_token(reward_dir, reward_model):
    ids, mask = mixed_padding_batch()
    graphdef, params = split_model(reward_model[0])
    ours = np.asarray(jax.jit(lambda p, i, m: reward_scores(graphdef, p, i, m))(params, ids, mask))
    ref = hf_scores(reward_dir[1], ids, mask)
    assert ours.shape == (3,) and ours.dtype == np.float32
    assert np.abs(ref).min() > 1e-3
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)


def test_reward_model_saved_loads_in_transformers_with_same_scores(reward_model, tmp_path):
    model, cfg = reward_model
    save_pretrained(model, cfg, tmp_path)
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path, attn_implementation="eager")
    ids, mask = mixed_padding_batch()
    ours = np.asarray(model(jnp.asarray(ids), jnp.asarray(mask))[0])
    np.testing.assert_allclose(hf_scores(hf.eval(), ids, mask), ours, atol=1e-4, rtol=0)


def test_critic_from_reward_checkpoint_starts_from_score_head(reward_dir, reward_model):
    critic, _ = load_model(reward_dir[0], "value")
    ids, mask = mixed_padding_batch()
    graphdef, params = split_model(critic)
    v = np.asarray(values(graphdef, params, jnp.asarray(ids), jnp.asarray(mask)))
    assert v.shape == ids.shape and v.dtype == np.float32
    scores = np.asarray(reward_model[0](jnp.asarray(ids), jnp.asarray(mask))[0])
    last = np.array([8, 4, 8])  # last real token of each row
    np.testing.assert_allclose(v[np.arange(3), last], scores, atol=1e-5, rtol=0)
    np.testing.assert_array_equal(np.asarray(critic.value_head.bias[...]), [0.0])


def test_critic_from_causal_lm_gets_fresh_value_head(hf_checkpoints):
    d = hf_checkpoints["llama_tied"][0]
    zero, _ = load_model(d, "value")
    ids, mask = mixed_padding_batch()
    v0 = np.asarray(zero(jnp.asarray(ids), jnp.asarray(mask))[0])
    np.testing.assert_array_equal(v0, np.zeros(ids.shape, np.float32))
    small, _ = load_model(d, "value", head_init_std=0.01)
    k = np.asarray(small.value_head.kernel[...])
    assert k.shape == (64, 1) and k.dtype == np.float32 and 0.005 < k.std() < 0.02
    v = np.asarray(small(jnp.asarray(ids), jnp.asarray(mask))[0])
    assert v.dtype == np.float32 and np.abs(v).max() > 0


def test_value_head_stays_float32_with_bfloat16_backbone(hf_checkpoints):
    critic, cfg = load_model(hf_checkpoints["llama_tied"][0], "value", param_dtype="bfloat16",
                             dtype="bfloat16", head_init_std=0.01)
    assert critic.backbone.norm.scale[...].dtype == jnp.bfloat16
    assert critic.value_head.kernel[...].dtype == jnp.float32
    ids, mask = mixed_padding_batch()
    v = critic(jnp.asarray(ids), jnp.asarray(mask))[0]
    assert v.shape == ids.shape and v.dtype == jnp.float32 and bool(jnp.isfinite(v).all())


def test_reward_kind_requires_score_tensor(hf_checkpoints):
    from ppo_jax.models import CheckpointError

    with pytest.raises(CheckpointError, match="'score.weight'"):
        load_model(hf_checkpoints["llama_tied"][0], "reward")


def test_saved_critic_reloads_with_same_values_including_bias(hf_checkpoints, tmp_path):
    critic, cfg = load_model(hf_checkpoints["gpt2"][0], "value", head_init_std=0.05)
    critic.value_head.bias[...] = jnp.array([0.25], jnp.float32)
    save_pretrained(critic, cfg, tmp_path)
    again, _ = load_model(tmp_path, "value")
    ids, mask = mixed_padding_batch()
    np.testing.assert_allclose(np.asarray(again(jnp.asarray(ids), jnp.asarray(mask))[0]),
                               np.asarray(critic(jnp.asarray(ids), jnp.asarray(mask))[0]), atol=1e-6)
