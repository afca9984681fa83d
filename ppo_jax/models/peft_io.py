"""LoRA adapters as Hugging Face PEFT directories, `adapter_config.json` and
`adapter_model.safetensors`, as `peft.PeftModel.save_pretrained` writes and `from_pretrained`
reads them. The layout follows peft 0.21's `get_peft_model_state_dict` and `LoraConfig`.

One tensor per layer and projection, keyed by the HF module name under the `PeftModel`
wrapper, adapter name ("default") removed; `lora_A.weight [r, in]` = our `lora_a[i].T`,
`lora_B.weight [out, r]` = our `lora_b[i].T`, e.g.
`base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight` (Llama family) or
`base_model.model.transformer.h.{i}.attn.c_attn.lora_B.weight` (GPT-2: Conv1D layers, so
`fan_in_fan_out: true`; the A/B layout is the same). A sequence-classification adapter
(task_type "SEQ_CLS") also holds its score head, a `modules_to_save` module, saved as
`base_model.model.score.weight [1, D]` (= our score/kernel.T). PEFT computes
`base(x) + lora_B(lora_A(x)) * lora_alpha / r`, as `models.lora` does.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from ppo_jax.models import hf_names
from ppo_jax.models.config import ModelConfig
from ppo_jax.models.functional import flat_params
from ppo_jax.models.lora import is_adapter

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
KEY_PREFIX = "base_model.model."  # PeftModel -> LoraModel -> the transformers model
SCORE_PATH, SCORE_KEY = "score/kernel", "base_model.model.score.weight"
TASK_TYPES = {"causal_lm": "CAUSAL_LM", "causal_lm_value": "CAUSAL_LM", "reward": "SEQ_CLS"}
# LoraConfig options that change the adapters' math or coverage: refused unless unset
UNSUPPORTED = ("use_rslora", "use_dora", "lora_bias", "layers_to_transform", "rank_pattern",
               "alpha_pattern", "exclude_modules", "layer_replication", "trainable_token_indices",
               "alora_invocation_tokens", "target_parameters", "use_qalora", "use_bdlora")
SEQ_CLS_HEADS = {"classifier", "score"}  # PeftModelForSequenceClassification's modules_to_save


class AdapterError(ValueError):
    """An adapter directory is incomplete, unsupported or does not fit the model config; the
    message names the directory, the field, the adapter's and the config's values and the
    config key to change."""


def _task_type(kind: str) -> str:
    if kind not in TASK_TYPES:
        raise ValueError(f"adapter kind {kind!r}: expected one of {list(TASK_TYPES)}")
    return TASK_TYPES[kind]


def expected_params(cfg: ModelConfig, kind: str = "causal_lm") -> dict[str, tuple[int, ...]]:
    """`{our param path: shape}` of the adapters of `cfg` (`lora_a [N, in, r]`, `lora_b
    [N, r, out]`), plus `score/kernel [D, 1]` for kind "reward". Raises ValueError: an unknown
    kind, or `cfg` without LoRA."""
    from ppo_jax.models.hf_io import abstract_model

    _task_type(kind)
    if not cfg.lora_rank:
        raise ValueError("the model config has no LoRA adapters (model.lora.rank is 0)")
    _, params = abstract_model(cfg, "reward" if kind == "reward" else "causal_lm")
    return {p: tuple(x.shape) for p, x in flat_params(params).items()
            if is_adapter(p) or (kind == "reward" and p == SCORE_PATH)}


def peft_keys(cfg: ModelConfig, path: str) -> list[str]:
    """PEFT's tensor keys of our param `path`, one per layer for an adapter (e.g.
    `backbone/layers/attn/q_proj/lora_a` -> `base_model.model.model.layers.{i}.self_attn.
    q_proj.lora_A.weight`), `[SCORE_KEY]` for `score/kernel`. Raises KeyError otherwise."""
    if path == SCORE_PATH:
        return [SCORE_KEY]
    if not is_adapter(path):
        raise KeyError(f"{path!r} is not a LoRA adapter or score head")
    spec = hf_names.hf_tensor(cfg, path.rsplit("/", 1)[0] + "/kernel")
    sub = "lora_A" if path.endswith("lora_a") else "lora_B"
    return [f"{KEY_PREFIX}{name.removesuffix('.weight')}.{sub}.weight"
            for name in spec.names(cfg.num_layers)]


def adapter_config(cfg: ModelConfig, *, base_model: str, kind: str = "causal_lm",
                   init: str = "default") -> dict:
    """The `adapter_config.json` dict of `cfg`'s adapters (peft 0.21 `LoraConfig` keys; the
    ones left out take PEFT's defaults). Raises ValueError: an unknown kind."""
    task = _task_type(kind)
    alpha = float(cfg.lora_alpha)
    return {
        "peft_type": "LORA", "task_type": task, "base_model_name_or_path": base_model,
        "revision": None, "r": cfg.lora_rank,
        "lora_alpha": int(alpha) if alpha.is_integer() else alpha,
        "target_modules": sorted(cfg.lora_targets), "exclude_modules": None, "lora_dropout": 0.0,
        "bias": "none", "fan_in_fan_out": cfg.model_type == "gpt2",
        "init_lora_weights": True if init == "default" else init,
        "use_rslora": False, "use_dora": False, "lora_bias": False, "inference_mode": True,
        "modules_to_save": ["score"] if task == "SEQ_CLS" else None,
        "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {},
        "alpha_pattern": {},
    }


def save_adapter(params, cfg: ModelConfig, out_dir, *, base_model: str,
                 kind: str = "causal_lm", init: str = "default") -> Path:
    """Write `cfg`'s adapters from `params` as a PEFT LoRA directory (module docstring):
    `adapter_config.json` and `adapter_model.safetensors` (each tensor in its param's dtype).

    params: a nested params dict or `nnx.State`, the whole model or the adapters only
      (`lora_a [N, in, r]`, `lora_b [N, r, out]`; kind "reward" also `score/kernel [D, 1]`).
      Only adapters (and the score head) are written.
    base_model: the base checkpoint (`base_model_name_or_path`), e.g. an HF repo id or path.
    kind: "causal_lm" / "causal_lm_value" (task_type CAUSAL_LM) or "reward" (SEQ_CLS).
    init: the adapters' init (`model.lora.init`), recorded as PEFT's `init_lora_weights`.
    Returns `out_dir`. Raises ValueError: an unknown kind, `cfg` without LoRA, an adapter (or
    the score head) missing from `params` or of the wrong shape.
    """
    want = expected_params(cfg, kind)
    flat = flat_params(params)
    tensors = {}
    for path, shape in want.items():
        if path not in flat:
            raise ValueError(f"params hold no {path!r} (needed for a {kind} adapter of "
                             f"{cfg.model_type})")
        a = np.asarray(jax.device_get(flat[path]))
        if a.shape != shape:
            raise ValueError(f"param {path!r} has shape {a.shape}, the config expects {shape}")
        layers = [a] if path == SCORE_PATH else list(a)
        for key, t in zip(peft_keys(cfg, path), layers):
            tensors[key] = np.ascontiguousarray(t.T)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    conf = adapter_config(cfg, base_model=base_model, kind=kind, init=init)
    (out_dir / CONFIG_FILE).write_text(json.dumps(conf, indent=2, sort_keys=True) + "\n")
    save_file(tensors, str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    return out_dir


def _mismatch(d: Path, field: str, got, want, key: str) -> AdapterError:
    return AdapterError(f"adapter {d}: {CONFIG_FILE} has {field}={got!r} but the model config "
                        f"has {key}={want!r}; set {key}={got!r} to load this adapter")


def _refuse(d: Path, field: str, got, why: str) -> AdapterError:
    return AdapterError(f"adapter {d}: {CONFIG_FILE} has {field}={got!r}, which is not "
                        f"supported: {why}")


def _is_set(v) -> bool:
    return not (v is None or v is False or (isinstance(v, (dict, list, tuple, str)) and not v))


def _read_config(d: Path) -> dict:
    if not d.is_dir():
        raise AdapterError(f"adapter directory {d} not found (model.lora.adapter)")
    if not (d / CONFIG_FILE).is_file():
        raise AdapterError(f"adapter {d}: {CONFIG_FILE} not found (is model.lora.adapter a "
                           "PEFT adapter directory?)")
    if not (d / WEIGHTS_FILE).is_file():
        bin_ = " (adapter_model.bin is not supported: re-save with safe_serialization=True)"
        raise AdapterError(f"adapter {d}: {WEIGHTS_FILE} not found"
                           + (bin_ if (d / "adapter_model.bin").is_file() else ""))
    try:
        conf = json.loads((d / CONFIG_FILE).read_text())
    except json.JSONDecodeError as e:
        raise AdapterError(f"adapter {d}: {CONFIG_FILE} is not valid JSON: {e}") from None
    if not isinstance(conf, dict):
        raise AdapterError(f"adapter {d}: {CONFIG_FILE} is not a JSON object")
    return conf


def _check_config(d: Path, conf: dict, cfg: ModelConfig, kind: str) -> None:
    """Raise AdapterError where `conf` (adapter_config.json) does not fit `cfg`."""
    if conf.get("peft_type") != "LORA":
        raise _refuse(d, "peft_type", conf.get("peft_type"), "only LORA adapters can be loaded")
    if conf.get("r") != cfg.lora_rank:
        raise _mismatch(d, "r", conf.get("r"), cfg.lora_rank, "model.lora.rank")
    alpha = conf.get("lora_alpha")
    if not isinstance(alpha, (int, float)) or float(alpha) != float(cfg.lora_alpha):
        raise _mismatch(d, "lora_alpha", alpha, cfg.lora_alpha, "model.lora.alpha")
    targets = conf.get("target_modules")
    if isinstance(targets, str):
        raise _refuse(d, "target_modules", targets, "a regular expression; only a list of module "
                      "names is read (re-save the adapter with target_modules as a list, e.g. "
                      f"{list(cfg.lora_targets)}, and set model.lora.target_modules to it)")
    if isinstance(targets, list):  # PEFT's "all-linear" is saved as module paths
        targets = sorted({str(t).rsplit(".", 1)[-1] for t in targets})
    if not isinstance(targets, list) or set(targets) != set(cfg.lora_targets):
        got = sorted(targets) if isinstance(targets, list) else targets
        raise _mismatch(d, "target_modules", got, sorted(cfg.lora_targets),
                        "model.lora.target_modules")
    fan = cfg.model_type == "gpt2"
    if bool(conf.get("fan_in_fan_out", False)) != fan:
        raise _refuse(d, "fan_in_fan_out", conf.get("fan_in_fan_out"), f"a {cfg.model_type} "
                      f"model needs fan_in_fan_out={fan} (true only for GPT-2's Conv1D layers): "
                      "was the adapter made for another architecture than the base model?")
    if conf.get("bias", "none") != "none":
        raise _refuse(d, "bias", conf["bias"], 'only bias="none" (no trained biases) is read')
    for key in UNSUPPORTED:
        if _is_set(conf.get(key)):
            raise _refuse(d, key, conf[key], "ppo_jax's LoRA is x W + (alpha/r) (x A) B on every "
                          "layer of the target modules; re-save the adapter without it")
    heads = conf.get("modules_to_save") or []
    allowed = SEQ_CLS_HEADS if kind == "reward" else set()
    if not set(heads) <= allowed:
        raise _refuse(d, "modules_to_save", heads, f"a {kind} adapter may save only "
                      f"{sorted(allowed)} besides its LoRA matrices")


def load_adapter(adapter_dir, cfg: ModelConfig, *,
                 kind: str = "causal_lm") -> dict[str, np.ndarray]:
    """Read a PEFT LoRA directory (written by `save_adapter` or by peft) for the model `cfg`.

    Returns `{our param path: array}` in the file's dtype: every adapter `cfg` expects,
    stacked over layers (`lora_a [N, in, r]`, `lora_b [N, r, out]`), and for kind "reward"
    `score/kernel [D, 1]` when the file holds `base_model.model.score.weight`. Pass it as
    `hf_io.load_model(..., lora=..., adapters=...)`.

    Raises AdapterError (all checked before returning; the message names the directory, the
    field, both values and the config key): a missing directory, adapter_config.json or
    adapter_model.safetensors; peft_type not LORA; r != cfg.lora_rank (model.lora.rank);
    lora_alpha != cfg.lora_alpha (model.lora.alpha); target_modules not the set
    cfg.lora_targets (model.lora.target_modules), or a regex string; fan_in_fan_out not the
    architecture's; bias not "none"; use_rslora, use_dora, layers_to_transform, rank/alpha
    patterns or other options of `UNSUPPORTED` set; modules_to_save other than the score head;
    a missing, unreadable, unexpected or wrongly shaped tensor. ValueError: an unknown kind.
    """
    d = Path(adapter_dir)
    conf = _read_config(d)
    _check_config(d, conf, cfg, kind)
    want = expected_params(cfg, kind)
    try:
        with safe_open(d / WEIGHTS_FILE, framework="np") as f:
            names = f.keys()
            tensors = {k: f.get_tensor(k) for k in names}
    except SafetensorError as e:
        raise AdapterError(f"adapter {d}: {WEIGHTS_FILE} is not readable: {e}") from None
    out, used = {}, set()
    for path, shape in want.items():
        if path == SCORE_PATH and SCORE_KEY not in tensors:
            continue
        hf_shape = shape[::-1] if path == SCORE_PATH else shape[1:][::-1]
        layers = []
        for key in peft_keys(cfg, path):
            if key not in tensors:
                raise AdapterError(f"adapter {d}: {WEIGHTS_FILE} has no tensor {key!r} (param "
                                   f"{path}); the model config expects one of shape {hf_shape}")
            if tuple(tensors[key].shape) != hf_shape:
                raise AdapterError(f"adapter {d}: tensor {key!r} has shape "
                                   f"{tuple(tensors[key].shape)} but the model config expects "
                                   f"{hf_shape} (param {path}); is the stage's model (model.actor / model.reward_model) its base?")
            layers.append(tensors[key].T)
            used.add(key)
        out[path] = layers[0].copy() if path == SCORE_PATH else np.stack(layers)
    extra = sorted(set(tensors) - used)
    if extra:
        raise AdapterError(f"adapter {d}: {len(extra)} tensors the model config does not expect "
                           f"(more layers or modules than the base model has?): {extra[:4]}")
    return out
