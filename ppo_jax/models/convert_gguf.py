"""Convert a Llama or Gemma 3 GGUF checkpoint into a Hugging Face directory (config.json,
model.safetensors, tokenizer files with the chat template when the file has one,
generation_config.json), without torch.

    python -m ppo_jax.models.convert_gguf IN.gguf OUT_DIR [--dtype float32|bfloat16|float16]

The `gguf` package reads the file (`GGUFReader`) and dequantises each tensor in numpy
(`gguf.quants.dequantize`); tensor names are mapped to HF names, and what llama.cpp's converter
did to the tensors is undone: the rotary row permutation of q_proj / k_proj (llama), the `+ 1` on
every RMSNorm weight (gemma3, whose HF norms compute `x * (1 + w)`). config.json and
generation_config.json come from the metadata; the tokenizer is rebuilt from the metadata with
`tokenizers` (`gguf_tokenizer.py`). This reproduces, tensor for tensor and token for token, what
transformers' GGUF loader gives with torch, `from_pretrained(dir, gguf_file=name)`;
tests/models/test_convert_gguf.py pins it. The output is written to a temporary sibling folder
and renamed into place, so an interrupted conversion never looks finished. torch is never
imported.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ppo_jax.models.gguf_tokenizer import gguf_tokenizer

DTYPES = ("float32", "bfloat16", "float16")
# GGUF `blk.N.<key>` -> HF `model.layers.N.<value>` (llama.cpp gguf-py tensor_mapping.py)
LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
# Gemma 3 norms every block on both sides; llama.cpp's `ffn_norm` is the norm before the MLP
GEMMA3_LAYER_NAMES = {
    **LAYER_NAMES, "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
}
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                "output": "lm_head"}
# What llama.cpp hard-codes for LLM_ARCH_GEMMA3 (src/llama-model.cpp, `load_hparams`) and the
# file does not state: every 6th layer global, the others local with RoPE base 10000.
GEMMA3_SLIDING_PATTERN = 6
GEMMA3_LOCAL_ROPE_BASE = 10000.0
GEMMA3_27B_LAYERS = 62  # llama.cpp scales Gemma 3 27B's queries by hidden / heads, not head_dim
# transformers' defaults, written so the file matches what `save_pretrained` writes
HF_DEFAULTS = {
    "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True,
    "chunk_size_feed_forward": 0, "is_encoder_decoder": False, "output_attentions": False,
    "output_hidden_states": False, "problem_type": None, "return_dict": True,
}


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


def _special_ids(meta: dict) -> dict:
    def token_id(name):
        return meta.get(f"tokenizer.ggml.{name}")

    return {"bos_token_id": token_id("bos_token_id"), "eos_token_id": token_id("eos_token_id"),
            "pad_token_id": token_id("padding_token_id"),
            "unk_token_id": token_id("unknown_token_id")}


def llama_config(meta: dict, names: set, dtype: str) -> dict:
    """config.json of a `LlamaForCausalLM`, with the fields transformers 5 writes
    (`rope_parameters`) plus the legacy `rope_theta` for older readers. The key mapping is
    transformers' `GGUF_CONFIG_MAPPING["llama"]`."""
    def key(name, default=None):
        return meta.get(f"llama.{name}", default)

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
        "hidden_act": "silu", "pretraining_tp": 1, **_special_ids(meta), **HF_DEFAULTS,
    }


def gemma3_layer_types(num_layers: int) -> list[str]:
    """Gemma 3's 5 local : 1 global layers: layer i is global when (i + 1) % 6 == 0 (as
    transformers' `Gemma3TextConfig` derives `layer_types` from `sliding_window_pattern`)."""
    return ["full_attention" if (i + 1) % GEMMA3_SLIDING_PATTERN == 0 else "sliding_attention"
            for i in range(num_layers)]


def gemma3_config(meta: dict, names: set, dtype: str) -> dict:
    """config.json of a `Gemma3ForCausalLM` (`gemma3_text`) as transformers 5's GGUF loader
    builds it: `GGUF_CONFIG_MAPPING["gemma3"]` for what the file states, `Gemma3TextConfig`'s
    defaults for the rest (layer_types from the 1-in-6 pattern, local RoPE base 10000, the
    gelu-tanh MLP, no soft-capping). Beside `rope_parameters`, the legacy `rope_theta` /
    `rope_local_base_freq` for older readers. Raises ValueError for a sliding-window pattern
    other than 1 global layer in 6.

    `query_pre_attn_scalar` follows llama.cpp: head_dim, but hidden / heads for the 62-layer 27B
    (google/gemma-3-27b says 168 too), where transformers' loader would keep its default 256.
    """
    def key(name, default=None):
        return meta.get(f"gemma3.{name}", default)

    layers, hidden, n_heads = (key("block_count"), key("embedding_length"),
                               key("attention.head_count"))
    pattern = key("attention.sliding_window_pattern", GEMMA3_SLIDING_PATTERN)
    if pattern != GEMMA3_SLIDING_PATTERN:  # transformers' loader would ignore it
        raise ValueError(f"gemma3.attention.sliding_window_pattern={pattern!r} is not supported "
                         f"(only {GEMMA3_SLIDING_PATTERN}: 5 local layers to 1 global)")
    head_dim = key("attention.key_length", 256)
    theta = float(key("rope.freq_base", 1_000_000.0))
    return {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
        "dtype": dtype, "torch_dtype": dtype,
        "vocab_size": key("vocab_size") or len(meta["tokenizer.ggml.tokens"]),
        "hidden_size": hidden, "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": layers, "num_attention_heads": n_heads,
        "num_key_value_heads": key("attention.head_count_kv", n_heads), "head_dim": head_dim,
        "max_position_embeddings": key("context_length", 131072),
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon", 1e-6),
        "sliding_window": key("attention.sliding_window", 4096),
        "layer_types": gemma3_layer_types(layers),
        "_sliding_window_pattern": GEMMA3_SLIDING_PATTERN,
        "rope_parameters": {
            "full_attention": {"rope_theta": theta, "rope_type": "default"},
            "sliding_attention": {"rope_theta": GEMMA3_LOCAL_ROPE_BASE, "rope_type": "default"}},
        "rope_theta": theta, "rope_local_base_freq": GEMMA3_LOCAL_ROPE_BASE,
        "query_pre_attn_scalar": hidden // n_heads if layers == GEMMA3_27B_LAYERS else head_dim,
        "hidden_activation": "gelu_pytorch_tanh", "final_logit_softcapping": None,
        "attn_logit_softcapping": None, "use_bidirectional_attention": False,
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names, **_special_ids(meta), **HF_DEFAULTS,
    }


@dataclass(frozen=True)
class GgufArch:
    """How one `general.architecture` maps to HF: its config.json, its layer tensor names, and
    what llama.cpp's converter did to the tensors (`unpermute_qk`: q/k rows in rotary pairs;
    `norm_offset`: added to every `*norm.weight`)."""

    config: Callable[[dict, set, str], dict]
    layer_names: dict
    unpermute_qk: bool
    norm_offset: float


# transformers' TensorProcessors: `LlamaTensorProcessor` reverses the permutation,
# `Gemma2TensorProcessor` (used for gemma3) subtracts 1 from the norms and permutes nothing
ARCHS = {"llama": GgufArch(llama_config, LAYER_NAMES, unpermute_qk=True, norm_offset=0.0),
         "gemma3": GgufArch(gemma3_config, GEMMA3_LAYER_NAMES, unpermute_qk=False,
                            norm_offset=1.0)}


def gguf_arch(meta: dict) -> str:
    """`general.architecture`, checked. Raises ValueError for one not in ARCHS or a file with
    RoPE scaling (Gemma 3 4B and up: transformers' GGUF loader ignores it)."""
    arch = meta.get("general.architecture")
    if arch not in ARCHS:
        raise ValueError(f"GGUF architecture {arch!r} is not supported (only "
                         f"{', '.join(map(repr, ARCHS))})")
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling != "none":
        raise ValueError(f"RoPE scaling {scaling!r} ({arch}.rope.scaling.type) is not supported")
    return arch


def hf_config(meta: dict, tensor_names, dtype: str) -> dict:
    """config.json of the file's architecture (`ARCHS`), from its metadata; the lm head is tied
    when the file has no `output.weight` (llama.cpp writes it only when untied). Raises ValueError
    as `gguf_arch`."""
    return ARCHS[gguf_arch(meta)].config(meta, set(tensor_names), dtype)


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`, `token_embd.weight` ->
    `model.embed_tokens.weight`, ... Raises ValueError for a tensor with no HF counterpart in
    `arch` (e.g. llama-3.1's `rope_freqs.weight`)."""
    base, _, leaf = gguf_name.rpartition(".")
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    layer_names = ARCHS[arch].layer_names
    if m and m[2] in layer_names and leaf in ("weight", "bias"):
        return f"model.layers.{m[1]}.{layer_names[m[2]]}.{leaf}"
    if base in GLOBAL_NAMES and leaf in ("weight", "bias"):
        return f"{GLOBAL_NAMES[base]}.{leaf}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face {arch} counterpart")


def unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: `[n_head * head_dim, ...]` rows, each head's rows
    stored as interleaved (even, odd) rotary pairs, back to HF's two halves (`rotate_half`).

    Inverse of `LlamaModel.permute` in llama.cpp convert_hf_to_gguf.py, written as transformers'
    `LlamaTensorProcessor._reverse_permute_weights`: reshape `[n_head, head_dim/2, 2, ...]`, swap
    the two middle axes. `n_head` is the KV head count for k_proj.
    """
    pairs = w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
    return pairs.swapaxes(1, 2).reshape(w.shape)


def hf_tensors(reader, cfg: dict, dtype: str, arch: str = "llama") -> dict[str, np.ndarray]:
    """`{HF name: array}` in HF layout (`[out, in]` weights) and `dtype`, dequantised with
    `gguf.quants.dequantize` (float32), undone as `ARCHS[arch]` says (in float32), then cast
    (round to nearest even, as torch's `.to`). A tied head has no tensor in the file, so none is
    written (as `save_pretrained` does)."""
    import ml_dtypes
    from gguf.quants import dequantize

    spec = ARCHS[arch]
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]}
    out = {}
    for t in reader.tensors:
        name = hf_tensor_name(t.name, arch)
        w = dequantize(t.data, t.tensor_type)
        kind = t.name.split(".")[2] if t.name.startswith("blk.") else None
        if spec.unpermute_qk and kind in heads:
            w = unpermute_rope_rows(w, heads[kind])
        if spec.norm_offset and t.name.endswith("norm.weight"):
            w = w - np.float32(spec.norm_offset)
        out[name] = np.ascontiguousarray(w.astype(np_dtype))
    return out


def _write_hf_dir(gguf_path: Path, out: Path, dtype: str) -> None:
    from gguf import GGUFReader
    from safetensors.numpy import save_file
    from transformers import GenerationConfig

    reader = GGUFReader(str(gguf_path))
    meta = read_metadata(reader)
    cfg = hf_config(meta, [t.name for t in reader.tensors], dtype)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    save_file(hf_tensors(reader, cfg, dtype, gguf_arch(meta)), str(out / "model.safetensors"),
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
      gguf_path: a `.gguf` file of an architecture in `ARCHS` with a tokenizer `gguf_tokenizer`
        reads (tested on SmolLM2-135M-Instruct Q4_1 and Gemma 3 270M Q4_K_M); any ggml type
        `gguf.quants.dequantize` reads.
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
