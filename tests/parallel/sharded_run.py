"""Run PPO steps of the tiny config under one or more meshes; save metrics, params, layouts.

Run in a fresh process (the device count is fixed when jax starts), e.g.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/parallel/sharded_run.py \
        --out DIR --mesh 1,1,1 --mesh 8,1,1 --mesh 2,2,2

Each mesh `d,f,t` uses the first d*f*t devices; it writes `DIR/<d>x<f>x<t>.npz` (final actor
and critic params, flattened by path) and `DIR/<d>x<f>x<t>.json` (per-step metrics and the
sharding of a few arrays). With `--num-processes N --process-id I --coordinator HOST:PORT` it
joins a multi-process run through `distributed.initialize`; only process 0 writes. A fourth
number, `d,f,t,n`, adds a rollout group of n devices (`generation.placement: split`; the mesh
lays out the trainer's d*f*t, the run takes d*f*t + n devices), named `<d>x<f>x<t>+<n>`.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

VOLATILE = ("time/", "tokens_per_s/")  # wall-clock metrics: not compared
WATCH = ("params/backbone/layers/attn/q_proj/kernel", "params/backbone/layers/attn/o_proj/kernel",
         "params/backbone/layers/mlp/down_proj/kernel", "params/backbone/embed_tokens/embedding",
         "params/backbone/norm/scale", "opt_state/1/0/mu/backbone/layers/attn/q_proj/kernel",
         # LoRA runs (model.lora.rank > 0): the adapters and a moment
         "params/backbone/layers/attn/q_proj/lora_a", "params/backbone/layers/attn/q_proj/lora_b",
         "params/backbone/layers/mlp/down_proj/lora_a",
         "opt_state/1/0/mu/backbone/layers/attn/q_proj/lora_b",
         # Qwen3-MoE runs (model.actor=tiny-random-moe): the experts and the router
         "params/backbone/layers/mlp/experts/gate_proj", "params/backbone/layers/mlp/experts/down_proj",
         "params/backbone/layers/mlp/gate/kernel",
         "opt_state/1/0/mu/backbone/layers/mlp/experts/gate_proj")


def overrides(args, mesh, out_dir) -> list[str]:
    d, f, t, *split = mesh
    split = (["generation.placement=split", f"generation.rollout_devices={split[0]}"]
             if split else [])
    return [*split, f"data.prompts={ROOT / 'configs/prompts/reviews.jsonl'}", f"mesh.data={d}",
            f"mesh.fsdp={f}", f"mesh.tensor={t}", f"train.output_dir={out_dir}",
            f"train.steps={args.steps}", "train.progress=false", "train.tensorboard=false",
            f"train.export_hf={str(args.loop == 'train').lower()}",
            "ppo.batch_size=16", "ppo.mini_batch_size=8", "ppo.micro_batch_size=4",
            "ppo.ppo_epochs=2", *args.set]


def layouts(state) -> dict:
    """{path: {"spec", "shard_shape", "shape"}} of a few actor arrays (params and Adam moments)."""
    import jax
    from ppo_jax.models.functional import path_str

    out = {}
    for kp, x in jax.tree_util.tree_flatten_with_path(state)[0]:
        p = path_str(kp)
        if p in WATCH:
            out[p] = {"spec": str(x.sharding.spec), "shape": list(x.shape),
                      "shard_shape": list(x.addressable_shards[0].data.shape)}
    return out


def run_name(mesh) -> str:
    """`<d>x<f>x<t>`, and `+<n>` with a rollout group of n devices."""
    return "x".join(map(str, mesh[:3])) + "".join(f"+{n}" for n in mesh[3:])


def run(args, mesh) -> None:
    import jax
    import numpy as np
    from ppo_jax.models.functional import flat_params
    from ppo_jax.parallel.host import to_host
    from ppo_jax.trainer.config import load_config
    from ppo_jax.trainer.stages.ppo.trainer import PPOTrainer

    name = run_name(mesh)
    out = Path(args.out)
    cfg = load_config(ROOT / "configs/tiny.yaml", overrides(args, mesh, out / f"run_{name}"))
    size = mesh[0] * mesh[1] * mesh[2] + sum(mesh[3:])
    devices = jax.devices()[:size] if jax.process_count() == 1 else None
    trainer = PPOTrainer(cfg, devices=devices)
    before = layouts(trainer.state["actor"])
    if args.loop == "train":
        history = trainer.train()
    else:
        history = [trainer.step() for _ in range(args.steps)]
    params = {"actor": to_host(trainer.state["actor"].params),
              "critic": to_host(trainer.state["critic"].params)}
    if jax.process_index() != 0:
        return
    flat = {f"{k}/{p}": v for k, tree in params.items() for p, v in flat_params(tree).items()}
    np.savez(out / f"{name}.npz", **flat)
    metrics = [{k: v for k, v in m.items() if not k.startswith(VOLATILE)} for m in history]
    record = {"mesh": mesh, "devices": size, "processes": jax.process_count(),
              "metrics": metrics, "layout_before": before, "layout_after": layouts(trainer.state["actor"]),
              "ref_dtype": str(jax.tree.leaves(trainer.ref_params)[0].dtype),
              "ref_memory": jax.tree.leaves(trainer.ref_params)[0].sharding.memory_kind}
    (out / f"{name}.json").write_text(json.dumps(record, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--mesh", action="append", required=True,
                        help="data,fsdp,tensor[,rollout devices]")
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--loop", choices=("step", "train"), default="step")
    parser.add_argument("--set", action="append", default=[], help="extra config override")
    parser.add_argument("--import", dest="imports", action="append", default=[],
                        help="a module to import first (registers an environment, a loss, ...)")
    parser.add_argument("--coordinator")
    parser.add_argument("--num-processes", type=int)
    parser.add_argument("--process-id", type=int)
    args = parser.parse_args()
    if args.coordinator:
        from ppo_jax.trainer.config import DistributedConfig
        from ppo_jax.trainer.host.distributed import initialize

        initialize(DistributedConfig(enabled=True, coordinator_address=args.coordinator,
                                     num_processes=args.num_processes, process_id=args.process_id))
    for name in args.imports:
        importlib.import_module(name)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    for mesh in args.mesh:
        run(args, tuple(int(s) for s in mesh.split(",")))


if __name__ == "__main__":
    main()
