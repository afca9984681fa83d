"""Issue 57, the split placement: dividing the devices into a trainer and a rollout group
(`trainer.split`) and moving arrays between them device to device (`parallel.transfer`).

The device split and the coverage check read only `process_index` / `id` of devices and the
index maps of shardings, so they are pinned here with stand-ins for two processes' devices; the
transfers themselves run on 8 CPU devices in a subprocess (the device count is fixed when jax
starts).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

from ppo_jax.parallel.transfer import uncovered
from ppo_jax.trainer.config import ConfigError
from ppo_jax.trainer.split import split_devices
from tests.xla_env import xla_flags

ROOT = Path(__file__).resolve().parents[2]


class Dev(NamedTuple):
    id: int
    process_index: int


def devices(processes: int, each: int) -> list[Dev]:
    return [Dev(p * each + i, p) for p in range(processes) for i in range(each)]


def test_each_process_gives_its_last_devices_to_the_rollout_group():
    trainer, rollout = split_devices(devices(2, 4), 4)
    assert [d.id for d in trainer] == [0, 1, 4, 5]
    assert [d.id for d in rollout] == [2, 3, 6, 7]
    trainer, rollout = split_devices(devices(1, 8), 2)  # one process: the last two
    assert [d.id for d in trainer] == list(range(6)) and [d.id for d in rollout] == [6, 7]


@pytest.mark.parametrize("processes, each, n, match", [
    (1, 8, 8, "leave the trainer at least one"),
    (1, 8, 0, "leave the trainer at least one"),
    (2, 4, 3, "every process gives the same number"),  # whole-process groups: refused
])
def test_a_rollout_group_that_does_not_fit_is_refused_naming_the_key(processes, each, n, match):
    with pytest.raises(ConfigError, match=match) as err:
        split_devices(devices(processes, each), n)
    assert f"generation.rollout_devices={n}" in str(err.value)


class Rows(NamedTuple):
    """A stand-in sharding: dim 0 of a [rows, 2] array split in equal blocks over `devs`."""
    devs: list

    def devices_indices_map(self, shape):
        block = shape[0] // len(self.devs)
        return {d: (slice(i * block, (i + 1) * block), slice(None))
                for i, d in enumerate(self.devs)}


def test_coverage_needs_the_destination_rows_on_the_same_process():
    d = devices(2, 4)
    # trainer rows on devices 0, 1 | 4, 5; rollout rows on 2, 3 | 6, 7: each process holds the
    # same rows in both groups, in 2 blocks or in 4
    assert uncovered(Rows([d[0], d[1], d[4], d[5]]), Rows([d[2], d[3], d[6], d[7]]), (8, 2)) is None
    assert uncovered(Rows([d[0], d[4]]), Rows([d[2], d[3], d[6], d[7]]), (8, 2)) is None
    assert uncovered(Rows([d[2], d[3], d[6], d[7]]), Rows([d[0], d[4]]), (8, 2)) is None
    # whole-process groups: process 1's rollout devices need rows only process 0 holds
    why = uncovered(Rows([d[0], d[1], d[2], d[3]]), Rows([d[4], d[5], d[6], d[7]]), (8, 2))
    assert why == ("destination device 4 (process 1) needs ((0, 2), (0, 2)) of an array (8, 2): "
                   "no source device of its process holds it")


SCRIPT = r'''
import jax, jax.numpy as jnp, numpy as np
from jax._src import array as jax_array
from jax.sharding import NamedSharding, PartitionSpec as P
from ppo_jax.parallel import make_mesh
from ppo_jax.parallel.transfer import transfer, tree_bytes

d = jax.devices()
six, two, halves = make_mesh(3, 1, 2, d[:6]), make_mesh(1, 1, 2, d[6:]), make_mesh(2, 1, 1, d[6:])
four_a, four_b = make_mesh(2, 1, 2, d[:4]), make_mesh(2, 1, 2, d[4:])
rows = lambda m: NamedSharding(m, P(("data", "fsdp")))
x = jnp.arange(24 * 4, dtype=jnp.float32).reshape(24, 4)
cases = [  # (source, destination): row blocks 3 -> 1, 1 -> 3, 3 -> 2 (a block from parts of
           # two), 2 -> 2, tensor columns kept, rows and columns -> columns only (the rollout
           # layout of a weight)
    (rows(six), rows(two)), (rows(two), rows(six)), (rows(six), rows(halves)),
    (rows(four_a), rows(four_b)),
    (NamedSharding(four_a, P(None, "tensor")), NamedSharding(four_b, P(None, "tensor"))),
    (NamedSharding(four_a, P("data", "tensor")), NamedSharding(four_b, P(None, "tensor")))]
placed = [jax.device_put(x, src) for src, _ in cases]

def no_host(self):  # the only way jax moves a sharded array through host memory
    raise AssertionError("host round trip")

value = jax_array.ArrayImpl._value
jax_array.ArrayImpl._value = property(no_host)
try:
    moved = jax.block_until_ready(transfer(placed, [dst for _, dst in cases]))
    try:  # the guard is live: jax's own device_put of 3 row blocks into 1 goes through host
        jax.device_put(placed[0], cases[0][1])
        raise SystemExit("jax.device_put did not touch host memory: the guard tests nothing")
    except AssertionError:
        pass
finally:
    jax_array.ArrayImpl._value = value
for y, (_, dst) in zip(moved, cases):
    assert y.sharding == dst, (y.sharding, dst)
    assert {s.device for s in y.addressable_shards} == set(dst.device_set)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
tree = {"w": x, "b": jnp.ones(3, jnp.bfloat16)}
assert tree_bytes(tree) == 24 * 4 * 4 + 3 * 2
print("ok")
'''


def test_transfer_moves_shards_device_to_device_between_groups():
    """Row blocks regrouped (3 -> 1, 1 -> 3, 3 -> 2, 2 -> 2) and weights into the rollout layout land on
    the destination devices with the same values, and no array is read to host on the way
    (jax's own `device_put` of the 3 -> 1 case is, which shows the guard is live)."""
    env = dict(os.environ, XLA_FLAGS=xla_flags(8), PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and "ok" in proc.stdout, (proc.stdout + proc.stderr)[-4000:]
