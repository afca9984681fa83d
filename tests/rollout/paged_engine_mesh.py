"""The paged engine on a 2x2x2 mesh of 8 CPU devices (4 replicas, KV heads over `tensor`)
against the static sampler on one device.

Run in a fresh process with XLA_FLAGS=--xla_force_host_platform_device_count=8 (the device count
is fixed when jax starts); tests/rollout/test_paged_engine.py does. Prints one `same` line per
case whose tokens, masks and log-probs equal the one-device static sampler's, raises otherwise.
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
from ppo_jax.rollout.engine import PagedEngine  # noqa: E402
from ppo_jax.rollout.static_batch import generate  # noqa: E402
from tests.rollout.sampling_settings import engine_settings, sampling_settings  # noqa: E402


def main() -> None:
    assert jax.device_count() == 8, jax.devices()
    cfg = tiny_config(96)
    graphdef, params = split_model(init_model(cfg, seed=3))
    rng = np.random.default_rng(0)
    kw = dict(max_new_tokens=10, temperature=1.0, top_k=20, pad_token_id=0, stop_token_ids=(5,))
    key, mesh = jax.random.PRNGKey(11), make_mesh(2, 2, 2)  # 4 replicas
    p = jax.device_put(params, tree_shardings(params, mesh))
    for n, engine in ((1, engine_settings(page_size=4, max_concurrent=8, num_pages=4 * 7,
                                         decode_chunk=3)),
                      (2, engine_settings(page_size=8, decode_chunk=4))):
        ids = np.repeat(rng.integers(4, 96, (16 // n, 6)).astype(np.int32), n, axis=0)
        mask = np.ones_like(ids)
        mask[n:2 * n, :2], ids[n:2 * n, :2] = 0, 0  # the second group's prompt is left-padded
        want = generate(graphdef, params, ids, mask, key, return_logprobs=True, **kw)
        settings = sampling_settings(samples_per_prompt=n, mesh=mesh, **kw)
        eng = PagedEngine(graphdef, cfg, settings, engine, batch=16, prompt_width=6)
        q, qm = (jax.device_put(x, batch_sharding(mesh)) for x in (ids, mask))
        got = eng.generate(p, q, qm, jax.device_put(key, replicated(mesh)))
        for g, w, name in zip(got, want, ("tokens", "mask", "logprobs")):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5,
                                       err_msg=f"n={n} {name}")
        assert got[0].sharding.spec[0] == ("data", "fsdp"), got[0].sharding
        print(f"same: mesh 2x2x2, samples_per_prompt {n}, {eng.last_stats}", flush=True)


if __name__ == "__main__":
    main()
