"""Fixtures shared by the model tests (helpers live in hf_tiny.py)."""

from __future__ import annotations

import jax
import pytest

from ppo_jax.models import causal_lm_logits, load_model, split_model

from hf_tiny import HF_CONFIGS, SHARDED, build_hf, transformers


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory):
    """{name: (dir, torch CausalLM)} for every config in HF_CONFIGS."""
    out = {}
    for i, (name, make) in enumerate(HF_CONFIGS.items()):
        model = build_hf(transformers.AutoModelForCausalLM, make(), seed=i)
        d = tmp_path_factory.mktemp(name)
        model.save_pretrained(d, max_shard_size="100KB" if name in SHARDED else "50GB")
        out[name] = (d, model)
    return out


@pytest.fixture(scope="session")
def loaded(hf_checkpoints):
    """{name: (graphdef, params, cfg, jitted logits fn, torch model)}."""
    out = {}
    for name, (d, torch_model) in hf_checkpoints.items():
        model, cfg = load_model(d, "causal_lm")
        graphdef, params = split_model(model)
        fn = jax.jit(lambda p, i, m, g=graphdef: causal_lm_logits(g, p, i, m))
        out[name] = (graphdef, params, cfg, fn, torch_model)
    return out
