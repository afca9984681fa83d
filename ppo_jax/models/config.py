"""`ModelConfig`: the static description of a decoder, read from a Hugging Face `config.json`.

One frozen, hashable dataclass covers the Llama family (Llama 2/3, Qwen2/2.5, Qwen3, Qwen3-MoE,
Mistral, SmolLM2), Gemma 3 (text) and GPT-2. It is stored on the modules (static part of the
NNX graphdef), so it must stay hashable: tuples, not lists.

Sources: transformers `configuration_{llama,qwen2,qwen3,qwen3_moe,mistral,gemma3,gpt2}.py` and
`modeling_rope_utils.py` (both the transformers-5 `rope_parameters` dict and the older
`rope_theta` / `rope_scaling` keys are accepted).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Mapping

import jax
import jax.numpy as jnp

from ppo_jax.models.attention_kernels import ATTENTION_KERNELS
from ppo_jax.models.gemma3_config import GEMMA3, gemma3_fields, gemma3_hf_dict
from ppo_jax.models.moe_layout import (
    LayerRun, check_moe, layer_runs, moe_fields, moe_hf_fields,
)

LLAMA_FAMILY = ("llama", "qwen2", "qwen3", "qwen3_moe", "mistral")
SUPPORTED_MODEL_TYPES = LLAMA_FAMILY + (GEMMA3, "gpt2")
ROPE_TYPES = ("default", "linear", "llama3")
DTYPES = ("float32", "bfloat16", "float16")
# HF `hidden_act` / `activation_function` names the decoders implement (`layers.ACTIVATIONS`)
ACTIVATION_NAMES = ("silu", "swish", "gelu", "gelu_new", "gelu_pytorch_tanh", "relu")


REMAT_POLICIES = (
    "dots_saveable",
    "dots_with_no_batch_dims_saveable",
    "nothing_saveable",
    "everything_saveable",
    "checkpoint_dots",
    "checkpoint_dots_with_no_batch_dims",
)


def remat_policy_names() -> tuple[str, ...]:
    """Names accepted by `ModelConfig.remat`: "none", "full", or a `jax.checkpoint_policies`
    policy that takes no arguments."""
    return ("none", "full") + tuple(p for p in REMAT_POLICIES if hasattr(jax.checkpoint_policies, p))


Dtype = Literal[DTYPES]  # the trainer config's type of model.param_dtype / dtype / ...
RematPolicy = Literal[remat_policy_names()]  # the trainer config's type of model.remat


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Static model description.

    Attributes:
      model_type: "llama" | "qwen2" | "qwen3" | "qwen3_moe" | "mistral" | "gemma3_text" | "gpt2".
      vocab_size, hidden_size, intermediate_size, num_layers, num_heads, num_kv_heads,
      head_dim: sizes (GQA when num_kv_heads < num_heads).
      max_position_embeddings: context length (GPT-2: size of the learned position table).
      norm_eps: RMSNorm / LayerNorm epsilon.
      hidden_act: "silu" (SwiGLU gate) or "gelu_new" (GPT-2 MLP), or another of `ACTIVATION_NAMES`.
      tie_word_embeddings: LM head shares the token embedding.
      qkv_bias / o_bias / mlp_bias: biases on q,k,v projections / output projection / MLP.
      qk_norm: per-head RMSNorm over head_dim on q and k before RoPE (Qwen3, Gemma 3).
      query_pre_attn_scalar: attention scores are scaled by `query_pre_attn_scalar ** -0.5`
        (Gemma 3); None: by `head_dim ** -0.5`. See `attn_scale`.
      rope_theta, rope_type ("default" | "linear" | "llama3"), rope_factor,
      rope_low_freq_factor, rope_high_freq_factor, rope_original_max_position_embeddings:
        RoPE settings (Su et al. 2021; Llama-3.1 frequency scaling).
      rope_local_theta: RoPE base of the sliding-window layers, unscaled (Gemma 3's
        `rope_local_base_freq`); None: every layer uses `rope_theta`.
      sliding_windows: per-layer attention window, 0 for full attention; empty for none.
      num_experts, num_experts_per_tok, moe_intermediate_size, norm_topk_prob,
      router_aux_loss_coef: Qwen3-MoE's sparse MLP (`models.moe`): E experts of FFN width
        moe_intermediate_size, top-k routing, top-k weights renormalised when norm_topk_prob,
        the load-balancing loss's coefficient. num_experts 0 = dense.
      sparse_layers: per-layer flag, True where the MLP is the sparse block; empty for a
        model without experts (from HF `decoder_sparse_step` / `mlp_only_layers` by
        `moe_layout.sparse_pattern`).
      bos_token_id, eos_token_ids, pad_token_id: special ids from config.json; None or empty
        when it has none.
      param_dtype: "float32" | "bfloat16" | "float16" - storage dtype of the weights.
      dtype: compute dtype of activations and matmuls. Logits/values/scores are float32.
      remat: "none", "full", or a `jax.checkpoint_policies` name, applied per decoder layer.
      attention: the attention of full-sequence (no-cache) calls, one of `ATTENTION_KERNELS`:
        "auto" (splash on TPU, cuDNN on GPU where the shapes allow, else the reference),
        "reference", "splash" or "cudnn" (`attention_kernels.sequence_kernel`).
      lora_rank, lora_alpha, lora_targets: LoRA adapters (Hu et al. 2021) of rank `lora_rank`,
        0 for none, on the projections named in `lora_targets` by PEFT's module names, one of
        `LORA_TARGETS`; scaled by `lora_alpha / lora_rank`.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int = 2048
    norm_eps: float = 1e-6
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    query_pre_attn_scalar: float | None = None
    rope_theta: float = 10000.0
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position_embeddings: int = 8192
    rope_local_theta: float | None = None
    sliding_windows: tuple[int, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    router_aux_loss_coef: float = 0.0
    sparse_layers: tuple[bool, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    param_dtype: str = "float32"
    dtype: str = "float32"
    remat: str = "none"
    attention: str = "auto"
    lora_rank: int = 0
    lora_alpha: float = 0.0
    lora_targets: tuple[str, ...] = ()

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {self.model_type!r}; supported: {SUPPORTED_MODEL_TYPES}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive int")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"unsupported rope_type {self.rope_type!r}; supported: {ROPE_TYPES}")
        if self.hidden_act not in ACTIVATION_NAMES:
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r}; supported: "
                             f"{ACTIVATION_NAMES}")
        for name in ("param_dtype", "dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"{name}={getattr(self, name)!r}; expected one of {DTYPES}")
        if self.remat not in remat_policy_names():
            raise ValueError(f"remat={self.remat!r}; expected one of {remat_policy_names()}")
        if self.attention not in ATTENTION_KERNELS:
            raise ValueError(f"attention={self.attention!r}; expected one of {ATTENTION_KERNELS}")
        if self.sliding_windows and len(self.sliding_windows) != self.num_layers:
            raise ValueError("sliding_windows must have one entry per layer (0 = full attention)")
        for name in ("query_pre_attn_scalar", "rope_local_theta"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name}={value!r} must be > 0 (or None)")
        check_moe(self)
        self._check_lora()

    def _check_lora(self) -> None:
        if isinstance(self.lora_rank, bool) or not isinstance(self.lora_rank, int) or self.lora_rank < 0:
            raise ValueError(f"lora_rank={self.lora_rank!r} must be an int >= 0")
        if not self.lora_rank:
            return
        names = lora_target_names(self.model_type)
        bad = [t for t in self.lora_targets if t not in names]
        moe = (" (adapters on the experts or the router of a sparse layer are not supported)"
               if self.num_moe_layers else "")
        if bad or not self.lora_targets:
            raise ValueError(f"lora target_modules={list(self.lora_targets)}: "
                             f"{'unknown ' + str(bad) if bad else 'empty'}; a {self.model_type} "
                             f"model has {list(names)} (PEFT's module names){moe}")
        mlp = [t for t in self.lora_targets if t in ("gate_proj", "up_proj", "down_proj")]
        if mlp and self.num_moe_layers == self.num_layers:
            raise ValueError(
                f"lora target_modules {mlp}: every layer of this {self.model_type} model is "
                "sparse, and its gate/up/down projections are stacked experts, which take no "
                "adapter (PEFT cannot target transformers' fused expert parameters by module "
                "name either); target the attention projections (q/k/v/o_proj)")
        if not self.lora_alpha > 0:
            raise ValueError(f"lora_alpha={self.lora_alpha!r} must be > 0")

    @property
    def lora_scale(self) -> float:
        """`lora_alpha / lora_rank`, PEFT's `scaling` (0 without LoRA)."""
        return self.lora_alpha / self.lora_rank if self.lora_rank else 0.0

    def lora_on(self, module: str) -> bool:
        """Whether the projection named `module` (PEFT's name, e.g. "q_proj") has an adapter."""
        return self.lora_rank > 0 and module in self.lora_targets

    def without_lora(self) -> "ModelConfig":
        """The same model with no adapters: the base graph of a LoRA model."""
        return dataclasses.replace(self, lora_rank=0, lora_alpha=0.0, lora_targets=())

    @property
    def num_moe_layers(self) -> int:
        """How many layers have the sparse MLP block (0 for a dense model)."""
        return sum(self.sparse_layers)

    @property
    def layer_runs(self) -> tuple["LayerRun", ...]:
        """The decoder's layers as runs of consecutive same-kind (dense / sparse) layers, each
        one stacked module scanned by `layers.scan_layer_run`. A model with one kind of layer
        has one run named "layers"; a mixed one names each run `layers_{first}`."""
        return layer_runs(self.sparse_layers or (False,) * self.num_layers)

    @property
    def is_llama_family(self) -> bool:
        """True for llama / qwen2 / qwen3 / qwen3_moe / mistral (RMSNorm, RoPE, SwiGLU)."""
        return self.model_type in LLAMA_FAMILY

    @property
    def attn_scale(self) -> float:
        """The factor of the attention scores: `query_pre_attn_scalar ** -0.5` (Gemma 3), else
        `head_dim ** -0.5`."""
        return (self.head_dim if self.query_pre_attn_scalar is None
                else self.query_pre_attn_scalar) ** -0.5

    @property
    def jnp_dtype(self):
        """Compute dtype as a jnp dtype."""
        return jnp.dtype(self.dtype)

    @property
    def jnp_param_dtype(self):
        """Parameter storage dtype as a jnp dtype."""
        return jnp.dtype(self.param_dtype)

    def replace(self, **changes) -> "ModelConfig":
        """A copy with `changes` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf(cls, hf_config: Any, **overrides) -> "ModelConfig":
        """Build from a HF config (a `PretrainedConfig` or the `config.json` dict).

        `overrides` set our own fields (param_dtype, dtype, remat, ...).
        Raises ValueError on an unsupported model_type or rope type, a missing size field, a
        size that is not a positive int, or a feature the decoders lack (`gemma3_fields`).
        """
        d = hf_config if isinstance(hf_config, Mapping) else hf_config.to_dict()
        mt = d.get("model_type")
        if mt not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {mt!r}; supported: {SUPPORTED_MODEL_TYPES}"
            )
        try:
            fields = (_gpt2_fields(d) if mt == "gpt2" else gemma3_fields(d) if mt == GEMMA3
                      else _llama_fields(d, mt))
        except KeyError as e:
            raise ValueError(f"{mt} config is missing the required field {e.args[0]!r}") from None
        fields.update(_special_ids(d))
        fields.update(overrides)
        return cls(**fields)


# PEFT's `target_modules` names of the projections that can carry a LoRA adapter
LORA_TARGETS = {
    "llama": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    "gpt2": ("c_attn", "c_proj", "c_fc"),
}


def lora_target_names(model_type: str) -> tuple[str, ...]:
    """The PEFT module names of `model_type`'s projections (the Llama family shares Llama's)."""
    return LORA_TARGETS["gpt2" if model_type == "gpt2" else "llama"]


def _special_ids(d: Mapping) -> dict:
    eos = d.get("eos_token_id")
    eos = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
    return dict(bos_token_id=d.get("bos_token_id"), eos_token_ids=eos,
                pad_token_id=d.get("pad_token_id"))


def _rope_fields(d: Mapping) -> dict:
    """RoPE keys from transformers>=5 `rope_parameters` or older `rope_theta`/`rope_scaling`."""
    params = dict(d.get("rope_parameters") or {})
    if "full_attention" in params and isinstance(params["full_attention"], Mapping):
        params = dict(params["full_attention"])  # per-layer-type form; one type for us
    legacy = dict(d.get("rope_scaling") or {})
    merged = {**legacy, **params}
    theta = merged.get("rope_theta", d.get("rope_theta", 10000.0))
    rtype = merged.get("rope_type", merged.get("type", "default")) or "default"
    if rtype not in ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rtype!r}; supported: {ROPE_TYPES}")
    out = dict(rope_theta=float(theta), rope_type=rtype)
    if rtype != "default":
        out["rope_factor"] = float(merged["factor"])
    if rtype == "llama3":
        out.update(
            rope_low_freq_factor=float(merged["low_freq_factor"]),
            rope_high_freq_factor=float(merged["high_freq_factor"]),
            rope_original_max_position_embeddings=int(
                merged.get("original_max_position_embeddings",
                           d.get("max_position_embeddings", 8192))),
        )
    if float(merged.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported")
    return out


def _sliding_windows(d: Mapping, mt: str, n_layers: int) -> tuple[int, ...]:
    """Per-layer windows. Mistral: `sliding_window` on every layer; Qwen2/3: `layer_types`
    (or `use_sliding_window` + `max_window_layers`); Qwen3-MoE: every layer when
    `use_sliding_window` (its attention reads the one `sliding_window` of its config)."""
    window = d.get("sliding_window")
    if mt == "llama" or not window:
        return ()
    if mt == "mistral":
        return (int(window),) * n_layers
    if not d.get("use_sliding_window", False):
        return ()
    if mt == "qwen3_moe":
        return (int(window),) * n_layers
    types = d.get("layer_types") or [
        "sliding_attention" if i >= d.get("max_window_layers", 28) else "full_attention"
        for i in range(n_layers)
    ]
    wins = tuple(int(window) if t == "sliding_attention" else 0 for t in types)
    return wins if any(wins) else ()


def _llama_fields(d: Mapping, mt: str) -> dict:
    n_heads = d["num_attention_heads"]
    hidden = d["hidden_size"]
    n_layers = d["num_hidden_layers"]
    attn_bias = bool(d.get("attention_bias", False))
    return dict(
        model_type=mt,
        vocab_size=d["vocab_size"],
        hidden_size=hidden,
        intermediate_size=d["intermediate_size"],
        num_layers=n_layers,
        num_heads=n_heads,
        num_kv_heads=d.get("num_key_value_heads") or n_heads,
        # Qwen3Config's head_dim defaults to 128, not hidden // heads
        head_dim=d.get("head_dim") or (128 if mt == "qwen3" else hidden // n_heads),
        max_position_embeddings=d.get("max_position_embeddings", 2048),
        norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        hidden_act=d.get("hidden_act", "silu"),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        qkv_bias=True if mt == "qwen2" else attn_bias,
        o_bias=False if mt == "qwen2" else attn_bias,
        mlp_bias=bool(d.get("mlp_bias", False)),
        qk_norm=mt in ("qwen3", "qwen3_moe"),
        sliding_windows=_sliding_windows(d, mt, n_layers),
        **_rope_fields(d),
        **(moe_fields(d, n_layers) if mt == "qwen3_moe" else {}),
    )


def _gpt2_fields(d: Mapping) -> dict:
    if d.get("scale_attn_by_inverse_layer_idx", False):
        raise ValueError("gpt2 with scale_attn_by_inverse_layer_idx=True is not supported")
    if not d.get("scale_attn_weights", True):
        raise ValueError("gpt2 with scale_attn_weights=False is not supported")
    hidden = d["n_embd"]
    n_heads = d["n_head"]
    return dict(
        model_type="gpt2",
        vocab_size=d["vocab_size"],
        hidden_size=hidden,
        intermediate_size=d.get("n_inner") or 4 * hidden,
        num_layers=d["n_layer"],
        num_heads=n_heads,
        num_kv_heads=n_heads,
        head_dim=hidden // n_heads,
        max_position_embeddings=d.get("n_positions", 1024),
        norm_eps=float(d.get("layer_norm_epsilon", 1e-5)),
        hidden_act=d.get("activation_function", "gelu_new"),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
        qkv_bias=True,
        o_bias=True,
        mlp_bias=True,
    )


def to_hf_dict(cfg: ModelConfig, architecture: str, torch_dtype: str) -> dict:
    """Keyword arguments for the transformers config class of `cfg.model_type`.

    `architecture`: e.g. "LlamaForCausalLM". Rope settings are written both as transformers-5
    `rope_parameters` and as legacy `rope_theta`/`rope_scaling` so older readers work too.
    """
    ids = dict(bos_token_id=cfg.bos_token_id, pad_token_id=cfg.pad_token_id,
               eos_token_id=(list(cfg.eos_token_ids) if len(cfg.eos_token_ids) > 1
                             else (cfg.eos_token_ids[0] if cfg.eos_token_ids else None)))
    common = dict(model_type=cfg.model_type, architectures=[architecture],
                  vocab_size=cfg.vocab_size, tie_word_embeddings=cfg.tie_word_embeddings,
                  torch_dtype=torch_dtype, **ids)
    if cfg.model_type == GEMMA3:
        return dict(common, **gemma3_hf_dict(cfg))
    if cfg.model_type == "gpt2":
        return dict(common, n_embd=cfg.hidden_size, n_layer=cfg.num_layers, n_head=cfg.num_heads,
                    n_inner=cfg.intermediate_size, n_positions=cfg.max_position_embeddings,
                    layer_norm_epsilon=cfg.norm_eps, activation_function=cfg.hidden_act)
    rope = dict(rope_type=cfg.rope_type, rope_theta=cfg.rope_theta)
    if cfg.rope_type != "default":
        rope["factor"] = cfg.rope_factor
    if cfg.rope_type == "llama3":
        rope.update(low_freq_factor=cfg.rope_low_freq_factor,
                    high_freq_factor=cfg.rope_high_freq_factor,
                    original_max_position_embeddings=cfg.rope_original_max_position_embeddings)
    out = dict(common, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
               num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
               num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
               max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.norm_eps,
               hidden_act=cfg.hidden_act, rope_parameters=rope, rope_theta=cfg.rope_theta,
               rope_scaling=None if cfg.rope_type == "default" else
               {k: v for k, v in rope.items() if k != "rope_theta"})
    if cfg.model_type == "llama":
        out.update(attention_bias=cfg.qkv_bias, mlp_bias=cfg.mlp_bias)
    if cfg.model_type in ("qwen3", "qwen3_moe"):
        out.update(attention_bias=cfg.qkv_bias)
    if cfg.model_type == "qwen3_moe":
        out.update(moe_hf_fields(cfg))
    windows = set(cfg.sliding_windows) - {0}
    if cfg.model_type == "mistral":
        out["sliding_window"] = max(windows) if windows else None
    if cfg.model_type == "qwen3_moe" and windows:
        out.update(use_sliding_window=True, sliding_window=max(windows))
    if cfg.model_type in ("qwen2", "qwen3") and windows:
        out.update(use_sliding_window=True, sliding_window=max(windows),
                   layer_types=["sliding_attention" if w else "full_attention"
                                for w in cfg.sliding_windows])
    return out
