"""HF directory I/O: save -> transformers load round trip, dtype fidelity, sharded loading and
clear errors for broken checkpoints."""

from __future__ import annotations

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from ppo_jax.models import CheckpointError, load_model, load_tokenizer, save_pretrained
from hf_tiny import hf_logits, padded_batch, transformers


@pytest.mark.parametrize("name", ["llama3_untied", "qwen2", "qwen3_tied", "qwen3_untied", "gpt2"])
def test_saved_actor_loads_in_transformers_with_same_logits(loaded, name, tmp_path):
    graphdef, params, cfg, fn, _ = loaded[name]
    save_pretrained(nnx.merge(graphdef, params), cfg, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    ids, mask = padded_batch(seed=4)
    ours = np.asarray(fn(params, jnp.asarray(ids), jnp.asarray(mask)))
    real = mask.astype(bool)
    np.testing.assert_allclose(hf_logits(hf, ids, mask)[real], ours[real], atol=1e-4, rtol=0)


def test_sharded_checkpoint_with_index_is_loaded(hf_checkpoints, loaded):
    d = hf_checkpoints["llama3_untied"][0]
    assert (d / "model.safetensors.index.json").is_file()
    assert len(list(d.glob("model-*.safetensors"))) > 1
    assert loaded["llama3_untied"][2].rope_type == "llama3"


def test_save_writes_param_dtype_or_float32_faithfully(hf_checkpoints, tmp_path):
    model, cfg = load_model(hf_checkpoints["llama_tied"][0], param_dtype="bfloat16", dtype="bfloat16")
    save_pretrained(model, cfg, tmp_path / "bf16")
    save_pretrained(model, cfg, tmp_path / "f32", dtype="float32")
    with safe_open(tmp_path / "bf16" / "model.safetensors", framework="np") as f:
        assert f.get_tensor("model.layers.0.self_attn.q_proj.weight").dtype == jnp.bfloat16
        assert "lm_head.weight" not in f.keys()  # tied: HF re-ties it
    bf16 = load_file(tmp_path / "bf16" / "model.safetensors")
    f32 = load_file(tmp_path / "f32" / "model.safetensors")
    assert all(v.dtype == np.float32 for v in f32.values())
    for k in bf16:  # the float32 export holds exactly the bf16 values
        np.testing.assert_array_equal(f32[k], bf16[k].astype(np.float32))
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["model_type"] == "llama"
    reloaded, _ = load_model(tmp_path / "bf16", param_dtype="bfloat16")
    np.testing.assert_array_equal(np.asarray(reloaded.backbone.embed_tokens.embedding[...]),
                                  np.asarray(model.backbone.embed_tokens.embedding[...]))


def test_tokenizer_round_trips_through_save(tmp_path):
    tok_json = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
                "normalizer": None, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None,
                "decoder": None, "model": {"type": "WordLevel", "vocab": {"<unk>": 0, "<eos>": 1, "hi": 2},
                                           "unk_token": "<unk>"}}
    src = tmp_path / "tok"
    src.mkdir()
    (src / "tokenizer.json").write_text(json.dumps(tok_json))
    (src / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<eos>", "unk_token": "<unk>", "chat_template": "{{ messages[0]['content'] }}"}))
    tok = load_tokenizer(src)
    assert tok.pad_token == "<eos>" and tok.padding_side == "left"  # pad falls back to eos
    from ppo_jax.models import ModelConfig, init_model
    cfg = ModelConfig(model_type="llama", vocab_size=8, hidden_size=16, intermediate_size=32,
                      num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8)
    save_pretrained(init_model(cfg), cfg, tmp_path / "out", tokenizer=tok)
    again = load_tokenizer(tmp_path / "out")
    assert again.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "hi"


# ---------------------------------------------------------------- clear errors


def copy_ckpt(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_missing_config_json_raises_file_not_found(hf_checkpoints, tmp_path):
    d = copy_ckpt(hf_checkpoints["llama_tied"][0], tmp_path / "c")
    (d / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(d)
    with pytest.raises(FileNotFoundError, match="not found"):
        load_model(tmp_path / "does-not-exist")


def test_unsupported_model_type_is_named(hf_checkpoints, tmp_path):
    d = copy_ckpt(hf_checkpoints["llama_tied"][0], tmp_path / "c")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "model_type": "bert"}))
    with pytest.raises(ValueError, match="unsupported model_type 'bert'"):
        load_model(d)


def rewrite_tensors(d, edit):
    path = d / "model.safetensors"
    tensors = edit(load_file(path))
    save_file(tensors, path, metadata={"format": "pt"})


def test_wrong_tensor_shape_error_names_the_tensor(hf_checkpoints, tmp_path):
    d = copy_ckpt(hf_checkpoints["llama_tied"][0], tmp_path / "c")
    name = "model.layers.1.mlp.up_proj.weight"
    rewrite_tensors(d, lambda t: {**t, name: t[name][:, :-1]})
    with pytest.raises(CheckpointError, match=r"'model\.layers\.1\.mlp\.up_proj\.weight' has shape \(128, 63\)"):
        load_model(d)


def test_missing_tensor_error_names_the_tensor(hf_checkpoints, tmp_path):
    d = copy_ckpt(hf_checkpoints["qwen2"][0], tmp_path / "c")
    name = "model.layers.0.self_attn.k_proj.bias"
    rewrite_tensors(d, lambda t: {k: v for k, v in t.items() if k != name})
    with pytest.raises(CheckpointError, match=r"'model\.layers\.0\.self_attn\.k_proj\.bias' not found"):
        load_model(d)


def test_missing_weights_or_shard_raises_file_not_found(hf_checkpoints, tmp_path):
    d = copy_ckpt(hf_checkpoints["llama_tied"][0], tmp_path / "c")
    (d / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_model(d)
    s = copy_ckpt(hf_checkpoints["llama3_untied"][0], tmp_path / "s")
    shard = sorted(s.glob("model-*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=shard.name):
        load_model(s)


@pytest.mark.parametrize("edit,match", [
    (lambda c: {k: v for k, v in c.items() if k != "hidden_size"},
     "missing the required field 'hidden_size'"),
    (lambda c: {**c, "hidden_size": "64"}, "hidden_size='64' must be a positive int"),
    (lambda c: {**c, "num_hidden_layers": 0}, "num_layers=0 must be a positive int"),
])
def test_malformed_config_names_the_file_and_field(hf_checkpoints, tmp_path, edit, match):
    d = copy_ckpt(hf_checkpoints["llama_tied"][0], tmp_path / "c")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(edit(cfg)))
    with pytest.raises(ValueError, match=f"config.json: .*{match}"):
        load_model(d)


def test_unreadable_safetensors_names_the_file(hf_checkpoints, tmp_path):
    d = copy_ckpt(hf_checkpoints["llama_tied"][0], tmp_path / "c")
    (d / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(CheckpointError, match="model.safetensors is not a readable safetensors"):
        load_model(d)


def test_weights_the_config_does_not_use_are_reported(hf_checkpoints, tmp_path):
    """config.json with fewer layers than the weights: loading works (as in transformers) but
    warns with the unread tensors; a causal LM's own checkpoint loads without a warning."""
    import warnings

    d = copy_ckpt(hf_checkpoints["llama_tied"][0], tmp_path / "c")
    cfg = json.loads((d / "config.json").read_text())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_model(d)
        load_model(hf_checkpoints["llama3_untied"][0], "value")  # lm_head unused: no warning
    (d / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 1}))
    with pytest.warns(UserWarning, match=r"tensors were not loaded .*model\.layers\.1\."):
        model, loaded_cfg = load_model(d)
    assert loaded_cfg.num_layers == 1
