"""Helpers for tiny random HF checkpoints (created and saved locally, never downloaded).

Every checkpoint has 2 layers (the Qwen3-MoE ones up to 4), hidden 64, vocab 256. Weights are
re-drawn with a larger scale than HF's init (and norms around 1, not exactly 1) so a wrong
transpose or a missed tensor shows up in the logits.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 256
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)

MOE = dict(COMMON, head_dim=24, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}

HF_CONFIGS = {
    "llama_tied": lambda: transformers.LlamaConfig(**COMMON, tie_word_embeddings=True),
    "llama3_untied": lambda: transformers.LlamaConfig(
        **COMMON, tie_word_embeddings=False, rope_parameters=LLAMA3_ROPE, mlp_bias=True),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON, tie_word_embeddings=False,
                                              rope_parameters={"rope_type": "default",
                                                               "rope_theta": 1e6}),
    # Qwen3: q/k norms, head_dim independent of hidden / heads (64 / 4 = 16)
    "qwen3_tied": lambda: transformers.Qwen3Config(**COMMON, head_dim=24, tie_word_embeddings=True),
    "qwen3_untied": lambda: transformers.Qwen3Config(**COMMON, head_dim=8, tie_word_embeddings=False,
                                                     rope_parameters={"rope_type": "default",
                                                                      "rope_theta": 1e6}),
    # Qwen3-MoE: 8 experts, top-2; all layers sparse (one `layers` stack), or a dense layer 0
    # then sparse (mlp_only_layers) / every other layer sparse (decoder_sparse_step=2)
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**MOE, tie_word_embeddings=True,
                                                     norm_topk_prob=True),
    "qwen3_moe_mixed": lambda: transformers.Qwen3MoeConfig(**{**MOE, "num_hidden_layers": 3},
                                                           mlp_only_layers=[0]),
    "qwen3_moe_step2": lambda: transformers.Qwen3MoeConfig(**{**MOE, "num_hidden_layers": 4},
                                                           decoder_sparse_step=2,
                                                           norm_topk_prob=True),
    "mistral_window": lambda: transformers.MistralConfig(**COMMON, sliding_window=4),
    "gpt2": lambda: transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4,
                                            n_positions=64, bos_token_id=1, eos_token_id=2),
}

# checkpoints saved as shards + model.safetensors.index.json, to exercise that path
SHARDED = {"llama3_untied"}


def randomize_(model, seed: int = 0) -> None:
    """Re-draw every weight: norms ~ 1 + N(0, 0.1), everything else ~ N(0, 0.08)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=p.dtype)
            if ("norm" in name or ".ln_" in name) and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * noise)
            else:
                p.copy_(0.08 * noise)


def build_hf(kind_cls, hf_cfg, seed: int = 0):
    torch.manual_seed(seed)
    model = kind_cls.from_config(hf_cfg, attn_implementation="eager", dtype=torch.float32)
    randomize_(model, seed)
    return model.eval()


def hf_logits(model, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """HF logits with position ids rebuilt from the mask (as our models do)."""
    pos = np.maximum(np.cumsum(mask, -1) - 1, 0)
    with torch.no_grad():
        out = model(input_ids=torch.tensor(ids, dtype=torch.long),
                    attention_mask=torch.tensor(mask, dtype=torch.long),
                    position_ids=torch.tensor(pos, dtype=torch.long))
    return out.logits.float().numpy()


def padded_batch(seed: int = 0, length: int = 12, pads=(0, 2, 5), vocab: int = VOCAB):
    """Left-padded batch: row r has pads[r] pad slots (token 0, mask 0) then random tokens >= 3."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, vocab, size=(len(pads), length)).astype(np.int32)
    mask = np.ones_like(ids)
    for r, p in enumerate(pads):
        ids[r, :p] = 0
        mask[r, :p] = 0
    return ids, mask
