"""A tiny Qwen3-MoE on a mesh of 8 CPU devices, params laid out by `parallel.rules`: the experts
split over `fsdp` (their FFN width over `tensor`), the router replicated.

- The expert params' shardings are printed and checked: each device holds E / fsdp experts.
- Logits, the routing, the aux loss and the gradients of a loss that uses both equal one
  device's with the mesh given (`backbone.run(..., mesh=)`: each device routes and computes
  its own rows, `models.moe_dispatch`), half the tokens on replayed routes.
- With the mesh, the compiled MoE forward all-gathers the expert weights only, and no
  collective moves the whole call's tokens (only the psum over `tensor` of each device's own
  rows); without it the partitioner moves every token (the check's control: an all-reduce of
  the `[B*L*k, D]` rows). Its FLOPs per device are printed for both.
- Slow: the same without `tensor` (no psum), also under the partitioner's own layout (no mesh
  given to the model), a batch the mesh does not divide (the global path), and the paged
  engine on the mesh (`PagedView.mesh`) against the static sampler.

Runs in a subprocess: the device count is fixed when jax starts.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from ppo_jax.models import init_model, split_model
from ppo_jax.models.moe_dispatch import splits_rows
from ppo_jax.models.tiny_random import tiny_config
from ppo_jax.parallel import make_mesh
from tests.xla_env import xla_flags

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r'''
import re, sys
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P
from ppo_jax.models import init_model, split_model
from ppo_jax.models.moe import SparseMoeBlock
from ppo_jax.models.tiny_random import tiny_config
from ppo_jax.parallel import make_mesh
from ppo_jax.parallel.rules import describe, tree_shardings

data, fsdp, tensor = map(int, sys.argv[1:4])
extra = set(sys.argv[4:])
E, D, F = 8, 64, 32
cfg = tiny_config(96, model_type="qwen3_moe", qk_norm=True, num_experts=E, num_experts_per_tok=2,
                  moe_intermediate_size=F, norm_topk_prob=True, sparse_layers=(False, True, True),
                  num_layers=3)
graphdef, params = split_model(init_model(cfg, seed=0))
rng = np.random.default_rng(0)
ids = rng.integers(3, 96, (8, 10)).astype(np.int32)
mask = np.ones_like(ids)
mask[1, :4] = 0
mask[3, :2] = 0
w = jnp.asarray(rng.standard_normal((8, 10, 96)), jnp.float32)

def loss(p, ids, mask, routes, mesh):
    model = nnx.merge(graphdef, p)
    hidden, _, routing = model.backbone.run(ids, mask, routes=routes, mesh=mesh)
    logits = model.lm_head(hidden)
    return jnp.sum(logits * w) + 0.1 * routing.aux_loss, (logits, routing)

step = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=4)
# replay: the odd tokens on random experts, the even ones routed by the router
routes = np.argsort(rng.random((8, 10, 2, E)), axis=-1)[..., :2].astype(np.int32)
routes[:, ::2] = -1
want = step(params, ids, mask, routes, None)
assert (np.asarray(want[0][1][1].experts)[:, 1::2] == routes[:, 1::2]).all()
mesh = make_mesh(data=data, fsdp=fsdp, tensor=tensor)
sharded = jax.device_put(params, tree_shardings(params, mesh))
rows = NamedSharding(mesh, P(("data", "fsdp")))
ids_s, mask_s, routes_s = (jax.device_put(a, rows) for a in (ids, mask, routes))
experts = nnx.to_pure_dict(sharded)["backbone"]["layers_1"]["mlp"]["experts"]
for path, line in describe(sharded, mesh).items():
    if "/mlp/" in path and "layers_1" in path:
        print(path, line)
assert experts["gate_proj"].sharding.spec == (P(None, "fsdp", None, "tensor") if tensor > 1
                                              else P(None, "fsdp"))
assert experts["gate_proj"].addressable_shards[0].data.shape == (2, E // fsdp, D, F // tensor)
router = nnx.to_pure_dict(sharded)["backbone"]["layers_1"]["mlp"]["gate"]["kernel"]
assert router.sharding.spec == P()

def same(got, want, label):
    (got_l, (got_logits, got_r)), got_g = got
    (want_l, (want_logits, want_r)), want_g = want
    np.testing.assert_array_equal(np.asarray(got_r.experts), np.asarray(want_r.experts))
    np.testing.assert_allclose(np.asarray(got_logits), np.asarray(want_logits), atol=1e-5, rtol=0)
    np.testing.assert_allclose(float(got_r.aux_loss), float(want_r.aux_loss), rtol=1e-6)
    np.testing.assert_allclose(float(got_l), float(want_l), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4, rtol=1e-4)
    print("same:", label, "| gradient of experts/up_proj:", nnx.to_pure_dict(got_g)["backbone"]
          ["layers_1"]["mlp"]["experts"]["up_proj"].sharding.spec, flush=True)

if "partitioner" in extra:
    same(step(sharded, ids_s, mask_s, routes_s, None), want, "partitioner's layout, no mesh")
same(step(sharded, ids_s, mask_s, routes_s, mesh), want, "mesh given")

# the MoE forward's collectives: which arrays are all-gathered, and which move the whole call's
# tokens (B*L rows, or B*L*k (token, expert) rows) between devices
block = nnx.graphdef(SparseMoeBlock(cfg, nnx.Rngs(0)))
mlp = nnx.state(nnx.merge(graphdef, sharded).backbone.layers_1.mlp)
x = jax.device_put(jnp.asarray(rng.standard_normal((8, 10, D)), jnp.float32), rows)
def moe(s, x, m, mesh):
    return nnx.merge(block, jax.tree.map(lambda a: a[0], s))(x, m, None, mesh)
def collectives(m):
    """{op: [shape of each array it moves, 1-dims dropped]} of the compiled MoE forward."""
    compiled = jax.jit(moe, static_argnums=3).lower(mlp, x, mask_s, m).compile()
    found = re.findall(r"= (.*?) (all-gather|all-reduce|all-to-all|collective-permute|"
                       r"reduce-scatter)(?:-start)?\(", compiled.as_text())
    ops = {}
    for result, op in found:  # a combined collective returns a tuple of arrays
        for dims in re.findall(r"[a-z]\w*\[([\d,]*)\]", result):
            ops.setdefault(op, []).append(tuple(int(d) for d in dims.split(",") if d and d != "1"))
    print("collectives", "with mesh:" if m else "without mesh:", ops, "| flops per device:",
          compiled.cost_analysis()["flops"], flush=True)
    return ops
def moves_all_tokens(ops):
    return [s for shapes in ops.values() for s in shapes if {80, 160} & set(s)]
assert moves_all_tokens(collectives(None)), "the control: the partitioner moves every token"
ops = collectives(mesh)
assert not moves_all_tokens(ops), ops
weights = {tuple(sorted((E, D, F // tensor)))}
assert ops["all-gather"] and all(tuple(sorted(s)) in weights for s in ops["all-gather"]), ops
print("no token gather with the mesh", flush=True)

if "fallback" in extra:  # 4 rows over 8 batch shards: the global path, same values
    fb = jax.jit(lambda p, i, a, m: nnx.merge(graphdef, p).backbone.run(i, a, mesh=m)[::2],
                 static_argnums=3)
    (h0, r0), (h1, r1) = fb(params, ids[:4], mask[:4], None), fb(sharded, ids[:4], mask[:4], mesh)
    np.testing.assert_allclose(np.asarray(h1), np.asarray(h0), atol=1e-5)
    np.testing.assert_array_equal(np.asarray(r1.experts), np.asarray(r0.experts))
    print("same: a batch the mesh does not divide", flush=True)

if "engine" in extra:
    from ppo_jax.parallel.mesh import replicated
    from ppo_jax.rollout.engine import PagedEngine
    from ppo_jax.rollout.static_batch import generate
    from tests.rollout.sampling_settings import engine_settings, sampling_settings
    kw = dict(max_new_tokens=8, greedy=True, pad_token_id=0)
    ids[mask == 0] = 0
    want = generate(graphdef, params, ids, mask, None, return_logprobs=True, **kw)
    eng = PagedEngine(graphdef, cfg, sampling_settings(mesh=mesh, **kw),
                      engine_settings(page_size=8, decode_chunk=4), batch=8, prompt_width=10)
    got = eng.generate(sharded, jax.device_put(ids, rows), mask_s,
                       jax.device_put(jax.random.PRNGKey(0), replicated(mesh)))
    for g, w_, name in zip(got, want, ("tokens", "mask", "logprobs")):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w_), atol=1e-5, err_msg=name)
    print("same: paged engine on the mesh", flush=True)
print("ok")
'''


def _run(*argv: str) -> str:
    env = dict(os.environ, XLA_FLAGS=xla_flags(8), PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and proc.stdout.endswith("ok\n"), out[-4000:]
    print(proc.stdout)
    return proc.stdout


def test_experts_split_over_fsdp_and_tensor_with_the_mesh_give_one_devices_values():
    out = _run("2", "2", "2")
    assert out.count("same:") == 1 and "no token gather with the mesh" in out


@pytest.mark.slow  # ~90 s on 2 cores: another mesh, no mesh given, fallback, the paged engine
def test_experts_split_over_fsdp_only_without_and_with_mesh_and_the_paged_engine():
    out = _run("2", "4", "1", "partitioner", "fallback", "engine")
    assert out.count("same:") == 4 and "no token gather with the mesh" in out


def _tiny_moe():
    cfg = tiny_config(96, model_type="qwen3_moe", qk_norm=True, num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True,
                      sparse_layers=(True, True))
    return split_model(init_model(cfg, seed=1))


def test_a_one_device_mesh_is_the_global_path_bit_for_bit():
    graphdef, params = _tiny_moe()
    ids = np.random.default_rng(1).integers(3, 96, (2, 6)).astype(np.int32)
    mask = np.ones_like(ids)
    mesh = make_mesh(data=1, fsdp=1, tensor=1, devices=jax.devices()[:1])
    assert not splits_rows(mesh, 2)
    run = jax.jit(lambda p, m: nnx.merge(graphdef, p).backbone.run(ids, mask, mesh=m),
                  static_argnums=1)
    (h0, _, r0), (h1, _, r1) = run(params, None), run(params, mesh)
    np.testing.assert_array_equal(np.asarray(h1), np.asarray(h0))
    np.testing.assert_array_equal(np.asarray(r1.aux_loss), np.asarray(r0.aux_loss))


def test_a_mesh_without_the_batch_axes_is_refused():
    mesh = jax.make_mesh((1,), ("x",), devices=jax.devices()[:1])
    with pytest.raises(ValueError, match=r"lack \['data', 'fsdp', 'tensor'\]"):
        splits_rows(mesh, 4)
