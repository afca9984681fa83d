"""Rebuild a GGUF file's tokenizer from its metadata with `tokenizers`, as transformers does.

A GGUF has no tokenizer.json: the vocabulary, merges (when any), token types, special ids and
chat template are metadata. Two kinds are read here, each built exactly as transformers 5's GGUF
loader builds it (`integrations/gguf/gguf_tokenizer_mapping.py`; tests/models/test_convert_gguf.py
pins both to its tokenizer.json and ids):
- byte-level BPE (`tokenizer.ggml.model == "gpt2"`, e.g. SmolLM2): `byte_level_tokenizer`;
- Gemma's SentencePiece BPE (`"llama"` model in a gemma / gemma2 / gemma3 file): `gemma_tokenizer`.
transformers (without torch) supplies only `PreTrainedTokenizerFast`, to save the files.
"""

from __future__ import annotations

# llama.cpp pre-tokenizers that split like GPT-2's regex (transformers' GGUF loader adds no
# Split for them either). "smollm" also splits digits one by one, which gives the same ids on
# SmolLM2's vocabulary: it has no merge that involves a digit.
GPT2_PRETOKENIZERS = (None, "default", "gpt2", "gpt-2", "smollm")
GEMMA_ARCHS = ("gemma", "gemma2", "gemma3")
CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types (gguf.TokenType)


def gguf_tokenizer(meta: dict):
    """A `PreTrainedTokenizerFast` from GGUF metadata (`convert_gguf.read_metadata`): the
    backend tokenizer, the special tokens, `add_bos_token` / `add_eos_token` and the chat template
    (when the file has one).

    Raises ValueError for a tokenizer model, architecture or pre-tokenizer not read here.
    """
    model, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre")
    arch = meta.get("general.architecture")
    if model == "gpt2" and pre in GPT2_PRETOKENIZERS:
        return _fast(meta, byte_level_tokenizer(meta), extra={})
    if model == "llama" and arch in GEMMA_ARCHS:
        # llama.cpp adds BOS to a sentencepiece vocabulary that does not say otherwise
        return _fast(meta, gemma_tokenizer(meta), extra={"mask_token": "<mask>"},
                     add_bos_default=True)
    raise ValueError(f"GGUF tokenizer {model!r} of architecture {arch!r} with pre-tokenizer "
                     f"{pre!r} is not supported (only byte-level BPE 'gpt2' with "
                     f"{GPT2_PRETOKENIZERS[1:]}, or 'llama' in a {'/'.join(GEMMA_ARCHS)} file)")


def byte_level_tokenizer(meta: dict):
    """A `tokenizers.Tokenizer` for a byte-level BPE ("gpt2") vocabulary: the tokens respelled
    in GPT-2's byte alphabet, the file's merges, GPT-2's ByteLevel pre-tokenizer and decoder, the
    control tokens (type 3) as special tokens, user-defined ones (type 4) as added tokens.
    transformers: `byte_level_tokenizer` + `add_gguf_special_tokens` (control tokens outside the
    byte alphabet are llama.cpp mislabels and are skipped)."""
    from gguf.vocab import bytes_to_unicode  # GPT-2's byte -> printable character table
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokens = meta["tokenizer.ggml.tokens"]
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
             for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False,
                               continuing_subword_prefix="", end_of_word_suffix=""))
    # llama.cpp reads `add_space_prefix` for sentencepiece vocabularies only
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return _add_special_tokens(tok, meta, vocab, keep=lambda t: set(t) <= alphabet)


def gemma_tokenizer(meta: dict):
    """A `tokenizers.Tokenizer` for Gemma's SentencePiece vocabulary, as transformers'
    `gemma_tokenizer` + `GemmaTokenizer` build it: BPE with byte fallback and `<unk>`, spaces
    normalised to "▁", the decoder undoing that and the byte fallback.

    The file has no merges: they are rebuilt from the vocabulary (`generate_merges`), ranked by
    the tokens' order in the file, since Gemma's scores do not follow its merge order; tokens of
    two or more spaces, stored as real spaces, are first respelled as "▁"s.
    """
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t
              for t in meta["tokenizer.ggml.tokens"]]
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = generate_merges(vocab, {t: -i for i, t in enumerate(tokens)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, unk_token="<unk>",
                               dropout=None, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous",
                                             invert=False)
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse()])
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    return _add_special_tokens(tok, meta, vocab, keep=lambda t: True)


def generate_merges(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """Every split `(left, right)` of a token whose two halves are tokens too, best score first
    (ties: shorter left, then shorter right, then the order found). Each token's splits are
    listed in the vocabulary order of their halves.

    transformers `tokenization_utils_base.generate_merges` with `vocab_scores` (reversed order).
    """
    ranked = []
    for merge, score in scores.items():
        local = [(merge[:i], merge[i:], score) for i in range(1, len(merge))
                 if merge[:i] in vocab and merge[i:] in vocab]
        ranked.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    ranked.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in ranked]


def _add_special_tokens(tok, meta: dict, vocab: dict, keep):
    """Control tokens that pass `keep` as special tokens, user-defined ones in the vocabulary as
    plain added tokens (llama.cpp matches both whole in the text)."""
    from tokenizers import AddedToken

    tokens, types = meta["tokenizer.ggml.tokens"], meta.get("tokenizer.ggml.token_type", [])
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t, ty in zip(tokens, types) if ty == CONTROL and keep(t)])
    tok.add_tokens([AddedToken(t, normalized=False, special=False)
                    for t, ty in zip(tokens, types) if ty == USER_DEFINED and t in vocab])
    return tok


def _fast(meta: dict, tok, *, extra: dict, add_bos_default: bool = False):
    """Wrap `tok` with the file's special tokens, BOS / EOS flags and chat template."""
    from transformers import PreTrainedTokenizerFast

    tokens = meta["tokenizer.ggml.tokens"]

    def special(name):
        i = meta.get(f"tokenizer.ggml.{name}")
        return tokens[i] if i is not None else None

    extra = {k: v for k, v in extra.items() if v in tokens}
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=special("bos_token_id"), eos_token=special("eos_token_id"),
        unk_token=special("unknown_token_id"), pad_token=special("padding_token_id"),
        add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default)),
        add_eos_token=bool(meta.get("tokenizer.ggml.add_eos_token", False)), **extra)
    if meta.get("tokenizer.chat_template"):
        fast.chat_template = meta["tokenizer.chat_template"]
    return fast
