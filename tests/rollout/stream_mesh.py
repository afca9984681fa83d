"""A stream of batches (rollout.stream) on a 2x2x2 mesh of 8 CPU devices (4 replicas, each with
its own rows of every ring block): three batches equal the mesh engine's `generate` under
their keys, and a partial rollout's post-switch log-probs equal the new weights' one-device
forward pass.

Run in a fresh process with XLA_FLAGS=--xla_force_host_platform_device_count=8;
tests/rollout/test_stream.py does. Prints one `same` line per check, raises otherwise.
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
from ppo_jax.rollout.forward import policy_logprobs  # noqa: E402
from tests.rollout.sampling_settings import engine_settings, sampling_settings  # noqa: E402


def main() -> None:
    assert jax.device_count() == 8, jax.devices()
    cfg = tiny_config(96)
    graphdef, params = split_model(init_model(cfg, seed=3))
    _, new = split_model(init_model(cfg, seed=4))
    mesh, rng = make_mesh(2, 2, 2), np.random.default_rng(0)  # 4 replicas
    put = lambda tree: jax.device_put(tree, tree_shardings(tree, mesh))  # noqa: E731
    kw = dict(temperature=1.0, pad_token_id=0, stop_token_ids=(5, 7, 9, 11, 13),
              samples_per_prompt=2)
    eng = PagedEngine(graphdef, cfg, sampling_settings(10, mesh=mesh, **kw),
                      engine_settings(page_size=4, max_concurrent=16, decode_chunk=3,
                                      decode_buckets=1), batch=16, prompt_width=6)
    batches = []
    for i in range(3):
        ids = np.repeat(rng.integers(4, 96, (8, 6)).astype(np.int32), 2, axis=0)
        mask = np.ones_like(ids)
        mask[2 * i:2 * i + 2, :3], ids[2 * i:2 * i + 2, :3] = 0, 0  # a left-padded group
        batches.append((ids, mask, jax.device_put(jax.random.PRNGKey(20 + i), replicated(mesh))))
    def on_mesh(ids, mask):
        return [jax.device_put(x, batch_sharding(mesh)) for x in (ids, mask)]

    stream = eng.stream(put(params), version=0, max_batches_in_flight=2)
    for i, (ids, mask, key) in enumerate(batches):
        stream.submit(*on_mesh(ids, mask), key, tag=i)
    for b in stream.flush():
        ids, mask, key = batches[b.tag]
        want = eng.generate(put(params), *on_mesh(ids, mask), key)
        for g, w, name in zip(b.generation[:2], want[:2], ("tokens", "mask")):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=f"{b.tag} {name}")
        # a prefill of another group count rounds otherwise (4.8e-7 seen)
        np.testing.assert_allclose(np.asarray(b.generation[2]), np.asarray(want[2]), atol=2e-6)
        assert b.generation[0].sharding.spec[0] == ("data", "fsdp"), b.generation[0].sharding
    assert stream.stats.mixed_chunks > 0, stream.stats
    print(f"same: mesh 2x2x2, 3 streamed batches = generate, {stream.stats}", flush=True)

    stream = eng.stream(put(params), version=0)
    ids, mask, key = batches[0]
    stream.submit(*on_mesh(ids, mask), key)
    stream.step()
    stream.set_params(put(new), 1)
    (b,) = stream.flush()
    tokens, resp_mask, logp = (np.asarray(x) for x in b.generation[:3])
    ref = np.asarray(policy_logprobs(graphdef, new, ids, mask, tokens, resp_mask))
    after = b.versions == 1
    assert after.sum() > 16, b.versions
    np.testing.assert_allclose(logp[after], ref[after], atol=2e-5)
    print(f"same: mesh 2x2x2, post-switch log-probs = the new weights' forward pass "
          f"({int(after.sum())} tokens)", flush=True)


if __name__ == "__main__":
    main()
