"""What jax does with the two layouts of a split placement over two processes (issue 57).

Run two copies, 4 CPU devices each (docs/async_rl.md quotes their output):

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/parallel/split_layouts.py \
        --coordinator localhost:PORT --process-id {0,1}

layout "shared": each process gives 2 devices to each group (what `trainer.split` builds);
layout "whole": process 0 holds the trainer group, process 1 the rollout group. For each, a
weight-like array and a row-sharded batch go trainer -> rollout by `jax.device_put` and by
`parallel.transfer`, a jitted program runs on the rollout mesh, and its replicated output is
read on the host by every process (what the paged engine's scheduler does). Each line prints
"ok" or the first line of the error. `--socket` switches on jax's own transfers between
processes over sockets (`jax_cross_host_transfer_socket_address`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def attempt(name: str, fn) -> None:
    import jax

    try:
        out = fn()
        if out is not None:
            jax.block_until_ready(out)
        print(f"process {jax.process_index()}: {name}: ok", flush=True)
    except Exception as e:  # noqa: BLE001 - the point is to report what jax raises
        first = str(e).strip().splitlines()[0][:240]
        print(f"process {jax.process_index()}: {name}: {type(e).__name__}: {first}", flush=True)


def groups(layout: str):
    import jax

    by_process = {}
    for d in jax.devices():
        by_process.setdefault(d.process_index, []).append(d)
    if layout == "shared":
        return ([d for p in sorted(by_process) for d in by_process[p][:2]],
                [d for p in sorted(by_process) for d in by_process[p][2:]])
    return by_process[0], by_process[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--coordinator", required=True)
    parser.add_argument("--process-id", type=int, required=True)
    parser.add_argument("--socket", help="jax_cross_host_transfer_socket_address of this "
                        "process (jax's DCN transfers between processes), e.g. localhost:PORT")
    args = parser.parse_args()
    import jax

    if args.socket:
        jax.config.update("jax_cross_host_transfer_socket_address", args.socket)
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from ppo_jax.parallel import make_mesh
    from ppo_jax.parallel.transfer import transfer

    jax.distributed.initialize(args.coordinator, num_processes=2, process_id=args.process_id)
    for layout in ("shared", "whole"):
        trainer, rollout = groups(layout)
        tm, rm = make_mesh(1, 2, 2, trainer), make_mesh(2, 1, 2, rollout)
        weight_src = NamedSharding(tm, P(None, "tensor"))  # the trainer's copy, rollout layout
        weight_dst = NamedSharding(rm, P(None, "tensor"))
        rows_src = NamedSharding(tm, P(("data", "fsdp")))
        rows_dst = NamedSharding(rm, P(("data", "fsdp")))
        w = jax.jit(lambda: jnp.ones((8, 8)), out_shardings=weight_src)()
        x = jax.jit(lambda: jnp.arange(16.0), out_shardings=rows_src)()
        print(f"process {jax.process_index()}: layout {layout}: trainer devices "
              f"{[d.id for d in trainer]}, rollout devices {[d.id for d in rollout]}", flush=True)
        attempt(f"{layout}: jax.device_put weights", lambda: jax.device_put(w, weight_dst))
        attempt(f"{layout}: jax.device_put rows", lambda: jax.device_put(x, rows_dst))
        attempt(f"{layout}: transfer weights", lambda: transfer(w, weight_dst))
        attempt(f"{layout}: transfer rows", lambda: transfer(x, rows_dst))
        on_rollout = jax.jit(lambda: jnp.full((4,), 2.0), out_shardings=NamedSharding(rm, P()))
        attempt(f"{layout}: a program on the rollout mesh", on_rollout)
        attempt(f"{layout}: its replicated output read on the host",
                lambda: print(f"  {jax.device_get(on_rollout())}"))


if __name__ == "__main__":
    main()
