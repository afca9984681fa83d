"""The chunked log-prob head on a vocabulary split over `tensor` (8 CPU devices, mesh 2x1x4):
with `vocab_shards` = the tensor size every device slices its own columns (no all-gather of the
head, forward or backward) and the values and gradients equal the full-logits path's; without
it, XLA gathers the whole head on every device (why `forward.head_logprobs` passes it).

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
import re
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from ppo_jax.core import chunked_logprobs_and_entropy, entropy_from_logits, logprobs_from_logits
from ppo_jax.parallel import make_mesh, vocab_shards

B, T, D, V = 8, 6, 16, 512
mesh = make_mesh(data=2, fsdp=1, tensor=4)
assert vocab_shards(mesh, V) == 4 and vocab_shards(mesh, V + 1) == 1 and vocab_shards(None, V) == 1
k = jax.random.split(jax.random.PRNGKey(0), 5)
args = (jax.random.normal(k[0], (B, T, D)), 0.3 * jax.random.normal(k[1], (V, D)),
        jax.random.randint(k[2], (B, T), 0, V), jax.random.normal(k[3], (B, T)),
        jax.random.normal(k[4], (B, T)))
rows, vocab = NamedSharding(mesh, P(("data", "fsdp"))), NamedSharding(mesh, P("tensor", "fsdp"))

def plain(h, w, tok):
    logits = jnp.einsum("btd,vd->btv", h, w, preferred_element_type=jnp.float32)
    return logprobs_from_logits(logits, tok, 0.8), entropy_from_logits(logits, 0.8)

def chunked(shards):
    return lambda h, w, tok: chunked_logprobs_and_entropy(
        h, w, tok, 0.8, chunk_size=48, vocab_axis=0, vocab_shards=shards)

def run(head):
    def loss(h, w, tok, a, c):
        lp, ent = head(h, w, tok)
        return jnp.sum(a * lp + c * ent)
    fn = jax.jit(jax.value_and_grad(loss, (0, 1)), in_shardings=(rows, vocab, rows, rows, rows))
    compiled = fn.lower(*args).compile()
    gathers = re.findall(r"= (\S+) all-gather", compiled.as_text())
    return compiled(*args), gathers

want, _ = run(plain)
got, gathers = run(chunked(4))
assert not gathers, gathers
for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)
assert got[1][1].sharding.spec[0] == "tensor"
_, gathers = run(chunked(1))
assert any(f"{V},{D}]" in g for g in gathers), gathers
print("ok")
'''


def test_vocab_sharded_head_slices_local_columns_and_matches_full_logits():
    env = dict(os.environ, XLA_FLAGS=xla_flags(8),
               PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and "ok" in proc.stdout, (proc.stdout + proc.stderr)[-4000:]
