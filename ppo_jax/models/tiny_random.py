"""A tiny randomly initialised Llama checkpoint with a word-level tokenizer, built locally.

Tests and the `tiny` config need a real HF directory (config.json, safetensors, tokenizer with a
chat template) without any download; `ensure_tiny_random(dir)` writes one in about a second:
a 2-layer Llama (hidden 64) over a ~200-word vocabulary, so sampled text is made of English
words and rule-based rewards such as VADER give non-zero scores. `ensure_tiny_random(dir,
moe=True)` writes the same shape as a Qwen3-MoE (`TINY_MOE`: 8 experts, 2 per token, every
layer sparse), for router replay and the MoE losses.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from ppo_jax.models.config import ModelConfig

SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>"]  # ids 0..3
WORDS = """
the a an and or but so to of in on at for with from by about as is was are were be been
it this that these those i you he she we they me my your our their his her its what which who
how why when where not no yes very really quite too more most less much many some any all
one two three first last new old good great nice fine happy glad love lovely wonderful
excellent amazing beautiful best better fun enjoy enjoyed like liked pleasant calm friendly
bad terrible awful sad hate hated boring worst worse horrible ugly angry annoying poor
tired slow late long short loud quiet small big cold warm wet dry busy crowded empty
day night morning evening week time place town city home house room food coffee train bus
car trip walk work school book film movie music game party dinner market garden store
rain sun weather people friend family team would could should will can may might feel felt
think thought say said see saw go went get got make made take took want need know
write describe tell me about words few sentences briefly how do you of what think
user assistant system
""".split()


def tiny_vocab() -> list[str]:
    """Special tokens, then the unique words in order, then punctuation."""
    seen, words = set(), []
    for w in WORDS + [".", ",", "?", "!", ":"]:
        if w not in seen:
            seen.add(w)
            words.append(w)
    return SPECIAL_TOKENS + words


CHAT_TEMPLATE = (
    "{% for m in messages %}<bos> {{ m['role'] }} : {{ m['content'] }} <eos> {% endfor %}"
    "{% if add_generation_prompt %}<bos> assistant : {% endif %}"
)


def tiny_tokenizer():
    """A word-level `PreTrainedTokenizerFast` (lower-cased, punctuation split) with a chat
    template; pad=0, eos=1, bos=2, unk=3."""
    from tokenizers import Tokenizer, normalizers, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(tiny_vocab())}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                                 pre_tokenizers.Punctuation()])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   bos_token="<bos>", unk_token="<unk>", padding_side="left")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_config(vocab_size: int, **overrides) -> ModelConfig:
    """The tiny Llama: 2 layers, hidden 64, 4 heads (2 KV heads), tied embeddings."""
    fields = dict(model_type="llama", vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                  max_position_embeddings=512, norm_eps=1e-5, tie_word_embeddings=True,
                  bos_token_id=2, eos_token_ids=(1,), pad_token_id=0)
    fields.update(overrides)
    return ModelConfig(**fields)


# `tiny_config(V, **TINY_MOE)`: the tiny model as a Qwen3-MoE with q/k norms and 8 experts of
# 32 columns, 2 per token, in both layers (transformers' Qwen3MoeConfig defaults otherwise)
TINY_MOE = dict(model_type="qwen3_moe", qk_norm=True, num_experts=8, num_experts_per_tok=2,
                moe_intermediate_size=32, norm_topk_prob=True, router_aux_loss_coef=0.001,
                sparse_layers=(True, True))


def ensure_tiny_random(directory: str | Path, seed: int = 0, moe: bool = False) -> Path:
    """Write the tiny checkpoint (with `moe`, its Qwen3-MoE form) to `directory` unless it is
    already there; return the path."""
    directory = Path(directory)
    if _complete(directory):
        return directory
    tokenizer = tiny_tokenizer()
    cfg = tiny_config(len(tokenizer), **(TINY_MOE if moe else {}))
    return ensure_random_checkpoint(directory, tokenizer, cfg, seed)


def _complete(directory: Path) -> bool:
    return (directory / "config.json").is_file() and (directory / "model.safetensors").is_file()


def ensure_random_checkpoint(directory: str | Path, tokenizer, cfg: ModelConfig, seed: int = 0,
                             dtype: str | None = None) -> Path:
    """Randomly initialised weights of `cfg` (a causal LM) with `tokenizer`, as an HF directory
    (weights in `dtype`, default each param's own), unless `directory` already holds one; the path.
    Any shape works (the benchmarks' random SmolLM2-shape models on a machine without a download).

    Written to a temporary sibling then renamed, so an interrupted write is never reused.
    """
    from ppo_jax.models.heads import init_model
    from ppo_jax.models.hf_io import save_pretrained

    directory = Path(directory)
    if _complete(directory):
        return directory
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=directory.name + ".tmp", dir=directory.parent))
    try:
        save_pretrained(init_model(cfg, "causal_lm", seed=seed), cfg, tmp, tokenizer, dtype=dtype)
        if directory.exists():
            shutil.rmtree(directory)
        os.replace(tmp, directory)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return directory
