"""A tiny Qwen3-MoE on a mesh of 8 CPU devices (data 2, fsdp 2, tensor 2), params laid out by
`parallel.rules`: the experts split over `fsdp` (their FFN width over `tensor`), the router
replicated. Logits, the routing, the aux loss and the gradients of a loss that uses both equal
one device's. The expert params' shardings are printed and checked: each device holds E / 2
experts.

Runs in a subprocess: the device count is fixed when jax starts.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.xla_env import xla_flags

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r'''
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P
from ppo_jax.models import init_model, split_model
from ppo_jax.models.tiny_random import tiny_config
from ppo_jax.parallel import make_mesh
from ppo_jax.parallel.rules import describe, tree_shardings

cfg = tiny_config(96, model_type="qwen3_moe", qk_norm=True, num_experts=8, num_experts_per_tok=2,
                  moe_intermediate_size=32, norm_topk_prob=True, sparse_layers=(False, True, True),
                  num_layers=3)
graphdef, params = split_model(init_model(cfg, seed=0))
rng = np.random.default_rng(0)
ids = rng.integers(3, 96, (4, 10)).astype(np.int32)
mask = np.ones_like(ids)
mask[1, :4] = 0
mask[3, :2] = 0
w = jnp.asarray(rng.standard_normal((4, 10, 96)), jnp.float32)

def loss(p, ids, mask):
    model = nnx.merge(graphdef, p)
    hidden, _, routing = model.backbone.run(ids, mask)
    logits = model.lm_head(hidden)
    return jnp.sum(logits * w) + 0.1 * routing.aux_loss, (logits, routing)

step = jax.jit(jax.value_and_grad(loss, has_aux=True))
(want_l, (want_logits, want_r)), want_g = step(params, ids, mask)

mesh = make_mesh(data=2, fsdp=2, tensor=2)
sharded = jax.device_put(params, tree_shardings(params, mesh))
rows = NamedSharding(mesh, P(("data", "fsdp")))
(got_l, (got_logits, got_r)), got_g = step(sharded, jax.device_put(ids, rows),
                                           jax.device_put(mask, rows))
for path, line in describe(sharded, mesh).items():
    if "/mlp/" in path and "layers_1" in path:
        print(path, line)
experts = nnx.to_pure_dict(sharded)["backbone"]["layers_1"]["mlp"]["experts"]
assert experts["gate_proj"].sharding.spec == P(None, "fsdp", None, "tensor")
assert experts["down_proj"].sharding.spec == P(None, "fsdp", "tensor")
shard = experts["gate_proj"].addressable_shards[0].data
assert shard.shape == (2, 4, 64, 16), shard.shape  # 8 experts / fsdp 2, F 32 / tensor 2
router = nnx.to_pure_dict(sharded)["backbone"]["layers_1"]["mlp"]["gate"]["kernel"]
assert router.sharding.spec == P()
grad_experts = nnx.to_pure_dict(got_g)["backbone"]["layers_1"]["mlp"]["experts"]["up_proj"]
print("gradient of experts/up_proj:", grad_experts.sharding.spec)
np.testing.assert_array_equal(np.asarray(got_r.experts), np.asarray(want_r.experts))
np.testing.assert_allclose(np.asarray(got_logits), np.asarray(want_logits), atol=1e-5, rtol=0)
np.testing.assert_allclose(float(got_r.aux_loss), float(want_r.aux_loss), rtol=1e-6)
np.testing.assert_allclose(float(got_l), float(want_l), rtol=1e-5)
for a, b in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4, rtol=1e-4)
print("ok")
'''


def test_experts_split_over_fsdp_give_one_devices_logits_routing_and_gradients():
    env = dict(os.environ, XLA_FLAGS=xla_flags(8), PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "ok" in proc.stdout, out[-4000:]
    print(proc.stdout)
