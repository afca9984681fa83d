"""The shared prefill on a 2x2x2 mesh of 8 CPU devices against the repeated path on one.

Run in a fresh process with XLA_FLAGS=--xla_force_host_platform_device_count=8 (the device count
is fixed when jax starts); tests/rollout/test_shared_prefill.py does. Prints one `same` line per
samples_per_prompt whose tokens and masks equal the repeated path's on one device, raises
otherwise.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from ppo_jax.models import split_model  # noqa: E402
from ppo_jax.models.heads import init_model  # noqa: E402
from ppo_jax.models.tiny_random import tiny_config  # noqa: E402
from ppo_jax.parallel.mesh import batch_sharding, make_mesh, replicated  # noqa: E402
from ppo_jax.parallel.rules import tree_shardings  # noqa: E402
from ppo_jax.rollout.static_batch import generate  # noqa: E402


def main() -> None:
    assert jax.device_count() == 8, jax.devices()
    graphdef, params = split_model(init_model(tiny_config(96), seed=3))
    rng = np.random.default_rng(0)
    kw = dict(max_new_tokens=10, temperature=1.0, top_k=20, pad_token_id=0, stop_token_ids=(5,))
    key, mesh = jax.random.PRNGKey(11), make_mesh(2, 2, 2)  # 4 batch shards
    p = jax.device_put(params, tree_shardings(params, mesh))
    for n in (2, 4):  # 4 prefill rows (split over the 4 shards), 2 (replicated)
        ids = np.repeat(rng.integers(4, 96, (8 // n, 6)).astype(np.int32), n, axis=0)
        mask = np.ones_like(ids)
        mask[n:2 * n, :2], ids[n:2 * n, :2] = 0, 0  # the second group's prompt is left-padded
        want = generate(graphdef, params, ids, mask, key, **kw)  # one device, n prefill rows
        q, qm = (jax.device_put(x, batch_sharding(mesh)) for x in (ids, mask))
        got = generate(graphdef, p, q, qm, jax.device_put(key, replicated(mesh)),
                       samples_per_prompt=n, mesh=mesh, **kw)
        for g, w, name in zip(got, want, ("tokens", "mask")):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=f"n={n} {name}")
        print(f"same: mesh 2x2x2, samples_per_prompt {n}", flush=True)

if __name__ == "__main__":
    main()
