"""Convert a GGUF checkpoint into a Hugging Face directory (config.json, model.safetensors,
tokenizer files with the chat template, generation_config.json).

    python -m ppo_jax.models.convert_gguf IN.gguf OUT_DIR [--dtype float32|bfloat16]

transformers dequantises the GGUF (`from_pretrained(dir, gguf_file=name)`, needs `gguf`,
`accelerate` and torch CPU). It refuses `save_pretrained` on a GGUF-loaded model, so the weights
are written here with the `safetensors` library. The output is written to a temporary sibling
folder and renamed into place, so an interrupted conversion never looks finished.
torch is imported only inside this module (never on the training path).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

CONFIG_DROP = ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version",
               "id2label", "label2id")


def _write_hf_dir(gguf_path: Path, out: Path, dtype: str) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src, name = str(gguf_path.parent), gguf_path.name
    torch_dtype = getattr(torch, dtype)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch_dtype)
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)

    cfg = model.config.to_dict()
    for key in CONFIG_DROP:
        cfg.pop(key, None)
    cfg["architectures"] = [type(model).__name__]
    cfg["torch_dtype"] = dtype
    cfg["dtype"] = dtype
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")

    tensors = {}
    tied = bool(cfg.get("tie_word_embeddings", False))
    for key, t in model.state_dict().items():
        if tied and key == "lm_head.weight":
            continue  # HF re-ties it from the embedding on load
        tensors[key] = t.detach().to(torch_dtype).contiguous().clone()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})

    tokenizer.save_pretrained(str(out))
    if model.generation_config is not None:
        model.generation_config.save_pretrained(str(out))


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
      gguf_path: a `.gguf` file (any architecture transformers' GGUF loader supports; Llama
        family tested on SmolLM2-135M-Instruct Q4_1).
      out_dir: target directory; must not exist unless overwrite=True.
      dtype: "float32" (default, exact dequantised values) or "bfloat16".
    Returns the directory. Raises FileNotFoundError (no GGUF file), FileExistsError (out_dir
    exists and overwrite=False), ImportError (gguf / torch / accelerate missing).
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
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
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--overwrite", action="store_true")
    args = p.parse_args(argv)
    out = convert_gguf(args.gguf, args.out_dir, dtype=args.dtype, overwrite=args.overwrite)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
