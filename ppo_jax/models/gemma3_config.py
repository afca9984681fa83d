"""Gemma 3 text (`model_type: gemma3_text`) config keys, read from and written to a Hugging
Face `config.json` (the `ModelConfig` fields of `config.py`; this module does not import it).

What the keys mean, from transformers 5.25 `configuration_gemma3.Gemma3TextConfig` and
`modeling_gemma3.py`:
- `layer_types`: "sliding_attention" (local: a window of `sliding_window` keys) or
  "full_attention" (global) per layer. Older configs give `sliding_window_pattern` N instead
  (`_sliding_window_pattern` once transformers 5 re-saves them): layer i is global when
  `(i + 1) % N == 0`, N = 6 when neither key is there.
- RoPE: transformers 5 writes `rope_parameters` per layer type, `{"full_attention": {...},
  "sliding_attention": {...}}`. Older configs give `rope_theta` (global, default 1e6),
  `rope_scaling` (global only: Gemma-3-4B and larger use `{"rope_type": "linear", "factor":
  8}`) and `rope_local_base_freq` (local, default 1e4). A `rope_scaling` overrides the global
  entry of `rope_parameters`, as `Gemma3TextConfig.convert_rope_params_to_dict` does.
- `hidden_activation` (not `hidden_act`), `query_pre_attn_scalar` (scores scaled by its
  `** -0.5`), `head_dim` (default 256), one `attention_bias` for q/k/v/o, tied embeddings.
- Gemma 3 has no logit soft-capping (Gemma 2 does): a config with
  `attn_logit_softcapping` or `final_logit_softcapping` set is refused, as is
  `use_bidirectional_attention` (an encoder-style mask).
"""

from __future__ import annotations

from typing import Any, Mapping

GEMMA3 = "gemma3_text"
SLIDING, FULL = "sliding_attention", "full_attention"
GLOBAL_ROPE_TYPES = ("default", "linear")


def _get(d: Mapping, key: str, default):
    """`d[key]`, or `default` when the key is absent or null."""
    value = d.get(key)
    return default if value is None else value


def _layer_types(d: Mapping, n_layers: int) -> list[str]:
    types = d.get("layer_types")
    if types is None:
        every = int(_get(d, "sliding_window_pattern", _get(d, "_sliding_window_pattern", 6)))
        return [SLIDING if (i + 1) % every else FULL for i in range(n_layers)]
    if len(types) != n_layers or set(types) - {SLIDING, FULL}:
        raise ValueError(f"layer_types={list(types)} must give one of {SLIDING!r} / {FULL!r} "
                         f"for each of the {n_layers} layers")
    return list(types)


def _windows(d: Mapping, n_layers: int) -> tuple[int, ...]:
    """Per-layer windows (0: global); () when every layer is global."""
    types = _layer_types(d, n_layers)
    if SLIDING not in types:
        return ()
    window = d.get("sliding_window")
    if not window or int(window) < 1:
        raise ValueError(f"sliding_window={window!r}: the {SLIDING} layers of layer_types need "
                         "a window of at least 1")
    return tuple(int(window) if t == SLIDING else 0 for t in types)


def _rope(d: Mapping) -> dict:
    """The global (scaled) and local (plain) RoPE settings, from either form of the config."""
    params = d.get("rope_parameters") or {}
    per_type = isinstance(params.get(FULL), Mapping) or isinstance(params.get(SLIDING), Mapping)
    full = dict(params.get(FULL) or {}) if per_type else {}
    local = dict(params.get(SLIDING) or {}) if per_type else {}
    full.update(d.get("rope_scaling") or {})
    full.setdefault("rope_theta", _get(d, "rope_theta", 1_000_000.0))
    local.setdefault("rope_theta", _get(d, "rope_local_base_freq", 10_000.0))
    kind = full.get("rope_type", full.get("type", "default")) or "default"
    if kind not in GLOBAL_ROPE_TYPES:
        raise ValueError(f"rope_parameters[{FULL!r}] rope_type={kind!r}: Gemma 3's global RoPE "
                         f"is one of {GLOBAL_ROPE_TYPES}")
    local_kind = local.get("rope_type", local.get("type", "default")) or "default"
    if local_kind != "default":
        raise ValueError(f"rope_parameters[{SLIDING!r}] rope_type={local_kind!r}: Gemma 3's "
                         "local RoPE is unscaled ('default')")
    for p in (full, local):
        if float(p.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ValueError("partial_rotary_factor != 1 is not supported")
    out = dict(rope_theta=float(full["rope_theta"]), rope_type=kind,
               rope_local_theta=float(local["rope_theta"]))
    if kind == "linear":
        out["rope_factor"] = float(full["factor"])
    return out


def _refuse_unsupported(d: Mapping) -> None:
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if d.get(key) is not None:
            raise ValueError(f"{GEMMA3} {key}={d[key]!r}: Gemma 3 has no logit soft-capping "
                             "(Gemma 2 has); set it to null")
    if d.get("use_bidirectional_attention"):
        raise ValueError(f"{GEMMA3} use_bidirectional_attention=True (an encoder mask) is not "
                         "supported: the decoders are causal")


def gemma3_fields(d: Mapping) -> dict:
    """`ModelConfig` fields of a `gemma3_text` config dict.

    Raises:
      KeyError: a required size (vocab_size, hidden_size, intermediate_size,
        num_hidden_layers, num_attention_heads, num_key_value_heads) is missing.
      ValueError: soft-capping or bidirectional attention set, malformed `layer_types`, sliding
        layers without a `sliding_window`, a RoPE type Gemma 3 does not use.
    """
    _refuse_unsupported(d)
    n_layers = d["num_hidden_layers"]
    bias = bool(d.get("attention_bias", False))
    return dict(
        model_type=GEMMA3,
        vocab_size=d["vocab_size"],
        hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"],
        num_layers=n_layers,
        num_heads=d["num_attention_heads"],
        num_kv_heads=d["num_key_value_heads"],
        head_dim=_get(d, "head_dim", 256),
        max_position_embeddings=_get(d, "max_position_embeddings", 131_072),
        norm_eps=float(_get(d, "rms_norm_eps", 1e-6)),
        hidden_act=_get(d, "hidden_activation", "gelu_pytorch_tanh"),
        tie_word_embeddings=bool(_get(d, "tie_word_embeddings", True)),
        qkv_bias=bias,
        o_bias=bias,
        qk_norm=True,
        query_pre_attn_scalar=float(_get(d, "query_pre_attn_scalar", 256)),
        sliding_windows=_windows(d, n_layers),
        **_rope(d),
    )


def _number(x: float) -> Any:
    """An integral float as int: `Gemma3TextConfig` types `query_pre_attn_scalar` as int."""
    return int(x) if float(x).is_integer() else x


def gemma3_hf_dict(cfg) -> dict:
    """The `Gemma3TextConfig` keyword arguments of a gemma3_text `ModelConfig` (sizes, norms,
    attention and RoPE; `config.to_hf_dict` adds the ids, vocabulary and architecture). RoPE is
    written in transformers 5's per-layer-type form only: `Gemma3TextConfig` consumes the
    legacy keys (`rope_theta`, `rope_local_base_freq`) and does not save them.

    Raises:
      ValueError: a config transformers' Gemma 3 cannot express: an MLP bias, a q/k/v bias
        different from the output projection's (it has one `attention_bias`), or sliding
        windows of more than one size (it has one `sliding_window`).
    """
    if cfg.mlp_bias or cfg.qkv_bias != cfg.o_bias:
        raise ValueError(f"{GEMMA3}: mlp_bias={cfg.mlp_bias}, qkv_bias={cfg.qkv_bias}, "
                         f"o_bias={cfg.o_bias}; Gemma 3 has no MLP bias and one attention_bias")
    windows = set(cfg.sliding_windows) - {0}
    if len(windows) > 1:
        raise ValueError(f"{GEMMA3}: sliding_windows={cfg.sliding_windows} hold several sizes; "
                         "Gemma 3 has one sliding_window")
    full = dict(rope_type=cfg.rope_type, rope_theta=cfg.rope_theta)
    if cfg.rope_type != "default":
        full["factor"] = cfg.rope_factor
    local_theta = cfg.rope_theta if cfg.rope_local_theta is None else cfg.rope_local_theta
    return dict(
        hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.norm_eps,
        hidden_activation=cfg.hidden_act, attention_bias=cfg.qkv_bias,
        query_pre_attn_scalar=_number(cfg.head_dim if cfg.query_pre_attn_scalar is None
                                      else cfg.query_pre_attn_scalar),
        sliding_window=windows.pop() if windows else None,
        layer_types=[SLIDING if w else FULL for w in (cfg.sliding_windows
                                                       or (0,) * cfg.num_layers)],
        rope_parameters={FULL: full, SLIDING: dict(rope_type="default", rope_theta=local_theta)},
        attn_logit_softcapping=None, final_logit_softcapping=None)
