"""Mapping between our param paths and Hugging Face tensor names / layouts.

Our paths are the NNX state paths joined by "/" (see `functional.param_paths`), e.g.
`backbone/layers/attn/q_proj/kernel` (stacked: `[num_layers, in, out]`). HF names are the
PyTorch `state_dict` keys, e.g. `model.layers.3.self_attn.q_proj.weight` (`[out, in]`).

Rules (transformers `modeling_llama.py`, `modeling_gemma3.py`, `modeling_gpt2.py`,
`GenericForSequenceClassification`):
- `backbone/` -> the base-model prefix: "model." (Llama family, Gemma 3) / "transformer."
  (GPT-2), or "" for a bare base-model checkpoint;
- `layers/` -> `layers.{i}.` (Llama) / `h.{i}.` (GPT-2), one HF tensor per layer, stacked;
  a run `layers_{first}/` of a mixed dense/sparse MoE decoder (`ModelConfig.layer_runs`) covers
  its own layers `first .. stop - 1`;
- MoE (`modeling_qwen3_moe.py`, the hub layout that `save_pretrained` writes): the router
  `mlp/gate/kernel [D, E]` -> `mlp.gate.weight [E, D]`; the experts `mlp/experts/{gate,up,
  down}_proj [E, in, out]` -> `mlp.experts.{j}.{gate,up,down}_proj.weight [out, in]`, one HF
  tensor per layer and expert;
- Llama `attn/` -> `self_attn.`;
- leaves: `kernel` -> `weight` transposed (torch `nn.Linear` is `[out, in]`), except GPT-2
  backbone kernels (`Conv1D` is already `[in, out]`); `scale`/`embedding` -> `weight`;
- heads: `unembed/kernel` -> `lm_head.weight`, `score/kernel` -> `score.weight`,
  `value_head/kernel` -> `score.weight`, `value_head/bias` -> `score.bias` (a critic is saved
  and loaded as a sequence-classification checkpoint; HF ignores `score.bias`).
"""

from __future__ import annotations

from typing import Iterable, NamedTuple

from ppo_jax.models.config import ModelConfig

HEAD_NAMES = {
    "unembed/kernel": "lm_head.weight",
    "score/kernel": "score.weight",
    "value_head/kernel": "score.weight",
    "value_head/bias": "score.bias",
}

ARCHITECTURES = {
    ("llama", "causal_lm"): "LlamaForCausalLM",
    ("qwen2", "causal_lm"): "Qwen2ForCausalLM",
    ("qwen3", "causal_lm"): "Qwen3ForCausalLM",
    ("qwen3_moe", "causal_lm"): "Qwen3MoeForCausalLM",
    ("mistral", "causal_lm"): "MistralForCausalLM",
    ("gemma3_text", "causal_lm"): "Gemma3ForCausalLM",
    ("gpt2", "causal_lm"): "GPT2LMHeadModel",
    ("llama", "reward"): "LlamaForSequenceClassification",
    ("qwen2", "reward"): "Qwen2ForSequenceClassification",
    ("qwen3", "reward"): "Qwen3ForSequenceClassification",
    ("qwen3_moe", "reward"): "Qwen3MoeForSequenceClassification",
    ("mistral", "reward"): "MistralForSequenceClassification",
    # transformers' Gemma3ForSequenceClassification is the multimodal model's (gemma3)
    ("gemma3_text", "reward"): "Gemma3TextForSequenceClassification",
    ("gpt2", "reward"): "GPT2ForSequenceClassification",
}


def architecture(cfg: ModelConfig, kind: str) -> str:
    """HF `architectures[0]` for a model kind; a critic ("value") is saved as a reward model."""
    return ARCHITECTURES[(cfg.model_type, "causal_lm" if kind == "causal_lm" else "reward")]


class HFTensor(NamedTuple):
    """How one of our params is stored in HF format.

    name: HF key, with `{i}` standing for the layer index when `stacked` and `{j}` for the
      expert when `experts`.
    transpose: our array is the transpose of the HF tensor (its last two dims, per tensor).
    stacked: our array has a leading layer axis; HF has one tensor per layer.
    layers: the decoder layers of the stack, in order (empty: `range(num_layers)`).
    experts: E > 0 when our array has an expert axis after the layer axis; HF has one tensor
      per layer and expert.
    """

    name: str
    transpose: bool
    stacked: bool
    layers: tuple[int, ...] = ()
    experts: int = 0

    @property
    def lead(self) -> int:
        """How many leading dims of our array index HF tensors (layer, expert)."""
        return int(self.stacked) + int(self.experts > 0)

    def names(self, num_layers: int | None = None) -> list[str]:
        """All HF keys this param is made of, layer-major then expert (one per layer when
        stacked); `num_layers` counts the layers when `layers` is empty."""
        if not self.stacked:
            return [self.name]
        layers = self.layers or range(num_layers)
        return [self.name.format(i=i, j=j) for i in layers for j in range(self.experts or 1)]


def base_prefix_candidates(cfg: ModelConfig) -> tuple[str, ...]:
    """Possible base-model prefixes, most common first."""
    return ("transformer.", "") if cfg.model_type == "gpt2" else ("model.", "")


def detect_prefix(cfg: ModelConfig, names: Iterable[str]) -> str:
    """Base-model prefix used by a checkpoint, found from its token-embedding key.

    Raises KeyError naming the expected embedding tensor when none is present.
    """
    names = set(names)
    leaf = "wte.weight" if cfg.model_type == "gpt2" else "embed_tokens.weight"
    for prefix in base_prefix_candidates(cfg):
        if prefix + leaf in names:
            return prefix
    raise KeyError(base_prefix_candidates(cfg)[0] + leaf)


def hf_tensor(cfg: ModelConfig, path: str, prefix: str | None = None) -> HFTensor:
    """The HF tensor behind our param `path`. Raises KeyError for an unknown path."""
    if path in HEAD_NAMES:
        return HFTensor(HEAD_NAMES[path], transpose=path.endswith("kernel"), stacked=False)
    if not path.startswith("backbone/"):
        raise KeyError(f"no HF name for param {path!r}")
    if prefix is None:
        prefix = base_prefix_candidates(cfg)[0]
    gpt2 = cfg.model_type == "gpt2"
    parts = path.split("/")[1:]
    leaf = parts[-1]
    run = {r.name: r for r in cfg.layer_runs}.get(parts[0])
    layers = tuple(range(run.first, run.stop)) if run else ()
    if len(parts) > 2 and parts[-2] == "experts":  # stacked experts `[N, E, in, out]`
        return HFTensor(f"{prefix}layers.{{i}}.mlp.experts.{{j}}.{leaf}.weight", transpose=True,
                        stacked=True, layers=layers, experts=cfg.num_experts)
    out = []
    for i, part in enumerate(parts[:-1]):
        if i == 0 and run:
            out.append("h.{i}" if gpt2 else "layers.{i}")
        elif part == "attn" and not gpt2:
            out.append("self_attn")
        else:
            out.append(part)
    out.append("bias" if leaf == "bias" else "weight")
    return HFTensor(prefix + ".".join(out), transpose=(leaf == "kernel" and not gpt2),
                    stacked=bool(run), layers=layers)
