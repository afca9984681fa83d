"""Load and save Hugging Face checkpoint directories (config.json + safetensors + tokenizer).

Loading never materialises a random model: `nnx.eval_shape` gives the param shapes, each param
is then read from safetensors (stacking per-layer tensors, transposing `nn.Linear` weights),
checked against the expected shape, cast to `param_dtype` and put on device.
Saving writes the inverse, loadable by `transformers.AutoModelForCausalLM.from_pretrained`
(CausalLM) or `AutoModelForSequenceClassification` (RewardModel / ValueModel).

Errors: FileNotFoundError (missing directory, config.json, weights or index shard),
ValueError (unsupported model_type, bad config), `CheckpointError` (a ValueError) naming the
tensor for a missing tensor or a shape mismatch, or the file for an unreadable one. A
UserWarning lists checkpoint weights that no param read (e.g. more layers than config.json).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from ppo_jax.models import hf_names
from ppo_jax.models.config import ModelConfig, to_hf_dict
from ppo_jax.models.functional import flat_params, path_str
from ppo_jax.models.heads import CausalLM, RewardModel, ValueModel, model_class
from ppo_jax.models.lora import LoraSettings, fresh_adapter, is_adapter, merge_adapters

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint tensor is missing or has the wrong shape; the message names the tensor."""


def load_model_config(path, **overrides) -> ModelConfig:
    """`ModelConfig` from `<path>/config.json`; overrides: param_dtype, dtype, remat, ...

    Raises FileNotFoundError (no directory / config.json), ValueError (invalid JSON,
    unsupported model_type, a missing or malformed size; the message names the file).
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory not found: {path}")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"config.json not found in {path}")
    try:
        d = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_file} is not valid JSON: {e}") from e
    try:
        return ModelConfig.from_hf(d, **overrides)
    except ValueError as e:
        raise ValueError(f"{cfg_file}: {e}") from e


class SafetensorsReader:
    """Name -> numpy tensor over a single or sharded safetensors checkpoint (lazy, per tensor)."""

    def __init__(self, path):
        path = Path(path)
        index = path / INDEX_FILE
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = {name: path / f for name, f in weight_map.items()}
        elif (path / SINGLE_FILE).is_file():
            files = None
            shards = [path / SINGLE_FILE]
        else:
            shards = sorted(path.glob("*.safetensors"))
            files = None
            if not shards:
                raise FileNotFoundError(
                    f"no *.safetensors weights in {path} (pytorch_model.bin is not supported: load "
                    "it with transformers and save_pretrained(safe_serialization=True))")
        if files is not None:
            for f in sorted(set(files.values())):
                if not f.is_file():
                    raise FileNotFoundError(f"shard {f.name} listed in {INDEX_FILE} is missing in {path}")
        else:
            files = {}
            for f in shards:
                with _open(f) as h:
                    files.update({name: f for name in h.keys()})
        self.path, self.files, self._handles = path, files, {}
        self.used: set[str] = set()  # names read so far (for the unused-tensor warning)

    @property
    def names(self) -> set[str]:
        """All tensor names in the checkpoint."""
        return set(self.files)

    def get(self, name: str) -> np.ndarray:
        """The tensor `name` as a numpy array. Raises CheckpointError if absent."""
        if name not in self.files:
            raise CheckpointError(f"tensor {name!r} not found in checkpoint {self.path}")
        f = self.files[name]
        if f not in self._handles:
            self._handles[f] = _open(f)
        self.used.add(name)
        try:
            return self._handles[f].get_tensor(name)
        except SafetensorError as e:
            raise CheckpointError(f"{f}: cannot read tensor {name!r}: {e}") from None


def _open(file: Path):
    try:
        return safe_open(file, framework="np")
    except SafetensorError as e:
        raise CheckpointError(f"{file} is not a readable safetensors file: {e}") from None


# tensors a checkpoint may hold that no model kind reads: buffers (RoPE tables, GPT-2's causal
# masks) and heads of other kinds (a causal LM's lm_head loaded as critic, a score head as LM)
_NOT_WEIGHTS = (".rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")
_OTHER_HEADS = ("lm_head.", "score.", "v_head.", "value_head.")


def _warn_unused(reader: SafetensorsReader) -> None:
    unused = sorted(n for n in reader.names - reader.used
                    if not n.endswith(_NOT_WEIGHTS) and not n.startswith(_OTHER_HEADS))
    if unused:
        shown = ", ".join(unused[:6]) + (f", ... ({len(unused)} in all)" if len(unused) > 6 else "")
        warnings.warn(f"{reader.path}: {len(unused)} checkpoint tensors were not loaded (does "
                      f"config.json match the weights?): {shown}", stacklevel=3)


def _read_param(reader: SafetensorsReader, cfg: ModelConfig, path: str, shape, prefix: str):
    spec = hf_names.hf_tensor(cfg, path, prefix)
    lead = tuple(shape[:spec.lead])
    want = tuple(shape[spec.lead:])
    if spec.experts and spec.name.format(i=spec.layers[0], j=0) not in reader.names:
        return _read_fused_experts(reader, spec, path, want)
    want_hf = _transposed(want) if spec.transpose else want
    arrays = []
    for name in spec.names(cfg.num_layers):
        a = reader.get(name)
        if tuple(a.shape) != want_hf:
            raise CheckpointError(f"tensor {name!r} has shape {tuple(a.shape)} but the config "
                                  f"expects {want_hf} (param {path})")
        arrays.append(np.swapaxes(a, -1, -2) if spec.transpose else a)
    return np.stack(arrays).reshape(lead + want) if lead else arrays[0]


def _transposed(shape: tuple) -> tuple:
    return shape[:-2] + shape[:-3:-1]


def _read_fused_experts(reader: SafetensorsReader, spec: hf_names.HFTensor, path: str, want):
    """Experts `[N, E, in, out]` from transformers 5's in-memory layout, one tensor per layer of
    `[E, out, in]` experts: `mlp.experts.gate_up_proj [E, 2F, D]` (gate rows, then up rows) or
    `mlp.experts.down_proj [E, D, F]`, for a checkpoint written from a state dict without
    transformers' conversion to the per-expert layout."""
    leaf = path.rsplit("/", 1)[1]
    fused = "down_proj" if leaf == "down_proj" else "gate_up_proj"
    base = spec.name.split(".{j}.")[0]
    din, dout = want
    expect = (spec.experts, dout if fused == "down_proj" else 2 * dout, din)
    out = []
    for i in spec.layers:
        name = f"{base}.{fused}".format(i=i)
        a = reader.get(name)
        if tuple(a.shape) != expect:
            raise CheckpointError(f"tensor {name!r} has shape {tuple(a.shape)} but the config "
                                  f"expects {expect} (param {path})")
        if fused == "gate_up_proj":
            a = a[:, :dout] if leaf == "gate_proj" else a[:, dout:]
        out.append(np.swapaxes(a, -1, -2))
    return np.stack(out)


def _fresh_head(path: str, shape, std: float, seed: int) -> np.ndarray:
    if path.endswith("bias") or std == 0.0:
        return np.zeros(shape, np.float32)
    return np.asarray(std * jax.random.normal(jax.random.key(seed), shape), np.float32)


def load_model(path, kind: str = "causal_lm", *, param_dtype: str = "float32",
               dtype: str = "float32", remat: str = "none", attention: str = "auto",
               head_init_std: float = 0.0,
               seed: int = 0, sharding_fn: Callable | None = None, fresh_score_head: bool = False,
               lora: LoraSettings | None = None, adapters: Mapping[str, np.ndarray] | None = None):
    """Load a local HF checkpoint directory into `kind` ("causal_lm" | "value" | "reward" |
    "causal_lm_value").

    - causal_lm: backbone + LM head, `lm_head.weight` when untied.
    - reward: backbone + `score.weight` `[1, D]`, as HF `*ForSequenceClassification` with
      num_labels=1 stores it. With `fresh_score_head=True`, a causal-LM checkpoint without
      `score.weight` gets a fresh score head drawn from N(0, head_init_std^2), for reward-model
      training from an SFT model.
    - value: backbone + value head copied from `score.weight` and `score.bias` when present,
      a critic from a reward model as in DeepSpeed-Chat; otherwise a fresh head, zeros or
      N(0, head_init_std^2), a critic from an SFT or causal-LM checkpoint as in TRL.
    - causal_lm_value: a causal LM with a fresh value head on its backbone, zeros or
      N(0, head_init_std^2): the shared actor-critic.
    sharding_fn(path_str, shape) -> jax.sharding.Sharding places each param as it is read.
    attention: `ModelConfig.attention`, the kernel of no-cache calls (`attention_kernels`).
    lora: LoRA adapters on the projections it names. They are fresh, from `lora.init` and
    `seed`, with B = 0 so the model equals the checkpoint; or, when `adapters` is given, those:
    a `{param path: array}` dict such as `peft_io.load_adapter` returns. A reward adapter's
    `score/kernel` replaces the checkpoint's score head too.
    Returns (model, cfg). Raises FileNotFoundError, ValueError, CheckpointError (see module doc);
    warns when backbone tensors of the checkpoint were left unread.
    """
    path = Path(path)
    lora = lora or LoraSettings()
    cfg = load_model_config(path, param_dtype=param_dtype, dtype=dtype, remat=remat,
                            attention=attention, **lora.config_fields())
    reader = SafetensorsReader(path)
    cls = model_class(kind)
    kw = {} if cls is CausalLM else {"head_init_std": head_init_std}
    abstract = nnx.eval_shape(lambda: cls(cfg, rngs=nnx.Rngs(0), **kw))
    graphdef, abstract_state = nnx.split(abstract)
    try:
        prefix = hf_names.detect_prefix(cfg, reader.names)
    except KeyError as e:
        raise CheckpointError(f"tensor {e.args[0]!r} not found in checkpoint {path}") from None

    def fill(key_path, sds):
        p = path_str(key_path)
        no_score = "score.weight" not in reader.names
        fresh = ((kind == "causal_lm_value" and p.startswith("value_head/"))
                 or no_score and ((kind == "value" and p.startswith("value_head/"))
                                  or (kind == "reward" and fresh_score_head
                                      and p.startswith("score/"))))
        if adapters is not None and p in adapters:  # a PEFT adapter's (and its score head)
            arr = adapters[p]
        elif is_adapter(p):
            arr = fresh_adapter(p, sds.shape, sds.dtype, seed, lora.init)
        elif fresh:
            arr = _fresh_head(p, sds.shape, head_init_std, seed)
        elif p == "value_head/bias" and "score.bias" not in reader.names:
            arr = np.zeros(sds.shape, np.float32)
        else:
            arr = _read_param(reader, cfg, p, sds.shape, prefix)
        arr = np.asarray(arr).astype(sds.dtype)
        if sharding_fn is None:
            return jnp.asarray(arr)
        # each device (of every process) receives only its block; no cross-process checks
        return jax.make_array_from_callback(arr.shape, sharding_fn(p, sds.shape), lambda i: arr[i])

    state = jax.tree_util.tree_map_with_path(fill, abstract_state)
    _warn_unused(reader)
    return nnx.merge(graphdef, state), cfg


def abstract_model(cfg: ModelConfig, kind: str = "causal_lm", *,
                   sharding_fn: Callable | None = None):
    """The `(graphdef, params)` of a `kind` model of `cfg` with `jax.ShapeDtypeStruct` leaves
    in place of arrays; no weights are read or made. Given `sharding_fn`, each leaf carries the
    sharding it returns for the leaf's path and shape. What `load_model` would give, for
    lowering and compiling jitted functions ahead of time (`train.py --compile-for`) from a
    config.json alone.

    Raises ValueError: an unknown `kind`.
    """
    cls = model_class(kind)
    kw = {} if cls is CausalLM else {"head_init_std": 0.0}
    graphdef, state = nnx.split(nnx.eval_shape(lambda: cls(cfg, rngs=nnx.Rngs(0), **kw)))

    def shape(key_path, sds):
        sharding = None if sharding_fn is None else sharding_fn(path_str(key_path), sds.shape)
        return jax.ShapeDtypeStruct(sds.shape, sds.dtype, sharding=sharding)

    return graphdef, jax.tree_util.tree_map_with_path(shape, state)


def load_tokenizer(path, *, padding_side: str = "left"):
    """`transformers.AutoTokenizer` from a local directory (chat template included).

    Prompts are left-padded (padding_side="left"). When the tokenizer has no pad token, the EOS
    token is used as pad (callers then build masks from positions, never from token equality).
    Raises FileNotFoundError when the directory does not exist.
    """
    from transformers import AutoTokenizer

    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"tokenizer directory not found: {path}")
    tok = AutoTokenizer.from_pretrained(str(path), padding_side=padding_side)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def model_kind(model: nnx.Module) -> str:
    """"causal_lm" | "value" | "reward" for a model instance (a `CausalLMWithValueHead` is a
    "causal_lm": it is exported as its LM). Raises TypeError otherwise."""
    for cls, kind in ((CausalLM, "causal_lm"), (ValueModel, "value"), (RewardModel, "reward")):
        if isinstance(model, cls):
            return kind
    raise TypeError(f"not a ppo_jax model: {type(model).__name__}")


def hf_state_dict(model: nnx.Module, cfg: ModelConfig, dtype: str | None = None) -> dict[str, np.ndarray]:
    """`{HF name: numpy array}` in HF layout (per-layer tensors, `[out, in]` Linear weights).

    dtype: None keeps each param's dtype; "float32" / "bfloat16" / "float16" casts all.
    """
    out = {}
    lm_only = model_kind(model) == "causal_lm"  # a shared actor-critic's value head stays out
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    if cfg.lora_rank:  # the adapters folded into their kernels (PEFT merge_and_unload)
        params, cfg = merge_adapters(params, cfg.lora_scale), cfg.without_lora()
    for p, arr in flat_params(params).items():
        if lm_only and p.startswith("value_head/"):
            continue
        spec = hf_names.hf_tensor(cfg, p)
        a = np.asarray(jax.device_get(arr))
        if dtype is not None:
            a = a.astype(jnp.dtype(dtype))
        tensors = list(a.reshape(-1, *a.shape[spec.lead:])) if spec.lead else [a]
        for name, t in zip(spec.names(cfg.num_layers), tensors):
            out[name] = np.ascontiguousarray(np.swapaxes(t, -1, -2) if spec.transpose else t)
    return out


def save_pretrained(model: nnx.Module, cfg: ModelConfig, out_dir, tokenizer=None, *,
                    dtype: str | None = None) -> Path:
    """Write `out_dir/{config.json, model.safetensors, generation_config.json}` (+ tokenizer files).

    CausalLM -> `*ForCausalLM` (tied head not written, as HF does); RewardModel -> 
    `*ForSequenceClassification` (num_labels=1); ValueModel -> the same with the value head as
    `score.weight` plus `score.bias` (HF ignores the bias; `load_model(kind="value")` reads it).
    dtype: None writes each param in its own dtype (param_dtype; heads float32), or cast all to
    "float32" / "bfloat16" / "float16". Returns the directory. Source: transformers
    `PreTrainedModel.save_pretrained` file layout.
    """
    from transformers import AutoConfig, GenerationConfig

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    kind = model_kind(model)
    tensors = hf_state_dict(model, cfg, dtype)
    torch_dtype = dtype or cfg.param_dtype
    hf_kwargs = to_hf_dict(cfg.without_lora(), hf_names.architecture(cfg, kind), torch_dtype)
    if kind != "causal_lm":
        hf_kwargs["num_labels"] = 1
    model_type = hf_kwargs.pop("model_type")
    AutoConfig.for_model(model_type, **hf_kwargs).save_pretrained(out_dir)
    save_file(tensors, str(out_dir / SINGLE_FILE), metadata={"format": "pt"})
    if kind == "causal_lm":
        eos = list(cfg.eos_token_ids)
        GenerationConfig(bos_token_id=cfg.bos_token_id, pad_token_id=cfg.pad_token_id,
                         eos_token_id=eos[0] if len(eos) == 1 else (eos or None)).save_pretrained(out_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    return out_dir
