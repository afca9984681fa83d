"""Qwen3-MoE (`model_type: qwen3_moe`) against transformers' `Qwen3MoeForCausalLM`: the config
and its sparse-layer pattern, float32 logits to 1e-5 with left padding, greedy tokens, the
checkpoint round trip both ways (per-expert hub layout, and the fused in-memory layout read),
the reward head, the load-balancing loss, router replay, LoRA targets, and the paged engine.
The checkpoints are the `qwen3_moe*` entries of hf_tiny.py (8 experts, top-2): all layers
sparse, a dense layer 0 (`mlp_only_layers`), every other layer sparse (`decoder_sparse_step`).
The 8-device sharded forward is in test_qwen3_moe_sharded.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from ppo_jax.models import load_model, reward_scores, save_pretrained, split_model
from ppo_jax.models.config import ModelConfig, to_hf_dict
from ppo_jax.models.heads import init_model
from ppo_jax.models.hf_names import architecture
from ppo_jax.models.moe import load_balancing_loss, route, router_stats
from ppo_jax.models.peft_io import peft_keys
from ppo_jax.models.tiny_random import tiny_config
from ppo_jax.rollout.static_batch import generate

from greedy_parity import assert_paged_equals_static
from hf_tiny import HF_CONFIGS, build_hf, hf_logits, padded_batch, torch, transformers

MOE = ("qwen3_moe", "qwen3_moe_mixed", "qwen3_moe_step2")
VOCAB = 96


def moe_config(**overrides) -> ModelConfig:
    """A tiny Qwen3-MoE of ours: layer 0 dense, layer 1 sparse (8 experts, top-2)."""
    fields = dict(model_type="qwen3_moe", qk_norm=True, num_experts=8, num_experts_per_tok=2,
                  moe_intermediate_size=32, norm_topk_prob=True, sparse_layers=(False, True))
    return tiny_config(VOCAB, **{**fields, **overrides})


@pytest.fixture(scope="module")
def mixed():
    """`(cfg, graphdef, params)` of `moe_config()`, its routers made decisive."""
    cfg = moe_config()
    graphdef, params = split_model(init_model(cfg, seed=2))
    return cfg, graphdef, decisive_router(params)


def abstract_params(cfg: ModelConfig):
    """`(graphdef, params as ShapeDtypeStructs)` of a causal LM of `cfg`, without computing."""
    return split_model(nnx.eval_shape(lambda: init_model(cfg, seed=0)))


def decisive_router(params, scale: float = 30.0):
    """Scale every router kernel so the top-k choice is far from a tie (and matters)."""
    pure = nnx.to_pure_dict(params)
    for name, stack in pure["backbone"].items():
        if name.startswith("layers") and "gate" in stack["mlp"]:
            stack["mlp"]["gate"]["kernel"] = stack["mlp"]["gate"]["kernel"] * scale
    nnx.replace_by_pure_dict(params, pure)
    return params


def test_config_reads_the_sparse_pattern_and_transformers_builds_the_same_layers():
    for name, want in [("qwen3_moe", (True, True)), ("qwen3_moe_mixed", (False, True, True)),
                       ("qwen3_moe_step2", (False, True, False, True))]:
        hf_cfg = HF_CONFIGS[name]()
        cfg = ModelConfig.from_hf(hf_cfg.to_dict())  # config.json spells it num_local_experts
        assert cfg.sparse_layers == want and cfg.num_moe_layers == sum(want)
        assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (8, 2, 32)
        assert cfg.qk_norm and cfg.head_dim == 24 and not cfg.qkv_bias  # not hidden / heads
        out = to_hf_dict(cfg, architecture(cfg, "causal_lm"), "float32")
        assert out["architectures"] == ["Qwen3MoeForCausalLM"]
        assert ModelConfig.from_hf(out) == cfg
        back = transformers.AutoConfig.for_model(**out)
        kinds = [type(layer.mlp).__name__ for layer in transformers.Qwen3MoeModel(back).layers]
        assert kinds == ["Qwen3MoeSparseMoeBlock" if s else "Qwen3MoeMLP" for s in want]
    # Qwen3MoeConfig has no head_dim field: its attention falls back to hidden // heads
    d = {k: v for k, v in HF_CONFIGS["qwen3_moe"]().to_dict().items() if k != "head_dim"}
    assert ModelConfig.from_hf(d).head_dim == 64 // 4
    runs = ModelConfig.from_hf(HF_CONFIGS["qwen3_moe_mixed"]()).layer_runs
    assert [(r.name, r.first, r.stop, r.sparse) for r in runs] == [
        ("layers_0", 0, 1, False), ("layers_1", 1, 3, True)]
    assert ModelConfig.from_hf(HF_CONFIGS["qwen3_moe"]()).layer_runs[0].name == "layers"


@pytest.mark.parametrize("change, words", [
    (dict(decoder_sparse_step=0), "decoder_sparse_step=0"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok=9 exceeds num_experts=8"),
    (dict(moe_intermediate_size=0), "moe_intermediate_size=0"),
])
def test_bad_moe_fields_are_named(change, words):
    d = {**HF_CONFIGS["qwen3_moe"]().to_dict(), **change}
    with pytest.raises(ValueError, match=words):
        ModelConfig.from_hf(d)
    with pytest.raises(ValueError, match="has no experts"):
        tiny_config(VOCAB, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=4,
                    sparse_layers=(True, True))


@pytest.mark.parametrize("name", MOE)
def test_logits_match_transformers_to_1e_5_with_left_padding(loaded, name):
    _, params, cfg, fn, torch_model = loaded[name]
    ids, mask = padded_batch(seed=1)
    ours = np.asarray(fn(params, jnp.asarray(ids), jnp.asarray(mask)))
    ref = hf_logits(torch_model, ids, mask)
    real = mask.astype(bool)
    assert np.abs(ref[real]).max() > 0.5
    np.testing.assert_allclose(ours[real], ref[real], atol=1e-5, rtol=0)
    paths = {k for k in nnx.to_pure_dict(params)["backbone"]}
    assert paths == {"embed_tokens", "norm"} | {r.name for r in cfg.layer_runs}


def test_greedy_tokens_equal_transformers_generate(loaded):
    graphdef, params, cfg, _, torch_model = loaded["qwen3_moe_mixed"]
    ids, mask = padded_batch(seed=3, length=7, pads=(0, 3, 1))
    ours, _ = generate(graphdef, params, ids, mask, None, max_new_tokens=10, greedy=True,
                       stop_token_ids=[2], pad_token_id=0)
    with torch.inference_mode():
        hf = torch_model.generate(torch.tensor(ids).long(),
                                  attention_mask=torch.tensor(mask).long(), max_new_tokens=10,
                                  do_sample=False, eos_token_id=2, pad_token_id=0,
                                  temperature=None, top_p=None, top_k=None)
    hf = hf[:, ids.shape[1]:].numpy()
    ours = np.asarray(ours)
    np.testing.assert_array_equal(ours[:, :hf.shape[1]], hf)
    assert hf.shape[1] == 10 and len(set(map(tuple, hf))) == 3  # not degenerate


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen3_moe_mixed"])
def test_saved_checkpoint_loads_in_transformers_with_the_same_logits(loaded, name, tmp_path):
    graphdef, params, cfg, fn, _ = loaded[name]
    save_pretrained(nnx.merge(graphdef, params), cfg, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    ids, mask = padded_batch(seed=4)
    ours = np.asarray(fn(params, jnp.asarray(ids), jnp.asarray(mask)))
    real = mask.astype(bool)
    np.testing.assert_allclose(hf_logits(hf.eval(), ids, mask)[real], ours[real], atol=1e-5, rtol=0)


def test_a_checkpoint_in_the_fused_expert_layout_loads_too(hf_checkpoints, loaded, tmp_path):
    """transformers 5 holds the experts fused (`mlp.experts.gate_up_proj [E, 2F, D]`,
    `down_proj [E, D, F]`); its save_pretrained writes the per-expert hub layout, but a state
    dict written as is must load as well."""
    src, torch_model = hf_checkpoints["qwen3_moe_mixed"]
    state = {k: v.numpy() for k, v in torch_model.state_dict().items()}
    assert "model.layers.1.mlp.experts.gate_up_proj" in state
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    model, _ = load_model(tmp_path, "causal_lm")
    _, params, _, fn, _ = loaded["qwen3_moe_mixed"]
    ids, mask = padded_batch(seed=5)
    np.testing.assert_array_equal(np.asarray(fn(split_model(model)[1], ids, mask)),
                                  np.asarray(fn(params, ids, mask)))


def test_reward_model_matches_qwen3moe_sequence_classification(tmp_path):
    hf_cfg = HF_CONFIGS["qwen3_moe_mixed"]()
    hf_cfg.num_labels, hf_cfg.pad_token_id = 1, 0
    hf = build_hf(transformers.AutoModelForSequenceClassification, hf_cfg, seed=11)
    hf.save_pretrained(tmp_path / "rm")
    model, cfg = load_model(tmp_path / "rm", "reward")
    ids, mask = padded_batch(seed=6)
    graphdef, params = split_model(model)
    ours = np.asarray(reward_scores(graphdef, params, ids, mask))
    pos = np.maximum(np.cumsum(mask, -1) - 1, 0)
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor(ids).long(), attention_mask=torch.tensor(mask).long(),
                 position_ids=torch.tensor(pos).long()).logits[:, 0].numpy()
    np.testing.assert_allclose(ours, ref, atol=1e-5, rtol=0)
    save_pretrained(model, cfg, tmp_path / "ours")
    back = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "ours")
    assert type(back).__name__ == "Qwen3MoeForSequenceClassification"


def test_aux_loss_equals_transformers_load_balancing_loss_with_a_padded_mask(loaded):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    for name in ("qwen3_moe_mixed", "qwen3_moe_step2"):
        graphdef, params, cfg, _, torch_model = loaded[name]
        ids, mask = padded_batch(seed=7, pads=(0, 4, 9))
        _, _, routing = nnx.merge(graphdef, params).backbone.run(ids, mask)
        pos = np.maximum(np.cumsum(mask, -1) - 1, 0)
        with torch.no_grad():
            out = torch_model(input_ids=torch.tensor(ids).long(),
                              attention_mask=torch.tensor(mask).long(),
                              position_ids=torch.tensor(pos).long(), output_router_logits=True)
        assert len(out.router_logits) == cfg.num_moe_layers
        assert routing.experts.shape == (3, 12, cfg.num_moe_layers, 2)
        np.testing.assert_allclose(float(routing.aux_loss), float(out.aux_loss), rtol=1e-5)
        no_mask = load_balancing_loss_func(out.router_logits, 8, 2, None)
        assert abs(float(no_mask) - float(out.aux_loss)) > 1e-4  # the mask matters here
        # the experts are the router's own top-2 at each layer
        for m, logits in enumerate(out.router_logits):
            want = torch.topk(logits.softmax(-1), 2).indices.numpy().reshape(3, 12, 2)
            got = np.asarray(routing.experts[:, :, m])
            np.testing.assert_array_equal(np.sort(got, -1), np.sort(want, -1))


def test_load_balancing_loss_equals_transformers_on_random_logits():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    rng = np.random.default_rng(0)
    logits = [rng.standard_normal((10, 6)).astype(np.float32) for _ in range(3)]
    mask = (rng.random((2, 5)) > 0.3).astype(np.int32)
    counts, probs = 0.0, 0.0
    for x in logits:
        _, experts, p, top = route(jnp.asarray(x), 2, False)
        stats = router_stats(experts, p, top, jnp.asarray(mask.reshape(-1)))
        counts, probs = counts + stats.counts, probs + stats.probs
    ours = load_balancing_loss(counts, probs, 3 * mask.sum())
    ref = load_balancing_loss_func(tuple(torch.tensor(x) for x in logits), 6, 2,
                                   torch.tensor(mask))
    np.testing.assert_allclose(float(ours), float(ref), rtol=1e-6)


def test_route_replays_given_experts_with_the_routers_renormalised_probabilities():
    logits = jnp.asarray(np.random.default_rng(1).standard_normal((4, 6)), jnp.float32)
    routes = jnp.asarray([[5, 0], [-1, -1], [2, 3], [1, 4]], jnp.int32)
    w, experts, probs, top = route(logits, 2, True, routes)
    p = np.exp(np.asarray(logits, np.float64))
    p /= p.sum(-1, keepdims=True)
    want_e = np.asarray(routes).copy()
    want_e[1] = np.argsort(-p[1])[:2]
    np.testing.assert_array_equal(np.asarray(experts), want_e)
    g = np.take_along_axis(p, want_e, -1)
    np.testing.assert_allclose(np.asarray(w), g / g.sum(-1, keepdims=True), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(top), np.argsort(-p, -1)[:, :2])


def test_replayed_routing_gives_identical_hidden_states_and_other_routes_train_the_router(mixed):
    cfg, graphdef, params = mixed
    ids, mask = padded_batch(seed=8, length=10, pads=(0, 3), vocab=VOCAB)

    def run(p, routes=None):
        return nnx.merge(graphdef, p).backbone.run(ids, mask, routes=routes)

    hidden, _, routing = jax.jit(run)(params)
    replayed, _, again = jax.jit(run)(params, routing.experts)
    np.testing.assert_array_equal(np.asarray(replayed), np.asarray(hidden))
    np.testing.assert_array_equal(np.asarray(again.experts), np.asarray(routing.experts))
    # other experts for half the tokens (the rest keep the router's choice: routes -1)
    other = (routing.experts + 3) % cfg.num_experts
    other = other.at[:, ::2].set(-1)
    moved, _, used = jax.jit(run)(params, other)
    np.testing.assert_array_equal(np.asarray(used.experts[:, 1::2]), np.asarray(other[:, 1::2]))
    np.testing.assert_array_equal(np.asarray(used.experts[:, ::2]),
                                  np.asarray(routing.experts[:, ::2]))
    assert np.abs(np.asarray(moved - hidden)[:, 1::2]).max() > 1e-3
    weights = jnp.asarray(np.random.default_rng(0).standard_normal(hidden.shape), jnp.float32)
    grads = jax.jit(jax.grad(lambda p: jnp.sum(run(p, other)[0] * weights)))(params)
    router = nnx.to_pure_dict(grads)["backbone"]["layers_1"]["mlp"]["gate"]["kernel"]
    assert np.abs(np.asarray(router)).max() > 1e-4
    with pytest.raises(ValueError, match="routes has shape"):
        jax.eval_shape(run, params, other[:, :, :, :1])


def test_dense_models_return_no_routing_and_refuse_routes():
    graphdef, params = abstract_params(tiny_config(VOCAB))
    ids, mask = padded_batch(seed=9, length=5, pads=(0,), vocab=VOCAB)

    def run(p, routes=None):
        return nnx.merge(graphdef, p).backbone.run(ids, mask, routes=routes)

    assert jax.eval_shape(run, params)[2] is None
    with pytest.raises(ValueError, match="no sparse layer"):
        jax.eval_shape(run, params, jnp.zeros((1, 5, 1, 2), jnp.int32))


@pytest.mark.slow
def test_remat_keeps_the_logits_and_gradients(mixed):
    cfg, graphdef, params = mixed
    full = abstract_params(cfg.replace(remat="full"))[0]
    ids, mask = padded_batch(seed=10, length=6, pads=(0, 2), vocab=VOCAB)
    out = []
    for g in (graphdef, full):
        def loss(p, g=g):
            hidden, _, routing = nnx.merge(g, p).backbone.run(ids, mask)
            return jnp.sum(hidden ** 2) + routing.aux_loss

        out.append(jax.jit(jax.value_and_grad(loss))(params))
    for a, b in zip(jax.tree.leaves(out[0]), jax.tree.leaves(out[1])):
        scale = float(np.abs(np.asarray(b)).max())  # recomputation may fuse differently
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5 * scale)


def test_lora_adapts_attention_and_dense_mlps_and_refuses_expert_targets():
    cfg = moe_config(lora_rank=2, lora_alpha=4.0, lora_targets=("q_proj", "gate_proj"))
    _, params = abstract_params(cfg)
    pure = nnx.to_pure_dict(params)["backbone"]
    assert "lora_a" in pure["layers_0"]["mlp"]["gate_proj"]  # the dense layer
    assert "lora_a" in pure["layers_1"]["attn"]["q_proj"]
    assert set(pure["layers_1"]["mlp"]) == {"gate", "experts"}  # no adapter on experts
    assert peft_keys(cfg, "backbone/layers_1/attn/q_proj/lora_b") == [
        "base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"]
    with pytest.raises(ValueError, match=r"\['gate_proj'\].*stacked experts"):
        moe_config(sparse_layers=(True, True), lora_rank=2, lora_alpha=4.0,
                   lora_targets=("q_proj", "gate_proj"))
    with pytest.raises(ValueError, match=r"unknown \['experts'\].*experts or the router"):
        moe_config(lora_rank=2, lora_alpha=4.0, lora_targets=("experts",))


def test_paged_engine_greedy_tokens_equal_the_static_sampler(mixed):
    cfg, graphdef, params = mixed
    ids, mask = padded_batch(seed=0, length=8, pads=(0, 3, 1, 5, 0, 2), vocab=VOCAB)
    tokens = assert_paged_equals_static(graphdef, params, cfg, ids, mask, max_new_tokens=12,
                                        page_size=8)
    assert len(set(map(tuple, tokens))) > 1
