"""Convert a Llama-family GGUF checkpoint into a Hugging Face directory (config.json,
model.safetensors, tokenizer files with the chat template, generation_config.json), without torch.

    python -m ppo_jax.models.convert_gguf IN.gguf OUT_DIR [--dtype float32|bfloat16|float16]

The `gguf` package reads the file (`GGUFReader`) and dequantises each tensor in numpy
(`gguf.quants.dequantize`); tensor names are mapped to HF Llama names and llama.cpp's rotary row
permutation of q_proj / k_proj is undone; config.json and generation_config.json come from the
metadata; the byte-level BPE tokenizer is rebuilt from the metadata with `tokenizers`. This
reproduces, tensor for tensor and token for token, what transformers' GGUF loader gives with
torch, `from_pretrained(dir, gguf_file=name)`; tests/models/test_convert_gguf.py pins it. The
output is written to a temporary sibling folder and renamed into place, so an interrupted
conversion never looks finished. torch is never imported.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

DTYPES = ("float32", "bfloat16", "float16")
# GGUF `blk.N.<key>` -> HF `model.layers.N.<value>` (llama.cpp gguf-py tensor_mapping.py)
LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                "output": "lm_head"}
# llama.cpp pre-tokenizers that split like GPT-2's regex (transformers' GGUF loader adds no
# Split for them either). "smollm" also splits digits one by one, which gives the same ids on
# SmolLM2's vocabulary: it has no merge that involves a digit.
GPT2_PRETOKENIZERS = (None, "default", "gpt2", "gpt-2", "smollm")


def read_metadata(reader) -> dict:
    """`{key: value}` of a `gguf.GGUFReader`'s fields: str / int / float / bool; lists for
    arrays."""
    from gguf import GGUFValueType

    out = {}
    for key, field in reader.fields.items():
        if field.types[-1] == GGUFValueType.STRING:
            values = [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        else:
            values = [part.item() for i in field.data for part in field.parts[i]]
        out[key] = values if field.types[0] == GGUFValueType.ARRAY else values[0]
    return out


def hf_config(meta: dict, tensor_names, dtype: str) -> dict:
    """config.json of a `LlamaForCausalLM` from GGUF metadata, with the fields transformers 5
    writes (`rope_parameters`) plus the legacy `rope_theta` for older readers.

    The key mapping is transformers' `GGUF_CONFIG_MAPPING["llama"]`; the lm head is tied when the
    file has no `output.weight` (llama.cpp writes it only when untied). Raises ValueError for an
    architecture other than llama or a file with RoPE scaling.
    """
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} is not supported (only 'llama')")
    if meta.get("llama.rope.scaling.type", "none") != "none":
        raise ValueError(f"RoPE scaling {meta['llama.rope.scaling.type']!r} is not supported")

    def key(name, default=None):
        return meta.get(f"llama.{name}", default)

    def token_id(name):
        return meta.get(f"tokenizer.ggml.{name}")

    names = set(tensor_names)
    n_heads, hidden = key("attention.head_count"), key("embedding_length")
    theta = float(key("rope.freq_base", 10000.0))
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "dtype": dtype, "torch_dtype": dtype,
        "vocab_size": key("vocab_size") or len(meta["tokenizer.ggml.tokens"]),
        "hidden_size": hidden, "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"), "num_attention_heads": n_heads,
        "num_key_value_heads": key("attention.head_count_kv", n_heads),
        "head_dim": key("rope.dimension_count", hidden // n_heads),
        "max_position_embeddings": key("context_length", 2048),
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_parameters": {"rope_theta": theta, "rope_type": "default"}, "rope_theta": theta,
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names, "mlp_bias": "blk.0.ffn_up.bias" in names,
        "bos_token_id": token_id("bos_token_id"), "eos_token_id": token_id("eos_token_id"),
        "pad_token_id": token_id("padding_token_id"), "unk_token_id": token_id("unknown_token_id"),
        # transformers' defaults, written so the file matches what `save_pretrained` writes
        "hidden_act": "silu", "attention_dropout": 0.0, "initializer_range": 0.02,
        "pretraining_tp": 1, "use_cache": True, "chunk_size_feed_forward": 0,
        "is_encoder_decoder": False, "output_attentions": False, "output_hidden_states": False,
        "problem_type": None, "return_dict": True,
    }


def hf_tensor_name(gguf_name: str) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`, `token_embd.weight` ->
    `model.embed_tokens.weight`, ... Raises ValueError for a tensor with no HF Llama counterpart
    (e.g. llama-3.1's `rope_freqs.weight`)."""
    base, _, leaf = gguf_name.rpartition(".")
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    if m and m[2] in LAYER_NAMES and leaf in ("weight", "bias"):
        return f"model.layers.{m[1]}.{LAYER_NAMES[m[2]]}.{leaf}"
    if base in GLOBAL_NAMES and leaf in ("weight", "bias"):
        return f"{GLOBAL_NAMES[base]}.{leaf}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face Llama counterpart")


def unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: `[n_head * head_dim, ...]` rows, each head's rows
    stored as interleaved (even, odd) rotary pairs, back to HF's two halves (`rotate_half`).

    Inverse of `LlamaModel.permute` in llama.cpp convert_hf_to_gguf.py, written as transformers'
    `LlamaTensorProcessor._reverse_permute_weights`: reshape `[n_head, head_dim/2, 2, ...]`, swap
    the two middle axes. `n_head` is the KV head count for k_proj.
    """
    pairs = w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
    return pairs.swapaxes(1, 2).reshape(w.shape)


def hf_tensors(reader, cfg: dict, dtype: str) -> dict[str, np.ndarray]:
    """`{HF name: array}` in HF layout (`[out, in]` weights) and `dtype`, dequantised with
    `gguf.quants.dequantize` (float32) then cast (round to nearest even, as torch's `.to`).
    A tied head has no tensor in the file, so none is written (as `save_pretrained` does)."""
    import ml_dtypes
    from gguf.quants import dequantize

    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]}
    out = {}
    for t in reader.tensors:
        name = hf_tensor_name(t.name)
        w = dequantize(t.data, t.tensor_type)
        kind = t.name.split(".")[2] if t.name.startswith("blk.") else None
        if kind in heads:
            w = unpermute_rope_rows(w, heads[kind])
        out[name] = np.ascontiguousarray(w.astype(np_dtype))
    return out


def gguf_tokenizer(meta: dict):
    """A `PreTrainedTokenizerFast` from the GGUF tokenizer metadata (byte-level BPE, "gpt2" model).

    Built as transformers' GGUF loader builds it (`integrations/gguf/gguf_tokenizer_mapping.py`
    `byte_level_tokenizer` + `add_gguf_special_tokens`): the vocabulary respelled in the byte
    alphabet, the file's merges, GPT-2's ByteLevel pre-tokenizer and decoder, control tokens
    (type 3) as special tokens, user-defined ones (type 4) as added tokens, the special tokens and
    chat template from the metadata. Raises ValueError for another tokenizer model or a
    pre-tokenizer that does not split like GPT-2.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre")
    if model != "gpt2" or pre not in GPT2_PRETOKENIZERS:
        raise ValueError(f"GGUF tokenizer {model!r} with pre-tokenizer {pre!r} is not supported "
                         f"(only byte-level BPE 'gpt2' with {GPT2_PRETOKENIZERS[1:]})")
    tokens, types = meta["tokenizer.ggml.tokens"], meta.get("tokenizer.ggml.token_type", [])
    from gguf.vocab import bytes_to_unicode  # GPT-2's byte -> printable character table

    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
             for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False,
                               continuing_subword_prefix="", end_of_word_suffix=""))
    # llama.cpp reads `add_space_prefix` for sentencepiece vocabularies only
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t, ty in zip(tokens, types) if ty == 3 and set(t) <= alphabet])
    tok.add_tokens([AddedToken(t, normalized=False, special=False)
                    for t, ty in zip(tokens, types) if ty == 4 and t in vocab])

    def special(name):
        i = meta.get(f"tokenizer.ggml.{name}")
        return tokens[i] if i is not None else None

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=special("bos_token_id"), eos_token=special("eos_token_id"),
        unk_token=special("unknown_token_id"), pad_token=special("padding_token_id"),
        add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        add_eos_token=bool(meta.get("tokenizer.ggml.add_eos_token", False)))
    if meta.get("tokenizer.chat_template"):
        fast.chat_template = meta["tokenizer.chat_template"]
    return fast


def _write_hf_dir(gguf_path: Path, out: Path, dtype: str) -> None:
    from gguf import GGUFReader
    from safetensors.numpy import save_file
    from transformers import GenerationConfig

    reader = GGUFReader(str(gguf_path))
    meta = read_metadata(reader)
    cfg = hf_config(meta, [t.name for t in reader.tensors], dtype)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    save_file(hf_tensors(reader, cfg, dtype), str(out / "model.safetensors"),
              metadata={"format": "pt"})
    gguf_tokenizer(meta).save_pretrained(str(out))
    ids = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
           if cfg[k] is not None}
    GenerationConfig(**ids, _from_model_config=True, output_attentions=False,
                     output_hidden_states=False, use_cache=True).save_pretrained(str(out))


def _make_readable(folder: Path) -> None:
    """mkdtemp creates 0700 folders; give the result ordinary permissions (umask applied)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for f in folder.iterdir():
        os.chmod(f, 0o666 & ~umask)


def convert_gguf(gguf_path, out_dir, *, dtype: str = "float32", overwrite: bool = False) -> Path:
    """Dequantise `gguf_path` and write an HF checkpoint directory at `out_dir`.

    Args:
      gguf_path: a `.gguf` file of the llama architecture with a byte-level BPE tokenizer (tested
        on SmolLM2-135M-Instruct Q4_1); any ggml type `gguf.quants.dequantize` reads.
      out_dir: target directory; must not exist unless overwrite=True.
      dtype: "float32" (default, exact dequantised values), "bfloat16" or "float16".
    Returns the directory. Raises FileNotFoundError (no GGUF file), FileExistsError (out_dir
    exists and overwrite=False), ValueError (unsupported dtype, architecture, tensor or
    tokenizer), ImportError (the `gguf` package is missing: `pip install -e '.[gguf]'`).
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {DTYPES}")
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    if out_dir.exists() and not overwrite:
        raise FileExistsError(f"output directory exists: {out_dir} (pass overwrite=True)")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        _write_hf_dir(gguf_path, tmp, dtype)
        _make_readable(tmp)
        if overwrite and out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)  # atomic; fails if another process created out_dir meanwhile
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def main(argv=None) -> int:
    """CLI entry point; prints the output directory. Returns the exit status."""
    p = argparse.ArgumentParser(prog="python -m ppo_jax.models.convert_gguf", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("gguf", type=Path, help="input .gguf file")
    p.add_argument("out_dir", type=Path, help="output HF directory")
    p.add_argument("--dtype", default="float32", choices=DTYPES)
    p.add_argument("--overwrite", action="store_true")
    args = p.parse_args(argv)
    out = convert_gguf(args.gguf, args.out_dir, dtype=args.dtype, overwrite=args.overwrite)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
