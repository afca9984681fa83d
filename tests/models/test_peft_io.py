"""PEFT adapter directories (`peft_io`): a ppo_jax LoRA model saved with `save_adapter` gives
the same logits in `peft.PeftModel` over transformers' model, an adapter saved by peft loads
into ppo_jax with the same logits, and adapters that do not fit the config are refused."""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_tiny import build_hf, hf_logits, padded_batch, torch, transformers
from safetensors.numpy import load_file, save_file

from ppo_jax.models import flat_params, load_model, peft_io, split_model
from ppo_jax.models.lora import LoraSettings, adapter_params, is_adapter
from ppo_jax.models.peft_io import AdapterError, load_adapter, save_adapter

peft = pytest.importorskip("peft")

CONFIG_FILE, WEIGHTS_FILE = peft_io.CONFIG_FILE, peft_io.WEIGHTS_FILE

VOCAB = 100
ARCHS = {
    "llama": (lambda: transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0),
        ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
    "gpt2": (lambda: transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=1,
        eos_token_id=2, pad_token_id=0),
        ("c_attn", "c_proj", "c_fc")),
}
# one key of each file, with PEFT's exact name and [r, in] / [out, r] shape
KEYS = {"llama": {"base_model.model.model.layers.1.self_attn.k_proj.lora_A.weight": (4, 64),
                  "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight": (64, 4)},
        "gpt2": {"base_model.model.transformer.h.1.attn.c_attn.lora_B.weight": (192, 4),
                 "base_model.model.transformer.h.0.mlp.c_proj.lora_A.weight": (4, 256)}}


def lora(name: str) -> LoraSettings:
    return LoraSettings(rank=4, alpha=8.0, target_modules=ARCHS[name][1])


def random_adapters(model, seed: int) -> dict[str, np.ndarray]:
    """Random A and B (B non-zero, so the adapters change the outputs) of the model's shapes."""
    rng = np.random.default_rng(seed)
    return {p: rng.normal(0.0, 0.1, x.shape).astype(np.float32)
            for p, x in flat_params(split_model(model)[1]).items() if is_adapter(p)}


def ours_logits(model, ids, mask) -> np.ndarray:
    return np.asarray(model(jnp.asarray(ids), jnp.asarray(mask))[0])


def from_peft(base_dir, adapter_dir, auto=None, **kw):
    auto = auto or transformers.AutoModelForCausalLM
    base = auto.from_pretrained(base_dir, attn_implementation="eager", dtype=torch.float32, **kw)
    return peft.PeftModel.from_pretrained(base, adapter_dir).eval()


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """{arch: (HF base dir, torch base model)}."""
    out = {}
    for i, (name, (make, _)) in enumerate(ARCHS.items()):
        hf = build_hf(transformers.AutoModelForCausalLM, make(), seed=20 + i)
        d = tmp_path_factory.mktemp(f"{name}_base")
        hf.save_pretrained(d)
        out[name] = (d, hf)
    return out


@pytest.fixture(scope="module")
def ours(bases):
    """{arch: (ppo_jax LoRA model, cfg, its adapters)} with random adapters on the base."""
    out = {}
    for i, name in enumerate(ARCHS):
        fresh, _ = load_model(bases[name][0], lora=lora(name))
        adapters = random_adapters(fresh, seed=i)
        model, cfg = load_model(bases[name][0], lora=lora(name), adapters=adapters)
        out[name] = (model, cfg, adapters)
    return out


@pytest.fixture(scope="module")
def saved(bases, ours, tmp_path_factory):
    """{arch: adapter dir written by save_adapter from the whole model's params}."""
    out = {}
    for name, (model, cfg, _) in ours.items():
        params = nnx.to_pure_dict(split_model(model)[1])
        out[name] = save_adapter(params, cfg, tmp_path_factory.mktemp(f"{name}_adapter"),
                                 base_model=str(bases[name][0]))
    return out


@pytest.mark.parametrize("name", list(ARCHS))
def test_saved_adapter_gives_our_logits_in_peft(bases, ours, saved, name):
    conf = json.loads((saved[name] / CONFIG_FILE).read_text())
    assert conf["peft_type"] == "LORA" and conf["task_type"] == "CAUSAL_LM"
    assert (conf["r"], conf["lora_alpha"]) == (4, 8)
    assert conf["target_modules"] == sorted(ARCHS[name][1])
    assert conf["fan_in_fan_out"] is (name == "gpt2") and conf["modules_to_save"] is None
    tensors = load_file(saved[name] / WEIGHTS_FILE)
    per_layer = 2 * len(ARCHS[name][1]) + (2 if name == "gpt2" else 0)  # two c_proj in gpt2
    assert len(tensors) == 2 * per_layer
    for key, shape in KEYS[name].items():
        assert tensors[key].shape == shape and tensors[key].dtype == np.float32

    ids, mask = padded_batch(seed=3, vocab=VOCAB)
    ref = hf_logits(from_peft(bases[name][0], saved[name]), ids, mask)
    real = mask.astype(bool)
    np.testing.assert_allclose(ours_logits(ours[name][0], ids, mask)[real], ref[real],
                               atol=1e-4, rtol=0)
    base = hf_logits(bases[name][1], ids, mask)
    assert np.abs(ref[real] - base[real]).max() > 0.05  # the adapters matter


@pytest.mark.parametrize("name", list(ARCHS))
def test_load_adapter_round_trips_bit_for_bit(ours, saved, name):
    _, cfg, adapters = ours[name]
    loaded = load_adapter(saved[name], cfg)
    assert set(loaded) == set(adapters)
    for p, a in adapters.items():
        assert loaded[p].dtype == a.dtype
        np.testing.assert_array_equal(loaded[p], a)


def test_adapters_only_bfloat16_round_trip(ours, tmp_path):
    model, cfg, _ = ours["llama"]
    only = jax.tree.map(lambda x: x.astype(jnp.bfloat16),
                        adapter_params(nnx.to_pure_dict(split_model(model)[1])))
    loaded = load_adapter(save_adapter(only, cfg, tmp_path, base_model="base"), cfg)
    flat = flat_params(only)
    assert set(loaded) == set(flat)
    for p, a in flat.items():
        assert loaded[p].dtype == jnp.bfloat16
        np.testing.assert_array_equal(loaded[p], np.asarray(a))


@pytest.mark.parametrize("name", list(ARCHS))
def test_adapter_saved_by_peft_loads_with_peft_logits(bases, ours, name, tmp_path):
    base = transformers.AutoModelForCausalLM.from_pretrained(
        bases[name][0], attn_implementation="eager", dtype=torch.float32)
    pm = peft.get_peft_model(base, peft.LoraConfig(
        task_type="CAUSAL_LM", r=4, lora_alpha=8, target_modules=list(ARCHS[name][1]),
        fan_in_fan_out=name == "gpt2"))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:  # PEFT's init has B = 0
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    pm.eval().save_pretrained(tmp_path)
    cfg = ours[name][1]
    model, _ = load_model(bases[name][0], lora=lora(name), adapters=load_adapter(tmp_path, cfg))
    ids, mask = padded_batch(seed=4, vocab=VOCAB)
    ref = hf_logits(pm, ids, mask)
    real = mask.astype(bool)
    np.testing.assert_allclose(ours_logits(model, ids, mask)[real], ref[real], atol=1e-4, rtol=0)
    assert np.abs(ref[real] - hf_logits(bases[name][1], ids, mask)[real]).max() > 0.05


def edited(src, dst, **changes):
    """A copy of the adapter dir `src` with adapter_config.json keys changed."""
    shutil.copytree(src, dst)
    conf = json.loads((dst / CONFIG_FILE).read_text())
    (dst / CONFIG_FILE).write_text(json.dumps({**conf, **changes}))
    return dst


@pytest.mark.parametrize("change, words", [
    ({"lora_rank": 8}, ["model.lora.rank=8", "r=4"]),
    ({"lora_alpha": 16.0}, ["model.lora.alpha=16.0", "lora_alpha=8"]),
    ({"lora_targets": ("q_proj", "v_proj")},
     ["model.lora.target_modules=['q_proj', 'v_proj']", "'down_proj', 'gate_proj', 'k_proj'"]),
])
def test_config_mismatch_names_key_and_both_values(ours, saved, change, words):
    cfg = ours["llama"][1].replace(**change)
    with pytest.raises(AdapterError) as e:
        load_adapter(saved["llama"], cfg)
    for w in [str(saved["llama"])] + words:
        assert w in str(e.value)


@pytest.mark.parametrize("change, words", [
    ({"peft_type": "IA3"}, ["peft_type='IA3'", "LORA"]),
    ({"target_modules": ".*proj"}, ["target_modules='.*proj'", "regular expression"]),
    ({"use_rslora": True}, ["use_rslora=True"]),
    ({"use_dora": True}, ["use_dora=True"]),
    ({"fan_in_fan_out": True}, ["fan_in_fan_out=True", "llama"]),
    ({"bias": "all"}, ["bias='all'"]),
    ({"layers_to_transform": [0]}, ["layers_to_transform=[0]"]),
    ({"modules_to_save": ["lm_head"]}, ["modules_to_save=['lm_head']"]),
])
def test_unsupported_options_are_refused(ours, saved, tmp_path, change, words):
    d = edited(saved["llama"], tmp_path / "a", **change)
    with pytest.raises(AdapterError) as e:
        load_adapter(d, ours["llama"][1])
    for w in [str(d)] + words:
        assert w in str(e.value)


@pytest.mark.parametrize("missing", [CONFIG_FILE, WEIGHTS_FILE])
def test_missing_file(ours, saved, tmp_path, missing):
    d = edited(saved["llama"], tmp_path / "a")
    (d / missing).unlink()
    with pytest.raises(AdapterError, match=missing):
        load_adapter(d, ours["llama"][1])


def test_bad_missing_or_extra_tensor(ours, saved, tmp_path):
    cfg = ours["llama"][1]
    key = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"
    tensors = load_file(saved["llama"] / WEIGHTS_FILE)
    assert tensors[key].shape == (32, 4)  # 2 KV heads x 16
    d = edited(saved["llama"], tmp_path / "a")
    save_file({**tensors, key: np.zeros((64, 4), np.float32)}, str(d / WEIGHTS_FILE))
    with pytest.raises(AdapterError) as e:
        load_adapter(d, cfg)
    for w in (repr(key), "(64, 4)", "(32, 4)"):
        assert w in str(e.value)
    save_file({k: v for k, v in tensors.items() if k != key}, str(d / WEIGHTS_FILE))
    with pytest.raises(AdapterError, match=f"no tensor '{key}'"):
        load_adapter(d, cfg)
    extra = key.replace("layers.1", "layers.2")
    save_file({**tensors, extra: tensors[key]}, str(d / WEIGHTS_FILE))
    with pytest.raises(AdapterError, match="does not expect"):
        load_adapter(d, cfg)


def test_reward_adapter_with_score_head_matches_peft_sequence_classification(tmp_path):
    hf_cfg = ARCHS["llama"][0]()
    hf_cfg.num_labels = 1
    rm = build_hf(transformers.AutoModelForSequenceClassification, hf_cfg, seed=30)
    rm_dir = tmp_path / "rm"
    rm.save_pretrained(rm_dir)
    fresh, _ = load_model(rm_dir, "reward", lora=lora("llama"))
    adapters = random_adapters(fresh, seed=7)
    model, cfg = load_model(rm_dir, "reward", lora=lora("llama"), adapters=adapters)
    score = np.random.default_rng(8).normal(0.0, 0.3, (64, 1)).astype(np.float32)
    model.score.kernel[...] = jnp.asarray(score)
    out = save_adapter(nnx.to_pure_dict(split_model(model)[1]), cfg, tmp_path / "adapter",
                       base_model=str(rm_dir), kind="reward")
    conf = json.loads((out / CONFIG_FILE).read_text())
    assert conf["task_type"] == "SEQ_CLS" and conf["modules_to_save"] == ["score"]
    assert load_file(out / WEIGHTS_FILE)["base_model.model.score.weight"].shape == (1, 64)
    np.testing.assert_array_equal(load_adapter(out, cfg, kind="reward")["score/kernel"], score)

    pm = from_peft(rm_dir, out, transformers.AutoModelForSequenceClassification, num_labels=1)
    ids, mask = padded_batch(seed=5, vocab=VOCAB)
    ref = hf_logits(pm, ids, mask)[:, 0]
    np.testing.assert_allclose(np.asarray(model(jnp.asarray(ids), jnp.asarray(mask))[0]), ref,
                               atol=1e-4, rtol=0)
    assert np.abs(ref - hf_logits(rm, ids, mask)[:, 0]).min() > 1e-2  # adapters + head matter


def test_target_modules_saved_as_module_paths_are_read_by_their_names(tmp_path):
    """PEFT's target_modules="all-linear" is written as module paths
    (`model.layers.0.self_attn.k_proj`, ...): read by their last name."""
    from ppo_jax.models.config import lora_target_names
    from ppo_jax.models.tiny_random import ensure_tiny_random

    base = ensure_tiny_random(tmp_path / "tiny")
    lo = LoraSettings(rank=4, alpha=8.0, target_modules=lora_target_names("llama"))
    model, cfg = load_model(base, lora=lo)
    out = save_adapter(nnx.to_pure_dict(split_model(model)[1]), cfg, tmp_path / "a",
                       base_model=str(base))
    conf = json.loads((out / CONFIG_FILE).read_text())
    conf["target_modules"] = [f"model.layers.{i}.{part}.{name}" for i in range(cfg.num_layers)
                              for part, names in (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
                                                  ("mlp", ("gate_proj", "up_proj", "down_proj")))
                              for name in names]
    (out / CONFIG_FILE).write_text(json.dumps(conf))
    assert set(load_adapter(out, cfg)) == set(adapter_params_paths(cfg))


def adapter_params_paths(cfg):
    return [p for p in peft_io.expected_params(cfg) if is_adapter(p)]
