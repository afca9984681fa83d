"""The model kinds over one shared backbone: `CausalLM`, `ValueModel`, `RewardModel`, and
`CausalLMWithValueHead` (the shared actor-critic).

All of them are called as `model(input_ids [B, L] int32, attention_mask [B, S] int32, *,
cache=None, cache_index=None)` and return `(output float32, cache)` (docs/contracts.md).
Heads compute in float32 whatever the compute dtype. Value and score heads keep float32
params (they are tiny); an untied LM head uses `cfg.param_dtype`.

Sources: transformers `LlamaForCausalLM`, `GenericForSequenceClassification` (score head
`score.weight [1, D]`, no bias, read at the last non-pad token); TRL `AutoModelForCausalLMWithValueHead`
and DeepSpeed-Chat `RewardModel` (critic = backbone + per-token scalar head).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ppo_jax.models.config import ModelConfig
from ppo_jax.models.gemma3 import Gemma3Backbone
from ppo_jax.models.gpt2 import GPT2Backbone
from ppo_jax.models.kv_cache import KVCache
from ppo_jax.models.llama import LlamaBackbone

KINDS = ("causal_lm", "value", "reward", "causal_lm_value")


def make_backbone(cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
    """`LlamaBackbone` for llama/qwen2/qwen3/mistral, `Gemma3Backbone` for gemma3_text,
    `GPT2Backbone` for gpt2. Raises ValueError otherwise."""
    if cfg.is_llama_family:
        return LlamaBackbone(cfg, rngs=rngs)
    if cfg.model_type == "gemma3_text":
        return Gemma3Backbone(cfg, rngs=rngs)
    if cfg.model_type == "gpt2":
        return GPT2Backbone(cfg, rngs=rngs)
    raise ValueError(f"unsupported model_type {cfg.model_type!r}")


def _f32_head(hidden: jax.Array, kernel: jax.Array, bias: jax.Array | None) -> jax.Array:
    out = jnp.dot(hidden.astype(jnp.float32), kernel.astype(jnp.float32))
    return out if bias is None else out + bias.astype(jnp.float32)


class CausalLM(nnx.Module):
    """Backbone + LM head -> logits `[B, L, V]` float32.

    Param paths: `backbone/...`, plus `unembed/kernel [D, V]` when embeddings are untied
    (HF `lm_head.weight` transposed).
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.backbone = make_backbone(cfg, rngs)
        if not cfg.tie_word_embeddings:
            self.unembed = nnx.Linear(cfg.hidden_size, cfg.vocab_size, use_bias=False,
                                      param_dtype=cfg.jnp_param_dtype,
                                      kernel_init=nnx.initializers.normal(0.02), rngs=rngs)

    def head_kernel(self) -> tuple[jax.Array, int]:
        """`(kernel, vocab_axis)` of the LM head in the compute dtype: the tied embedding matrix
        `[V, D]` (vocab_axis 0) or `unembed/kernel [D, V]` (vocab_axis 1). No bias."""
        dt = self.cfg.jnp_dtype
        if self.cfg.tie_word_embeddings:
            return self.backbone.embedding_matrix().astype(dt), 0
        return self.unembed.kernel[...].astype(dt), 1

    def lm_head(self, hidden: jax.Array) -> jax.Array:
        """hidden `[..., D]` (compute dtype) -> logits `[..., V]` float32 (float32 accumulation)."""
        w, vocab_axis = self.head_kernel()
        spec = "...d,vd->...v" if vocab_axis == 0 else "...d,dv->...v"
        return jnp.einsum(spec, hidden.astype(self.cfg.jnp_dtype), w,
                          preferred_element_type=jnp.float32)

    def __call__(self, input_ids, attention_mask, *, cache: KVCache | None = None, cache_index=None):
        """-> (logits `[B, L, V]` float32, cache). Raises ValueError on inconsistent shapes."""
        hidden, cache = self.backbone(input_ids, attention_mask, cache=cache, cache_index=cache_index)
        return self.lm_head(hidden), cache


class ValueModel(nnx.Module):
    """Backbone + value head -> values `[B, L]` float32 (one scalar per token).

    `value_head/kernel [D, 1]`, `value_head/bias [1]`, float32; initialised to zeros when
    `head_init_std == 0` else N(0, head_init_std^2) (small-variance init, "N implementation
    details of RLHF with PPO"). Loading from a reward checkpoint copies its score head.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, head_init_std: float = 0.0):
        self.cfg = cfg
        self.backbone = make_backbone(cfg, rngs)
        init = (nnx.initializers.zeros_init() if head_init_std == 0.0
                else nnx.initializers.normal(head_init_std))
        self.value_head = nnx.Linear(cfg.hidden_size, 1, use_bias=True, param_dtype=jnp.float32,
                                     kernel_init=init, rngs=rngs)

    def __call__(self, input_ids, attention_mask, *, cache: KVCache | None = None, cache_index=None,
                 mesh=None):
        """-> (values `[B, L]` float32, cache). mesh: the run's (static), for a no-cache
        call's attention kernel (`layers.make_context`)."""
        hidden, cache = self.backbone(input_ids, attention_mask, cache=cache,
                                      cache_index=cache_index, mesh=mesh)
        v = _f32_head(hidden, self.value_head.kernel[...], self.value_head.bias[...])
        return v[..., 0], cache


class CausalLMWithValueHead(CausalLM):
    """A CausalLM with a value head on its own backbone: the shared actor-critic (TRL 0.11
    `AutoModelForCausalLMWithValueHead`, `model.shared_critic`).

    As a `CausalLM` it is called for logits (sampling, log-probs); `values_from_hidden` reads
    the value of each position from the same final hidden states, so one backbone pass gives
    both. Param paths: a CausalLM's plus `value_head/kernel [D, 1]`, `value_head/bias [1]`
    (float32; zeros when `head_init_std == 0`, as TRL's ValueHead is trained from scratch).
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, head_init_std: float = 0.0):
        super().__init__(cfg, rngs=rngs)
        init = (nnx.initializers.zeros_init() if head_init_std == 0.0
                else nnx.initializers.normal(head_init_std))
        self.value_head = nnx.Linear(cfg.hidden_size, 1, use_bias=True, param_dtype=jnp.float32,
                                     kernel_init=init, rngs=rngs)

    def values_from_hidden(self, hidden: jax.Array) -> jax.Array:
        """hidden `[..., D]` -> values `[...]` float32 (float32 head, as `ValueModel`)."""
        return _f32_head(hidden, self.value_head.kernel[...], self.value_head.bias[...])[..., 0]


def last_real_index(attention_mask: jax.Array, length: int, cache_index=None) -> jax.Array:
    """`[B]` int32: index (0..L-1) of the last new token whose mask is 1; L-1 for a row with none.

    attention_mask `[B, S]`; the new tokens occupy slots `[cache_index, cache_index + L)`.
    """
    start = jnp.asarray(0 if cache_index is None else cache_index, jnp.int32)
    new = jax.lax.dynamic_slice_in_dim(attention_mask, start, length, axis=1) != 0
    idx = jnp.arange(length, dtype=jnp.int32)
    return jnp.max(jnp.where(new, idx[None, :], -1), axis=1).astype(jnp.int32) % length


class RewardModel(nnx.Module):
    """Backbone + score head -> scores `[B]` float32, read at the last position whose mask is 1.

    `score/kernel [D, 1]` float32, no bias (HF `*ForSequenceClassification` with num_labels=1,
    `score.weight [1, D]` transposed). A row with no real token reads position L-1.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, head_init_std: float = 0.0):
        self.cfg = cfg
        self.backbone = make_backbone(cfg, rngs)
        init = (nnx.initializers.zeros_init() if head_init_std == 0.0
                else nnx.initializers.normal(head_init_std))
        self.score = nnx.Linear(cfg.hidden_size, 1, use_bias=False, param_dtype=jnp.float32,
                                kernel_init=init, rngs=rngs)

    def __call__(self, input_ids, attention_mask, *, cache: KVCache | None = None, cache_index=None,
                 mesh=None):
        """-> (scores `[B]` float32, cache). mesh: as `ValueModel`'s."""
        hidden, cache = self.backbone(input_ids, attention_mask, cache=cache,
                                      cache_index=cache_index, mesh=mesh)
        idx = last_real_index(jnp.asarray(attention_mask), hidden.shape[1], cache_index)
        last = jnp.take_along_axis(hidden, idx[:, None, None], axis=1)[:, 0]
        return self.scores_from_hidden(last), cache

    def scores_from_hidden(self, hidden: jax.Array) -> jax.Array:
        """hidden `[..., D]` at the tokens to score -> scores `[...]` float32 (float32 head): a
        packed pass reads each sequence's last token itself (`rollout.packing.unpack_last`)."""
        return _f32_head(hidden, self.score.kernel[...], None)[..., 0]


MODEL_CLASSES = {"causal_lm": CausalLM, "value": ValueModel, "reward": RewardModel,
                 "causal_lm_value": CausalLMWithValueHead}


def model_class(kind: str):
    """Class for `kind` in `KINDS`. Raises ValueError on another kind."""
    if kind not in MODEL_CLASSES:
        raise ValueError(f"unknown model kind {kind!r}; expected one of {KINDS}")
    return MODEL_CLASSES[kind]


def init_model(cfg: ModelConfig, kind: str = "causal_lm", seed: int = 0, **kwargs) -> nnx.Module:
    """A randomly initialised model: N(0, 0.02) weights, unit norms, heads as their class
    initialises them."""
    return model_class(kind)(cfg, rngs=nnx.Rngs(seed), **kwargs)
